"""The fused AdamW on gloo ranks, under every sharding and mesh: donating gives the
pure update's bits in the tensors it was handed, and both follow the chain."""

import functools

import optree
import pytest
import torch

from ..reference import assert_trees_close
from .harness import run_cases
from .workloads import fused_adamw_steps

CASES = [(2, 1, "optim_grads_params"), (2, 1, "optim"), (2, 1, "no_shard"), (1, 2, "optim_grads_params"),
         (2, 2, "optim_grads_params")]


@functools.lru_cache(maxsize=None)
def of_world(world):
    return run_cases(world, fused_adamw_steps, [c for c in CASES if c[0] * c[1] == world])


def distributed(dp, ep, sharding):
    return [res[(dp, ep, sharding)] for res in of_world(dp * ep)]


def assert_same_bits(a, b):
    assert optree.tree_structure(a) == optree.tree_structure(b)
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)) if x.dtype == torch.float32 else torch.equal(x, y)


@pytest.mark.parametrize("dp,ep,sharding", CASES, ids=[f"dp{d}xep{e}-{s}" for d, e, s in CASES])
def test_pure_donated_and_chain_runs_agree(dp, ep, sharding):
    for runs in distributed(dp, ep, sharding):
        pure, donated, chain = runs["pure"], runs["donated"], runs["chain"]
        # the update: the same bits whether it copies the tensors or writes into them
        for key in ("losses", "grads", "params", "state"):
            assert_same_bits(pure[key], donated[key])
        assert donated["kept_storage"] and not pure["kept_storage"]
        # torch's kernel and the chain round differently: fp32 rounding apart after two updates
        assert_trees_close(pure["params"], chain["params"], rtol=1e-5, atol=1e-6)
