"""Adapters on data-parallel replicas (gloo ranks) against one process on the global batch."""

import torch

import fmoe

from ..reference import assert_trees_close
from ..test_lora import CFG, EVERY, lora_batch, random_adapters
from .harness import run_ranks
from .workloads import lora_configs, ref_params_fp32


def test_two_data_parallel_replicas_give_one_process_adapter_gradients():
    plan = fmoe.Plan(model=CFG, lora=EVERY, microbatches=2)
    want = fmoe.step(random_adapters(plan, seed=3), lora_batch(), plan, base=ref_params_fp32(CFG))
    for res in run_ranks(2, lora_configs):
        # each rank sums its rows' fp32 terms before the all-reduce: reordered additions
        torch.testing.assert_close(res["loss"], want.loss, rtol=1e-6, atol=1e-7)
        assert_trees_close(res["grads"], want.grads, rtol=1e-4, atol=2e-6)
