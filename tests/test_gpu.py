"""CUDA checks of the single-process core (run on the GPU machine; skipped elsewhere)."""

import optree
import pytest
import torch

import fmoe
from fmoe import layers, train

from . import reference as ref

pytestmark = pytest.mark.gpu

CFG = fmoe.ModelConfig(vocab=64, dim=64, layers=2, heads=4, experts=8, topk=2, ffn=32, shared_ffn=16,
                       expert_biases=True)


def to(tree, device):
    return optree.tree_map(lambda t: t.to(device), tree)


def test_cuda_fp32_step_matches_cpu():
    # Same arithmetic on another device: kernels block their reductions differently,
    # so agreement is to fp32 rounding (rtol 1e-4 on gradients), not bitwise.
    params = ref.random_params(CFG, dtype=torch.float32)
    batch = {"tokens": torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(0))}
    cpu = fmoe.step(params, batch, fmoe.Plan(model=CFG, microbatches=2))
    gpu = fmoe.step(to(params, "cuda"), batch, fmoe.Plan(model=CFG, microbatches=2, device="cuda"))
    torch.testing.assert_close(gpu.loss.cpu(), cpu.loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(optree.tree_leaves(gpu.grads), optree.tree_leaves(cpu.grads)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
    assert torch.equal(gpu.metrics["expert_counts"].cpu(), cpu.metrics["expert_counts"])


@pytest.mark.parametrize("pad", [0, 16])
def test_cuda_bf16_grouped_mm_matches_loop_and_reference(pad):
    cfg = fmoe.ModelConfig(dim=128, heads=4, experts=8, topk=2, ffn=64, expert_biases=True, pad_multiple=pad)
    p = optree.tree_map(lambda t: t.float().cuda(), ref.random_params(cfg, seed=2)["layers"][0]["moe"])
    p = dict(p, experts=optree.tree_map(lambda t: t.bfloat16(), p["experts"]))
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(pad)).cuda().bfloat16()
    # The reference sees exactly the bf16-rounded inputs, so routing decisions agree.
    p64, x64 = optree.tree_map(lambda t: t.double().cpu(), p), x.double().cpu()
    y_grouped, _ = layers.moe(p, x, cfg, backend="torch")
    y_loop, _ = layers.moe(p, x, cfg, backend="loop")
    # Both are bf16 GEMMs with fp32 accumulation over the same rows; differences are
    # bf16 output rounding (2^-8 relative).
    torch.testing.assert_close(y_grouped.float(), y_loop.float(), rtol=2e-2, atol=2e-2)
    y_ref = ref.moe(p64, x64, cfg)[0]
    torch.testing.assert_close(y_grouped.double().cpu(), y_ref, rtol=5e-2, atol=5e-2)


def test_cuda_bf16_main_job_learns(tmp_path):
    summary = train.main(["--device", "cuda", "--dtype", "bfloat16", "--steps", "300", "--eval-every", "100",
                          "--out", str(tmp_path), "--no-progress"])
    assert summary["heldout_loss"] < 0.6 * summary["unigram"]
