"""The planner (``fmoe.plan``): every stage's program checked together without a GPU,
the 1F1B bubble it times, the deadlocks and stray transfers it names, its memory sums
and its command line."""

import dataclasses
import sys

import pytest

import fmoe
from fmoe.plan import CostModel, Links, PlanError, simulate
from fmoe.plan.memory import estimate_memory
from fmoe.resolve import stage_program
from fmoe.schedule.actions import STREAM, STREAM_GRADIENT, Recv, Reduce, Release, Send, Wgrad

from .procs import run_at_once

CFG = fmoe.ModelConfig(vocab=256, dim=64, layers=8, heads=4, experts=8, topk=2, ffn=128)


class _EqualLayers(CostModel):
    """Every layer's nodes cost their FLOPs, the embedding and head nothing, the links
    nothing: the balanced pipeline the 1F1B formula describes."""

    def compute_seconds(self, flops, kind):
        return 0.0 if kind in ("head", "embed") else flops * 1e-12


FREE = _EqualLayers(links=Links(nvlink_gbps=1e12, network_gbps=1e12, nvlink_us=0, network_us=0))


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8), (4, 4), (8, 16)])
@pytest.mark.parametrize("schedule", ["standard", "1f1b_overlap"])
def test_the_bubble_is_1f1b_s(pp, microbatches, schedule):
    plan = fmoe.Plan(model=CFG, pp=pp, microbatches=microbatches, schedule=schedule)
    sim = simulate(plan, rows=4 * microbatches, seq=64, costs=FREE)
    for bubble in sim.bubble:
        assert bubble == pytest.approx((pp - 1) / (microbatches + pp - 1), abs=1e-9)


@pytest.mark.parametrize("pp, virtual, microbatches", [(2, 2, 4), (4, 2, 8), (2, 4, 2), (4, 2, 4)])
@pytest.mark.parametrize("schedule", ["standard", "1f1b_overlap"])
def test_the_interleaved_bubble_is_megatron_s(pp, virtual, microbatches, schedule):
    # each of the pp ranks fills and drains the pipeline one chunk (1 / virtual of its layers) at a time
    plan = fmoe.Plan(model=CFG, pp=pp, virtual_stages=virtual, microbatches=microbatches, schedule=schedule)
    sim = simulate(plan, rows=4 * microbatches, seq=64, costs=FREE)
    for bubble in sim.bubble:
        assert bubble == pytest.approx((pp - 1) / (virtual * microbatches + pp - 1), abs=1e-9)


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8)])
def test_delayed_wgrad_after_the_send_shrinks_the_bubble(pp, microbatches):
    # the experts' weight GEMMs run after the gradient is sent: the stage before starts
    # its backward sooner, and they fill the wait for the next gradient
    plain = (pp - 1) / (microbatches + pp - 1)
    plan = fmoe.Plan(model=CFG, pp=pp, microbatches=microbatches, delay_wgrad=True)
    program = stage_program(plan, 1, True).actions
    send = program.index(Send(0, STREAM_GRADIENT))
    assert any(isinstance(a, Wgrad) and a.mb == 0 for a in program[send:])
    for bubble in simulate(plan, rows=4 * microbatches, seq=64, costs=FREE).bubble:
        assert bubble < plain - 0.03


def test_without_stages_there_is_no_bubble():
    sim = simulate(fmoe.Plan(model=CFG, microbatches=4), rows=16, seq=64, costs=FREE)
    assert sim.bubble == [pytest.approx(0.0, abs=1e-12)]


def _programs(plan):
    return {s: list(stage_program(plan, s, True).actions) for s in range(plan.pp)}


def test_a_mis_ordered_program_is_a_deadlock_naming_the_ranks_and_actions():
    plan = fmoe.Plan(model=CFG, pp=2, microbatches=4, dp=2)
    programs = _programs(plan)
    first = programs[0]
    # stage 0 waits for microbatch 0's gradient before it sends microbatch 0's stream
    send = first.index(Send(0, STREAM))
    wait = first.index(Recv(0, STREAM_GRADIENT))
    first.insert(send, first.pop(wait))
    with pytest.raises(PlanError, match=r"deadlock.*rank 0 \(stage 0\) at action \d+: recv stream gradient mb0.*"
                                        r"rank 2 \(stage 1\) at action \d+: recv stream mb0"):
        simulate(plan, rows=16, seq=64, programs=programs)


@pytest.mark.parametrize("kw", [dict(pp=2, microbatches=4, sharding="optim_grads_params"),
                                dict(pp=2, virtual_stages=2, microbatches=4, sharding="optim_grads_params",
                                     schedule="1f1b_overlap", delay_wgrad=True, ep=2),
                                dict(microbatches=2, sharding="optim", remat="full"),
                                dict(pp=4, microbatches=8, sharding="optim_grads", tp=2, prefetch=2)])
def test_the_plans_own_programs_keep_the_lifecycle(kw):
    simulate(fmoe.Plan(model=CFG, **kw), rows=4 * kw["microbatches"] * kw.get("ep", 1), seq=64, costs=FREE)


def test_a_program_that_breaks_the_lifecycle_is_named():
    plan = fmoe.Plan(model=CFG, pp=2, microbatches=4, sharding="optim_grads_params")
    programs = _programs(plan)
    first = programs[1]
    at = next(i for i, a in enumerate(first) if isinstance(a, Release))
    first.insert(at + 1, first[at])  # released twice
    with pytest.raises(PlanError, match=r"rank 1 \(stage 1\) breaks the FSDP lifecycle: action \d+ \(release "
                                        r"layers\.\d\): unit layers\.\d is sharded, not gathered"):
        simulate(plan, rows=16, seq=64, programs=programs)
    programs = _programs(plan)
    programs[0] = [a for a in programs[0] if not (isinstance(a, Reduce) and a.mb == 3 and a.unit == "embed")]
    with pytest.raises(PlanError, match=r"unit embed: gradients reduced for microbatches \[0, 1, 2\], expected "
                                        r"\[0, 1, 2, 3\]"):
        simulate(plan, rows=16, seq=64, programs=programs)


def test_transfers_out_of_order_or_never_received_are_named():
    plan = fmoe.Plan(model=CFG, pp=2, microbatches=4)
    programs = _programs(plan)
    second = programs[1]
    a, b = second.index(Recv(0, STREAM)), second.index(Recv(1, STREAM))
    second[a], second[b] = second[b], second[a]
    with pytest.raises(PlanError, match=r"rank 1 \(stage 1\) receives stream of microbatch 1 from rank 0 \(stage 0\), "
                                        r"which sent stream of microbatch 0 first"):
        simulate(plan, rows=16, seq=64, programs=programs)
    programs = _programs(plan)
    programs[0].remove(Recv(3, STREAM_GRADIENT))
    with pytest.raises(PlanError, match=r"rank 1 \(stage 1\) sends stream gradient of microbatch 3 .* that rank 0 "
                                        r"\(stage 0\) never receives"):
        simulate(plan, rows=16, seq=64, programs=programs)


def test_memory_adds_up_what_a_rank_holds():
    plan = fmoe.Plan(model=CFG, dp=2, sharding="optim_grads_params", microbatches=2)
    parts = estimate_memory(plan, rows=8, seq=64)
    n = sum(p.numel() for p in __import__("optree").tree_leaves(fmoe.init(plan.replace(dp=1, sharding="no_shard"))))
    assert parts["params"] == pytest.approx(4 * n / 2, rel=0.05)  # half the elements, a row shard of each
    assert parts["optimizer"] == 2 * parts["params"] and parts["gathered"] > 0
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    full = estimate_memory(plan.replace(remat="full"), rows=8, seq=64)
    assert full["activations"] < parts["activations"] / 4
    # a pipeline's first stage holds more microbatches in flight than its last
    piped = fmoe.Plan(model=CFG, pp=4, microbatches=8)
    first, last = (estimate_memory(piped, rows=16, seq=64, stage=s)["activations"] for s in (0, 3))
    assert first > last


def test_step_time_counts_the_links():
    plan = fmoe.Plan(model=CFG, pp=2, dp=4, microbatches=4, sharding="optim_grads_params")
    fast = simulate(plan, rows=32, seq=64)
    slow = simulate(plan, rows=32, seq=64, costs=CostModel(links=dataclasses.replace(Links(), gpus_per_node=1)))
    assert slow.step_seconds > fast.step_seconds  # across nodes, at the network's bandwidth


def test_tokens_crossing_once_per_rank_move_fewer_bytes():
    from fmoe.plan.simulate import crossing_bytes_per_token

    fine = fmoe.ModelConfig(vocab=256, dim=2048, layers=2, heads=16, experts=64, topk=8, ffn=32)
    row = 2048 * 4  # fp32 compute: 4 bytes an element
    per_token = {ep: crossing_bytes_per_token(fmoe.Plan(model=fine, ep=ep, ep_exchange="tokens")) / row
                 for ep in (2, 4, 8)}
    # the ranks a token's experts fall on (2.0, 3.66, 5.43), each a row and 64 bytes of probabilities and slots
    assert per_token == pytest.approx({2: 2.0 * 1.0078, 4: 3.66 * 1.0078, 8: 5.43 * 1.0078}, abs=0.01)
    assert crossing_bytes_per_token(fmoe.Plan(model=fine, ep=2)) == 8 * row
    slow = CostModel(links=dataclasses.replace(Links(), gpus_per_node=1))  # the exchange over the network
    rows, tokens = (simulate(fmoe.Plan(model=CFG, ep=2, microbatches=2, ep_exchange=how), rows=8, seq=64, costs=slow)
                    for how in ("rows", "tokens"))
    assert tokens.step_seconds < rows.step_seconds


def test_routing_skew_weighs_the_busiest_expert_ranks_rows():
    from fmoe.plan.simulate import busiest_share

    ep4 = fmoe.Plan(model=CFG, ep=4, microbatches=2)  # 2 experts a rank, top-2: a rank can take every row
    assert [busiest_share(ep4, s) for s in (1, 3, 9)] == [1, 3, 4]
    assert busiest_share(ep4.replace(model=CFG.replace(topk=4)), 9) == 2  # 2 of a token's 4 choices at most
    assert busiest_share(ep4.replace(ep=1), 9) == 1  # each rank computes its own tokens' experts
    balanced, skewed = (estimate_memory(ep4, rows=8, seq=64, skew=s) for s in (1, 2))
    assert estimate_memory(ep4, rows=8, seq=64) == balanced
    assert skewed["activations"] > balanced["activations"] and skewed["params"] == balanced["params"]
    zero3 = ep4.replace(ep=1, dp=4, sharding="optim_grads_params")
    assert estimate_memory(zero3, rows=8, seq=64, skew=4) == estimate_memory(zero3, rows=8, seq=64)
    steps = [simulate(ep4, rows=8, seq=64, skew=s).step_seconds for s in (1, 2, 4)]
    assert steps[0] < steps[1] < steps[2]
    assert simulate(zero3, rows=8, seq=64, skew=4).step_seconds == simulate(zero3, rows=8, seq=64).step_seconds


def test_the_command_line_prints_the_plan_and_ranks_plans():
    out, searched, bad = run_at_once(
        [sys.executable, "-m", "fmoe.plan", "--config", "cpu", "--dim", 64, "--layers", 4, "--gpus", 4, "--pp", 2,
         "--microbatches", 4, "--batch", 16, "--seq", 64],
        [sys.executable, "-m", "fmoe.plan", "--config", "cpu", "--dim", 64, "--layers", 4, "--gpus", 4, "--search",
         "--memory", 1, "--batch", 16, "--seq", 64],
        [sys.executable, "-m", "fmoe.plan", "--config", "cpu", "--gpus", 3, "--pp", 2], timeout=300)
    assert out.returncode == 0, out.stderr
    assert "pp=2 dp=2 ep=1" in out.stdout and "bubble per stage" in out.stdout and "stage  1 (rank    2) |" in out.stdout
    assert searched.returncode == 0, searched.stderr
    assert "plan(s) for 4 GPUs fit 0.9 GiB (--memory 1 GiB less the 10% --reserve)" in searched.stdout and "tokens/s (key)" in searched.stdout
    assert bad.returncode == 2 and "--gpus=3 is not a multiple of pp * ep * cp * tp = 2" in bad.stderr


def test_a_calibration_file_sets_the_costs_it_names(tmp_path):
    import json

    from fmoe.plan import Calibration

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"efficiency": {"attn": 0.3}, "move_gbps": {"land": 100.0},
                                "host_us": {"forward attn": 50.0}, "source": "a test"}))
    calibration = Calibration.read(path)
    assert calibration.efficiency["attn"] == 0.3 and calibration.efficiency["experts"] == 0.55  # the rest default
    plan = fmoe.Plan(model=CFG, microbatches=2)
    plain = simulate(plan, rows=8, seq=64, costs=CostModel())
    landed = simulate(plan, rows=8, seq=64, costs=CostModel(calibration))
    # each Land moves 4 x 64 tokens x topk 2 x dim 64 x 4 bytes at 100 GB/s
    lands = sum(1 for a in stage_program(plan, 0, True).actions if type(a).__name__ == "Land")
    assert landed.step_seconds > plain.step_seconds + lands * (4 * 64 * 2 * 64 * 4) / 100e9 * 0.99
    path.write_text(json.dumps({"move_gbps": {"permute": 1.0}}))
    with pytest.raises(ValueError, match=r"move_gbps has unknown node kinds \['permute'\]; allowed: dispatch, "
                                         r"combine, land"):
        Calibration.read(path)
