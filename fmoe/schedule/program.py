"""A step as a program: the ordered list of lifecycle transitions and compute nodes.

The program is a pure function of the plan, built before anything runs, so the
same checks that guard execution can be run on it ahead of time, and a test can
hand the executor a deliberately wrong one.
"""

from __future__ import annotations

from typing import NamedTuple

from ..config import Plan
from ..shard.spec import shard_spec
from ..shard.units import members


class Action(NamedTuple):
    """``op`` is ``gather | wait | release | reduce`` (on ``unit``) or
    ``forward | backward`` (of ``node`` for microbatch ``mb``)."""

    op: str
    unit: str | None = None
    node: str | None = None
    mb: int = -1


def node_uses(plan: Plan, train: bool = True) -> list[tuple[int, str, str, str]]:
    """``(mb, "forward" | "backward", node, unit)`` in the standard schedule's order."""
    spec = shard_spec(plan)
    nodes = members(plan.model)
    phases = (("forward", nodes), ("backward", nodes[::-1])) if train else (("forward", nodes),)
    uses = []
    for mb in range(plan.microbatches):
        for direction, order in phases:
            uses += [(mb, direction, n, spec.unit_of_member(n).name) for n in order]
    return uses


def max_live_units(plan: Plan) -> int:
    """ZeRO-3 holds the unit in use plus ``prefetch`` more; the others hold all for the step."""
    if plan.sharding == "optim_grads_params":
        return plan.prefetch + 1
    return len(shard_spec(plan).units)


def _last_backward(uses) -> set:
    """Positions after which a unit has no more backward node in that microbatch."""
    last = {}
    for i, (mb, direction, _, unit) in enumerate(uses):
        if direction == "backward":
            last[(mb, unit)] = i
    return set(last.values())


def build_program(plan: Plan, train: bool = True) -> list[Action]:
    """The standard schedule: each microbatch forward then backward (forward only
    with ``train=False``).

    ``optim_grads_params`` gathers a unit before it is used (``prefetch`` nodes ahead)
    and releases it when the next node needs another unit; the other strategies
    gather every unit once, keep it for the step and release it at the end.
    Gradients are reduced after a unit's last backward node of a microbatch: every
    microbatch under ZeRO-2/3, only the last under DDP and ZeRO-1.
    """
    uses = node_uses(plan, train)
    last_bwd = _last_backward(uses)
    per_mb = plan.sharding in ("optim_grads", "optim_grads_params")
    zero3 = plan.sharding == "optim_grads_params"
    program, live, waited = [], set(), set()
    if not zero3:
        for unit in dict.fromkeys(u for *_, u in uses):
            program.append(Action("gather", unit))
            live.add(unit)
    for i, (mb, direction, node, unit) in enumerate(uses):
        if zero3:
            for *_, ahead in uses[i:i + 1 + plan.prefetch]:
                if ahead not in live:
                    program.append(Action("gather", ahead))
                    live.add(ahead)
        if unit not in waited:
            program.append(Action("wait", unit))
            waited.add(unit)
        program.append(Action(direction, unit, node, mb))
        next_unit = uses[i + 1][3] if i + 1 < len(uses) else None
        if zero3 and next_unit != unit:
            program.append(Action("release", unit))
            live.discard(unit)
            waited.discard(unit)
        if i in last_bwd and (per_mb or mb == plan.microbatches - 1):
            program.append(Action("reduce", unit, None, mb))
    for unit in live:
        program.append(Action("release", unit))
    return program


def double_buffer_slots(plan: Plan, program: list[Action]) -> dict | None:
    """Under ``gather_buffers='double'``, a fixed slot (0 or 1) per unit.

    Slots alternate in order of first gather; ValueError (before anything runs) if
    the program would ever need both live units in one slot.
    """
    if plan.gather_buffers != "double" or not any(size > 1 for size in shard_spec(plan).sizes.values()):
        return None
    slots, live = {}, set()
    for a in program:
        if a.op == "gather":
            slot = slots.setdefault(a.unit, len(slots) % 2)
            busy = [u for u in live if slots[u] == slot]
            if busy:
                raise ValueError(
                    f"Plan.gather_buffers='double' cannot hold this schedule: unit {a.unit} and {busy[0]} "
                    "share a slot while both are live (allowed: gather_buffers 'dynamic' or 'persistent', "
                    "or units that alternate)")
            live.add(a.unit)
        elif a.op == "release":
            live.discard(a.unit)
    return slots
