"""Adapters under every kind of plan (gloo ranks) against one process on the global batch:
ZeRO-1/2/3, expert, tensor, pipeline, expert-tensor and context parallelism and meshes of them.
Each rank's products use its pieces of the adapters beside the pieces of the base it holds; the
adapters' gradients, summed over the ranks, are one process's."""

import pytest
import torch

import fmoe

from ..reference import assert_trees_close
from ..test_lora import CFG, EVERY, random_adapters
from .harness import run_ranks
from .workloads import LORA_PLANS, lora_configs, lora_rows


@pytest.mark.parametrize("world", [2, 4])
def test_every_plan_gives_one_process_adapter_gradients(world):
    plan = fmoe.Plan(model=CFG, lora=EVERY, microbatches=2)
    adapters, base = random_adapters(plan, seed=3), fmoe.init(plan, seed=11)
    wants = {cp: fmoe.step(adapters, lora_rows(plan.replace(cp=cp)), plan, base=base) for cp in (1, 2)}
    names = [name for name, (w, _) in LORA_PLANS.items() if w == world]
    for rank, res in enumerate(run_ranks(world, lora_configs, names)):
        for name in names:
            got, want = res[name], wants[LORA_PLANS[name][1].get("cp", 1)]
            # each rank sums its rows' (and pieces') fp32 terms before the all-reduce: reordered additions
            torch.testing.assert_close(got["loss"], want.loss, rtol=1e-6, atol=1e-7, msg=f"{name}, rank {rank}")
            assert_trees_close(got["grads"], want.grads, rtol=1e-4, atol=2e-6, context=f"{name}, rank {rank}")
            # the frozen base sums nothing: the adapters' one all-reduce is the step's only gradient collective
            assert got["grads_summed"] == ["all_reduce"], (name, got["grads_summed"])
            assert got["frozen_same"], f"{name}, rank {rank}: a FrozenBase's step differs from the base's"
