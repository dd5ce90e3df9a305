"""A stage's program against the FSDP lifecycle, without tensors: the step's own ledger (``fmoe.shard.ledger``)
folded over the actions, so the planner finds a broken program before any GPU does."""

from ..config import Plan
from ..layers.nodes import Kind
from ..resolve import Program
from ..schedule.actions import Backward, Forward, Gather, Recompute, Reduce, Release, Wait, Wgrad, label
from ..shard import ledger as ledgers
from ..shard.spec import ShardSpec


def _apply(ledger, i: int, a, delayed: bool):
    what = f"action {i} ({label(a)})"
    match a:
        case Gather(unit):
            return ledgers.gather(ledger, unit, what)
        case Wait(unit):
            return ledgers.wait(ledger, unit, what)
        case Release(unit):
            return ledgers.release(ledger, unit, what)
        case Forward(_, _, unit) | Recompute(_, _, unit) if unit is not None:
            ledgers.require_gathered(ledger, unit, what)  # and the ledger as it was
        case Wgrad(_, mb, unit) if unit is not None:
            return ledgers.wgrad_done(ledgers.gradients(ledger, unit, mb, what), unit, mb, what)
        case Backward(node, mb, unit) if unit is not None:  # the experts' weight gradients delayed to their Wgrad
            ledger = ledgers.gradients(ledger, unit, mb, what)
            return ledgers.defer_wgrad(ledger, unit, mb) if delayed and node.kind == Kind.EXPERTS else ledger
        case Reduce(unit, mb, last):
            return ledgers.reduce(ledger, unit, mb, last, what)
    return ledger


def check_lifecycle(plan: Plan, spec: ShardSpec, program: Program, stage: int) -> None:
    """Raise ``LifecycleError`` naming the first action of ``program`` (stage ``stage``'s, under the plan's
    ShardSpec ``spec``) that breaks the lifecycle, or the units left wrong at its end."""
    units = [u.name for u in spec.stage_units(stage)]
    ledger = ledgers.start(units, program.max_live, spec.sharding, plan.microbatches)
    for i, a in enumerate(program.actions):
        ledger = _apply(ledger, i, a, plan.delay_wgrad)
    ledgers.finish(ledger, program.trains)
