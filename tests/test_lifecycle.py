"""The lifecycle checker and the schedule program, on one process."""

import json

import pytest
import torch

import fmoe
from fmoe.batch import Batch
from fmoe.params import named_leaves
from fmoe.resolve import resolve
from fmoe.schedule import Backward, Forward, Gather, Node, Reduce, Wait, execute
from fmoe.shard import LifecycleError

CFG = fmoe.ModelConfig(vocab=32, dim=16, layers=2, heads=2, experts=4, topk=2, ffn=8)
TOKENS = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))


def build_program(plan):
    return list(resolve(plan).train.actions)


def run(plan, program):
    params, setup = fmoe.init(plan, seed=0), resolve(plan)
    return execute(setup, named_leaves(params), Batch.of_tokens(TOKENS), 4 * 8, setup.train.with_actions(program))


def zero3(**kw):
    return fmoe.Plan(model=CFG, sharding="optim_grads_params", **kw)


def without(program, action):
    """``program`` minus the first occurrence of ``action``."""
    out = list(program)
    out.remove(action)
    return out


def test_program_runs_and_matches_step():
    plan = zero3(microbatches=2)
    ran = run(plan, build_program(plan))
    out = fmoe.step(fmoe.init(plan, seed=0), {"tokens": TOKENS}, plan)
    assert torch.equal(ran.ce_sum / 32, out.loss)


def test_backward_on_a_released_unit_is_caught_before_it_runs():
    plan = zero3()
    program = build_program(plan)
    bwd = program.index(Backward(Node("experts", 0), 0, "layers.0"))
    # Drop the re-gather (and its wait) that precede layers.0's backward: the weights
    # it would read were released after its forward.
    regather = [i for i, a in enumerate(program[:bwd]) if a.unit == "layers.0" and a.op in ("gather", "wait")][-2:]
    assert [program[i].op for i in regather] == ["gather", "wait"]
    wrong = [a for i, a in enumerate(program) if i not in regather]
    with pytest.raises(LifecycleError, match=r"backward layers.0.experts \(microbatch 0\) needs unit layers.0, which is sharded"):
        run(plan, wrong)


def test_forward_before_wait_is_caught():
    plan = zero3()
    wrong = without(build_program(plan), Wait("embed"))
    with pytest.raises(LifecycleError, match="forward embed .* gathering, not gathered"):
        run(plan, wrong)


def test_too_many_live_units_is_caught():
    plan = zero3(prefetch=1)
    wrong = [Gather("layers.0"), Gather("layers.1")] + build_program(plan)
    with pytest.raises(LifecycleError, match="exceed the plan's 2"):
        run(plan, wrong)


def test_gradients_reduced_twice_or_never_are_caught():
    plan = zero3(microbatches=2)
    program = build_program(plan)
    reduce = Reduce("head", 0, False)
    twice = program[:program.index(reduce) + 1] + [reduce] + program[program.index(reduce) + 1:]
    with pytest.raises(LifecycleError, match="already reduced"):
        run(plan, twice)
    with pytest.raises(LifecycleError, match="never reduced|reduced for microbatches"):
        run(plan, without(program, Reduce("layers.1", 1, True)))


def test_zero1_reducing_every_microbatch_is_caught():
    plan = fmoe.Plan(model=CFG, sharding="optim", microbatches=2)
    program = build_program(plan)
    at = program.index(Backward(Node("head"), 0, "head")) + 1
    wrong = program[:at] + [Reduce("head", 0, False)] + program[at:]
    with pytest.raises(LifecycleError, match="reduces once, on the last microbatch"):
        run(plan, wrong)


def test_unit_left_gathered_is_caught():
    plan = zero3()
    program = build_program(plan)
    with pytest.raises(LifecycleError, match="every unit must be released"):
        run(plan, program[:-2] + program[-1:])  # drop the final release of embed


def test_double_buffers_refuse_a_schedule_that_needs_one_slot_twice():
    plan = fmoe.Plan(model=CFG, dp=2, sharding="optim_grads_params", gather_buffers="double",
                     units=(("embed", "head"), ("layers.0",), ("layers.1",)))
    with pytest.raises(ValueError, match="share a slot while both are live"):
        resolve(plan)
    ok = plan.replace(units=None)
    assert resolve(ok).train.slots == {"embed": 0, "layers.0": 1, "layers.1": 0, "head": 1}


def test_prefetch_issues_gathers_ahead():
    def gathered_before_forward(plan, node):
        program = build_program(plan)
        return program.index(Gather(node)) < program.index(Forward(Node("attn", 0), 0, "layers.0"))

    assert gathered_before_forward(zero3(prefetch=1), "layers.1")
    assert not gathered_before_forward(zero3(prefetch=0), "layers.1")
    assert gathered_before_forward(zero3(prefetch=2), "head")


def test_trace_exports_to_chrome_json(tmp_path):
    plan = zero3(microbatches=2)
    out = fmoe.step(fmoe.init(plan, seed=0), {"tokens": TOKENS}, plan)
    trace = out.metrics["trace"]
    kinds = {e.kind for e in trace}
    assert {"forward", "backward", "release"} <= kinds
    path = fmoe.export_chrome_trace(trace, tmp_path / "step.json")
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) == len(trace)
    assert {e["ph"] for e in events} == {"X"} and all(e["dur"] >= 0 for e in events)
    names = [e["name"] for e in events if e["cat"] == "forward"]
    assert names[:2] == ["forward embed mb0", "forward layers.0.attn mb0"]


@pytest.mark.parametrize("kw", [dict(units=("embed", "head")), dict(units=[["embed"], ["nope"]]),
                                dict(units=[["embed", "head", "layers.0"]])])
def test_bad_units_are_rejected(kw):
    with pytest.raises(ValueError, match="Plan.units"):
        fmoe.Plan(model=CFG, **kw)


def test_profiler_traces_name_the_program_actions():
    plan = zero3(microbatches=2)
    params = fmoe.init(plan, seed=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fmoe.step(params, {"tokens": TOKENS}, plan)
    names = {e.name for e in prof.events()}
    for label in ("fmoe gather layers.0", "fmoe forward layers.0.attn mb1", "fmoe backward layers.1.experts mb0",
                  "fmoe reduce layers.1 mb1", "fmoe forward head mb0"):
        assert label in names, label


@pytest.mark.parametrize("schedule", ["standard", "1f1b_overlap"])
def test_zero3_holds_the_tied_embed_head_unit_beside_the_layers(schedule):
    # Tied embeddings make embed and head one unit, in use from the first compute to
    # the last: under ZeRO-3 it is live beside each layer's unit and the prefetched
    # one (the live-unit limit counted one unit in use and refused the program).
    cfg = CFG.replace(tie_embeddings=True)
    plan = fmoe.Plan(model=cfg, sharding="optim_grads_params", schedule=schedule, microbatches=2)
    params = fmoe.init(plan, seed=0)
    got = fmoe.step(params, {"tokens": TOKENS}, plan)
    want = fmoe.step(params, {"tokens": TOKENS}, plan.replace(sharding="no_shard"))
    assert torch.equal(got.loss, want.loss)


def test_the_ledger_alone_holds_the_rules_the_step_and_the_planner_share():
    from fmoe.shard import ledger as L
    from fmoe.shard.spec import Sharding

    zero3 = L.start(["embed", "layers.0"], max_live=1, sharding=Sharding("optim_grads_params"), microbatches=2)
    with pytest.raises(LifecycleError, match="b0 needs unit embed, which is sharded, not gathered"):
        L.gradients(zero3, "embed", 0, "b0")
    up = L.wait(L.gather(zero3, "embed", "g"), "embed", "w")
    with pytest.raises(LifecycleError, match="g1: 2 live units would exceed the plan's 1"):
        L.gather(up, "layers.0", "g1")
    with pytest.raises(LifecycleError, match="r: no gradients were accumulated"):
        L.reduce(up, "embed", 0, False, "r")
    done = L.reduce(L.gradients(up, "embed", 0, "b0"), "embed", 0, False, "r0")
    with pytest.raises(LifecycleError, match="b0 again: microbatch 0's gradients of unit embed were already reduced"):
        L.gradients(done, "embed", 0, "b0 again")  # what a backward after its own reduction would add
    delayed = L.defer_wgrad(L.gradients(done, "embed", 1, "b1"), "embed", 1)
    with pytest.raises(LifecycleError, match="the delayed wgrad of microbatch 1 has not run"):
        L.reduce(delayed, "embed", 1, True, "r1")
    with pytest.raises(LifecycleError, match="the step ends with unit embed gathered"):
        L.finish(delayed, trained=True)
    end = L.release(L.reduce(L.wgrad_done(delayed, "embed", 1, "wg"), "embed", 1, True, "r1"), "embed", "rel")
    with pytest.raises(LifecycleError, match=r"unit layers.0: gradients reduced for microbatches \[\], "
                                             r"expected \[0, 1\]"):
        L.finish(end, trained=True)
    L.finish(L.start(["embed"], 1, Sharding("optim"), 2), trained=False)  # forward only: nothing to reduce
