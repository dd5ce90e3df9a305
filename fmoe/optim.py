"""Optimizers as optax-style pairs of pure functions, and the expert-bias update.

A ``Transform`` is ``(init(params) -> state, update(grads, state, params) ->
(updates, state))``; ``chain`` composes them. ``Optimizer`` wraps a transform so that
``update`` returns new params: ``params, state = opt.update(grads, state, params)``.
Nothing is modified in place; every state is a NamedTuple of fp32 tensors.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import optree
import torch

Schedule = Callable[[torch.Tensor], torch.Tensor | float]


class Transform(NamedTuple):
    init: Callable
    update: Callable


class Optimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (params, state)``."""

    init: Callable
    update: Callable


class EmptyState(NamedTuple):
    pass


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict


class ScheduleState(NamedTuple):
    count: torch.Tensor


def _map(fn, *trees):
    return optree.tree_map(fn, *trees)


def global_norm(tree, plan=None) -> torch.Tensor:
    """The fp32 L2 norm over every leaf of ``tree``.

    Arguments:
        tree: a pytree of tensors; with ``plan``, shaped like ``fmoe.init(plan)``.
        plan: the Plan ``tree`` is laid out by; on several ranks the squared norms of
            the parts each rank holds alone (shards, its experts) are summed over the
            ranks that split them (a collective), so every rank gets the norm of the
            whole model.
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    sq = [torch.linalg.vector_norm(x.float()).square() for x in leaves]
    if plan is None or plan.world == 1:
        return torch.stack(sq).sum().sqrt()
    from .shard.mesh import mesh_for  # optim is usable without shard/: import late
    from .shard.spec import domain_of, shard_spec

    spec, mesh = shard_spec(plan), mesh_for(plan)
    total = torch.zeros((), device=leaves[0].device)
    for domain in ("dense", "expert"):
        part = sum((q for p, q in zip(paths, sq) if domain_of(".".join(map(str, p))) == domain), total * 0)
        if spec.sharded(domain):
            mesh.world.all_reduce(part).wait()  # every element lives on exactly one rank
        elif domain == "expert":
            mesh.ep.all_reduce(part).wait()  # replicated over edp, split over ep
        total = total + part
    return total.sqrt()


def _check_norm_scope(plan, what: str) -> None:
    if plan is None and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise ValueError(f"{what}: pass plan= when running on several ranks, so the norm covers every shard")


def _trainable(path) -> bool:
    # The expert bias is balanced from routing counts, never by gradient steps.
    return path[-1] != "expert_bias"


def _decays(path, leaf) -> bool:
    # Matrices decay; norms and biases (expert_bias, fc1_bias, fc2_bias) do not. By
    # name, since a row shard of a vector is 2-D.
    name = path[-1]
    return not (name.endswith("norm") or name.endswith("bias"))


def clip_by_global_norm(max_norm: float, plan=None) -> Transform:
    """Scale all updates by ``min(1, max_norm / global_norm)`` (see ``global_norm``)."""
    _check_norm_scope(plan, "clip_by_global_norm")

    def update(grads, state, params=None):
        scale = (max_norm / (global_norm(grads, plan) + 1e-6)).clamp(max=1.0)
        return _map(lambda g: g * scale, grads), state

    return Transform(lambda params: EmptyState(), update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8) -> Transform:
    """Adam's bias-corrected ``m / (sqrt(v) + eps)``, moments in fp32."""

    def init(params):
        zeros = lambda p: torch.zeros_like(p, dtype=torch.float32)
        count = torch.zeros((), dtype=torch.int64, device=optree.tree_leaves(params)[0].device)
        return ScaleByAdamState(count, _map(zeros, params), _map(zeros, params))

    def update(grads, state, params=None):
        count = state.count + 1
        mu = _map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = _map(lambda v, g: b2 * v + (1 - b2) * g.square(), state.nu, grads)
        c1 = 1 - b1 ** count.double()
        c2 = 1 - b2 ** count.double()
        updates = _map(lambda m, v: (m / c1) / ((v / c2).sqrt() + eps), mu, nu)
        return updates, ScaleByAdamState(count, mu, nu)

    return Transform(init, update)


def add_decayed_weights(weight_decay: float, mask: Callable = _decays) -> Transform:
    """Add ``weight_decay * param`` to the updates of leaves where ``mask(path, leaf)``."""

    def update(updates, state, params):
        def add(path, u, p):
            return u + weight_decay * p if mask(path, p) else u

        return optree.tree_map_with_path(add, updates, params), state

    return Transform(lambda params: EmptyState(), update)


def scale_by_learning_rate(lr: float | Schedule) -> Transform:
    """Multiply updates by ``-lr`` (``lr`` a float or a function of the step count)."""

    def init(params):
        return ScheduleState(torch.zeros((), dtype=torch.int64))

    def update(updates, state, params=None):
        rate = lr(state.count) if callable(lr) else lr
        return _map(lambda u: -rate * u, updates), ScheduleState(state.count + 1)

    return Transform(init, update)


def freeze(mask: Callable = _trainable) -> Transform:
    """Zero the updates of leaves where ``mask(path)`` is false."""

    def update(updates, state, params=None):
        return optree.tree_map_with_path(lambda path, u: u if mask(path) else torch.zeros_like(u),
                                         updates), state

    return Transform(lambda params: EmptyState(), update)


def chain(*transforms: Transform) -> Transform:
    """Apply transforms in order; the state is the tuple of their states."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return Transform(init, update)


def optimizer(transform: Transform) -> Optimizer:
    """Turn a Transform into an Optimizer whose update returns ``params + updates``."""

    def update(grads, state, params):
        updates, state = transform.update(grads, state, params)
        return _map(lambda p, u: p + u.to(p.dtype), params, updates), state

    return Optimizer(transform.init, update)


def _fused_adamw(transform: Transform, b1, b2, eps, weight_decay, lr, max_grad_norm, plan) -> Optimizer:
    """``adamw(fused=True)``: the chain's state and meaning, one fused kernel per group."""
    clipping = bool(max_grad_norm)

    def update(grads, state, params):
        adam, schedule = state[int(clipping)], state[int(clipping) + 2]
        count = adam.count + 1
        rate = lr(schedule.count) if callable(lr) else lr
        grad_scale = None
        if clipping:  # the kernel divides gradients by grad_scale
            grad_scale = ((global_norm(grads, plan) + 1e-6) / max_grad_norm).clamp(min=1.0).float()
        paths, p_leaves, treedef = optree.tree_flatten_with_path(params)
        g_leaves, m_leaves, v_leaves = (treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu))
        # Pure: the kernel updates copies. Frozen leaves get their moments updated (as
        # the chain does) with a zero rate, and keep their params.
        new_p, new_m, new_v = list(p_leaves), list(m_leaves), list(v_leaves)
        step = count.to(device=p_leaves[0].device, dtype=torch.float32)
        groups = {(True, True): [], (True, False): [], (False, False): []}  # (trainable, decays)
        for i, (path, p) in enumerate(zip(paths, p_leaves)):
            groups[(True, _decays(path, p)) if _trainable(path) else (False, False)].append(i)
        for (trainable, decay), idx in groups.items():
            if not idx:
                continue
            params_copy = [p_leaves[i].clone() for i in idx]
            for out, src in ((new_m, m_leaves), (new_v, v_leaves)):
                for i in idx:
                    out[i] = src[i].clone()
            torch._fused_adamw_(params_copy, [g_leaves[i].float() for i in idx],
                                [new_m[i] for i in idx], [new_v[i] for i in idx], [], [step] * len(idx),
                                lr=float(rate) if trainable else 0.0, beta1=b1, beta2=b2,
                                weight_decay=weight_decay if decay else 0.0, eps=eps, amsgrad=False,
                                maximize=False, grad_scale=grad_scale)
            if trainable:
                for i, p in zip(idx, params_copy):
                    new_p[i] = p
        new_state = list(state)
        new_state[int(clipping)] = ScaleByAdamState(count, treedef.unflatten(new_m), treedef.unflatten(new_v))
        new_state[int(clipping) + 2] = ScheduleState(schedule.count + 1)
        return treedef.unflatten(new_p), tuple(new_state)

    return Optimizer(transform.init, update)


def adamw(lr: float | Schedule = 1e-3, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.0, max_grad_norm: float | None = None, plan=None,
          fused: bool = False) -> Optimizer:
    """AdamW (decoupled weight decay on matrices), optional global-norm clipping.

    Every operation is per element, so it updates whatever each rank holds (full
    tensors or shards); only the clipping norm needs the other ranks.

    Arguments:
        lr: learning rate, or a function of the update count (a 0-dim int64 tensor).
        b1, b2, eps: Adam's moment decays and epsilon.
        weight_decay: decoupled decay, scaled by ``lr``; applied to matrices, not to
            norms or biases.
        max_grad_norm: clip gradients to this global norm first (None: no clipping).
        plan: the Plan params are sharded by; needed with clipping on several ranks.
        fused: run each update as torch's fused AdamW kernel on copies of the params
            and moments (one pass over memory instead of one per elementwise op; the
            same state, the same update up to rounding). False: the optax-style chain
            of elementwise transforms, bitwise the same for any sharding of the leaves.

    Returns:
        An Optimizer. ``expert_bias`` leaves are never changed by it.
    """
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"adamw {name}={value!r} is invalid: must be in [0, 1)")
    if weight_decay < 0:
        raise ValueError(f"adamw weight_decay={weight_decay!r} is invalid: must be >= 0")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"adamw max_grad_norm={max_grad_norm!r} is invalid: must be > 0 or None")
    parts = [clip_by_global_norm(max_grad_norm, plan)] if max_grad_norm else []
    parts += [scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay),
              scale_by_learning_rate(lr), freeze()]
    if fused:
        return _fused_adamw(chain(*parts), b1, b2, eps, weight_decay, lr, max_grad_norm, plan)
    return optimizer(chain(*parts))


def warmup_cosine(peak: float, warmup: int, total: int, floor: float = 0.1) -> Schedule:
    """Linear warm-up to ``peak`` over ``warmup`` updates, then cosine decay to
    ``floor * peak`` at ``total`` updates (held there after)."""
    import math

    def schedule(count):
        n = int(count)
        if n < warmup:
            return peak * (n + 1) / warmup
        progress = min(1.0, (n - warmup) / max(1, total - warmup))
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    return schedule


def update_expert_bias(params: dict, expert_counts: torch.Tensor, rate: float) -> dict:
    """Aux-loss-free balancing: nudge each layer's ``expert_bias`` toward even load.

    ``bias_e += rate * sign(mean(counts) - counts_e)``: under-loaded experts become
    likelier to be selected. The bias selects experts without weighting them.

    Arguments:
        params: the parameter pytree.
        expert_counts: ``[layers, E]`` tokens per expert (``out.metrics["expert_counts"]``).
        rate: step size (``ModelConfig.expert_bias_rate``).

    Returns:
        A new pytree sharing every other leaf with ``params``.
    """
    counts = expert_counts.float()
    delta = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
    layers = []
    for layer, d in zip(params["layers"], delta):
        bias = layer["moe"]["expert_bias"]  # [E], or a row shard [0 or 1, E]
        moe = dict(layer["moe"], expert_bias=bias + d.to(bias).expand_as(bias))
        layers.append(dict(layer, moe=moe))
    return dict(params, layers=layers)
