"""``Plan.remat='full'`` and ``'selective'`` on gloo ranks: ZeRO-3, expert parallelism, 1F1B, delayed wgrad.

Recomputation re-runs the same kernels on the same inputs: every loss, gradient and
parameter is bitwise the ``remat='none'`` run's, and no collective runs again (the
routing and the rows that crossed ranks are kept from the forward; the unit gathered
for the backward serves the recompute).
"""

import functools

import pytest

from .harness import run_ranks
from .test_schedule import assert_bitwise
from .workloads import REMAT_CASES, remat_configs


@functools.lru_cache(maxsize=None)
def runs(dp, ep):
    return run_ranks(dp * ep, remat_configs, dp, ep)


@pytest.mark.parametrize("case", REMAT_CASES)
def test_full_remat_is_bitwise_and_repeats_no_collective(case):
    for res in runs(1, 2):
        full, none = res[(case, "full")], res[(case, "none")]
        assert_bitwise(full, none)
        assert full["counts"] == none["counts"]  # all-to-alls, gathers, reductions: as many
        assert any(e.purpose == "slots" for e in full["trace"]) == case.endswith("tokens")  # tokens cross
        recomputes = [e for e in full["trace"] if e.kind == "recompute"]
        assert len(recomputes) == 4 * 2  # each layer of each of the 4 microbatches
        assert not [e for e in none["trace"] if e.kind == "recompute"]


@pytest.mark.parametrize("case", REMAT_CASES)
def test_selective_remat_is_bitwise_and_adds_no_action(case):
    # its recompute happens inside each node's backward: the trace's actions and the
    # collectives are the plain run's
    for res in runs(1, 2):
        selective, none = res[(case, "selective")], res[(case, "none")]
        assert_bitwise(selective, none)
        assert selective["counts"] == none["counts"]
        assert [(e.kind, e.node) for e in selective["trace"]] == [(e.kind, e.node) for e in none["trace"]]
