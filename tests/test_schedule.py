"""Schedules on one process: the 1F1B program, delayed wgrad and the checks guarding them."""

import pytest
import torch

import fmoe
from fmoe.batch import Batch
from fmoe.layers import DeferredWgrad, expert_mlp, make_dispatch, permute
from fmoe.params import named_leaves
from fmoe.resolve import resolve
from fmoe.schedule import Land, Node, Reduce, Release, Wgrad, execute
from fmoe.resolve import scheduling
from fmoe.schedule.program import schedule_ops
from fmoe.shard import LifecycleError

from .reference import assert_trees_equal

CFG = fmoe.ModelConfig(vocab=32, dim=16, layers=2, heads=2, experts=4, topk=2, ffn=8, shared_ffn=8,
                       expert_biases=True)
TOKENS = torch.randint(0, 32, (6, 9), generator=torch.Generator().manual_seed(0))


def plan(**kw):
    kw.setdefault("sharding", "optim_grads_params")
    return fmoe.Plan(model=CFG, microbatches=3, **kw)


def step(p):
    return fmoe.step(fmoe.init(p, seed=0), {"tokens": TOKENS}, p)


def assert_same_step(a, b):
    assert torch.equal(a.loss, b.loss)
    assert_trees_equal(a.grads, b.grads)


@pytest.mark.parametrize("sharding", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_1f1b_and_delayed_wgrad_are_bitwise_the_standard_step(sharding, prefetch):
    ref = step(plan(sharding=sharding, prefetch=prefetch))
    for delay in (False, True):
        assert_same_step(step(plan(sharding=sharding, prefetch=prefetch, schedule="1f1b_overlap",
                                   delay_wgrad=delay)), ref)


# dense layers first and last, as DeepSeek-V3's first: the 1F1B weave pairs a dense
# forward with a dense backward, a dense with a MoE and a MoE with a dense one
DENSE_CFG = CFG.replace(layers=5, dense_layers=(0, 1, 4), dense_ffn=12)


@pytest.mark.parametrize("sharding", ["no_shard", "optim_grads_params"])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_dense_layers_under_1f1b_delayed_wgrad_and_remat_are_bitwise_the_standard_step(sharding, remat):
    base = fmoe.Plan(model=DENSE_CFG, microbatches=3, sharding=sharding)
    ref = step(base)
    for delay in (False, True):
        assert_same_step(step(base.replace(schedule="1f1b_overlap", delay_wgrad=delay, remat=remat)), ref)
    if remat == "full":
        assert_same_step(step(base.replace(remat=remat)), ref)


def test_a_dense_layer_is_one_node_run_under_the_other_microbatchs_exchange():
    p = fmoe.Plan(model=DENSE_CFG, microbatches=2, schedule="1f1b_overlap")
    ops = [(mb, run.op, str(node)) for mb, run, node in schedule_ops(scheduling(p))]
    assert [op for op in ops if op[0] == 0 and "layers.0" in op[2]] == [
        (0, "forward", "layers.0.dense"), (0, "backward", "layers.0.dense")]
    b_moe = ops.index((0, "backward", "layers.3.combine"))  # its all-to-all under f's dense layer 1
    assert ops[b_moe + 1] == (1, "forward", "layers.1.dense")
    f_moe = ops.index((1, "forward", "layers.3.dispatch"))  # its all-to-all under b's dense layer 1
    assert ops[f_moe + 1:f_moe + 3] == [(0, "backward", "layers.1.dense"), (1, "forward", "layers.3.experts")]
    assert ops[ops.index((1, "forward", "layers.4.dense")) - 1] == (1, "land", "layers.3.combine")


def test_1f1b_weaves_forward_of_the_next_microbatch_into_the_backward():
    woven = scheduling(plan(schedule="1f1b_overlap", delay_wgrad=True))
    ops = [(mb, run.op, str(node)) for mb, run, node in schedule_ops(woven)]
    start = ops.index((0, "backward", "layers.1.combine"))
    assert ops[start:start + 9] == [
        (0, "backward", "layers.1.combine"), (1, "forward", "layers.0.attn"), (1, "forward", "layers.0.dispatch"),
        (0, "backward", "layers.1.experts"), (0, "backward", "layers.1.dispatch"), (1, "forward", "layers.0.experts"),
        (0, "wgrad", "layers.1.experts"), (1, "forward", "layers.0.combine"), (0, "backward", "layers.1.attn")]
    assert ops[:ops.index((1, "forward", "embed"))] == [op for op in ops if op[0] == 0 and op[1] in ("forward", "land")]
    one = plan(schedule="1f1b_overlap").replace(microbatches=1)
    assert schedule_ops(scheduling(one)) == schedule_ops(scheduling(one.replace(schedule="standard")))


@pytest.mark.parametrize("schedule", ["standard", "1f1b_overlap"])
def test_each_combine_lands_right_before_its_output_is_read(schedule):
    how = scheduling(plan(schedule=schedule, delay_wgrad=True))
    ops = [(mb, run.op, str(node)) for mb, run, node in schedule_ops(how)]
    for mb in range(3):
        for i, reader in ((0, "layers.1.attn"), (1, "head")):
            land = ops.index((mb, "land", f"layers.{i}.combine"))
            assert ops[land + 1] == (mb, "forward", reader)
            issued = ops.index((mb, "forward", f"layers.{i}.combine"))
            between = ops[issued + 1:land]
            assert all(op[0] != mb for op in between)  # nothing of its own microbatch in between
            if schedule == "1f1b_overlap" and mb > 0 and i == 0:  # the previous microbatch's backward
                assert (mb - 1, "backward", "layers.1.attn") in between  # is what the all-to-all overlaps
    assert sum(op[1] == "land" for op in ops) == 2 * 3  # one per layer and microbatch


def test_a_program_without_a_landing_is_caught():
    p = plan()
    program = [a for a in build_program(p) if a != Land(Node("combine", 0), 0)]
    with pytest.raises(LifecycleError, match=r"forward layers.1.attn \(microbatch 0\): layers.0.combine has not landed"):
        run(p, program)


def build_program(p):
    return list(resolve(p).train.actions)


def run(p, program):
    setup = resolve(p)
    return execute(setup, named_leaves(fmoe.init(p, seed=0)), Batch.of_tokens(TOKENS), 6 * 8,
                   setup.train.with_actions(program))


def moved(program, action, after):
    """``program`` with ``action`` taken out and put back right after ``after``."""
    out = [a for a in program if a != action]
    out.insert(out.index(after) + 1, action)
    return out


def test_delayed_wgrad_on_a_released_unit_is_caught():
    p = plan(delay_wgrad=True)
    program = build_program(p)
    wgrad = Wgrad(Node("experts", 1), 0, "layers.1")
    release = next(a for a in program[program.index(wgrad):] if a == Release("layers.1"))
    # Forgetting to keep (or gather again) the unit for its delayed wgrad:
    with pytest.raises(LifecycleError, match=r"wgrad layers.1.experts \(microbatch 0\) needs unit layers.1, "
                                             "which is sharded"):
        run(p, moved(program, wgrad, release))


def test_reducing_before_the_delayed_wgrad_is_caught():
    p = plan(delay_wgrad=True)
    program = build_program(p)
    wgrad = Wgrad(Node("experts", 0), 1, "layers.0")
    with pytest.raises(LifecycleError, match="delayed wgrad of microbatch 1 has not run"):
        run(p, moved(program, wgrad, Reduce("layers.0", 1, False)))
    with pytest.raises(LifecycleError, match="delayed wgrad of microbatch 1 has not run"):
        run(p, [a for a in program if a != wgrad])


def test_double_buffers_refuse_the_woven_schedule():
    p = fmoe.Plan(model=CFG, dp=2, sharding="optim_grads_params", gather_buffers="double", microbatches=2,
                  schedule="1f1b_overlap")
    with pytest.raises(ValueError, match="gather_buffers='double' cannot hold this schedule"):
        resolve(p)


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_deferred_wgrad_gives_the_same_gradients(backend):
    E, D, F = 4, 8, 6
    p = {"fc1": torch.randn(E, D, 2 * F, dtype=torch.float64), "fc2": torch.randn(E, F, D, dtype=torch.float64),
         "fc1_bias": torch.randn(E, 2 * F, dtype=torch.float64), "fc2_bias": torch.randn(E, D, dtype=torch.float64)}
    cfg = fmoe.ModelConfig(dim=D, experts=E, ffn=F, heads=2, topk=2, expert_biases=True)
    d = make_dispatch(torch.randint(0, E, (10, 2)), E)
    x = torch.randn(10, D, dtype=torch.float64)
    grad_y = torch.randn(d.num_rows, D, dtype=torch.float64)

    def grads(deferred):
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        rows = permute(x, d).requires_grad_()
        y = expert_mlp(leaves, rows, d, cfg, backend=backend, deferred=deferred)
        y.backward(grad_y)
        return rows.grad, {k: v.grad for k, v in leaves.items()}

    rows_now, now = grads(None)
    sink = DeferredWgrad()
    rows_later, later = grads(sink)
    assert later["fc1"] is None and later["fc2"] is None and len(sink.pending) == 2
    for w, g in sink.run():
        later["fc1" if w.shape == p["fc1"].shape else "fc2"] = g
    assert torch.equal(rows_now, rows_later)
    for k in p:
        torch.testing.assert_close(later[k], now[k], rtol=0, atol=0)


def test_every_schedule_has_an_order_for_one_stage_and_for_pipeline_stages():
    from fmoe.config_fields import SCHEDULES, Schedule
    from fmoe.schedule.program import ORDERS
    assert set(ORDERS) == set(Schedule) and tuple(Schedule) == tuple(map(Schedule, SCHEDULES))
    assert all(callable(order.single) and callable(order.pipeline) for order in ORDERS.values())
