"""The benchmarks' independent peer (``benchmarks/peer.py``): on each of ``vs_peer.py``'s
CPU toys, loaded with fmoe's weights, it gives fmoe's loss and gradients (what
``vs_peer.py --check`` runs, here without the peer's compilation, which the GPU
benchmark exercises); its FlexAttention path (CUDA's, for sinks and windows) computes
what its eager path computes; and what it refuses or leaves untrained."""

import argparse
import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import peer  # noqa: E402
import vs_peer  # noqa: E402


def toy(shape: str):
    """The shape's CPU toy, as ``vs_peer.py --check`` builds it (no model flag given)."""
    return vs_peer.shape_config(shape, argparse.Namespace(**dict.fromkeys(vs_peer.MODEL_FLAGS)), toy=True)


@pytest.mark.parametrize("shape", ["qwen3-moe-medium", "glm4.5-medium", "gpt-oss-medium", "deepseek-v3-medium"])
def test_the_peer_with_fmoes_weights_gives_fmoes_loss_and_gradients(shape):
    cfg = toy(shape)
    assert vs_peer.check_shape(cfg, shape, batch=2, seq=64, compiled=False)


def test_flex_attention_path_equals_the_eager_path():
    # FlexAttention has no CPU backward: its forward (eager) against the eager scores,
    # both windowed and full layers, with sinks
    cfg = toy("gpt-oss-medium")
    model = peer.build(cfg, "cpu", seed=3)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.normal_(0.0, 1.0)  # sinks that matter
        tokens = torch.randint(0, cfg.vocab, (2, 256))
        eager, _ = model(tokens, flex=False)
        flex, _ = model(tokens, flex=True)
    assert model.windows == [cfg.sliding_window, 0]
    torch.testing.assert_close(flex, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_flex_attention_path_on_cuda_gives_the_eager_paths_loss_and_gradients():
    # what the GPU benchmark runs: FlexAttention compiled on its own (the eager peer) and
    # inlined into each compiled block (the compiled peer), against the explicit scores
    # under bf16 autocast as the peer trains on CUDA (its grouped GEMM takes bf16 only):
    # the paths round differently, so gradients agree to bf16's precision, by norm, and a
    # token near a routing tie may pick another expert (the expert biases' gradients
    # moved 6% in norm on the H100)
    cfg = toy("gpt-oss-medium")
    tokens = torch.randint(0, cfg.vocab, (2, 257), device="cuda")
    out = {}
    for flex, compile in ((False, False), (True, False), (True, True)):
        model = peer.build(cfg, "cuda", seed=3, compile=compile)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = model(tokens[:, :-1], flex=flex)
            loss = model.loss_fn(logits, tokens[:, 1:])
        loss.backward()
        out[flex, compile] = loss.detach(), {n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters()}
        torch._dynamo.reset()
    loss, grads = out[False, False]
    for key in ((True, False), (True, True)):
        torch.testing.assert_close(out[key][0], loss, rtol=2e-2, atol=2e-2)
        for name, grad in grads.items():
            got = out[key][1][name]
            assert (got - grad).norm() <= 0.1 * grad.norm() + 1e-6, name


def test_the_expert_bias_selects_without_a_gradient_and_biases_are_not_decayed():
    cfg = toy("glm4.5-medium")
    model = peer.build(cfg, "cpu")
    moe = model.blocks[1].moe
    assert "expert_bias" in dict(moe.named_buffers()) and "expert_bias" not in dict(moe.named_parameters())
    x = torch.randn(32, cfg.dim)
    before = moe.route(x)[1]
    moe.expert_bias[before[:, 0]] -= 10.0  # each token's first choice made unattractive
    after = moe.route(x)[1]
    assert not (after == before[:, :1]).any(dim=1).all()

    opt = peer.optimizer(peer.build(toy("gpt-oss-medium"), "cpu"), lr=1e-3)
    decayed, kept = (sum(p.numel() for p in group["params"]) for group in opt.param_groups)
    gpt = peer.build(toy("gpt-oss-medium"), "cpu")
    biases = sum(p.numel() for n, p in gpt.named_parameters() if n.endswith(("bias", "b1", "b2", "sinks", "norm.weight")))
    assert kept == biases and decayed + kept == sum(p.numel() for p in gpt.parameters())


def test_a_config_the_peer_does_not_model_is_refused():
    cfg = toy("coarse").replace(tie_embeddings=True)
    with pytest.raises(ValueError, match="does not model tie_embeddings"):
        peer.PeerConfig.of(cfg)
    with pytest.raises(ValueError, match="latent attention"):
        peer.PeerConfig(kv_lora_rank=32, rope_head_dim=8, attn_sinks=True)


def test_mla_values_padded_to_the_qk_head_size_give_the_same_model():
    cfg = toy("deepseek-v3-medium")
    tokens = torch.randint(0, cfg.vocab, (2, 64))
    with torch.no_grad():
        native, _ = peer.build(cfg, "cpu", seed=3)(tokens)
        padded, _ = peer.build(cfg, "cpu", seed=3, mla_pad_values=True)(tokens)
    torch.testing.assert_close(padded, native)


def test_the_busiest_expert_ranks_share_is_what_the_planners_skew_means():
    # two MoE layers (and a dense one, no rows) over 2 expert ranks of 2 experts: the first
    # routes every row to rank 0 (2x an even share), the second evenly (1x)
    import types

    import fmoe

    plan = fmoe.Plan(model=fmoe.ModelConfig(experts=4, topk=2), ep=2)
    counts = torch.tensor([[6, 4, 0, 0], [0, 0, 0, 0], [5, 5, 5, 5]])
    assert vs_peer.busiest_rank(counts, plan, types.SimpleNamespace(distributed=False)) == (1.5, 2.0)
    assert vs_peer.busiest_rank(counts, plan.replace(ep=1), None) is None
