"""The FSDP lifecycle as a value: each transition takes the state and returns a new
state value. The device buffers it names are not copied: a gather fills a unit's
buffer in place, a release frees its storage, gradients are added into their buffers.

    SHARDED --gather (async)--> GATHERING --wait--> GATHERED --release--> SHARDED
    grads: accumulate per microbatch --reduce_grads (async)--> folded into the grad shard

The checks are part of the transitions, so a schedule that computes with a unit
that is not gathered, keeps too many units live, overwrites a busy buffer, or
reduces a unit's gradients twice or never fails loudly at that point, before the
compute that would read released memory. Every transition lands in ``trace``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..config import Plan
from ..layers.fp8 import E4M3, Fp8Weight, cast_weight, tensor_scale
from .mesh import Mesh
from .spec import ShardSpec, full_views, local_leaves, shard_rank, write_shard
from .trace import Event, now


class Phase(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class LifecycleError(RuntimeError):
    """A schedule broke an invariant of the lifecycle."""


def reduces_every_microbatch(plan: Plan) -> bool:
    """ZeRO-2/3 reduce-scatter after each microbatch; DDP and ZeRO-1 once, on the last."""
    return plan.sharding in ("optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class UnitState:
    """One unit's part of the lifecycle.

    Attributes:
        phase: SHARDED, GATHERING or GATHERED.
        buffers: ``{(domain, dtype): flat full buffer}`` once the unit was first gathered.
        in_flight: the pending gathers and when they were issued.
        views: ``{path: full-shape view}`` of the gathered buffers while GATHERED.
        grad_full: ``{group: fp32 full-layout grads}`` accumulated since the last reduce.
        grad_views: ``{path: full-shape view}`` of ``grad_full``.
        grad_written: paths whose grad views hold a value since ``grad_full`` was made.
        grad_shard: ``{group: fp32 reduced grads}`` (this rank's shard, or all of it unsharded).
        reduced: microbatches whose gradients were reduced.
        wgrad_pending: microbatches whose delayed weight gradients have not run yet.
    """

    phase: Phase = Phase.SHARDED
    buffers: dict | None = None
    in_flight: tuple = ()
    views: dict | None = None
    grad_full: dict | None = None
    grad_views: dict | None = None
    grad_written: frozenset = frozenset()
    grad_shard: dict | None = None
    reduced: tuple = ()
    wgrad_pending: tuple = ()


@dataclass(frozen=True)
class Lifecycle:
    """The lifecycle of every unit in one step, plus what the transitions need.

    Attributes:
        plan, spec: the Plan and its ShardSpec.
        mesh: this rank's process groups (who shares which buffers, who sums grads).
        shards: ``{unit: {(domain, dtype): flat shard in that dtype}}`` built from the params.
        units: ``{unit: UnitState}``.
        max_live: most units allowed gathered or gathering at once.
        slots: ``{unit: slot}`` under double buffering, else None.
        slot_buffers: ``{(slot, group): tensor}`` under double buffering.
        pending: Reductions in flight, oldest first.
        trace: every Event so far.
        scales: ``{path: fp32 scale}`` of the weights in ``fp8`` groups (``Shards``).
    """

    plan: Plan
    spec: ShardSpec
    mesh: Mesh
    shards: dict
    units: dict
    max_live: int
    slots: dict | None = None
    slot_buffers: dict | None = None
    pending: tuple = ()
    trace: tuple = ()
    scales: dict = dataclasses.field(default_factory=dict)

    def live(self) -> list[str]:
        return [name for name, u in self.units.items() if u.phase != Phase.SHARDED]


MAX_PENDING_REDUCTIONS = 2


def start(plan: Plan, spec: ShardSpec, mesh: Mesh, shards: Shards, max_live: int,
          slots: dict | None = None) -> Lifecycle:
    """Every unit SHARDED; ``shards`` are the flat shards of the params (``build_shards``)."""
    return Lifecycle(plan, spec, mesh, shards.flat, {u.name: UnitState() for u in spec.units},
                     max_live, slots, {} if slots is not None else None, scales=shards.scales)


def _shared(state: Lifecycle, key: tuple) -> bool:
    """Whether the buffers of group ``key`` are split over several ranks."""
    return state.spec.sizes[key[0]] > 1


def _shard_group(state: Lifecycle, key: tuple):
    return state.mesh.shard_group(key[0], state.spec.sizes[key[0]])


def _with(state: Lifecycle, unit: str, event: Event | None = None, **changes) -> Lifecycle:
    units = dict(state.units)
    units[unit] = dataclasses.replace(state.units[unit], **changes)
    trace = state.trace + ((event,) if event else ())
    return dataclasses.replace(state, units=units, trace=trace)


def _unit_spec(state: Lifecycle, unit: str):
    return next(u for u in state.spec.units if u.name == unit)


def _gather_buffers(state: Lifecycle, unit: str) -> dict:
    """The flat buffers a gather of ``unit`` writes (allocating or re-growing them).

    A unit always gathers into the same storage, so views autograd saved during its
    forward see the re-gathered weights in its backward. A group held whole by
    every rank needs no buffer: its shard is the full tensor.
    """
    spec, ustate = _unit_spec(state, unit), state.units[unit]
    bufs = {}
    if state.slots is not None:
        slot = state.slots[unit]
        for other in state.live():
            if state.slots.get(other) == slot:
                raise LifecycleError(f"gather {unit}: double-buffer slot {slot} is still held by {other}")
    for key, layout in spec.groups.items():
        if not _shared(state, key):
            bufs[key] = state.shards[unit][key]
        elif state.slots is not None:
            slot_key = (state.slots[unit], key)
            if slot_key not in state.slot_buffers:  # sized once for every unit sharing the slot
                size = max(u.groups[key].full_size for u in state.spec.units
                           if state.slots.get(u.name) == slot_key[0] and key in u.groups)
                state.slot_buffers[slot_key] = torch.empty(size, dtype=spec.dtype(key, state.plan),
                                                           device=state.plan.device)
            bufs[key] = state.slot_buffers[slot_key][:layout.full_size]
        elif ustate.buffers is None:
            bufs[key] = torch.empty(layout.full_size, dtype=spec.dtype(key, state.plan), device=state.plan.device)
        else:  # dynamic: released storage grows back in place
            buf = bufs[key] = ustate.buffers[key]
            storage = buf.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(buf.numel() * buf.element_size())
    return bufs


def gather(state: Lifecycle, unit: str) -> Lifecycle:
    """Issue the all-gather of ``unit``'s flat shards (async). SHARDED -> GATHERING."""
    ustate = state.units[unit]
    if ustate.phase != Phase.SHARDED:
        raise LifecycleError(f"gather {unit}: it is {ustate.phase.value}, not sharded")
    live = state.live()
    if len(live) + 1 > state.max_live:
        raise LifecycleError(f"gather {unit}: {len(live) + 1} live units would exceed the plan's "
                             f"{state.max_live} ({', '.join(live)} already live)")
    bufs = _gather_buffers(state, unit)
    issued = now()
    # Autograd may hold views of these buffers from an earlier forward of this unit;
    # refilling them with the same weights must not count as a mutation. The versions
    # are put back once the gather has landed (some backends copy in at completion).
    versions = torch.autograd._unsafe_preserve_version_counter(tuple(bufs.values()))
    pendings = [_shard_group(state, key).all_gather(buf, state.shards[unit][key])
                for key, buf in bufs.items() if _shared(state, key)]
    return _with(state, unit, phase=Phase.GATHERING, buffers=bufs, in_flight=(tuple(pendings), issued, versions))


def wait(state: Lifecycle, unit: str) -> Lifecycle:
    """Block until ``unit``'s gather landed. GATHERING -> GATHERED."""
    ustate = state.units[unit]
    if ustate.phase != Phase.GATHERING:
        raise LifecycleError(f"wait {unit}: it is {ustate.phase.value}; only a gathering unit can be waited on")
    pendings, issued, versions = ustate.in_flight
    for p in pendings:
        p.wait()
    versions.__exit__()
    event = None
    if pendings:
        nbytes = sum(b.numel() * b.element_size() for k, b in ustate.buffers.items() if _shared(state, k))
        event = Event("all_gather", unit, None, -1, issued, now(), nbytes, "params")
    views = {}
    for g, layout in _unit_spec(state, unit).groups.items():
        views.update(full_views(ustate.buffers[g], layout))
        if g[1] == "fp8":
            views.update(_fp8_weights(views, layout, state.scales, state.plan.compute_dtype))
    return _with(state, unit, event, phase=Phase.GATHERED, in_flight=(), views=views)


def _fp8_weights(views: dict, layout, scales: dict, dtype: torch.dtype) -> dict:
    """``{path: Fp8Weight}`` for the gathered FP8 views of ``layout``'s weights, each with
    its scale and a storage-less leaf of the weight's shape for its gradient."""
    zero = _zero(dtype, scales[layout.slots[0].path].device)
    return {s.path: Fp8Weight(views[s.path], scales[s.path], zero.expand(s.shape)) for s in layout.slots}


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # one per process: a grad_leaf keeps its address from step to step, so a graphed
    # scope (interop.cuda_graph) finds it where it was captured and copies nothing
    return torch.zeros((), dtype=dtype, device=device)


def release(state: Lifecycle, unit: str) -> Lifecycle:
    """Drop ``unit``'s gathered weights. GATHERED -> SHARDED (dynamic buffers are freed)."""
    ustate = state.units[unit]
    if ustate.phase != Phase.GATHERED:
        raise LifecycleError(f"release {unit}: it is {ustate.phase.value}, not gathered")
    t = now()
    if state.plan.gather_buffers == "dynamic":
        for key, buf in ustate.buffers.items():
            if _shared(state, key):
                buf.untyped_storage().resize_(0)
    return _with(state, unit, Event("release", unit, None, -1, t, now()), phase=Phase.SHARDED, views=None)


def require_gathered(state: Lifecycle, unit: str, what: str) -> dict:
    """The full-shape weight views of ``unit`` for compute ``what``; raises unless GATHERED."""
    ustate = state.units[unit]
    if ustate.phase != Phase.GATHERED:
        raise LifecycleError(f"{what} needs unit {unit}, which is {ustate.phase.value}, not gathered")
    return ustate.views


def accumulate_grads(state: Lifecycle, unit: str, grads: dict) -> Lifecycle:
    """Add ``{path: grad}`` (any dtype, full shapes) into ``unit``'s fp32 full-layout grads."""
    spec, ustate = _unit_spec(state, unit), state.units[unit]
    full, views, written = ustate.grad_full, ustate.grad_views, ustate.grad_written
    if full is None:  # uninitialised: every value is written here or zeroed by _zero_unwritten
        full = {g: torch.empty(layout.full_size, dtype=torch.float32, device=state.plan.device)
                for g, layout in spec.groups.items()}
        views, written = {}, frozenset()
        for g, layout in spec.groups.items():
            views.update(full_views(full[g], layout))
    firsts = [path for path, grad in grads.items() if grad is not None and path not in written]
    for path, grad in grads.items():
        if grad is not None and path in written:
            views[path].add_(grad)
    if firsts:  # the first values: one multi-tensor copy (cast) instead of adding to the zeros
        torch._foreach_copy_([views[p] for p in firsts], [grads[p] for p in firsts])
        written |= frozenset(firsts)
    return _with(state, unit, grad_full=full, grad_views=views, grad_written=written)


def _zero_unwritten(full: dict, layouts: dict, views: dict, written: frozenset) -> None:
    """Zero what ``accumulate_grads`` never wrote: the padding between leaves (the fused
    AdamW's finite check reads it) and leaves that got no gradient. One multi-tensor
    kernel instead of zero-filling every buffer before it is overwritten."""
    holes = [views[path] for path in views if path not in written]
    for key, layout in layouts.items():
        holes += [full[key][lo:hi] for lo, hi in layout.gaps]
    if holes:
        torch._foreach_zero_(holes)


def defer_wgrad(state: Lifecycle, unit: str, mb: int) -> Lifecycle:
    """Note that microbatch ``mb`` of ``unit`` has weight gradients still to compute;
    its reduction is refused until ``wgrad_done``."""
    ustate = state.units[unit]
    return _with(state, unit, wgrad_pending=ustate.wgrad_pending + (mb,))


def wgrad_done(state: Lifecycle, unit: str, mb: int) -> Lifecycle:
    ustate = state.units[unit]
    if mb not in ustate.wgrad_pending:
        raise LifecycleError(f"wgrad {unit}: microbatch {mb} has no delayed weight gradients")
    return _with(state, unit, wgrad_pending=tuple(m for m in ustate.wgrad_pending if m != mb))


class Reduction(NamedTuple):
    """A gradient reduction in flight: ``results`` are valid once ``pendings`` landed."""

    unit: str
    results: dict
    pendings: tuple
    issued: float
    kind: str
    nbytes: int


def _fold(state: Lifecycle, r: Reduction) -> Lifecycle:
    """Wait for a reduction and add its result into the unit's grad shard."""
    for p in r.pendings:
        p.wait()
    shard = state.units[r.unit].grad_shard
    shard = dict(r.results) if shard is None else {g: shard[g].add_(r.results[g]) for g in shard}
    event = Event(r.kind, r.unit, None, -1, r.issued, now(), r.nbytes, "grads") if r.kind else None
    return _with(state, r.unit, event, grad_shard=shard)


def reduce_grads(state: Lifecycle, unit: str, mb: int, last: bool) -> Lifecycle:
    """Sum ``unit``'s accumulated grads over the data-parallel ranks (async).

    Sharded: reduce-scatter into this rank's shard; unsharded: all-reduce. ZeRO-2/3
    reduce every microbatch; DDP and ZeRO-1 only on the last (``last=True``).
    """
    ustate = state.units[unit]
    if mb in ustate.reduced:
        raise LifecycleError(f"reduce {unit}: microbatch {mb}'s gradients were already reduced")
    if not last and not reduces_every_microbatch(state.plan):
        raise LifecycleError(f"reduce {unit}: sharding={state.plan.sharding!r} reduces once, on the last microbatch")
    if ustate.wgrad_pending:
        raise LifecycleError(f"reduce {unit}: the delayed wgrad of microbatch {ustate.wgrad_pending[0]} "
                             "has not run; it must come before the reduction")
    if ustate.grad_full is None:
        raise LifecycleError(f"reduce {unit}: no gradients were accumulated since the last reduction")
    while len(state.pending) >= MAX_PENDING_REDUCTIONS:
        state = dataclasses.replace(_fold(state, state.pending[0]), pending=state.pending[1:])
    issued = now()
    full = ustate.grad_full
    layouts = _unit_spec(state, unit).groups
    _zero_unwritten(full, layouts, ustate.grad_views, ustate.grad_written)
    results, works, kinds = {}, [], set()
    for key, grads in full.items():
        if _shared(state, key):
            results[key] = torch.empty(layouts[key].shard_size, dtype=torch.float32, device=state.plan.device)
            works.append(_shard_group(state, key).reduce_scatter(results[key], grads))
            kinds.add("reduce_scatter")
        else:
            results[key] = grads
            group = state.mesh.data_group(key[0])
            works.append(group.all_reduce(grads))
            kinds.add("all_reduce" if group.size > 1 else "")
    kind = "reduce_scatter" if "reduce_scatter" in kinds else ("all_reduce" if "all_reduce" in kinds else "")
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    state = _with(state, unit, grad_full=None, grad_views=None, grad_written=frozenset(),
                  reduced=ustate.reduced + (mb,))
    reduction = Reduction(unit, results, tuple(works), issued, kind, nbytes)
    return dataclasses.replace(state, pending=state.pending + (reduction,))


def record(state: Lifecycle, *events: Event) -> Lifecycle:
    """Append compute (or other) events to the trace."""
    return dataclasses.replace(state, trace=state.trace + events)


def finish(state: Lifecycle, trained: bool = True) -> Lifecycle:
    """Wait for every reduction and check the step left no unit gathered or unreduced.

    ``trained=False`` (a forward-only program) expects no reduction at all.
    """
    for oldest in state.pending:
        state = _fold(state, oldest)
    state = dataclasses.replace(state, pending=())
    M = state.plan.microbatches
    expected = (tuple(range(M)) if reduces_every_microbatch(state.plan) else (M - 1,)) if trained else ()
    for name, u in state.units.items():
        if u.phase != Phase.SHARDED:
            raise LifecycleError(f"step ended with unit {name} {u.phase.value}; every unit must be released")
        if tuple(sorted(u.reduced)) != expected:
            raise LifecycleError(f"unit {name}: gradients reduced for microbatches {sorted(u.reduced)}, "
                                 f"expected {list(expected)} under sharding={state.plan.sharding!r}")
        if u.wgrad_pending:
            raise LifecycleError(f"unit {name}: delayed wgrad of microbatches {list(u.wgrad_pending)} never ran")
        if u.grad_full is not None:
            raise LifecycleError(f"unit {name}: gradients accumulated after its last reduction were never reduced")
    return state


class Shards(NamedTuple):
    """What a step gathers from (``build_shards``).

    Attributes:
        flat: ``{unit: {(domain, dtype): flat shard in that dtype}}``.
        scales: ``{path: fp32 scale (0-d)}`` of each weight in an ``fp8`` group, the
            same on every rank.
    """

    flat: dict
    scales: dict


def build_shards(params_named: dict, spec: ShardSpec, plan: Plan, mesh: Mesh) -> Shards:
    """This rank's leaves copied into new flat shards, cast to each group's dtype on the
    way. This is the step's one pass over the params before it gathers: in a bf16 step
    it is the cast to bf16 any step pays; in an fp32 one a copy, held for the step beside
    the params. The params are plain tensors and the step never writes into them.
    An ``fp8`` group is written in bf16 first, then cast (``_cast_to_fp8``)."""
    rank = mesh.world.rank
    flat, staged = {}, []
    for u in spec.units:
        flat[u.name] = {}
        for key, layout in u.groups.items():
            r = shard_rank(plan, rank, key[0])
            dtype = plan.compute_dtype if key[1] == "fp8" else u.dtype(key, plan)
            out = torch.empty(layout.shard_size, dtype=dtype, device=plan.device)
            flat[u.name][key] = write_shard(params_named, layout, r, out)
            if key[1] == "fp8":
                staged.append((u.name, key, layout, r))
    return Shards(flat, _cast_to_fp8(flat, staged, spec, mesh) if staged else {})


def _cast_to_fp8(flat: dict, staged: list, spec: ShardSpec, mesh: Mesh) -> dict:
    """Replace each staged bf16 shard ``flat[unit][key]`` by its cast to E4M3, and return
    the weights' scales. A weight's scale comes from its amax over every rank's rows (one
    all-reduce for the whole model, before any gather) and its rows are cast with it, so
    a gather yields what ``quantize_tensor`` makes of the gathered bf16 weight."""
    rows = {}  # path: this rank's rows of the weight, in bf16
    for name, key, layout, r in staged:
        rows.update(local_leaves(flat[name][key], layout, r, sharded=True))
    amax = torch.stack([w.abs().amax().float() if w.numel() else w.new_zeros((), dtype=torch.float32)
                        for w in rows.values()])
    # (a NaN in a weight makes its scale NaN in quantize_tensor; a MAX over ranks may
    # drop it, leaving only the NaN rows NaN: the loss is NaN either way)
    mesh.shard_group("dense", spec.sizes["dense"]).all_reduce(amax, dist.ReduceOp.MAX).wait()
    # each its own allocation: cuBLASLt wants a scale's address 16-byte aligned
    scales = {path: scale.clone() for path, scale in zip(rows, tensor_scale(amax).unbind())}
    for name, key, layout, r in staged:
        q = torch.empty(layout.shard_size, dtype=E4M3, device=amax.device)
        for path, out in local_leaves(q, layout, r, sharded=True).items():
            if out.numel():
                out.copy_(cast_weight(rows[path], scales[path]))
        for lo, hi in layout.local_gaps(r):
            q[lo:hi].zero_()
        flat[name][key] = q
    return scales
