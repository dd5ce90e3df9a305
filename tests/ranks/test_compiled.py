"""``Plan.compile`` across gloo ranks: ZeRO-1 on dp=2, and ZeRO-3 with expert parallelism,
the 1F1B overlap schedule and delayed wgrad on dp1 x ep2.

Compiled kernels fuse fp32 reductions and sum in another order than eager ones, so
compiled runs agree with eager to fp32 rounding (see tests/test_compile.py: 1e-5 on
gradients; 1e-5 on parameters after two AdamW steps, whose update divides by the
gradients' own scale), with the same routing.
"""

import functools

import optree
import pytest
import torch

from ..reference import assert_same_structure, rel_err
from .harness import run_ranks
from .workloads import COMPILE_CASES, compiled_configs


@functools.lru_cache(maxsize=None)
def runs(dp, ep):
    return run_ranks(dp * ep, compiled_configs, dp, ep)


@pytest.mark.parametrize("mesh", [(2, 1), (1, 2)], ids=["dp2", "dp1xep2"])
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compiled_matches_eager_on_ranks(case, mesh):
    for res in runs(*mesh):
        eager, compiled = res[(case, False)], res[(case, True)]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-6, atol=0)
        assert compiled["counts"] == eager["counts"]  # the same collectives
        for key in ("grads", "params"):
            assert_same_structure(compiled[key], eager[key], key)
            for a, b in zip(optree.tree_leaves(compiled[key]), optree.tree_leaves(eager[key])):
                assert rel_err(a, b) < 1e-5, key
