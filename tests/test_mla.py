"""DeepSeek-V3's multi-head latent attention: against the per-position reference (which
rotates DeepSeek's interleaved pairs itself), its layout, cache and FLOPs. Through the
model, the schedules, packed documents, decoding and compile with the other features:
``test_model_features.py``."""

import pytest
import torch

import fmoe
from fmoe import layers
from fmoe.generate import empty_cache, kv_cache_bytes

from . import reference as ref
from .test_model_features import FEATURES
from .test_layers import assert_same_fwd_bwd

F64 = torch.float64
# DeepSeek-V3's pieces at toy size: a low-rank query, a latent of its own width, value
# heads narrower than the q/k heads, interleaved RoPE pairs, YaRN with the softmax
# correction, a dense first layer and grouped sigmoid routing
CFG = FEATURES["mla"]

VARIANTS = {
    "low_rank_q": dict(q_lora_rank=8),
    "full_q": dict(),
    "interleaved_narrow_v": dict(q_lora_rank=8, rope_interleave=True, v_head_size=6),
    "yarn_softmax_correction": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max=4, yarn_mscale=1.0,
                                    yarn_mscale_all_dim=1.0, rope_interleave=True),
    "wide_v_sinks_bias": dict(v_head_size=14, attn_sinks=True, out_bias=True),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_latent_attention_matches_the_reference(variant):
    cfg = fmoe.ModelConfig(dim=16, heads=2, head_size=10, kv_lora_rank=12, rope_head_dim=4, rope_theta=100.0,
                           **VARIANTS[variant])
    p = ref.random_params(cfg, seed=ref.seed_of_this_test())["layers"][0]["attn"]
    names = sorted(k for k in p if k != "norm")
    x = torch.randn(2, 6, 16, dtype=F64)
    assert_same_fwd_bwd(lambda x, *w: layers.attention(dict(zip(names, w)), x, cfg),
                        lambda x, *w: ref.attention(dict(zip(names, w)), x, cfg), [x, *(p[n] for n in names)])


def test_layout_and_leaf_kinds():
    table = fmoe.params.param_table(CFG)
    shapes = {leaf.path: leaf.shape for leaf in table.leaves if leaf.path.startswith("layers.1.attn.")}
    assert shapes == {"layers.1.attn.norm": (32,), "layers.1.attn.q_down": (32, 8), "layers.1.attn.q_down_norm": (8,),
                      "layers.1.attn.q_up": (8, 48), "layers.1.attn.kv_down": (32, 20),
                      "layers.1.attn.kv_down_norm": (16,), "layers.1.attn.kv_up": (16, 4 * (8 + 6)),
                      "layers.1.attn.out": (24, 32)}
    assert table["layers.1.attn.kv_up"].linear and table["layers.1.attn.q_down"].decayed
    assert not table["layers.1.attn.kv_down_norm"].decayed and not table["layers.1.attn.kv_down_norm"].linear
    assert "q" in fmoe.params.param_specs(CFG.replace(q_lora_rank=0))["layers"][1]["attn"]


def test_the_cache_holds_the_latent_keys_and_the_narrower_values():
    # that decoding through it equals the full forward: test_model_features.py
    cache = empty_cache(CFG, 2, 8, torch.float32, "cpu")
    assert cache.keys[0].shape == (2, 4, 8, 12) and cache.values[0].shape == (2, 4, 8, 6)
    assert kv_cache_bytes(CFG, 2, 8, torch.float32) == sum(t.numel() * 4 for t in cache.keys + cache.values)


def test_flops_count_the_value_heads_and_the_windows():
    seq = 64
    dense = fmoe.params.active_param_count(CFG)
    assert fmoe.train_flops_per_token(CFG, seq) == 6.0 * dense + 3 * 6.0 * 4 * (12 + 6) / 2 * seq / 2
    windowed = fmoe.ModelConfig(layers=2, sliding_window=16, window_layers=(1,))
    attn = 6.0 * windowed.heads * windowed.head_dim
    assert fmoe.train_flops_per_token(windowed, seq) == (6.0 * fmoe.params.active_param_count(windowed)
                                                         + attn * (seq / 2 + 16 - 16 * 16 / (2 * seq)))


@pytest.mark.parametrize("changes, field", [
    (dict(q_lora_rank=8), "q_lora_rank"),
    (dict(rope_head_dim=4), "rope_head_dim"),
    (dict(v_head_size=4), "v_head_size"),
    (dict(kv_lora_rank=8), "rope_head_dim"),
    (dict(kv_lora_rank=8, rope_head_dim=3), "rope_head_dim"),
    (dict(kv_lora_rank=8, rope_head_dim=12), "rope_head_dim"),
    (dict(kv_lora_rank=8, rope_head_dim=4, kv_heads=2), "kv_heads"),
    (dict(kv_lora_rank=8, rope_head_dim=4, qkv_bias=True), "qkv_bias"),
    (dict(kv_lora_rank=8, rope_head_dim=4, qk_norm="head"), "qk_norm"),
    (dict(kv_lora_rank=8, rope_head_dim=4, rope_fraction=0.5), "rope_fraction"),
    (dict(kv_lora_rank=-1), "kv_lora_rank"),
    (dict(rope_interleave=1), "rope_interleave"),
])
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        fmoe.ModelConfig(heads=4, head_size=12, **changes)
