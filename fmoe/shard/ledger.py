"""The FSDP lifecycle's rules, without tensors: a ledger entry per unit (its phase, whether
gradients wait for a reduction, the microbatches reduced, the delayed weight gradients
still to run) and transitions that check the rules and return a new ledger.

    SHARDED --gather--> GATHERING --wait--> GATHERED --release--> SHARDED

No more than the program's live-unit bound are gathering or gathered at once; a node
computes only with its unit gathered; gradients of a microbatch come before its
reduction, which comes once (every microbatch under ZeRO-2/3, the last under DDP and
ZeRO-1) and after its delayed weight gradients; the step ends with every unit released
and reduced. The step's ``Lifecycle`` (``lifecycle.py``) moves its buffers beside it; the
planner (``fmoe/plan/lifecycle_check.py``) folds it over a program's actions. Every
transition takes ``what``, the action it serves, which its error starts with.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class LifecycleError(RuntimeError):
    """A schedule broke an invariant of the lifecycle."""


@dataclass(frozen=True)
class Entry:
    """One unit's part of the ledger.

    Attributes:
        phase: SHARDED, GATHERING or GATHERED.
        accumulated: gradients were computed since the unit's last reduction.
        reduced: microbatches whose gradients were reduced.
        wgrad_pending: microbatches whose delayed weight gradients have not run yet.
    """

    phase: Phase = Phase.SHARDED
    accumulated: bool = False
    reduced: tuple = ()
    wgrad_pending: tuple = ()


@dataclass(frozen=True)
class Ledger:
    """Every unit's Entry, and the bounds the program runs under.

    Attributes:
        entries: ``{unit: Entry}``.
        max_live: most units gathering or gathered at once.
        sharding: the plan's ``Sharding`` (which microbatches reduce).
        microbatches: the step's microbatch count.
    """

    entries: dict
    max_live: int
    sharding: object
    microbatches: int

    def live(self) -> list[str]:
        return [unit for unit, e in self.entries.items() if e.phase != Phase.SHARDED]


def start(units, max_live: int, sharding, microbatches: int) -> Ledger:
    """Every unit of ``units`` (names) SHARDED, nothing accumulated or reduced."""
    return Ledger({unit: Entry() for unit in units}, max_live, sharding, microbatches)


def _entry(ledger: Ledger, unit: str, what: str) -> Entry:
    if unit not in ledger.entries:
        raise LifecycleError(f"{what}: unit {unit} is not on this stage")
    return ledger.entries[unit]


def _with(ledger: Ledger, unit: str, **changes) -> Ledger:
    return dataclasses.replace(ledger, entries={**ledger.entries,
                                                unit: dataclasses.replace(ledger.entries[unit], **changes)})


def gather(ledger: Ledger, unit: str, what: str) -> Ledger:
    """SHARDED -> GATHERING, within the live-unit bound."""
    e = _entry(ledger, unit, what)
    if e.phase != Phase.SHARDED:
        raise LifecycleError(f"{what}: unit {unit} is {e.phase.value}, not sharded")
    live = ledger.live()
    if len(live) + 1 > ledger.max_live:
        raise LifecycleError(f"{what}: {len(live) + 1} live units would exceed the plan's {ledger.max_live} "
                             f"({', '.join(live)} already live)")
    return _with(ledger, unit, phase=Phase.GATHERING)


def wait(ledger: Ledger, unit: str, what: str) -> Ledger:
    """GATHERING -> GATHERED."""
    e = _entry(ledger, unit, what)
    if e.phase != Phase.GATHERING:
        raise LifecycleError(f"{what}: unit {unit} is {e.phase.value}; only a gathering unit can be waited on")
    return _with(ledger, unit, phase=Phase.GATHERED)


def release(ledger: Ledger, unit: str, what: str) -> Ledger:
    """GATHERED -> SHARDED."""
    e = _entry(ledger, unit, what)
    if e.phase != Phase.GATHERED:
        raise LifecycleError(f"{what}: unit {unit} is {e.phase.value}, not gathered")
    return _with(ledger, unit, phase=Phase.SHARDED)


def require_gathered(ledger: Ledger, unit: str, what: str) -> None:
    """Raise unless ``unit`` is GATHERED (``what`` computes with it)."""
    e = _entry(ledger, unit, what)
    if e.phase != Phase.GATHERED:
        raise LifecycleError(f"{what} needs unit {unit}, which is {e.phase.value}, not gathered")


def gradients(ledger: Ledger, unit: str, mb: int, what: str) -> Ledger:
    """A backward (or delayed wgrad) of microbatch ``mb`` computes ``unit``'s gradients:
    the unit gathered and that microbatch not reduced yet."""
    require_gathered(ledger, unit, what)
    if mb in ledger.entries[unit].reduced:
        raise LifecycleError(f"{what}: microbatch {mb}'s gradients of unit {unit} were already reduced")
    return _with(ledger, unit, accumulated=True)


def defer_wgrad(ledger: Ledger, unit: str, mb: int) -> Ledger:
    """Microbatch ``mb`` of ``unit`` has weight gradients still to compute: its reduction
    is refused until ``wgrad_done``."""
    return _with(ledger, unit, wgrad_pending=ledger.entries[unit].wgrad_pending + (mb,))


def wgrad_done(ledger: Ledger, unit: str, mb: int, what: str) -> Ledger:
    e = _entry(ledger, unit, what)
    if mb not in e.wgrad_pending:
        raise LifecycleError(f"{what}: microbatch {mb} has no delayed weight gradients")
    return _with(ledger, unit, wgrad_pending=tuple(m for m in e.wgrad_pending if m != mb))


def reduce(ledger: Ledger, unit: str, mb: int, last: bool, what: str) -> Ledger:
    """Microbatch ``mb``'s gradients of ``unit`` reduced (``last``: the step's last)."""
    e = _entry(ledger, unit, what)
    if mb in e.reduced:
        raise LifecycleError(f"{what}: microbatch {mb}'s gradients were already reduced")
    if not last and not ledger.sharding.reduces_every_microbatch:
        raise LifecycleError(f"{what}: sharding={ledger.sharding.value!r} reduces once, on the last microbatch")
    if e.wgrad_pending:
        raise LifecycleError(f"{what}: the delayed wgrad of microbatch {e.wgrad_pending[0]} has not run; it must "
                             "come before the reduction")
    if not e.accumulated:
        raise LifecycleError(f"{what}: no gradients were accumulated since the last reduction")
    return _with(ledger, unit, accumulated=False, reduced=e.reduced + (mb,))


def finish(ledger: Ledger, trained: bool) -> None:
    """Raise unless the step left every unit released, reduced for the microbatches its
    sharding reduces (none for a forward-only program, ``trained=False``), with no
    gradients or delayed weight gradients left over."""
    M, sharding = ledger.microbatches, ledger.sharding
    expected = (tuple(range(M)) if sharding.reduces_every_microbatch else (M - 1,)) if trained else ()
    for unit, e in ledger.entries.items():
        if e.phase != Phase.SHARDED:
            raise LifecycleError(f"the step ends with unit {unit} {e.phase.value}; every unit must be released")
        if tuple(sorted(e.reduced)) != expected:
            raise LifecycleError(f"unit {unit}: gradients reduced for microbatches {sorted(e.reduced)}, "
                                 f"expected {list(expected)} under sharding={sharding.value!r}")
        if e.wgrad_pending:
            raise LifecycleError(f"unit {unit}: delayed wgrad of microbatches {list(e.wgrad_pending)} never ran")
        if e.accumulated:
            raise LifecycleError(f"unit {unit}: gradients computed after its last reduction were never reduced")
