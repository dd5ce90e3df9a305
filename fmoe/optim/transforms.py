"""The optax-style transforms, the global gradient norm, schedules, the expert-bias update.

A ``Transform`` is ``(init(params) -> state, update(grads, state, params) ->
(updates, state))``; ``chain`` and ``named_chain`` compose them. The transforms are
pure: they return new updates and states and write into no tensor they are handed.
The one exception here is ``update_expert_bias(donate=True)``, which writes the new
biases into the ``expert_bias`` leaves passed in (``adamw(fused=True, donate=True)``,
in ``fused.py``, is the other in-place update). A transform's state is a NamedTuple of
tensors or trees of tensors; ``chain``'s is a tuple of them, ``named_chain``'s a dict
by name. Settings are validated when a transform is built.

The global norm (``global_norm``; clipping and the finite check hold a ``NormFn``, from
``grad_norm_fn(plan)``, in place of the plan), given a ``plan`` of several ranks, reads
which leaves are split from the shard spec (``fmoe/shard``, looked up once) and the
ranks that split them from the mesh (``fmoe/comm``, at each call), and all-reduces over
those ranks; without a plan, or on one rank, it is a local sum and imports neither.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, NamedTuple

import optree
import torch

from ..checks import check, check_decay, check_finite, check_int, check_lr, is_number
from ..params import Domain, decays, trainable

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
    """State of ``scale_by_adam``: the update count and the two moments.

    ``skips`` is ``adamw``'s record of the non-finite steps it skipped, by default
    (``skip_nonfinite=None``): an ``ApplyIfFiniteState`` with no inner state, kept next
    to the moments that a skipped step leaves as they were (``fmoe.skipped_steps``
    reads it). None from ``scale_by_adam`` itself, from ``adamw`` with
    ``skip_nonfinite`` set, and in states saved before it existed (last, with a
    default, so that those still load).
    """

    count: torch.Tensor
    mu: dict
    nu: dict
    skips: Any = None


class ScheduleState(NamedTuple):
    count: torch.Tensor


class ClipState(NamedTuple):
    """State of ``clip_by_global_norm``: the global norm of the last gradients it saw
    (a 0-dim fp32 device tensor, 0 before the first update), before clipping. A
    training loop logs it (``fmoe.optim.last_grad_norm``) instead of computing it again.
    """

    grad_norm: torch.Tensor


def device_of(tree):
    leaves = optree.tree_leaves(tree)
    return leaves[0].device if leaves else torch.device("cpu")


class NormFn:
    """The global L2 norm of gradient trees laid out by one plan, built once from it:
    ``norm_fn(tree)`` is a 0-dim fp32 tensor. What the optimizer's clipping and finite
    check hold in place of the plan (``grad_norm_fn`` builds one).

    Attributes:
        world: the ranks the plan's trees are split over (1: a local sum, no
            collective), or None: no plan, so this rank's norm, and the finite check
            decides over the whole process group, when there is one.
    """

    def __init__(self, world: int | None, layout: Callable[[], tuple] | None = None):
        self.world, self._layout = world, layout

    def __call__(self, tree) -> torch.Tensor:
        paths, leaves, _ = optree.tree_flatten_with_path(tree)
        sq = [torch.linalg.vector_norm(x.float()).square() for x in leaves]
        if self._layout is None:
            return torch.stack(sq).sum().sqrt()
        spec, mesh = self._layout()
        total = torch.zeros((), device=leaves[0].device)
        placed = [_placement(spec, p) for p in paths]
        for domain in sorted({d for d, _ in placed}):  # no collective for a domain no leaf is in
            part = sum((_counted_once(q, x, spec, leaf) for (domain_, leaf), q, x in zip(placed, sq, leaves)
                        if domain_ == domain), total * 0)
            if spec.sharded(domain):
                mesh.world.all_reduce(part).wait()  # every element lives on one rank (copies counted once)
            else:  # replicated over the data-parallel ranks, split over the others
                if domain == Domain.TENSOR:
                    mesh.tp.all_reduce(part).wait()
                elif domain == Domain.EXPERT:
                    mesh.ep.all_reduce(part).wait()
                    mesh.etp.all_reduce(part).wait()
                mesh.pp.all_reduce(part).wait()  # each pipeline stage its own units
            total = total + part
        return total.sqrt()


def grad_norm_fn(plan=None) -> NormFn:
    """The NormFn of trees shaped like ``fmoe.init(plan)``: on several ranks the squared
    norms of the parts each rank holds alone (shards, its experts) are summed over the
    ranks that split them, so every rank gets the norm of the whole model. No plan, or
    one rank: a local sum. The plan is read once, by ``fmoe.resolve.norm_layout``."""
    if plan is None:
        return NormFn(None)
    from ..resolve import norm_layout  # the plan is resolved above the optimizer
    return NormFn(*norm_layout(plan))


def global_norm(tree, plan=None) -> torch.Tensor:
    """The fp32 L2 norm over every leaf of ``tree`` (``grad_norm_fn(plan)(tree)``).

    Arguments:
        tree: a pytree of tensors; with ``plan``, shaped like ``fmoe.init(plan)``.
        plan: the Plan ``tree`` is laid out by; on several ranks the squared norms of
            the parts each rank holds alone (shards, its experts) are summed over the
            ranks that split them (a collective), so every rank gets the norm of the
            whole model.

    Returns:
        A 0-dim fp32 tensor on the leaves' device; NaN or inf if any element is (or if
        the sum of squares overflows fp32).
    """
    return grad_norm_fn(plan)(tree)


def _placement(spec, keys):
    """The domain holding the leaf at ``keys`` (params or a tree mirroring them) and the
    parameter it mirrors (None: a dense value)."""
    leaf = spec.table.mirrored_by(keys)
    return (Domain.DENSE, None) if leaf is None else (spec.placement(leaf), leaf)


def _counted_once(sq: torch.Tensor, x: torch.Tensor, spec, leaf) -> torch.Tensor:
    """``sq`` (``x``'s squared norm) with the columns other ranks hold copies of
    (``ShardSpec.copies``) counted once over all of them."""
    if leaf is None or not (copies := spec.copies(leaf.path)) or x.numel() == 0:
        return sq
    cols = x.reshape(-1, x.shape[-1]).float()
    for lo, hi, n in copies:
        sq = sq - (1 - 1 / n) * torch.linalg.vector_norm(cols[:, lo:hi]).square()
    return sq


def check_norm_scope(norm: NormFn, what: str) -> None:
    if norm.world is None and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise ValueError(f"{what}: pass plan= when running on several ranks, so the norm covers every shard")


class StepNorm:
    """The global norm of one update's gradients, shared by the transforms of one
    optimizer that need it (``adamw``'s finite check and its clipping), so that the
    reduction behind it (a collective on several ranks) runs once per step.

    The outermost user computes it: ``with norm.held(grads) as n: inner.update(...)``.
    Inside, ``norm(grads)`` with that very grads object returns ``n``; with any other
    tree (updates further down a chain, say) it computes that tree's own norm.
    """

    def __init__(self, norm: NormFn):
        self.norm = norm
        self._held = None  # (grads, norm) while an update runs

    def __call__(self, grads) -> torch.Tensor:
        if self._held is not None and self._held[0] is grads:
            return self._held[1]
        return self.norm(grads)

    @contextlib.contextmanager
    def held(self, grads):
        norm = self.norm(grads)
        self._held = (grads, norm)
        try:
            yield norm
        finally:
            self._held = None


def _trainable(path) -> bool:
    return trainable(path[-1])


def _decays(path, leaf) -> bool:
    return decays(path[-1])


def clip_by_global_norm(max_norm: float, plan=None) -> Transform:
    """Scale all updates by ``min(1, max_norm / global_norm)`` (see ``global_norm``).

    Arguments:
        max_norm: the largest global norm let through (finite, > 0).
        plan: the Plan the gradients are laid out by (needed on several ranks).

    Returns:
        A Transform whose state is a ``ClipState``: the norm it computed, kept so that
        nobody computes it again (``fmoe.optim.last_grad_norm``).
    """
    check_finite("clip_by_global_norm max_norm", max_norm, positive=True)
    norm = grad_norm_fn(plan)
    check_norm_scope(norm, "clip_by_global_norm")
    return clip_with_norm(max_norm, StepNorm(norm), record=True)


def clip_with_norm(max_norm: float, norm_of: StepNorm, record: bool) -> Transform:
    """``clip_by_global_norm`` over a shared norm. ``record``: keep the norm in a
    ``ClipState``; False (state ``EmptyState``) where an ``apply_if_finite`` around it
    records the same norm already."""

    def init(params):
        if not record:
            return EmptyState()
        return ClipState(torch.zeros((), dtype=torch.float32, device=device_of(params)))

    def update(grads, state, params=None):
        norm = norm_of(grads)
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return optree.tree_map(lambda g: g * scale, grads), (ClipState(norm) if record else state)

    return Transform(init, update)


MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes Adam's moments may be kept in (``scale_by_adam(moments=...)``, ``adamw``)."""


def check_moments(where: str, moments: str) -> torch.dtype:
    """The torch dtype of ``moments`` (a key of ``MOMENT_DTYPES``); ValueError otherwise."""
    check(where, moments, isinstance(moments, str) and moments in MOMENT_DTYPES,
          "must be one of " + ", ".join(map(repr, MOMENT_DTYPES)))
    return MOMENT_DTYPES[moments]


def check_moment_state(where: str, state, dtype: torch.dtype) -> None:
    """Raise ValueError unless the moments of a ``ScaleByAdamState`` are kept in ``dtype``
    (a state made by another ``moments`` setting, e.g. a checkpoint of another run)."""
    found = {leaf.dtype for leaf in optree.tree_leaves((state.mu, state.nu))}
    if found - {dtype}:
        names = {v: k for k, v in MOMENT_DTYPES.items()}
        held = sorted(names.get(d, str(d)) for d in found)
        raise ValueError(f"{where}: the optimizer state holds moments in {held}, "
                         f"but this optimizer keeps them in {names[dtype]!r}; build it with the state's moments "
                         f"setting, or start a new state with init")


def scale_by_adam(b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, moments: str = "float32") -> Transform:
    """Adam's bias-corrected ``m / (sqrt(v) + eps)``.

    Arguments:
        b1, b2: the moments' decays, in [0, 1).
        eps: added to ``sqrt(v)`` (finite, > 0).
        moments: the dtype the moments are kept in between steps, ``float32`` or
            ``bfloat16`` (half their memory; each step computes in fp32 and
            rounds the new moments once to bf16, and the update uses them before that
            rounding). bf16 keeps 8 significant bits, so a second moment whose step
            ``(1 - b2) g^2`` is below 2^-9 of it stops moving: meant for ``b2`` around
            0.95, not 0.999.
    """
    check_decay("scale_by_adam b1", b1)
    check_decay("scale_by_adam b2", b2)
    check_finite("scale_by_adam eps", eps, positive=True)
    dtype = check_moments("scale_by_adam moments", moments)

    def init(params):
        zeros = lambda p: torch.zeros_like(p, dtype=dtype)
        count = torch.zeros((), dtype=torch.int64, device=device_of(params))
        return ScaleByAdamState(count, optree.tree_map(zeros, params), optree.tree_map(zeros, params))

    def update(grads, state, params=None):
        check_moment_state("scale_by_adam", state, dtype)
        count = state.count + 1
        mu = optree.tree_map(lambda m, g: b1 * m.float() + (1 - b1) * g, state.mu, grads)
        nu = optree.tree_map(lambda v, g: b2 * v.float() + (1 - b2) * g.square(), state.nu, grads)
        c1 = 1 - b1 ** count.double()
        c2 = 1 - b2 ** count.double()
        updates = optree.tree_map(lambda m, v: (m / c1) / ((v / c2).sqrt() + eps), mu, nu)
        if dtype != torch.float32:
            mu, nu = (optree.tree_map(lambda t: t.to(dtype), tree) for tree in (mu, nu))
        return updates, ScaleByAdamState(count, mu, nu)

    return Transform(init, update)


def add_decayed_weights(weight_decay: float, mask: Callable = _decays) -> Transform:
    """Add ``weight_decay * param`` (``weight_decay`` finite, >= 0) to the updates of
    leaves where ``mask(path, leaf)``."""
    check_finite("add_decayed_weights weight_decay", weight_decay, positive=False)

    def update(updates, state, params):
        def add(path, u, p):
            return u + weight_decay * p if mask(path, p) else u

        return optree.tree_map_with_path(add, updates, params), state

    return Transform(lambda params: EmptyState(), update)


def scale_by_learning_rate(lr: float | Schedule) -> Transform:
    """Multiply updates by ``-lr`` (``lr`` finite and > 0, or a function of the step count).

    The count lives on the params' device, so a schedule written with tensor ops
    (``warmup_cosine`` is) gives the rate without a host read.
    """
    check_lr("scale_by_learning_rate lr", lr)

    def init(params):
        return ScheduleState(torch.zeros((), dtype=torch.int64, device=device_of(params)))

    def update(updates, state, params=None):
        rate = lr(state.count) if callable(lr) else lr
        return optree.tree_map(lambda u: -rate * u, updates), ScheduleState(state.count + 1)

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


def check_named_state(state, names: list) -> None:
    """ValueError unless ``state`` is a named chain's state with exactly ``names``."""
    if not isinstance(state, dict) or set(state) != set(names):
        held = sorted(state) if isinstance(state, dict) else type(state).__name__
        hint = ("; an adamw state saved before its states were named? fmoe.load renames those, "
                "fmoe.optim.migrate_state(state) too" if type(state) is tuple else "")
        raise ValueError(f"named_chain: the state holds {held}, this chain's states are {names} "
                         f"(a state from an optimizer built with other settings?{hint})")


def named_chain(*named: tuple[str, Transform]) -> Transform:
    """Apply transforms in order; the state is ``{name: state}`` (optax's ``named_chain``),
    so code reading one transform's state finds it by name.

    Arguments:
        named: ``(name, transform)`` pairs, names unique.
    """
    names = [name for name, _ in named]
    check("named_chain names", names, len(set(names)) == len(names), "must be unique")

    def init(params):
        return {name: t.init(params) for name, t in named}

    def update(updates, state, params=None):
        check_named_state(state, names)
        new_state = {}
        for name, t in named:
            updates, new_state[name] = t.update(updates, state[name], params)
        return updates, new_state

    return Transform(init, update)


def warmup_cosine(peak: float, warmup: int, total: int, floor: float = 0.1) -> Schedule:
    """Linear warm-up to ``peak`` over ``warmup`` updates, then cosine decay to
    ``floor * peak`` at ``total`` updates (held there after).

    Written with tensor ops: given the count as a device tensor, the rate is a device
    tensor too, computed without a host read.

    Arguments:
        peak: the top rate (finite, > 0).
        warmup: updates of linear warm-up (an int >= 0).
        total: the update at which the decay ends (an int >= 1).
        floor: the final rate as a fraction of ``peak``, in [0, 1].
    """
    check_finite("warmup_cosine peak", peak, positive=True)
    check_int("warmup_cosine warmup", warmup, 0)
    check_int("warmup_cosine total", total, 1)
    check("warmup_cosine floor", floor, is_number(floor) and 0 <= floor <= 1, "must be in [0, 1]")

    def schedule(count):
        n = torch.as_tensor(count, dtype=torch.float64)
        warm = peak * (n + 1) / max(warmup, 1)
        progress = ((n - warmup) / max(1, total - warmup)).clamp(0.0, 1.0)
        decay = peak * (floor + (1 - floor) * 0.5 * (1 + torch.cos(math.pi * progress)))
        return torch.where(n < warmup, warm, decay)

    return schedule


def cosine_from(schedule: Schedule, at: int, total: int, end: float) -> Schedule:
    """``schedule`` before update ``at``; from there a cosine decay from the rate
    ``schedule`` gives at ``at`` to ``end`` at update ``total`` (held there after).

    What a run extended or shortened midway trains with: the rate at ``at`` is the one
    the run would have had, so it goes on without a jump, and the rest of the decay
    fits the new length. Written with tensor ops, as ``warmup_cosine``.

    Arguments:
        schedule: the rate before (a function of the update count).
        at: the update count from which the decay restarts (an int >= 0).
        total: the update at which it ends (an int > ``at``).
        end: the final rate (finite, >= 0).
    """
    check_int("cosine_from at", at, 0)
    check_int("cosine_from total", total, at + 1, f" (after at={at})")
    check_finite("cosine_from end", end, positive=False)
    start = float(schedule(at))  # once, on the host: the closure below reads no device value

    def continued(count):
        n = torch.as_tensor(count, dtype=torch.float64)
        progress = ((n - at) / (total - at)).clamp(0.0, 1.0)
        decay = end + (start - end) * 0.5 * (1 + torch.cos(math.pi * progress))
        return torch.where(n < at, schedule(count), decay)

    return continued


def _moe_layers(params: dict) -> list[dict]:
    """The MoE layers of a params pytree (dense ones, holding ``mlp``, left out)."""
    layers = params.get("layers") if isinstance(params, dict) else None
    if not isinstance(layers, (list, tuple)) or not all(
            isinstance(layer, dict) and (isinstance(layer.get("moe"), dict) and "expert_bias" in layer["moe"]
                                         or "mlp" in layer) for layer in layers):
        raise ValueError("update_expert_bias params must be a params pytree whose 'layers' each hold "
                         "'moe' -> 'expert_bias' (or, a dense layer, 'mlp')")
    return [layer for layer in layers if "moe" in layer]


def _check_expert_counts(params: dict, expert_counts) -> None:
    """``expert_counts`` must be ``[MoE layers, E]`` numbers for these params' MoE layers."""
    layers = _moe_layers(params)
    experts = layers[0]["moe"]["expert_bias"].shape[-1] if layers else 0
    if not isinstance(expert_counts, torch.Tensor):
        raise ValueError(f"update_expert_bias expert_counts must be a tensor [layers={len(layers)}, "
                         f"experts={experts}] (out.metrics['expert_counts']), got {type(expert_counts).__name__}")
    if expert_counts.dtype == torch.bool or expert_counts.dtype.is_complex or \
            tuple(expert_counts.shape) != (len(layers), experts):
        raise ValueError(f"update_expert_bias expert_counts has shape {list(expert_counts.shape)} and dtype "
                         f"{expert_counts.dtype}; these params need [layers={len(layers)}, experts={experts}] "
                         "integer or float counts (out.metrics['expert_counts'])")


def update_expert_bias(params: dict, expert_counts: torch.Tensor, rate: float, donate: bool = False,
                       applied: torch.Tensor | None = None) -> dict:
    """Aux-loss-free balancing: nudge each layer's ``expert_bias`` toward even load.

    ``bias_e += rate * sign(mean(counts) - counts_e)``: under-loaded experts become
    likelier to be selected. The bias selects experts without weighting them.

    Arguments:
        params: the parameter pytree.
        expert_counts: ``[MoE layers, E]`` tokens per expert (``out.metrics["expert_counts"]``;
            a row per MoE layer in order, dense layers have none).
        rate: step size (``ModelConfig.expert_bias_rate``).
        donate: False (default): pure, the new biases are new tensors. True: as
            ``adamw(donate=True)``, the new biases are written into the ``expert_bias``
            leaves passed in (their storage, bit for bit what the pure form computes)
            and ``params`` itself is returned, so a CUDA-graphed step that reads these
            tensors (``interop.capture_step(..., donate=True)``) finds the new biases
            where it reads. The old bias values are gone: pass only params you will not
            read again.
        applied: None, or a 0-dim device bool (``ApplyIfFiniteState.applied``): where
            it is False the biases are kept bit for bit, so an optimizer step that was
            skipped changes no parameter, with no host read to find out.

    Returns:
        A new pytree sharing every other leaf with ``params``; with ``donate``, ``params``.
    """
    check("update_expert_bias donate", donate, isinstance(donate, bool), "must be True or False")
    check_finite("update_expert_bias rate", rate, positive=False)
    _check_expert_counts(params, expert_counts)
    counts = expert_counts.float()
    delta = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
    layers, deltas = [], iter(delta)
    for layer in params["layers"]:
        if "moe" not in layer:  # a dense layer
            layers.append(layer)
            continue
        d = next(deltas)
        bias = layer["moe"]["expert_bias"]  # [E], or a row shard [0 or 1, E]
        new = bias + d.to(bias).expand_as(bias)
        if applied is not None:
            new = torch.where(applied, new, bias)  # not bias + 0: a skip keeps the old bits
        if donate:
            bias.copy_(new)
        else:
            layers.append(dict(layer, moe=dict(layer["moe"], expert_bias=new)))
    return params if donate else dict(params, layers=layers)
