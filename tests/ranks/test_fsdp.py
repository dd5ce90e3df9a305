"""FSDP on 2 and 4 gloo ranks against the single-process run of the same global batch."""

import functools

import optree
import pytest
import torch

import fmoe

from ..reference import assert_trees_close
from .harness import run_cases, run_ranks
from .workloads import CFG, STRATEGIES, global_batch, fsdp_configs, resting_memory, train

# Summing per-rank partial gradients reorders fp32 additions (matmul reductions
# over fewer rows, then a cross-rank sum): agreement is to rounding, not bitwise.
# AdamW normalises updates by sqrt(v), so after 3 steps differences stay at the
# level of lr * 1e-4 relative.
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)


@functools.lru_cache(maxsize=None)
def distributed(world):
    return run_ranks(world, fsdp_configs)


@functools.lru_cache(maxsize=None)
def single(sharding, mb):
    return train(fmoe.Plan(model=CFG, sharding=sharding, microbatches=mb), global_batch())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mb", [1, 4])
@pytest.mark.parametrize("sharding", STRATEGIES)
def test_matches_single_process(sharding, mb, world):
    ref = single(sharding, mb)
    ranks = distributed(world)
    for rank, res in enumerate(ranks):
        got = res[(sharding, mb)]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(got["grads"], ref["grads"], **GRAD_TOL)
        assert_trees_close(got["params"], ref["params"], **PARAM_TOL)
        assert optree.tree_structure(got["params"]) == optree.tree_structure(ref["params"])
    for other in ranks[1:]:  # every rank holds the same global loss and model
        assert torch.equal(other[(sharding, mb)]["losses"], ranks[0][(sharding, mb)]["losses"])
        assert_trees_close(other[(sharding, mb)]["params"], ranks[0][(sharding, mb)]["params"], rtol=0, atol=0)


def expected_counts(sharding, units, mb):
    """Collectives per step (default units: embed, each layer, head)."""
    if sharding == "no_shard":
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": units}
    # ZeRO-3: each unit is gathered before its forward and again before its backward,
    # except the head (its backward follows its forward) and the embed between
    # microbatches (backward of one, forward of the next).
    gathers = {"optim": units, "optim_grads": units, "optim_grads_params": mb * (2 * units - 1) - (mb - 1)}[sharding]
    reduces = units if sharding == "optim" else units * mb
    return {"all_gather": gathers, "reduce_scatter": reduces, "all_reduce": 0}


@pytest.mark.parametrize("mb", [1, 4])
@pytest.mark.parametrize("sharding", STRATEGIES)
def test_collective_counts_follow_zero_formulas(sharding, mb):
    units = CFG.layers + 2
    for res in distributed(2):
        for counts in res[(sharding, mb)]["counts"]:
            assert counts == expected_counts(sharding, units, mb)


@functools.lru_cache(maxsize=None)
def resting():
    """One process's no_shard run, and two ranks' of every strategy (each start of ranks costs seconds)."""
    return run_ranks(1, resting_memory, "no_shard")[0], run_cases(2, resting_memory, [(s,) for s in STRATEGIES])


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_resting_memory_is_one_over_dp(sharding):
    world = 2
    full, both = resting()
    ranks = [res[(sharding,)] for res in both]
    for res in ranks:
        # What stays alive is exactly params + grads + optimizer state, nothing gathered.
        assert res["held"] <= res["trees"] * 1.02 + 4096
        if sharding == "no_shard":
            assert res["held"] >= 0.95 * full["held"]
        else:
            assert res["held"] <= full["held"] / world * 1.1 + 8192
