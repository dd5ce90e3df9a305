"""Each model feature through the same properties, one process: the loss and every
gradient against the float64 reference (rows and packed documents), cached decoding
against the full forward, the overlap schedule with whole-layer remat or delayed weight
gradients bitwise the standard step under ZeRO-3, and the compiled step against the
eager one. What is a feature's own (its modules against transformers', its layout, its
bad configs) stays in its file; the same features across ranks: ``ranks/test_model_features.py``."""

import optree
import pytest
import torch

import fmoe
from fmoe import layers
from fmoe.batch import IGNORE
from fmoe.layers import forward

from . import reference as ref
from .ranks.workloads import OSS_CFG
from .test_generate import decoded_logits
from .test_layers import assert_same_fwd_bwd
from .test_schedule import assert_same_step

SMALL = dict(vocab=40, dim=32, layers=3, heads=4, kv_heads=2, experts=4, topk=2, ffn=16)
FEATURES = {
    # DeepSeek-V3's pieces: a low-rank query, a latent of its own width, value heads narrower
    # than the q/k heads, interleaved RoPE pairs, YaRN with the softmax correction, a dense
    # first layer and grouped sigmoid routing
    "mla": fmoe.ModelConfig(vocab=40, dim=32, layers=3, heads=4, head_size=12, kv_lora_rank=16, q_lora_rank=8,
                            rope_head_dim=4, v_head_size=6, rope_interleave=True, experts=4, topk=2, ffn=16,
                            dense_layers=(0,), dense_ffn=24, score_func="sigmoid", expert_groups=2, topk_groups=1,
                            routed_scaling=2.5, shared_ffn=16, rope_scaling="yarn", rope_factor=4.0,
                            rope_original_max=4, yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
    # GPT-OSS's attention: sinks and sliding-window layers
    "sinks_window": fmoe.ModelConfig(**SMALL, attn_sinks=True, sliding_window=3, window_layers=(0, 2)),
    # GPT-OSS whole: biases everywhere, top-k softmax routing, the clamped GLU, interleaved
    "gpt_oss": OSS_CFG,
    # GLM-4.5: group-limited routing with a scaled top-k, partial RoPE, q/k/v biases
    "grouped_route_partial_rope": fmoe.ModelConfig(**SMALL | dict(experts=8, topk=3), score_func="sigmoid",
                                                   expert_groups=4, topk_groups=2, routed_scaling=2.5,
                                                   rope_fraction=0.5, qkv_bias=True),
    # YaRN on whole heads with DeepSeek's mscales (the contexts short: rope_original_max 4)
    "yarn": fmoe.ModelConfig(**SMALL, head_size=12, rope_scaling="yarn", qkv_bias=True, rope_factor=8.0,
                             rope_original_max=4, rope_theta=300.0, yarn_mscale=0.9, yarn_mscale_all_dim=0.7,
                             yarn_beta_fast=8.0),
    # a dense layer beside MoE layers with a shared expert
    "dense_layers": fmoe.ModelConfig(**SMALL, shared_ffn=8, dense_layers=(0,), dense_ffn=24),
}
BOTH = pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
EACH = pytest.mark.parametrize("feature", FEATURES)


def tokens_and_segments(cfg, rows: int, positions: int, packed: bool):
    """Fresh random tokens, and with ``packed`` documents of about five positions."""
    g = torch.Generator().manual_seed(ref.seed_of_this_test())
    tokens = torch.randint(0, cfg.vocab, (rows, positions), generator=g)
    segments = (torch.rand(rows, positions, generator=g) < 0.2).long().cumsum(1) if packed else None
    return tokens, segments


@EACH
@BOTH
def test_loss_and_gradients_match_the_float64_reference(feature, packed):
    cfg = FEATURES[feature]
    params = ref.random_params(cfg)
    tokens, seg = tokens_and_segments(cfg, 2, 11, packed)
    leaves, treedef = optree.tree_flatten(params)
    targets = tokens[:, 1:]
    if packed:  # the reference counts a target only inside its input's document
        targets = targets.masked_fill(seg[:, :-1] != seg[:, 1:], IGNORE)

    def fast(*lv):
        return layers.lm_loss_sum(optree.tree_unflatten(treedef, lv), tokens, cfg, targets_BS=targets,
                                  segments_BS=None if seg is None else seg[:, :-1])[0]

    def slow(*lv):
        return ref.lm_loss_sum(optree.tree_unflatten(treedef, lv), tokens, cfg, segments_BS1=seg)[0]

    assert_same_fwd_bwd(fast, slow, leaves)


@EACH
def test_cached_decode_equals_the_full_forward(feature):
    cfg = FEATURES[feature]
    params = ref.random_params(cfg, dtype=torch.float32)
    tokens, _ = tokens_and_segments(cfg, 2, 9, False)
    full, _ = forward(params, tokens, cfg)
    # past a window the cache keeps the old keys and the mask hides them
    logits, _ = decoded_logits(params, tokens, cfg, prompt=4)
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


@EACH
@pytest.mark.parametrize("changes", [dict(schedule="1f1b_overlap", remat="full"),
                                     dict(schedule="1f1b_overlap", delay_wgrad=True)], ids=["1f1b_remat", "1f1b_dw"])
def test_schedules_are_bitwise_the_standard_step_under_zero3(feature, changes):
    cfg = FEATURES[feature]
    tokens, _ = tokens_and_segments(cfg, 6, 9, False)
    base = fmoe.Plan(model=cfg, microbatches=2, sharding="optim_grads_params")
    params = fmoe.init(base, seed=0)
    want = fmoe.step(params, {"tokens": tokens}, base)
    assert_same_step(fmoe.step(params, {"tokens": tokens}, base.replace(**changes)), want)


# packed documents once, where the window meets the documents' masks in the compiled attention
@pytest.mark.parametrize("feature,packed", [(f, False) for f in FEATURES] + [("sinks_window", True)])
def test_the_compiled_step_matches_the_eager_one(feature, packed):
    cfg = FEATURES[feature]
    params = ref.random_params(cfg, dtype=torch.float32)
    tokens, seg = tokens_and_segments(cfg, 4, 13, packed)
    batch = {"tokens": tokens} if seg is None else {"tokens": tokens, "segments": seg}
    plan = fmoe.Plan(model=cfg, microbatches=2)
    eager = fmoe.step(params, batch, plan)
    compiled = fmoe.step(params, batch, plan.replace(compile=True))
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-6, atol=1e-6)
    # fp32 sums reassociated by the compiled kernels: over 60 random batches of the windowed
    # model each leaf stayed within 6.2e-6 of its largest gradient (the embedding's: 1.6e-6
    # absolute, past a fixed 1e-6, which failed twice)
    ref.assert_trees_close(compiled.grads, eager.grads, rtol=1e-5, atol_of_scale=2e-5)
