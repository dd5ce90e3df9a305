"""DeepSeek-V3 / GLM-4.5 variants against transformers' own modules: group-limited
routing with a scaled top-k (``Glm4MoeTopkRouter``) and partial RoPE
(``Glm4MoeRotaryEmbedding`` + ``apply_rotary_pos_emb``)."""

import pytest
import torch
from einops import rearrange

import fmoe
from fmoe import layers

from . import reference as ref

glm4_moe = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")
Glm4MoeConfig = pytest.importorskip("transformers").Glm4MoeConfig

F64 = torch.float64


def hf_router(p, cfg):
    """transformers' GLM-4.5 router holding fmoe's ``router`` and ``expert_bias``."""
    hf_cfg = Glm4MoeConfig(hidden_size=cfg.dim, n_routed_experts=cfg.experts, num_experts_per_tok=cfg.topk,
                           n_group=cfg.expert_groups, topk_group=cfg.topk_groups,
                           norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling)
    router = glm4_moe.Glm4MoeTopkRouter(hf_cfg)
    with torch.no_grad():
        router.weight.copy_(p["router"].T)
        router.e_score_correction_bias.copy_(p["expert_bias"])
    return router


def by_expert(indices_TK, probs_TK):
    """Each token's experts in increasing order, with their probabilities (top-k order
    is not part of the result)."""
    indices_TK, order_TK = indices_TK.sort(-1)
    return indices_TK, probs_TK.gather(-1, order_TK)


ROUTINGS = {
    "4_groups_keep_2": dict(experts=16, topk=4, expert_groups=4, topk_groups=2, routed_scaling=2.5),
    "8_groups_keep_3_unnormalised": dict(experts=16, topk=5, expert_groups=8, topk_groups=3,
                                         norm_topk_prob=False, routed_scaling=1.8),
    "2_groups_keep_1_topk_fills_it": dict(experts=8, topk=4, expert_groups=2, topk_groups=1),
    "no_groups_scaled": dict(experts=8, topk=3, routed_scaling=0.7),
}


@pytest.mark.parametrize("routing", ROUTINGS, ids=list(ROUTINGS))
def test_route_picks_and_weighs_as_transformers_glm4_moe_router(routing):
    cfg = fmoe.ModelConfig(dim=16, heads=2, score_func="sigmoid", **ROUTINGS[routing])
    p = ref.random_params(cfg, dtype=torch.float32)["layers"][0]["moe"]
    p["expert_bias"] = 0.1 * torch.randn(cfg.experts)  # of the scores' size: it moves the choice
    x_TD = torch.randn(64, 16)
    got = layers.route(p, x_TD, cfg)
    with torch.no_grad():
        _, hf_probs_TK, hf_indices_TK = hf_router(p, cfg)(x_TD)
    indices_TK, probs_TK = by_expert(got.indices_TK, got.probs_TK)
    hf_indices_TK, hf_probs_TK = by_expert(hf_indices_TK, hf_probs_TK)
    assert torch.equal(indices_TK, hf_indices_TK)
    torch.testing.assert_close(probs_TK, hf_probs_TK, rtol=1e-6, atol=1e-6)
    if cfg.expert_groups > 1:  # the groups changed what plain top-k would pick
        plain = layers.route(p, x_TD, cfg.replace(expert_groups=1, topk_groups=1))
        assert not torch.equal(plain.indices_TK.sort(-1).values, indices_TK)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_grouped_route_matches_the_per_token_loop(score_func):
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=12, topk=3, expert_groups=4, topk_groups=2,
                           routed_scaling=2.0, score_func=score_func)
    p = ref.random_params(cfg)["layers"][0]["moe"]
    x_TD = torch.randn(30, 16, dtype=F64)
    r = layers.route(p, x_TD, cfg)
    for t in range(30):
        chosen, probs, _ = ref.route_token(p, x_TD[t], cfg)
        assert r.indices_TK[t].tolist() == chosen
        torch.testing.assert_close(r.probs_TK[t], probs)
    assert r.counts_E.sum() == 30 * 3


def test_group_selection_has_no_gradient_and_the_scaled_probs_do():
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=8, topk=2, expert_groups=4, topk_groups=2, routed_scaling=3.0)
    p = ref.random_params(cfg)["layers"][0]["moe"]
    router = p["router"].clone().requires_grad_(True)
    r = layers.route(dict(p, router=router), torch.randn(10, 16, dtype=F64), cfg)
    torch.testing.assert_close(r.probs_TK.sum(-1), torch.full((10,), 3.0, dtype=F64))  # renormalised, then scaled
    (r.probs_TK * torch.randn(10, 2, dtype=F64)).sum().backward()
    assert router.grad.abs().sum() > 0


def hf_rope(q_BHSd, k_BKSd, cfg, positions_BS):
    """transformers' partial RoPE: its cos/sin tables (fp32) and its rotation."""
    hf_cfg = Glm4MoeConfig(hidden_size=cfg.dim, num_attention_heads=cfg.heads, num_key_value_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, partial_rotary_factor=cfg.rope_fraction,
                           rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                            "partial_rotary_factor": cfg.rope_fraction})
    rotary = glm4_moe.Glm4MoeRotaryEmbedding(hf_cfg)
    assert rotary.inv_freq.shape == (cfg.rope_dims // 2,)
    cos, sin = rotary(q_BHSd, positions_BS)
    return glm4_moe.apply_rotary_pos_emb(q_BHSd, k_BKSd, cos, sin)


def unrotated_qk(p, x_BSD, cfg):
    """q and k as ``project_qkv`` makes them, before RoPE (no q/k norm, no bias here)."""
    q_BSQ, k_BSK, _ = (x_BSD @ p["qkv"]).split([cfg.q_width, cfg.kv_width, cfg.kv_width], dim=-1)
    return (rearrange(q_BSQ, "b s (h d) -> b h s d", h=cfg.heads),
            rearrange(k_BSK, "b s (h d) -> b h s d", h=cfg.num_kv_heads))


@pytest.mark.parametrize("head_size,fraction", [(16, 0.5), (12, 0.5), (20, 0.4)])
def test_partial_rope_equals_transformers_apply_rotary_pos_emb(head_size, fraction):
    cfg = fmoe.ModelConfig(dim=32, heads=4, kv_heads=2, head_size=head_size, rope_fraction=fraction, rope_theta=50.0)
    assert cfg.rope_dims == int(head_size * fraction) < head_size
    p = ref.random_params(cfg)["layers"][0]["attn"]
    x_BSD = torch.randn(2, 7, 32, dtype=F64)
    start = 3
    q_BHSd, k_BKSd, _ = layers.project_qkv(p, x_BSD, cfg, start=start)
    raw_q, raw_k = unrotated_qk(p, x_BSD, cfg)
    positions_BS = torch.arange(start, start + 7).expand(2, 7)
    hf_q, hf_k = hf_rope(raw_q, raw_k, cfg, positions_BS)
    # transformers makes its tables in fp32: agreement to fp32's rounding of the angles
    torch.testing.assert_close(q_BHSd, hf_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_BKSd, hf_k, rtol=1e-6, atol=1e-6)
    # with fmoe's fp64 tables in transformers' layout, transformers' rotation to fp64's
    cos_Sh, sin_Sh = layers.rope_tables(7, cfg.rope_dims, cfg.rope_theta, start=start)
    cos_Sr, sin_Sr = torch.cat([cos_Sh, cos_Sh], -1), torch.cat([sin_Sh, sin_Sh], -1)
    exact_q, exact_k = glm4_moe.apply_rotary_pos_emb(raw_q, raw_k, cos_Sr, sin_Sr, unsqueeze_dim=0)
    torch.testing.assert_close(q_BHSd, exact_q, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(k_BKSd, exact_k, rtol=1e-13, atol=1e-13)
    assert torch.equal(q_BHSd[..., cfg.rope_dims:], raw_q[..., cfg.rope_dims:])  # passed through untouched


def test_partial_rope_restarts_at_each_packed_document():
    # (a cached decode with partial RoPE: test_layers.py's cache test)
    cfg = fmoe.ModelConfig(dim=16, heads=2, kv_heads=1, rope_fraction=0.5, qk_norm="head")
    p = ref.random_params(cfg, seed=4)["layers"][0]["attn"]
    x_BSD = torch.randn(2, 7, 16, dtype=F64)
    whole = layers.attention(p, x_BSD, cfg)
    ids_BS = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    packed = layers.attention(p, x_BSD, cfg, docs=layers.documents(ids_BS))
    torch.testing.assert_close(packed[:, :3], whole[:, :3])
    torch.testing.assert_close(packed[0, 3:], layers.attention(p, x_BSD[:1, 3:], cfg)[0])


def test_defaults_take_the_full_rope_and_ungrouped_route_bitwise():
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=8, topk=2)
    assert (cfg.expert_groups, cfg.topk_groups, cfg.routed_scaling, cfg.rope_fraction) == (1, 1, 1.0, 1.0)
    assert cfg.rope_dims == cfg.head_dim
    p = ref.random_params(cfg, dtype=torch.float32)["layers"][0]
    x_BSD = torch.randn(2, 5, 16)
    q_BHSd, k_BKSd, _ = layers.project_qkv(p["attn"], x_BSD, cfg)
    raw_q, raw_k = unrotated_qk(p["attn"], x_BSD, cfg)
    cos_Sh, sin_Sh = layers.rope_tables(5, cfg.head_dim, cfg.rope_theta)
    x1, x2 = raw_q.chunk(2, -1)
    cos_Sh, sin_Sh = cos_Sh.float(), sin_Sh.float()
    assert torch.equal(q_BHSd, torch.cat([x1 * cos_Sh - x2 * sin_Sh, x2 * cos_Sh + x1 * sin_Sh], -1))
    # one group keeping itself selects as no groups at all
    r = layers.route(p["moe"], x_BSD.flatten(0, 1), cfg)
    logits = x_BSD.flatten(0, 1) @ p["moe"]["router"]
    scores = logits.softmax(-1)
    indices = (scores + p["moe"]["expert_bias"]).topk(2, dim=-1).indices
    probs = scores.gather(-1, indices)
    assert torch.equal(r.indices_TK, indices) and torch.equal(r.probs_TK, probs / probs.sum(-1, keepdim=True))


def test_model_loss_with_grouped_routing_and_partial_rope_matches_the_reference():
    cfg = fmoe.ModelConfig(vocab=11, dim=16, layers=2, heads=2, kv_heads=1, head_size=12, experts=8, topk=3,
                           ffn=8, score_func="sigmoid", expert_groups=4, topk_groups=2, routed_scaling=2.5,
                           rope_fraction=0.5, qkv_bias=True)
    params = ref.random_params(cfg, seed=2)
    tokens = torch.randint(0, 11, (2, 6))
    fast = layers.lm_loss_sum(params, tokens, cfg)[0]
    torch.testing.assert_close(fast, ref.lm_loss_sum(params, tokens, cfg)[0])
    plan = fmoe.Plan(model=cfg, microbatches=2)
    out = fmoe.step(ref.random_params(cfg, seed=2, dtype=torch.float32), {"tokens": tokens}, plan)
    torch.testing.assert_close(out.loss.double(), fast / tokens[:, 1:].numel(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change,field", [(dict(expert_groups=2), "expert_groups"),
                                          (dict(routed_scaling=2.0), "routed_scaling"),
                                          (dict(rope_fraction=0.5), "rope_fraction"),
                                          # written as gpt_oss, whose experts are the clamped SwiGLU
                                          (dict(score_func="topk_softmax"), "activation"),
                                          (dict(router_bias=True), "router_bias"),
                                          (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max=64),
                                           "rope_scaling"),
                                          (dict(attn_sinks=True), "attn_sinks"),
                                          (dict(sliding_window=4, window_layers=(0,)), "window_layers")])
def test_hf_save_refuses_what_the_released_families_cannot_hold(change, field):
    from fmoe.hf.families import family_of

    cfg = fmoe.ModelConfig(vocab=64, dim=32, heads=4, experts=4, ffn=16).replace(**change)
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
        family_of(cfg)


def test_gpt_oss_routing_equals_transformers_router():
    """``topk_softmax`` with a router bias: the experts of the top-k biased logits,
    weighted by a softmax over those k logits (transformers' GptOssTopKRouter)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    cfg = fmoe.ModelConfig(dim=16, experts=8, topk=3, score_func="topk_softmax", router_bias=True,
                           norm_topk_prob=False)
    p = ref.random_params(cfg, seed=11)["layers"][0]["moe"]
    p["expert_bias"] = torch.zeros_like(p["expert_bias"])  # GPT-OSS selects without one
    x_TD = torch.randn(40, 16, dtype=F64)
    theirs = modeling_gpt_oss.GptOssTopKRouter(modeling_gpt_oss.GptOssConfig(
        hidden_size=16, num_local_experts=8, num_experts_per_tok=3)).double()
    with torch.no_grad():
        theirs.weight.copy_(p["router"].t())
        theirs.bias.copy_(p["router_bias"])
        _, want_probs, want_idx = theirs(x_TD)
    got = layers.route(p, x_TD, cfg)
    got_idx, got_probs = by_expert(got.indices_TK, got.probs_TK)
    want_idx, want_probs = by_expert(want_idx, want_probs)
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_probs, want_probs, rtol=1e-12, atol=1e-12)


