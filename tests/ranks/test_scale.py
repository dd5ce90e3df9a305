"""4- and 8-rank DP x EP meshes (gloo) against the single-process run of the same global
batch, under ZeRO-3 with the 1F1B overlap schedule and delayed wgrad."""

import functools

import pytest
import torch

from ..reference import assert_trees_close
from .harness import run_cases
from .workloads import SCALE_MESHES, global_batch, scale_config, scale_plan, train

# Per-rank partial sums reorder fp32 additions (as in test_fsdp / test_ep).
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


@functools.lru_cache(maxsize=None)
def single():
    return train(scale_plan(), global_batch(), steps=2)


@functools.lru_cache(maxsize=None)
def meshes_of(world):
    return run_cases(world, scale_config, [m for m in SCALE_MESHES if m[0] * m[1] == world])


@pytest.mark.parametrize("dp,ep", SCALE_MESHES, ids=[f"dp{d}xep{e}" for d, e in SCALE_MESHES])
def test_large_meshes_match_single_process(dp, ep):
    ref = single()
    ranks = [res[(dp, ep)] for res in meshes_of(dp * ep)]
    for res in ranks:
        torch.testing.assert_close(res["losses"], ref["losses"], **LOSS_TOL)
        assert_trees_close(res["grads"], ref["grads"], **GRAD_TOL)
    for other in ranks[1:]:
        assert torch.equal(other["losses"], ranks[0]["losses"])
