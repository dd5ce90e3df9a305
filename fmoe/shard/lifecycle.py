"""The FSDP lifecycle as a state machine: each transition takes the state and returns a
new state (a frozen dataclass). The device buffers it names are not copied and are
mutated in place: a gather fills a unit's buffer, a release frees its storage,
gradients are added into their buffers.

    SHARDED --gather (async)--> GATHERING --wait--> GATHERED --release--> SHARDED
    grads: accumulate per microbatch --reduce_grads (async)--> folded into the grad shard

The rules are the ledger's (``ledger.py``, which the planner checks programs with), and
each transition applies its rule first, so a schedule that computes with a unit that
is not gathered, keeps too many units live, reduces a unit's gradients twice or never,
or (here alone) overwrites a busy double buffer fails loudly at that point, before the
compute that would read released memory. Every transition lands in ``trace``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..comm.mesh import Mesh
from ..comm.trace import Event, now
from . import ledger as ledgers
from .ledger import Ledger, LifecycleError, Phase
from .shards import Shards, gathered_views
from .spec import GroupKey, ShardSpec, full_views

__all__ = ["Lifecycle", "LifecycleError", "Phase", "UnitState"]


@dataclass(frozen=True)
class UnitState:
    """One unit's buffers (its phase and reductions are the ledger's).

    Attributes:
        buffers: ``{GroupKey: flat full buffer}`` once the unit was first gathered.
        in_flight: the pending gathers and when they were issued.
        views: ``{path: full-shape view}`` of the gathered buffers while GATHERED.
        grad_full: ``{group: fp32 full-layout grads}`` accumulated since the last reduce.
        grad_views: ``{path: full-shape view}`` of ``grad_full``.
        grad_written: paths whose grad views hold a value since ``grad_full`` was made.
        grad_shard: ``{group: fp32 reduced grads}`` (this rank's shard, or all of it unsharded).
    """

    buffers: dict | None = None
    in_flight: tuple = ()
    views: dict | None = None
    grad_full: dict | None = None
    grad_views: dict | None = None
    grad_written: frozenset = frozenset()
    grad_shard: dict | None = None


@dataclass(frozen=True)
class Lifecycle:
    """The lifecycle of every unit in one step, plus what the transitions need.

    Attributes:
        spec: the plan's ShardSpec.
        mesh: this rank's process groups (who shares which buffers, who sums grads).
        device: where the buffers live.
        dynamic: ``Plan.gather_buffers='dynamic'``: a release frees a unit's buffers.
        shards: ``{unit: {GroupKey: flat shard in that dtype}}`` built from the params.
        units: ``{unit: UnitState}``.
        ledger: every unit's phase and reductions, and the rules (``ledger.Ledger``).
        slots: ``{unit: slot}`` under double buffering, else None.
        slot_buffers: ``{(slot, group): tensor}`` under double buffering.
        pending: Reductions in flight, oldest first.
        trace: every Event so far.
        scales: ``{path: fp32 scale}`` of the weights in ``fp8`` groups (``Shards``).
        frozen: the weights take no gradient (``Plan.lora``'s base): a reduction is the
            ledger's transition alone, with nothing to sum.
    """

    spec: ShardSpec
    mesh: Mesh
    device: torch.device
    dynamic: bool
    shards: dict
    units: dict
    ledger: Ledger
    slots: dict | None = None
    slot_buffers: dict | None = None
    pending: tuple = ()
    trace: tuple = ()
    scales: dict = dataclasses.field(default_factory=dict)
    frozen: bool = False

    def live(self) -> list[str]:
        return self.ledger.live()


MAX_PENDING_REDUCTIONS = 2


def start(spec: ShardSpec, mesh: Mesh, shards: Shards, max_live: int, slots: dict | None, device,
          dynamic: bool, microbatches: int, frozen: bool = False) -> Lifecycle:
    """Every unit of ``shards`` SHARDED: the flat shards of the params this rank holds
    (``fmoe.shard.shards.build_shards``); ``max_live`` and ``slots``: the program's;
    ``frozen``: the weights take no gradient."""
    return Lifecycle(spec, mesh, torch.device(device), dynamic, shards.flat,
                     {name: UnitState() for name in shards.flat},
                     ledgers.start(shards.flat, max_live, spec.sharding, microbatches), slots,
                     {} if slots is not None else None, scales=shards.scales, frozen=frozen)


def _shared(state: Lifecycle, key: GroupKey) -> bool:
    """Whether the buffers of group ``key`` are split over several ranks."""
    return state.spec.sharded(key.domain)


def _shard_group(state: Lifecycle, key: GroupKey):
    return state.mesh.shard_group(key.domain, state.spec.sizes[key.domain])


def _with(state: Lifecycle, unit: str, event: Event | None = None, ledger: Ledger | None = None,
          **changes) -> Lifecycle:
    units = dict(state.units)
    units[unit] = dataclasses.replace(state.units[unit], **changes)
    trace = state.trace + ((event,) if event else ())
    return dataclasses.replace(state, units=units, trace=trace, ledger=ledger or state.ledger)


def _gather_buffers(state: Lifecycle, unit: str) -> dict:
    """The flat buffers a gather of ``unit`` writes (allocating or re-growing them).

    A unit always gathers into the same storage, so views autograd saved during its
    forward see the re-gathered weights in its backward. A group held whole by
    every rank needs no buffer: its shard is the full tensor.
    """
    spec, ustate = state.spec.unit(unit), state.units[unit]
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
                state.slot_buffers[slot_key] = torch.empty(size, dtype=state.spec.dtype(key), device=state.device)
            bufs[key] = state.slot_buffers[slot_key][:layout.full_size]
        elif ustate.buffers is None:
            bufs[key] = torch.empty(layout.full_size, dtype=state.spec.dtype(key), device=state.device)
        else:  # dynamic: released storage grows back in place
            buf = bufs[key] = ustate.buffers[key]
            storage = buf.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(buf.numel() * buf.element_size())
    return bufs


def gather(state: Lifecycle, unit: str) -> Lifecycle:
    """Issue the all-gather of ``unit``'s flat shards (async). SHARDED -> GATHERING."""
    ledger = ledgers.gather(state.ledger, unit, f"gather {unit}")
    bufs = _gather_buffers(state, unit)
    issued = now()
    # Autograd may hold views of these buffers from an earlier forward of this unit;
    # refilling them with the same weights must not count as a mutation. The versions
    # are put back once the gather has landed (some backends copy in at completion).
    versions = torch.autograd._unsafe_preserve_version_counter(tuple(bufs.values()))
    pendings = [_shard_group(state, key).all_gather(buf, state.shards[unit][key])
                for key, buf in bufs.items() if _shared(state, key)]
    return _with(state, unit, ledger=ledger, buffers=bufs, in_flight=(tuple(pendings), issued, versions))


def wait(state: Lifecycle, unit: str) -> Lifecycle:
    """Block until ``unit``'s gather landed. GATHERING -> GATHERED."""
    ledger = ledgers.wait(state.ledger, unit, f"wait {unit}")
    ustate = state.units[unit]
    pendings, issued, versions = ustate.in_flight
    for p in pendings:
        p.wait()
    versions.__exit__()
    event = None
    if pendings:
        nbytes = sum(b.numel() * b.element_size() for k, b in ustate.buffers.items() if _shared(state, k))
        event = Event("all_gather", unit, None, -1, issued, now(), nbytes, "params")
    views = gathered_views(ustate.buffers, state.spec.unit(unit), state.scales, state.spec.compute_dtype)
    return _with(state, unit, event, ledger, in_flight=(), views=views)


def release(state: Lifecycle, unit: str) -> Lifecycle:
    """Drop ``unit``'s gathered weights. GATHERED -> SHARDED (dynamic buffers are freed)."""
    ledger = ledgers.release(state.ledger, unit, f"release {unit}")
    ustate = state.units[unit]
    t = now()
    if state.dynamic:
        for key, buf in ustate.buffers.items():
            if _shared(state, key):
                buf.untyped_storage().resize_(0)
    return _with(state, unit, Event("release", unit, None, -1, t, now()), ledger, views=None)


def require_gathered(state: Lifecycle, unit: str, what: str) -> dict:
    """The full-shape weight views of ``unit`` for compute ``what``; raises unless GATHERED."""
    ledgers.require_gathered(state.ledger, unit, what)
    return state.units[unit].views


def gradients(state: Lifecycle, unit: str, mb: int, what: str) -> Lifecycle:
    """``what`` (a backward or delayed wgrad of microbatch ``mb``) is about to add
    ``unit``'s gradients: the ledger's rule (gathered, ``mb`` not reduced)."""
    return dataclasses.replace(state, ledger=ledgers.gradients(state.ledger, unit, mb, what))


def accumulate_grads(state: Lifecycle, unit: str, grads: dict) -> Lifecycle:
    """Add ``{path: grad}`` (any dtype, full shapes) into ``unit``'s fp32 full-layout grads."""
    spec, ustate = state.spec.unit(unit), state.units[unit]
    full, views, written = ustate.grad_full, ustate.grad_views, ustate.grad_written
    if full is None:  # uninitialised: every value is written here or zeroed by _zero_unwritten
        full = {g: torch.empty(layout.full_size, dtype=torch.float32, device=state.device)
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
    return dataclasses.replace(state, ledger=ledgers.defer_wgrad(state.ledger, unit, mb))


def wgrad_done(state: Lifecycle, unit: str, mb: int) -> Lifecycle:
    return dataclasses.replace(state, ledger=ledgers.wgrad_done(state.ledger, unit, mb, f"wgrad {unit}"))


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
    ledger = ledgers.reduce(state.ledger, unit, mb, last, f"reduce {unit}")
    if state.frozen:
        return dataclasses.replace(state, ledger=ledger)
    ustate = state.units[unit]
    if ustate.grad_full is None:  # the ledger saw a backward, which left no weight gradient here
        raise LifecycleError(f"reduce {unit}: its backward left no weight gradients in its buffers")
    while len(state.pending) >= MAX_PENDING_REDUCTIONS:
        state = dataclasses.replace(_fold(state, state.pending[0]), pending=state.pending[1:])
    issued = now()
    full = ustate.grad_full
    layouts = state.spec.unit(unit).groups
    _zero_unwritten(full, layouts, ustate.grad_views, ustate.grad_written)
    results, works, kinds = {}, [], set()
    for key, grads in full.items():
        if _shared(state, key):
            results[key] = torch.empty(layouts[key].shard_size, dtype=torch.float32, device=state.device)
            works.append(_shard_group(state, key).reduce_scatter(results[key], grads))
            kinds.add("reduce_scatter")
        else:
            results[key] = grads
            group = state.mesh.data_group(key.domain)
            works.append(group.all_reduce(grads))
            kinds.add("all_reduce" if group.size > 1 else "")
    kind = "reduce_scatter" if "reduce_scatter" in kinds else ("all_reduce" if "all_reduce" in kinds else "")
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    state = _with(state, unit, ledger=ledger, grad_full=None, grad_views=None, grad_written=frozenset())
    reduction = Reduction(unit, results, tuple(works), issued, kind, nbytes)
    return dataclasses.replace(state, pending=state.pending + (reduction,))


def record(state: Lifecycle, *events: Event) -> Lifecycle:
    """Append compute (or other) events to the trace."""
    return dataclasses.replace(state, trace=state.trace + events)


def finish(state: Lifecycle, trained: bool = True) -> Lifecycle:
    """Wait for every reduction and check the step left no unit gathered or unreduced
    (``ledger.finish``; ``trained=False``, a forward-only program, expects no reduction)."""
    for oldest in state.pending:
        state = _fold(state, oldest)
    ledgers.finish(state.ledger, trained)
    return dataclasses.replace(state, pending=())
