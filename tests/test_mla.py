"""DeepSeek-V3's multi-head latent attention: against the per-position reference (which
rotates DeepSeek's interleaved pairs itself), through the model, the schedule, packed
documents, decoding and compile."""

import optree
import pytest
import torch

import fmoe
from fmoe import layers
from fmoe.batch import IGNORE
from fmoe.generate import empty_cache, kv_cache_bytes
from fmoe.layers import forward

from . import reference as ref
from .test_generate import decoded_logits
from .test_layers import assert_same_fwd_bwd
from .test_schedule import assert_same_step

F64 = torch.float64
# DeepSeek-V3's pieces at toy size: a low-rank query, a latent of its own width, value
# heads narrower than the q/k heads, interleaved RoPE pairs, YaRN with the softmax
# correction, a dense first layer and grouped sigmoid routing
CFG = fmoe.ModelConfig(vocab=40, dim=32, layers=3, heads=4, head_size=12, kv_lora_rank=16, q_lora_rank=8,
                       rope_head_dim=4, v_head_size=6, rope_interleave=True, experts=4, topk=2, ffn=16,
                       dense_layers=(0,), dense_ffn=24, score_func="sigmoid", expert_groups=2, topk_groups=1,
                       routed_scaling=2.5, shared_ffn=16, rope_scaling="yarn", rope_factor=4.0, rope_original_max=4,
                       yarn_mscale=1.0, yarn_mscale_all_dim=1.0)

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


@pytest.mark.parametrize("segments", [False, True], ids=["rows", "packed"])
def test_model_loss_and_gradients_match_the_reference(segments):
    params = ref.random_params(CFG)
    g = torch.Generator().manual_seed(ref.seed_of_this_test())
    tokens = torch.randint(0, 40, (2, 9), generator=g)
    seg = (torch.rand(2, 9, generator=g) < 0.25).long().cumsum(1) if segments else None
    leaves, treedef = optree.tree_flatten(params)
    targets = tokens[:, 1:]
    if segments:
        targets = targets.masked_fill(seg[:, :-1] != seg[:, 1:], IGNORE)

    def fast(*lv):
        return layers.lm_loss_sum(optree.tree_unflatten(treedef, lv), tokens, CFG, targets_BS=targets,
                                  segments_BS=None if seg is None else seg[:, :-1])[0]

    def slow(*lv):
        return ref.lm_loss_sum(optree.tree_unflatten(treedef, lv), tokens, CFG, segments_BS1=seg)[0]

    assert_same_fwd_bwd(fast, slow, leaves)


def test_cached_decode_equals_the_full_forward():
    params = ref.random_params(CFG, dtype=torch.float32)
    tokens = torch.randint(0, 40, (2, 8))
    full, _ = forward(params, tokens, CFG)
    cache = empty_cache(CFG, 2, 8, torch.float32, "cpu")
    assert cache.keys[0].shape == (2, 4, 8, 12) and cache.values[0].shape == (2, 4, 8, 6)
    assert kv_cache_bytes(CFG, 2, 8, torch.float32) == sum(t.numel() * 4 for t in cache.keys + cache.values)
    logits, _ = decoded_logits(params, tokens, CFG, prompt=3)
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes", [dict(schedule="1f1b_overlap", remat="full"),
                                     dict(schedule="1f1b_overlap", delay_wgrad=True)], ids=["1f1b_remat", "1f1b_dw"])
def test_schedules_are_bitwise_the_standard_step(changes):
    tokens = torch.randint(0, 40, (6, 9))
    base = fmoe.Plan(model=CFG, microbatches=2, sharding="optim_grads_params")
    params = fmoe.init(base, seed=0)
    want = fmoe.step(params, {"tokens": tokens}, base)
    assert_same_step(fmoe.step(params, {"tokens": tokens}, base.replace(**changes)), want)


def test_the_compiled_step_matches_the_eager_one():
    params = ref.random_params(CFG, dtype=torch.float32)
    b = {"tokens": torch.randint(0, 40, (4, 11))}
    plan = fmoe.Plan(model=CFG, microbatches=2)
    eager = fmoe.step(params, b, plan)
    compiled = fmoe.step(params, b, plan.replace(compile=True))
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-6, atol=1e-6)
    ref.assert_trees_close(compiled.grads, eager.grads, rtol=1e-5, atol=1e-6)


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
