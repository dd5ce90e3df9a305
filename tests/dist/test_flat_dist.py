"""Flat storage on gloo ranks: a step from params in flat storage (``fmoe.init``) and
one from standalone leaves compute the same bits under every sharding and mesh, and
``adamw(fused=True, donate=True)`` gives the pure update's bits in the same buffers."""

import functools

import optree
import pytest
import torch

from .harness import run_ranks
from .workloads import flat_storage_steps

CASES = [(2, 1, "optim_grads_params"), (2, 1, "optim"), (2, 1, "no_shard"), (1, 2, "optim_grads_params"),
         (2, 2, "optim_grads_params")]


@functools.lru_cache(maxsize=None)
def distributed(dp, ep, sharding):
    return run_ranks(dp * ep, flat_storage_steps, dp, ep, sharding)


def assert_same_bits(a, b):
    assert optree.tree_structure(a) == optree.tree_structure(b)
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)) if x.dtype == torch.float32 else torch.equal(x, y)


@pytest.mark.parametrize("dp,ep,sharding", CASES, ids=[f"dp{d}xep{e}-{s}" for d, e, s in CASES])
def test_flat_standalone_and_donated_runs_agree_bitwise(dp, ep, sharding):
    for runs in distributed(dp, ep, sharding):
        flat, donated, standalone = runs["flat"], runs["donated"], runs["standalone"]
        # step: the same values whether it reads the buffers or copies leaves in
        assert_same_bits(flat["grads"][0], standalone["grads"][0])
        # the update: the same bits whether it copies the buffers or writes into them
        for key in ("losses", "grads", "params", "state"):
            assert_same_bits(flat[key], donated[key])
        assert flat["in_place"] and donated["in_place"] and donated["kept_storage"]
        assert not flat["kept_storage"]  # the pure update returned new buffers
