"""GLM-4.5's pieces on a GPU (dense layers, grouped sigmoid routing with routed scaling,
partial RoPE, q/k/v bias): against the CPU step, compiled, packed, CUDA-graphed, and
across schedules."""

import pytest
import torch

import fmoe
from interop.cuda_graph import capture_step

from . import reference as ref
from .test_gpu import assert_cuda_fp32_step_matches_cpu, to

pytestmark = pytest.mark.gpu

GLM = fmoe.ModelConfig(vocab=64, dim=64, layers=3, heads=4, kv_heads=2, head_size=32, experts=8, topk=2, ffn=32,
                       shared_ffn=32, dense_layers=(0,), dense_ffn=48, score_func="sigmoid", expert_groups=4,
                       topk_groups=2, routed_scaling=2.5, rope_fraction=0.5, qkv_bias=True)


def batch(seed, packed=False):
    g = torch.Generator().manual_seed(seed)
    out = {"tokens": torch.randint(0, 64, (8, 33), generator=g)}
    if packed:  # documents of random lengths (FlexAttention's block mask on the GPU)
        cuts = torch.rand(8, 33, generator=g) < 0.1
        out["segments"] = cuts.long().cumsum(1)
    return out


def test_the_glm_step_on_the_gpu_matches_the_cpu():
    assert_cuda_fp32_step_matches_cpu(GLM, seed=7)


def assert_compiled_and_eager_match_the_cpu(cfg, seed, packed):
    # compiled kernels fuse and reassociate: fp32 agreement, not bitwise
    params = ref.random_params(cfg, seed=seed, dtype=torch.float32)
    b = batch(seed, packed)
    cpu = fmoe.step(params, b, fmoe.Plan(model=cfg))
    gpu_b = {k: v.cuda() for k, v in b.items()}
    eager = fmoe.step(to(params, "cuda"), gpu_b, fmoe.Plan(model=cfg, device="cuda"))
    compiled = fmoe.step(to(params, "cuda"), gpu_b, fmoe.Plan(model=cfg, device="cuda", compile=True))
    for out in (eager, compiled):
        torch.testing.assert_close(out.loss.cpu(), cpu.loss, rtol=1e-5, atol=1e-5)
        ref.assert_trees_close(to(out.grads, "cpu"), cpu.grads, rtol=1e-4, atol=1e-5)


def assert_schedules_are_bitwise_the_standard_step(cfg, seed):
    params = to(fmoe.init(fmoe.Plan(model=cfg), seed=seed), "cuda")
    b = {k: v.cuda() for k, v in batch(seed).items()}
    base = fmoe.Plan(model=cfg, device="cuda", dtype="bfloat16", microbatches=4)
    want = fmoe.step(params, b, base)
    for changes in (dict(schedule="1f1b_overlap", delay_wgrad=True), dict(schedule="1f1b_overlap", remat="full")):
        got = fmoe.step(params, b, base.replace(**changes))
        assert torch.equal(got.loss, want.loss), changes
        ref.assert_trees_equal(got.grads, want.grads)


def assert_a_graphed_step_is_bitwise_the_eager_one(cfg, seed):
    plan = fmoe.Plan(model=cfg, device="cuda", dtype="bfloat16")
    params = to(fmoe.init(fmoe.Plan(model=cfg), seed=seed), "cuda")
    graphed = capture_step(params, {k: v.cuda() for k, v in batch(seed).items()}, plan)
    for other in (seed + 1, seed + 2):
        b = {k: v.cuda() for k, v in batch(other).items()}
        out, eager = graphed(params, b), fmoe.step(params, b, plan)
        assert torch.equal(out.loss, eager.loss)
        ref.assert_trees_equal(out.grads, eager.grads)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_compiled_glm_step_matches_the_eager_one_and_the_cpu(packed):
    assert_compiled_and_eager_match_the_cpu(GLM, 8, packed)


def test_glm_schedules_are_bitwise_the_standard_step_on_the_gpu():
    assert_schedules_are_bitwise_the_standard_step(GLM, 9)


def test_a_graphed_glm_step_is_bitwise_the_eager_one():
    assert_a_graphed_step_is_bitwise_the_eager_one(GLM, 10)


def test_a_yarn_step_on_the_gpu_matches_the_cpu():
    # whole-head RoPE: the Triton kernel takes YaRN's scaled tables (DeepSeek-V3's softmax
    # correction too, mscale_all_dim)
    yarn = GLM.replace(rope_fraction=1.0, rope_scaling="yarn", rope_factor=4.0, rope_original_max=16,
                       yarn_mscale=1.0, yarn_mscale_all_dim=1.0)
    assert_cuda_fp32_step_matches_cpu(yarn, seed=13)
