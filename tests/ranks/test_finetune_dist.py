"""Fine-tuning batches on gloo ranks: the loss is the global batch's mean over counted
targets, whatever each rank counts, and packed rows equal separate ones."""

import functools

import pytest
import torch

import fmoe

from ..test_finetune import PLAIN, fine_tuning_batch, packed_and_separate
from ..reference import assert_trees_close
from .harness import run_ranks
from .workloads import finetune_configs

# per-rank partial sums reorder fp32 additions (as the other distributed tests)
GRAD_TOL = dict(rtol=1e-4, atol=2e-6)


@functools.lru_cache(maxsize=None)
def distributed(dp, ep):
    return run_ranks(dp * ep, finetune_configs, dp, ep)


def single(batch):
    plan = fmoe.Plan(model=PLAIN, microbatches=2)
    return fmoe.step(fmoe.init(plan, seed=0), batch, plan)


@pytest.mark.parametrize("dp,ep", [(1, 2), (2, 1)], ids=["zero3_ep2", "zero3_dp2"])
def test_ranks_counting_very_different_targets_give_the_global_mean(dp, ep):
    uneven = fine_tuning_batch(B=8, seed=3)
    uneven["loss_mask"][:4] = False
    uneven["loss_mask"][0, 5] = True
    uneven["segments"][0, 5:7] = uneven["segments"][0, 5]
    want = single(uneven)
    for res in distributed(dp, ep):
        got = res["uneven"]
        assert got["tokens"] == want.metrics["tokens"]
        torch.testing.assert_close(got["loss"], want.loss, rtol=1e-6, atol=0)
        assert_trees_close(got["grads"], want.grads, **GRAD_TOL)


@pytest.mark.parametrize("dp,ep", [(1, 2)], ids=["zero3_ep2"])
def test_packed_rows_equal_separate_rows_under_zero3_and_ep(dp, ep):
    packed, _ = packed_and_separate()
    want = single(packed)
    for res in distributed(dp, ep):
        assert res["packed"]["tokens"] == res["separate"]["tokens"] == want.metrics["tokens"]
        torch.testing.assert_close(res["packed"]["loss"], want.loss, rtol=1e-6, atol=0)
        assert_trees_close(res["packed"]["grads"], want.grads, **GRAD_TOL)
        # fp32: attention over a document's keys in another order (masked row vs shorter one)
        torch.testing.assert_close(res["separate"]["loss"], res["packed"]["loss"], rtol=2e-6, atol=0)
        assert_trees_close(res["separate"]["grads"], res["packed"]["grads"], rtol=1e-4, atol=2e-6)
