"""Expert parallelism on gloo ranks against the single-process run (EP=1)."""

import functools

import pytest
import torch

import fmoe

from ..reference import assert_trees_close
from .harness import run_cases
from .workloads import CFG, STRATEGIES, ep_configs, global_batch, round_trip, token_round_trip, train

# Same reasoning as FSDP: per-rank partial sums reorder fp32 additions.
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)
MESHES = [(1, 2), (1, 4), (2, 2)]


@functools.lru_cache(maxsize=None)
def of_world(world):
    return run_cases(world, ep_configs, [m for m in MESHES if m[0] * m[1] == world])


def distributed(dp, ep):
    return [res[(dp, ep)] for res in of_world(dp * ep)]


@functools.lru_cache(maxsize=None)
def single(sharding, **changes):
    plan = fmoe.Plan(model=CFG.replace(**changes), sharding=sharding, microbatches=2)
    return train(plan, global_batch())


@pytest.mark.parametrize("dp,ep", MESHES, ids=[f"dp{d}xep{e}" for d, e in MESHES])
@pytest.mark.parametrize("sharding", STRATEGIES)
def test_matches_single_process(sharding, dp, ep):
    # dp=2 x ep=2 also checks the classic bug: expert gradients must be summed over
    # the expert-data-parallel ranks *and* normalised by the whole batch, not edp's.
    ref = single(sharding)
    for res in distributed(dp, ep):
        got = res[sharding]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(got["grads"], ref["grads"], **GRAD_TOL)
        assert_trees_close(got["params"], ref["params"], **PARAM_TOL)


@pytest.mark.parametrize("dp,ep", MESHES, ids=[f"dp{d}xep{e}" for d, e in MESHES])
def test_metrics_cover_the_global_batch(dp, ep):
    ref = fmoe.step(fmoe.init(fmoe.Plan(model=CFG, microbatches=2), seed=0), {"tokens": global_batch()},
                    fmoe.Plan(model=CFG, microbatches=2))
    for res in distributed(dp, ep):
        m = res["no_shard"]["metrics"]
        assert torch.equal(m["expert_counts"], ref.metrics["expert_counts"])
        assert m["a2a_bytes"] > 0 and m["dropped_tokens"] == 0
        assert {"a2a_splits", "all_to_all"} <= set(res["no_shard"]["trace_kinds"])


@pytest.mark.parametrize("dp,ep", MESHES, ids=[f"dp{d}xep{e}" for d, e in MESHES])
def test_large_capacity_equals_dropless(dp, ep):
    ref = single("optim_grads_params")
    for res in distributed(dp, ep):
        torch.testing.assert_close(res["capacity"]["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(res["capacity"]["grads"], ref["grads"], **GRAD_TOL)


@pytest.mark.parametrize("dp,ep", MESHES, ids=[f"dp{d}xep{e}" for d, e in MESHES])
def test_probabilities_inside_the_activation_travel_with_the_rows(dp, ep):
    ref = single("no_shard", prob_placement="activation")
    for res in distributed(dp, ep):
        torch.testing.assert_close(res["prob_in_activation"]["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(res["prob_in_activation"]["grads"], ref["grads"], **GRAD_TOL)


@pytest.mark.parametrize("placement", fmoe.config.PROB_PLACEMENTS)
@pytest.mark.parametrize("dp,ep", MESHES, ids=[f"dp{d}xep{e}" for d, e in MESHES])
def test_tokens_travelling_once_per_rank_match_single_process(dp, ep, placement):
    # a token's expert outputs are summed per rank first: fp32 rounding, the tolerance above
    ref = single("optim_grads_params", prob_placement=placement)
    for res in distributed(dp, ep):
        got = res[f"tokens_{placement}"]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(got["grads"], ref["grads"], **GRAD_TOL)
        assert_trees_close(got["params"], ref["params"], **PARAM_TOL)
        m, by_rows = got["metrics"], res["no_shard"]["metrics"]
        assert torch.equal(m["expert_counts"], by_rows["expert_counts"]) and m["dropped_tokens"] == 0
        # top-2: with two experts a rank, a token's two often share one, and then it
        # travels once; with one expert a rank, never: as many rows as under ``rows``,
        # and the probabilities and slots besides
        if CFG.experts // ep > 1:
            assert 0 < m["a2a_bytes"] < by_rows["a2a_bytes"]
        else:
            assert m["a2a_bytes"] > by_rows["a2a_bytes"]


@functools.lru_cache(maxsize=None)
def round_trips_of(world, workload=round_trip):
    return run_cases(world, workload, [(False,), (True,)])


@pytest.mark.parametrize("first_rank_only", [False, True], ids=["uneven", "idle-ranks"])
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_round_trip(world, first_rank_only):
    for rank, res in enumerate(res[(first_rank_only,)] for res in round_trips_of(world)):
        # identity experts: each token comes back once per chosen expert (K = 2)
        torch.testing.assert_close(res["y"], 2 * res["x"], rtol=0, atol=0)
        torch.testing.assert_close(res["grad"], 2 * res["upstream"], rtol=0, atol=0)
        if first_rank_only and rank > 0:
            assert res["local_rows"] == 0 and res["segments"] == [0, 0]
        # the order and segments built before the host read (bounded, then cut) are the
        # exact ones; rank 0, given every token with fewer of its own, rebuilds them after it
        assert res["same_plan"]
        assert res["over_bound"] == (first_rank_only and rank == 0)
        if not first_rank_only and rank == world - 1:
            assert res["segments"][-1] == 0  # the idle expert's segment is empty


@pytest.mark.parametrize("first_rank_only", [False, True], ids=["uneven", "idle-ranks"])
@pytest.mark.parametrize("world", [2, 4])
def test_tokens_travel_once_per_rank_and_come_back_weighted(world, first_rank_only):
    for rank, res in enumerate(res[(first_rank_only,)] for res in round_trips_of(world, token_round_trip)):
        x, p, g = res["x"], res["probs"], res["upstream"]
        # identity experts: y = x * (p_1 + p_2), summed per rank first (fp32 rounding)
        torch.testing.assert_close(res["y"], x * p.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["grad_x"], g * p.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["grad_probs"], (g * x).sum(1, keepdim=True).expand_as(p), rtol=1e-5,
                                   atol=1e-6)
        assert res["sent"] == sum(res["held"])  # a token once per rank holding one of its experts
        if first_rank_only and rank > 0:
            assert res["received"] == 0 and res["local_rows"] == 0
