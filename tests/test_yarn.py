"""YaRN RoPE scaling (``rope_scaling="yarn"``) against transformers' ``rope_type="yarn"``:
the inverse frequencies and cos/sin of its rotary embeddings (GPT-OSS's, GLM-4.5's for
partial RoPE), q/k through ``apply_rotary_pos_emb``, DeepSeek-V3's softmax scale, and a
model's loss against the plain reference."""

import math

import pytest
import torch

import fmoe
from fmoe import layers
from fmoe.layers.rope import yarn_inverse_frequencies

from . import reference as ref
from .test_router_variants import unrotated_qk

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek_v3  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as glm4_moe  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss  # noqa: E402

F64 = torch.float64

# small contexts, so that the positions past rope_original_max stay where fp32 tables
# (transformers') are still accurate to about 1e-6; theta and the betas put YaRN's ramp
# inside the rotated pairs
YARNS = {
    "gpt_oss_like": dict(rope_factor=4.0, rope_original_max=32, rope_theta=500.0),
    "deepseek_like_mscale_all_dim": dict(rope_factor=8.0, rope_original_max=32, rope_theta=300.0,
                                         yarn_mscale=0.9, yarn_mscale_all_dim=0.7, yarn_beta_fast=8.0),
    "untruncated": dict(rope_factor=3.0, rope_original_max=24, rope_theta=200.0, yarn_truncate=False,
                        yarn_beta_fast=12.0, yarn_beta_slow=0.5),
    "explicit_attention_factor": dict(rope_factor=2.5, rope_original_max=20, rope_theta=100.0,
                                      yarn_attention_factor=1.3),
    "mscale_all_dim_without_mscale": dict(rope_factor=5.0, rope_original_max=32, rope_theta=400.0,
                                          yarn_mscale=0.0, yarn_mscale_all_dim=1.0),
    "partial_half": dict(rope_factor=4.0, rope_original_max=32, rope_theta=500.0, rope_fraction=0.5),
    "partial_half_untruncated_mscales": dict(rope_factor=6.0, rope_original_max=28, rope_theta=250.0,
                                             rope_fraction=0.5, yarn_truncate=False, yarn_mscale=1.0,
                                             yarn_mscale_all_dim=1.0),
}


def yarn_config(name, **extra):
    return fmoe.ModelConfig(dim=32, heads=4, kv_heads=2, head_size=16, rope_scaling="yarn",
                            **{**YARNS[name], **extra})


def hf_rope_parameters(cfg):
    """transformers' ``rope_parameters`` for ``cfg``'s YaRN (fmoe's 0: the key unset)."""
    params = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
              "original_max_position_embeddings": cfg.rope_original_max, "beta_fast": cfg.yarn_beta_fast,
              "beta_slow": cfg.yarn_beta_slow, "truncate": cfg.yarn_truncate}
    for key, value in (("mscale", cfg.yarn_mscale), ("mscale_all_dim", cfg.yarn_mscale_all_dim),
                       ("attention_factor", cfg.yarn_attention_factor)):
        if value:
            params[key] = value
    if cfg.rope_fraction != 1.0:
        params["partial_rotary_factor"] = cfg.rope_fraction
    return params


def hf_rotary(cfg):
    """transformers' rotary embedding for ``cfg``: GPT-OSS's for whole heads, GLM-4.5's
    (which has ``partial_rotary_factor``) for partial RoPE. Its cos/sin are ``[.., r/2]``
    (GPT-OSS) or ``[.., r]`` (GLM-4.5's rotate-half duplicate)."""
    common = dict(hidden_size=cfg.dim, num_attention_heads=cfg.heads, num_key_value_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=int(cfg.rope_original_max * cfg.rope_factor),
                  rope_parameters=hf_rope_parameters(cfg))
    if cfg.rope_fraction == 1.0:
        return gpt_oss.GptOssRotaryEmbedding(transformers.GptOssConfig(**common))
    return glm4_moe.Glm4MoeRotaryEmbedding(
        transformers.Glm4MoeConfig(partial_rotary_factor=cfg.rope_fraction, **common))


def fp32_tolerance(angles):
    """What fp32 tables can be trusted to: 1e-6, plus the rounding of an angle this large
    (its inverse frequency's and the product's, half an ulp each)."""
    return 1e-6 + 2 * 2.0 ** -24 * angles.abs()


@pytest.mark.parametrize("name", YARNS, ids=list(YARNS))
def test_yarn_tables_equal_transformers_rotary_embedding(name):
    cfg = yarn_config(name)
    rotary = hf_rotary(cfg)
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS["yarn"](rotary.config)
    assert hf_inv_freq.shape == (cfg.rope_dims // 2,)
    ours = yarn_inverse_frequencies(cfg.rope_dims, cfg.rope_theta, cfg.yarn)
    torch.testing.assert_close(ours, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert cfg.yarn.cos_factor == pytest.approx(hf_scaling, rel=1e-15)
    assert torch.equal(rotary.inv_freq, hf_inv_freq)
    # the ramp really blends: some pairs kept, some interpolated
    kept = torch.isclose(ours, cfg.rope_theta ** (-torch.arange(0, cfg.rope_dims, 2, dtype=F64) / cfg.rope_dims))
    assert kept.any() and not kept.all()

    S = 3 * cfg.rope_original_max  # well past the original context
    positions_BS = torch.arange(S)[None]
    cos_Sh, sin_Sh = layers.rope_tables(S, cfg.rope_dims, cfg.rope_theta, yarn=cfg.yarn)
    assert cos_Sh.dtype == F64 and cos_Sh.shape == (S, cfg.rope_dims // 2)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions_BS)
    hf_cos, hf_sin = hf_cos[0, :, :cfg.rope_dims // 2].double(), hf_sin[0, :, :cfg.rope_dims // 2].double()
    tol = fp32_tolerance(torch.arange(S, dtype=F64)[:, None] * ours)
    assert ((cos_Sh - hf_cos).abs() <= tol).all() and ((sin_Sh - hf_sin).abs() <= tol).all()
    first = cfg.rope_original_max + 8  # up to there the angles are small enough for a flat 1e-6
    torch.testing.assert_close(cos_Sh[:first], hf_cos[:first], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin_Sh[:first], hf_sin[:first], rtol=0, atol=2e-6)

    # against the reference's YaRN, written from the paper's formula: to fp64
    plain = torch.tensor([ref.yarn_frequency(i, cfg.rope_dims, cfg.rope_theta, cfg)
                          for i in range(cfg.rope_dims // 2)], dtype=F64)
    torch.testing.assert_close(ours, plain, rtol=1e-14, atol=0)
    assert cfg.yarn.cos_factor == pytest.approx(ref.yarn_cos_factor(cfg), rel=1e-15)


def test_yarn_tables_at_document_positions_equal_the_contiguous_ones():
    cfg = yarn_config("deepseek_like_mscale_all_dim")
    cos_Sh, sin_Sh = layers.rope_tables(80, cfg.rope_dims, cfg.rope_theta, start=5, yarn=cfg.yarn)
    positions_BS = torch.arange(5, 85)[None].expand(2, 80)
    cos_B1Sh, sin_B1Sh = layers.rope_tables(80, cfg.rope_dims, cfg.rope_theta, positions_BS=positions_BS,
                                            yarn=cfg.yarn)
    assert torch.equal(cos_B1Sh[1, 0], cos_Sh) and torch.equal(sin_B1Sh[0, 0], sin_Sh)


@pytest.mark.parametrize("name", ["gpt_oss_like", "partial_half_untruncated_mscales"])
def test_yarn_qk_equal_transformers_apply_rotary_pos_emb(name):
    cfg = yarn_config(name)
    p = ref.random_params(cfg)["layers"][0]["attn"]
    S, start = 20, 30  # across rope_original_max
    x_BSD = torch.randn(2, S, cfg.dim, dtype=F64)
    q_BHSd, k_BKSd, _ = layers.project_qkv(p, x_BSD, cfg, start=start)
    raw_q, raw_k = unrotated_qk(p, x_BSD, cfg)
    positions_BS = torch.arange(start, start + S).expand(2, S)
    rotary = hf_rotary(cfg)
    cos, sin = rotary(raw_q.float(), positions_BS)
    cos, sin = cos.double(), sin.double()
    if cfg.rope_fraction == 1.0:
        hf_q, hf_k = gpt_oss.apply_rotary_pos_emb(raw_q, raw_k, cos, sin)
    else:
        hf_q, hf_k = glm4_moe.apply_rotary_pos_emb(raw_q, raw_k, cos, sin)
    torch.testing.assert_close(q_BHSd, hf_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_BKSd, hf_k, rtol=1e-5, atol=1e-5)
    # fmoe's fp64 tables through transformers' rotation: to fp64
    cos_Sh, sin_Sh = layers.rope_tables(S, cfg.rope_dims, cfg.rope_theta, start=start, yarn=cfg.yarn)
    if cfg.rope_fraction == 1.0:
        exact_q, exact_k = gpt_oss.apply_rotary_pos_emb(raw_q, raw_k, cos_Sh, sin_Sh, unsqueeze_dim=0)
    else:
        cos_Sr, sin_Sr = torch.cat([cos_Sh, cos_Sh], -1), torch.cat([sin_Sh, sin_Sh], -1)
        exact_q, exact_k = glm4_moe.apply_rotary_pos_emb(raw_q, raw_k, cos_Sr, sin_Sr, unsqueeze_dim=0)
    torch.testing.assert_close(q_BHSd, exact_q, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(k_BKSd, exact_k, rtol=1e-13, atol=1e-13)
    assert torch.equal(q_BHSd[..., cfg.rope_dims:], raw_q[..., cfg.rope_dims:])


def deepseek_v3_config(cfg):
    return transformers.DeepseekV3Config(
        hidden_size=cfg.dim, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        qk_nope_head_dim=cfg.head_dim - cfg.rope_dims, qk_rope_head_dim=cfg.rope_dims, v_head_dim=cfg.head_dim,
        q_lora_rank=None, kv_lora_rank=16, max_position_embeddings=int(cfg.rope_original_max * cfg.rope_factor),
        rope_parameters=hf_rope_parameters(cfg.replace(rope_fraction=1.0)))


@pytest.mark.parametrize("name", ["deepseek_like_mscale_all_dim", "mscale_all_dim_without_mscale",
                                  "partial_half_untruncated_mscales", "gpt_oss_like"])
def test_attention_scale_equals_deepseek_v3_attention_scaling(name):
    cfg = yarn_config(name)
    hf_attention = deepseek_v3.DeepseekV3Attention(deepseek_v3_config(cfg), layer_idx=0)
    assert cfg.attention_scale == hf_attention.scaling
    if cfg.yarn_mscale_all_dim:
        assert cfg.attention_scale > 1.0 / math.sqrt(cfg.head_dim)
    else:
        assert cfg.attention_scale == 1.0 / math.sqrt(cfg.head_dim)


def test_deepseek_v3_rope_matches_its_yarn_tables():
    # DeepSeek-V3 rotates its qk_rope_head_dim features: fmoe's partial-RoPE dims
    cfg = yarn_config("partial_half_untruncated_mscales")
    rotary = deepseek_v3.DeepseekV3RotaryEmbedding(deepseek_v3_config(cfg))
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS["yarn"](rotary.config)
    ours = yarn_inverse_frequencies(cfg.rope_dims, cfg.rope_theta, cfg.yarn)
    torch.testing.assert_close(ours, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert cfg.yarn.cos_factor == pytest.approx(hf_scaling, rel=1e-15)


@pytest.mark.parametrize("name", ["deepseek_like_mscale_all_dim", "partial_half"])
def test_model_loss_with_yarn_matches_the_reference(name):
    cfg = fmoe.ModelConfig(vocab=11, dim=16, layers=2, heads=2, kv_heads=1, head_size=12, experts=4, topk=2,
                           ffn=8, rope_scaling="yarn", qkv_bias=True,
                           **{**YARNS[name], "rope_original_max": 4})
    params = ref.random_params(cfg, seed=3)
    tokens = torch.randint(0, 11, (2, 10))
    fast = layers.lm_loss_sum(params, tokens, cfg)[0]
    slow = ref.lm_loss_sum(params, tokens, cfg)[0]
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    plain = layers.lm_loss_sum(params, tokens, cfg.replace(**{k: f.default for k, f in FIELDS.items()}))[0]
    assert not torch.allclose(fast, plain)  # YaRN changed the computation


FIELDS = {f.name: f for f in fmoe.ModelConfig.__dataclass_fields__.values()
          if f.name == "rope_scaling" or f.name.startswith(("rope_factor", "rope_original", "yarn_"))}


def test_defaults_leave_rope_and_the_scale_as_before():
    cfg = fmoe.ModelConfig(dim=32, heads=4, head_size=16)
    assert cfg.rope_scaling == "none" and cfg.yarn is None
    assert cfg.attention_scale == 1.0 / math.sqrt(cfg.head_dim)
    cos_Sh, sin_Sh = layers.rope_tables(9, 16, cfg.rope_theta, start=2)
    angles = torch.arange(2, 11, dtype=F64)[:, None] * cfg.rope_theta ** (-torch.arange(0, 16, 2, dtype=F64) / 16)
    assert torch.equal(cos_Sh, angles.cos()) and torch.equal(sin_Sh, angles.sin())
    # a factor of 1 is YaRN's identity on the frequencies (transformers allows it); its
    # cos factor is 1 too
    same = fmoe.ModelConfig(dim=32, heads=4, head_size=16, rope_scaling="yarn", rope_original_max=64)
    yarn_cos, yarn_sin = layers.rope_tables(9, 16, cfg.rope_theta, start=2, yarn=same.yarn)
    torch.testing.assert_close(yarn_cos, cos_Sh, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(yarn_sin, sin_Sh, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("changes,field", [
    (dict(rope_scaling="ntk"), "rope_scaling"),
    (dict(rope_scaling="yarn", rope_factor=4.0), "rope_original_max"),
    (dict(rope_scaling="yarn", rope_factor=0.5, rope_original_max=8), "rope_factor"),
    (dict(rope_scaling="yarn", rope_factor=math.inf, rope_original_max=8), "rope_factor"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max=8.0), "rope_original_max"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max=8, yarn_beta_fast=0.5), "yarn_beta_fast"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max=8, yarn_beta_slow=0.0), "yarn_beta_slow"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max=8, yarn_mscale=-1.0), "yarn_mscale"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max=8, yarn_mscale_all_dim=math.nan),
     "yarn_mscale_all_dim"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max=8, yarn_attention_factor=-0.5),
     "yarn_attention_factor"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max=8, yarn_truncate=1), "yarn_truncate"),
    (dict(rope_factor=2.0), "rope_factor"),  # YaRN's settings without YaRN would be ignored
    (dict(rope_original_max=4096), "rope_original_max"),
    (dict(yarn_mscale_all_dim=1.0), "yarn_mscale_all_dim"),
])
def test_bad_yarn_settings_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}="):
        fmoe.ModelConfig(**changes)


def test_yarn_rope_backward_is_the_rotation_by_minus_the_angles():
    # the fused kernel's backward (fmoe::rope with NEGATE) reuses the forward's tables
    # with sin negated: right for YaRN's scaled tables too, since a * R(angle) has the
    # transpose a * R(-angle)
    cfg = yarn_config("deepseek_like_mscale_all_dim")
    cos_Sh, sin_Sh = layers.rope_tables(40, cfg.rope_dims, cfg.rope_theta, start=10, yarn=cfg.yarn)
    assert cos_Sh.abs().max() > 1  # the cos factor is in the tables
    x_BHSd = torch.randn(2, 3, 40, cfg.head_dim, dtype=F64, requires_grad=True)
    grad_BHSd = torch.randn(2, 3, 40, cfg.head_dim, dtype=F64)
    (layers.apply_rope(x_BHSd, cos_Sh, sin_Sh) * grad_BHSd).sum().backward()
    torch.testing.assert_close(x_BHSd.grad, layers.apply_rope(grad_BHSd, cos_Sh, -sin_Sh), rtol=1e-14, atol=1e-14)


def test_yarn_attention_with_a_cache_and_packed_documents_continues_the_sequence():
    cfg = fmoe.ModelConfig(dim=16, heads=2, kv_heads=1, rope_fraction=0.5, rope_scaling="yarn", rope_factor=4.0,
                           rope_original_max=4, rope_theta=100.0, yarn_mscale_all_dim=1.0)
    p = ref.random_params(cfg, seed=5)["layers"][0]["attn"]
    x_BSD = torch.randn(2, 9, 16, dtype=F64)
    whole = layers.attention(p, x_BSD, cfg)
    scale = cfg.attention_scale
    q, k, v = layers.project_qkv(p, x_BSD[:, :5], cfg)
    first = layers.attend(q, k, v, scale=scale) @ p["out"]
    q2, k2, v2 = layers.project_qkv(p, x_BSD[:, 5:], cfg, start=5)
    rest = layers.attend(q2, torch.cat([k, k2], 2), torch.cat([v, v2], 2), start=5, scale=scale) @ p["out"]
    torch.testing.assert_close(torch.cat([first, rest], 1), whole)
    ids_BS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0] * 9])
    packed = layers.attention(p, x_BSD, cfg, docs=layers.documents(ids_BS))
    torch.testing.assert_close(packed[:, :3], whole[:, :3])
    torch.testing.assert_close(packed[0, 3:], layers.attention(p, x_BSD[:1, 3:], cfg)[0])
    torch.testing.assert_close(packed[1], whole[1])
