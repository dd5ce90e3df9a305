"""GPT-OSS's attention sinks and sliding-window layers on a GPU: the CUDA step, eager
and compiled (FlexAttention's block masks and lse for packed rows), against the CPU."""

import pytest
import torch

import fmoe

from . import reference as ref
from .test_gpu import to

pytestmark = pytest.mark.gpu

# heads of 32 features: packed rows take FlexAttention (it needs at least 16)
GPT_OSS = fmoe.ModelConfig(vocab=64, dim=64, layers=3, heads=4, kv_heads=2, head_size=32, experts=8, topk=2,
                           ffn=32, attn_sinks=True, sliding_window=5, window_layers=(0, 2), qkv_bias=True)


def batch(seed, packed=False):
    g = torch.Generator().manual_seed(seed)
    out = {"tokens": torch.randint(0, 64, (8, 33), generator=g)}
    if packed:  # documents of random lengths, some longer than the window
        out["segments"] = (torch.rand(8, 33, generator=g) < 0.1).long().cumsum(1)
    return out


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_sinks_window_step_on_the_gpu_matches_the_cpu(packed, compile):
    # another device, and compiled kernels that fuse: fp32 agreement, not bitwise
    params = ref.random_params(GPT_OSS, seed=3, dtype=torch.float32)
    b = batch(3, packed)
    cpu = fmoe.step(params, b, fmoe.Plan(model=GPT_OSS, microbatches=2))
    gpu_b = {k: v.cuda() for k, v in b.items()}
    gpu = fmoe.step(to(params, "cuda"), gpu_b, fmoe.Plan(model=GPT_OSS, microbatches=2, device="cuda",
                                                          compile=compile))
    torch.testing.assert_close(gpu.loss.cpu(), cpu.loss, rtol=1e-5, atol=1e-5)
    ref.assert_trees_close(to(gpu.grads, "cpu"), cpu.grads, rtol=1e-4, atol=1e-5)


def test_sinks_window_schedules_are_bitwise_the_standard_step_on_the_gpu():
    params = to(fmoe.init(fmoe.Plan(model=GPT_OSS), seed=4), "cuda")
    b = {k: v.cuda() for k, v in batch(4, packed=True).items()}
    base = fmoe.Plan(model=GPT_OSS, device="cuda", dtype="bfloat16", microbatches=2, sharding="optim_grads_params")
    want = fmoe.step(params, b, base)
    got = fmoe.step(params, b, base.replace(schedule="1f1b_overlap", remat="full"))
    assert torch.equal(got.loss, want.loss)
    ref.assert_trees_equal(got.grads, want.grads)
