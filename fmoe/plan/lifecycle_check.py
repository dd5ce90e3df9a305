"""A stage's program against the FSDP lifecycle, without tensors: the rules
``fmoe.shard.lifecycle`` enforces while a step runs, checked on the actions alone so
the planner finds a broken program before any GPU does.

A unit goes sharded -> (``Gather``) gathering -> (``Wait``) gathered -> (``Release``)
sharded; no more than the program's live-unit bound are gathering or gathered at once;
a node computes only with its unit gathered; a ``Reduce`` of a microbatch comes after
that microbatch's gradients (its delayed wgrad included) and once, every microbatch
under ZeRO-2/3, the last under DDP and ZeRO-1; the step ends with every unit released
and reduced.
"""

from __future__ import annotations

from ..config import Plan
from ..layers.nodes import Kind
from ..resolve import Program
from ..schedule.actions import Backward, Forward, Gather, Recompute, Reduce, Release, Wait, Wgrad
from ..shard.spec import ShardSpec


class LifecycleViolation(ValueError):
    """A program that breaks the lifecycle (``simulate`` raises it as a PlanError)."""


def check_lifecycle(plan: Plan, spec: ShardSpec, program: Program, stage: int) -> None:
    """Raise LifecycleViolation naming the first action of ``program`` (pipeline stage
    ``stage``'s, under ``spec``: the plan's ShardSpec) that breaks the lifecycle, or the
    units left wrong at its end."""
    phase = {u.name: "sharded" for u in spec.stage_units(stage)}
    reduced = {u: set() for u in phase}
    accumulated, pending_wgrad = set(), set()
    delayed = plan.delay_wgrad

    def fail(i, a, why):
        raise LifecycleViolation(f"action {i} ({a.op} {getattr(a, 'node', None) or a.unit}"
                                 f"{f' mb{a.mb}' if getattr(a, 'mb', -1) >= 0 else ''}): {why}")

    for i, a in enumerate(program.actions):
        match a:
            case Gather(unit):
                if phase.get(unit) != "sharded":
                    fail(i, a, f"unit {unit} is {phase.get(unit, 'not on this stage')}, not sharded")
                phase[unit] = "gathering"
                live = [u for u, p in phase.items() if p != "sharded"]
                if len(live) > program.max_live:
                    fail(i, a, f"{len(live)} live units exceed the plan's {program.max_live} ({', '.join(live)})")
            case Wait(unit):
                if phase.get(unit) != "gathering":
                    fail(i, a, f"unit {unit} is {phase.get(unit)}; only a gathering unit can be waited on")
                phase[unit] = "gathered"
            case Release(unit):
                if phase.get(unit) != "gathered":
                    fail(i, a, f"unit {unit} is {phase.get(unit)}, not gathered")
                phase[unit] = "sharded"
            case Forward(_, _, unit) | Recompute(_, _, unit) if unit is not None:
                if phase.get(unit) != "gathered":
                    fail(i, a, f"needs unit {unit}, which is {phase.get(unit)}, not gathered")
            case Backward(node, mb, unit) | Wgrad(node, mb, unit) if unit is not None:
                if phase.get(unit) != "gathered":
                    fail(i, a, f"needs unit {unit}, which is {phase.get(unit)}, not gathered")
                if mb in reduced[unit]:
                    fail(i, a, f"microbatch {mb}'s gradients of unit {unit} were already reduced")
                accumulated.add(unit)
                if isinstance(a, Wgrad):
                    if (unit, mb) not in pending_wgrad:
                        fail(i, a, f"microbatch {mb} has no delayed weight gradients")
                    pending_wgrad.discard((unit, mb))
                elif delayed and node.kind == Kind.EXPERTS:
                    pending_wgrad.add((unit, mb))
            case Reduce(unit, mb, last):
                if mb in reduced[unit]:
                    fail(i, a, f"microbatch {mb}'s gradients were already reduced")
                if not last and not spec.sharding.reduces_every_microbatch:
                    fail(i, a, f"sharding={spec.sharding.value!r} reduces once, on the last microbatch")
                if any(u == unit for u, _ in pending_wgrad):
                    fail(i, a, "a delayed wgrad has not run; it must come before the reduction")
                if unit not in accumulated:
                    fail(i, a, "no gradients were accumulated since the last reduction")
                accumulated.discard(unit)
                reduced[unit].add(mb)
    M = plan.microbatches
    expected = (set(range(M)) if spec.sharding.reduces_every_microbatch else {M - 1}) if program.trains else set()
    for unit, p in phase.items():
        if p != "sharded":
            raise LifecycleViolation(f"the program ends with unit {unit} {p}; every unit must be released")
        if reduced[unit] != expected:
            raise LifecycleViolation(f"unit {unit}: gradients reduced for microbatches {sorted(reduced[unit])}, "
                                     f"expected {sorted(expected)} under sharding={spec.sharding.value!r}")
    if pending_wgrad or accumulated:
        left = sorted({u for u, _ in pending_wgrad} | accumulated)
        raise LifecycleViolation(f"units {left}: gradients computed after the last reduction were never reduced")
