"""The rank harness: kept gloo ranks start each run as fresh processes would, and a
failed run is reported and ends them."""

import os

import pytest
import torch

from .harness import FRESH_RANKS, run_ranks


def _draw_and_dirty(rank, world):
    # what a run could leave behind for the next: an environment variable, a seed
    seen, seed = os.environ.get("FMOE_HARNESS_PROBE"), torch.initial_seed()
    os.environ["FMOE_HARNESS_PROBE"] = "set"
    torch.manual_seed(0)
    return seen, seed, os.getpid()


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_each_run_starts_from_a_fresh_processs_state():
    first, second = run_ranks(2, _draw_and_dirty), run_ranks(2, _draw_and_dirty)
    for (seen_a, _, _), (seen_b, seed_b, _) in zip(first, second):
        assert seen_a is None and seen_b is None
        assert seed_b != 0  # not the seed the first run left
    if not FRESH_RANKS:  # the same processes ran both
        assert [pid for *_, pid in first] == [pid for *_, pid in second]


def test_a_failed_run_names_the_rank_and_the_next_run_gets_new_processes():
    before = [pid for *_, pid in run_ranks(2, _draw_and_dirty)]
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*rank one refuses"):
        run_ranks(2, _fail_on_rank_one)
    after = [pid for *_, pid in run_ranks(2, _draw_and_dirty)]
    assert not set(before) & set(after)
