"""CUDA checks of the single-process core (run on the GPU machine; skipped elsewhere)."""

import json

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


def assert_cuda_fp32_step_matches_cpu(cfg, seed):
    # Same arithmetic on another device: kernels block their reductions differently,
    # so agreement is to fp32 rounding (rtol 1e-4 on gradients), not bitwise.
    params = ref.random_params(cfg, seed=seed, dtype=torch.float32)
    batch = {"tokens": torch.randint(0, cfg.vocab, (8, 33), generator=torch.Generator().manual_seed(seed))}
    cpu = fmoe.step(params, batch, fmoe.Plan(model=cfg, microbatches=2))
    gpu = fmoe.step(to(params, "cuda"), batch, fmoe.Plan(model=cfg, microbatches=2, device="cuda"))
    torch.testing.assert_close(gpu.loss.cpu(), cpu.loss, rtol=1e-5, atol=1e-5)
    ref.assert_trees_close(to(gpu.grads, "cpu"), cpu.grads, rtol=1e-4, atol=1e-5)
    assert torch.equal(gpu.metrics["expert_counts"].cpu(), cpu.metrics["expert_counts"])


def test_cuda_fp32_step_matches_cpu():
    assert_cuda_fp32_step_matches_cpu(CFG, seed=0)


def moe_with_grads(p, x, cfg, backend, upstream):
    leaves, treedef = optree.tree_flatten(p)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in leaves]
    x = x.detach().requires_grad_(True)
    y, stats = layers.moe(optree.tree_unflatten(treedef, leaves), x, cfg, backend=backend)
    y.backward(upstream)
    grads = optree.tree_unflatten(treedef, [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves])
    return y.detach(), x.grad, grads, stats


@pytest.mark.parametrize("pad", [0, 16])
def test_cuda_bf16_grouped_mm_matches_loop_and_reference(pad):
    cfg = fmoe.ModelConfig(dim=128, heads=4, experts=8, topk=2, ffn=64, expert_biases=True, pad_multiple=pad)
    p = optree.tree_map(lambda t: t.float().cuda(), ref.random_params(cfg, seed=2)["layers"][0]["moe"])
    p["expert_bias"][-1] = -100.0  # the last expert receives no token
    p = dict(p, experts=optree.tree_map(lambda t: t.bfloat16(), p["experts"]))
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(pad)).cuda().bfloat16()
    upstream = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
    y, dx, grads, stats = moe_with_grads(p, x, cfg, "torch", upstream)
    y_loop, dx_loop, grads_loop, _ = moe_with_grads(p, x, cfg, "loop", upstream)
    assert stats.counts_E[-1] == 0
    # Both are bf16 GEMMs with fp32 accumulation over the same rows; differences are
    # bf16 rounding of outputs and of the per-row gradients (2^-8 relative).
    torch.testing.assert_close(y.float(), y_loop.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx.float(), dx_loop.float(), rtol=2e-2, atol=2e-2)
    for name in ("fc1", "fc2", "fc1_bias", "fc2_bias"):
        g, g_loop = grads["experts"][name].float(), grads_loop["experts"][name].float()
        scale = g_loop.abs().max()
        torch.testing.assert_close(g / scale, g_loop / scale, rtol=0, atol=2e-2)
        assert (g[-1] == 0).all(), f"{name}: the expert without tokens must get a zero gradient"
    # The reference sees exactly the bf16-rounded inputs, so routing decisions agree.
    p64, x64 = optree.tree_map(lambda t: t.double().cpu(), p), x.double().cpu()
    torch.testing.assert_close(y.double().cpu(), ref.moe(p64, x64, cfg)[0], rtol=5e-2, atol=5e-2)


def test_cuda_bf16_main_job_learns(tmp_path):
    summary = train.main(["--device", "cuda", "--dtype", "bfloat16", "--steps", "300", "--eval-every", "100",
                          "--out", str(tmp_path), "--no-progress"])
    assert summary["heldout_loss"] < 0.6 * summary["unigram"]


FEATURES = fmoe.ModelConfig(vocab=64, dim=64, layers=2, heads=4, kv_heads=2, head_size=24, qk_norm="head",
                            qkv_bias=True, tie_embeddings=True, experts=8, topk=2, ffn=32, shared_ffn=16,
                            shared_gate=True)


def test_cuda_model_features_step_matches_cpu():
    # grouped-query attention (SDPA with enable_gqa on CUDA), q/k norms, qkv bias, tied
    # embeddings and the gated shared expert
    assert_cuda_fp32_step_matches_cpu(FEATURES, seed=3)


def test_cuda_cached_generation_matches_full_forward():
    from fmoe.generate import generate

    params = to(ref.random_params(FEATURES, seed=4, dtype=torch.float32), "cuda")
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(4)).cuda()
    got = generate(params, prompt, FEATURES, max_new_tokens=10)
    ids = prompt
    for _ in range(10):  # no cache: the whole sequence again for every token
        logits, _ = layers.forward(params, ids, FEATURES)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got.device.type == "cuda" and torch.equal(got, ids)


@pytest.mark.parametrize("graphs,extra", [
    ("step", []),  # the step, the chain AdamW and the skip decision in one graph
    ("step", ["--fused-optimizer", "--moments", "bfloat16", "--expert-bias-rate", "1e-3"]),  # donated, biases too
    ("attn,router,experts", []),
], ids=["step", "step-fused-bias", "scopes"])
def test_cuda_graphed_main_job_is_bitwise_eager(tmp_path, graphs, extra):
    from interop.train import main as interop_main

    common = ["--device", "cuda", "--dtype", "bfloat16", "--capacity-factor", "1.5", "--steps", "6",
              "--eval-every", "6", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", *extra]
    eager = interop_main(common + ["--out", str(tmp_path / "eager")])
    graphed = interop_main(common + ["--cuda-graph", graphs, "--out", str(tmp_path / "graphed")])

    def losses(out):
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "graphed") == losses(tmp_path / "eager")
    assert graphed["heldout_loss"] == eager["heldout_loss"]
