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


def adamw(lr: float | Schedule = 1e-3, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.0, max_grad_norm: float | None = None, plan=None) -> Optimizer:
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
