"""The checks behind every ``ModelConfig``'s ValueError: each field's type and range,
and the fields against each other (heads and widths, expert groups, latent attention,
RoPE and YaRN, dense and windowed layers, the GLU layout), named as ``ModelConfig.<field>``."""

from __future__ import annotations

import dataclasses
import math

from .checks import check_bool, check_int, check_positive, fail, is_int, is_number
from .config_fields import _check_choices


def check_model_config(cfg) -> None:
    """Raise ``ValueError`` naming the first field of ``cfg`` (a ModelConfig) that is out
    of range or disagrees with another."""
    own = "ModelConfig"
    for name in ("vocab", "dim", "layers", "heads", "experts", "topk", "ffn"):
        check_int(f"{own}.{name}", getattr(cfg, name), 1, builtin=True)
    check_int(f"{own}.shared_ffn", cfg.shared_ffn, 0, builtin=True)
    check_int(f"{own}.glu_interleave", cfg.glu_interleave, 0, builtin=True)
    check_int(f"{own}.kv_heads", cfg.kv_heads, 0, builtin=True)
    check_int(f"{own}.head_size", cfg.head_size, 0, builtin=True)
    check_int(f"{own}.expert_groups", cfg.expert_groups, 1, builtin=True)
    check_int(f"{own}.topk_groups", cfg.topk_groups, 1, builtin=True)
    _check_choices(cfg, own)
    for name in ("qkv_bias", "out_bias", "tie_embeddings", "shared_gate", "norm_topk_prob", "expert_biases",
                 "router_bias", "attn_sinks", "rope_interleave"):
        check_bool(f"{own}.{name}", getattr(cfg, name))
    check_positive(f"{own}.glu_limit", cfg.glu_limit, allow_inf=True)  # inf: no clamp
    for name in ("rope_theta", "norm_eps", "init_std", "routed_scaling", "rope_fraction"):
        check_positive(f"{own}.{name}", getattr(cfg, name))
    for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate", "capacity_factor"):
        check_positive(f"{own}.{name}", getattr(cfg, name), allow_zero=True)
    if not is_number(cfg.glu_offset, builtin=True) or not math.isfinite(cfg.glu_offset):
        fail(f"{own}.glu_offset", cfg.glu_offset, "must be a finite number")
    if cfg.topk > cfg.experts:
        fail(f"{own}.topk", cfg.topk, f"must be <= experts ({cfg.experts})")
    if cfg.head_size == 0 and cfg.dim % cfg.heads:
        fail(f"{own}.dim", cfg.dim, f"must be divisible by heads ({cfg.heads}) unless head_size is set")
    if cfg.head_dim % 2 and not cfg.kv_lora_rank:  # MLA rotates its rope_head_dim part only
        what = "head_size" if cfg.head_size else "heads"
        fail(f"{own}.{what}", getattr(cfg, what), f"the head size must be even for RoPE (got {cfg.head_dim})")
    _check_groups(cfg)
    _check_latent_attention(cfg)
    _check_rope_fraction(cfg)
    _check_rope_scaling(cfg)
    if cfg.kv_heads and cfg.heads % cfg.kv_heads:
        fail(f"{own}.kv_heads", cfg.kv_heads, f"must divide heads ({cfg.heads}), or be 0 for kv_heads = heads")
    _check_dense_layers(cfg, own)
    _check_window(cfg, own)
    if cfg.shared_gate and not cfg.shared_ffn:
        fail(f"{own}.shared_gate", cfg.shared_gate, "needs a shared expert (shared_ffn > 0)")
    if cfg.glu_interleave:
        if not cfg.is_glu:
            fail(f"{own}.glu_interleave", cfg.glu_interleave,
                  f"must be 0 for the non-GLU activation {cfg.activation!r}")
        for name in ("ffn", "shared_ffn"):
            width = getattr(cfg, name)
            if width % cfg.glu_interleave:
                fail(f"{own}.glu_interleave", cfg.glu_interleave,
                      f"must divide {name} ({width})")


def _check_layer_indices(cfg, own: str, name: str) -> tuple:
    """``cfg.<name>``, a tuple of distinct layer indices in order, or a ValueError naming it."""
    layers = getattr(cfg, name)
    ok = isinstance(layers, tuple) and all(is_int(i, builtin=True) and 0 <= i < cfg.layers for i in layers)
    if not ok or tuple(sorted(set(layers))) != layers:
        fail(f"{own}.{name}", layers, f"must be distinct layer indices in 0..{cfg.layers - 1}, in order")
    return layers


def _check_dense_layers(cfg, own: str) -> None:
    layers = _check_layer_indices(cfg, own, "dense_layers")
    if len(layers) == cfg.layers:
        fail(f"{own}.dense_layers", layers, f"must leave at least one of the {cfg.layers} layers MoE")
    check_int(f"{own}.dense_ffn", cfg.dense_ffn, 0, builtin=True)
    if bool(layers) != bool(cfg.dense_ffn):
        fail(f"{own}.dense_ffn", cfg.dense_ffn, "must be > 0 exactly when dense_layers names a layer "
             f"(dense_layers={list(layers)})")
    if cfg.glu_interleave and cfg.dense_ffn % cfg.glu_interleave:
        fail(f"{own}.glu_interleave", cfg.glu_interleave, f"must divide dense_ffn ({cfg.dense_ffn})")


def _check_window(cfg, own: str) -> None:
    layers = _check_layer_indices(cfg, own, "window_layers")
    check_int(f"{own}.sliding_window", cfg.sliding_window, 0, builtin=True)
    if bool(layers) != bool(cfg.sliding_window):
        fail(f"{own}.sliding_window", cfg.sliding_window, "must be > 0 exactly when window_layers names a layer "
             f"(window_layers={list(layers)})")


_YARN_FIELDS = ("rope_factor", "rope_original_max", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
                "yarn_mscale_all_dim", "yarn_attention_factor", "yarn_truncate")


def _check_groups(cfg) -> None:
    own, groups = "ModelConfig", cfg.expert_groups
    if cfg.experts % groups:
        fail(f"{own}.expert_groups", groups, f"must divide experts ({cfg.experts})")
    if cfg.topk_groups > groups:
        fail(f"{own}.topk_groups", cfg.topk_groups, f"must be <= expert_groups ({groups})")
    if groups == 1:
        return
    per_group = cfg.experts // groups
    if per_group < 2:  # a group's score is the sum of its 2 best experts'
        fail(f"{own}.expert_groups", groups, f"must leave at least 2 experts a group (experts={cfg.experts})")
    if cfg.topk > cfg.topk_groups * per_group:
        fail(f"{own}.topk_groups", cfg.topk_groups,
             f"keeps {cfg.topk_groups * per_group} experts ({per_group} a group), fewer than topk ({cfg.topk})")

def _check_latent_attention(cfg) -> None:
    own = "ModelConfig"
    for name in ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_size"):
        check_int(f"{own}.{name}", getattr(cfg, name), 0, builtin=True)
    if not cfg.kv_lora_rank:
        for name in ("q_lora_rank", "rope_head_dim", "v_head_size"):
            if getattr(cfg, name):
                fail(f"{own}.{name}", getattr(cfg, name), "is read only with multi-head latent attention "
                                                           "(kv_lora_rank > 0): leave it 0")
        return
    if cfg.kv_heads:
        fail(f"{own}.kv_heads", cfg.kv_heads, "must be 0 with multi-head latent attention (kv_lora_rank > 0): "
                                               "every head has its own key and value")
    if cfg.qkv_bias or cfg.qk_norm_widths is not None:
        what = "qkv_bias" if cfg.qkv_bias else "qk_norm"
        fail(f"{own}.{what}", getattr(cfg, what), "belongs to the qkv projection, which multi-head latent "
                                                   "attention (kv_lora_rank > 0) does not have")
    if cfg.rope_fraction != 1.0:
        fail(f"{own}.rope_fraction", cfg.rope_fraction, "must stay 1 with multi-head latent attention: "
                                                         "rope_head_dim says which features rotate")
    if not 0 < cfg.rope_head_dim < cfg.head_dim or cfg.rope_head_dim % 2:
        fail(f"{own}.rope_head_dim", cfg.rope_head_dim, f"must be even, > 0 and < the q/k head size "
                                                         f"({cfg.head_dim}) with kv_lora_rank > 0")

def _check_rope_fraction(cfg) -> None:
    own = "ModelConfig.rope_fraction"
    if cfg.rope_fraction > 1:
        fail(own, cfg.rope_fraction, "must be in (0, 1]")
    if cfg.rope_dims == 0 or cfg.rope_dims % 2:
        fail(own, cfg.rope_fraction, f"must give an even, nonzero rope_dims = int(head_dim * rope_fraction) "
                                      f"(head_dim {cfg.head_dim}: {cfg.rope_dims})")

def _check_rope_scaling(cfg) -> None:
    own = "ModelConfig"
    check_bool(f"{own}.yarn_truncate", cfg.yarn_truncate)
    check_int(f"{own}.rope_original_max", cfg.rope_original_max, 0, builtin=True)
    for name in ("yarn_beta_fast", "yarn_beta_slow"):
        check_positive(f"{own}.{name}", getattr(cfg, name))
    for name in ("yarn_mscale", "yarn_mscale_all_dim", "yarn_attention_factor"):
        check_positive(f"{own}.{name}", getattr(cfg, name), allow_zero=True)
    check_positive(f"{own}.rope_factor", cfg.rope_factor)
    if cfg.rope_scaling == "none":
        # a YaRN setting without rope_scaling='yarn' would be silently ignored
        for field in dataclasses.fields(cfg):
            if field.name in _YARN_FIELDS and getattr(cfg, field.name) != field.default:
                fail(f"{own}.{field.name}", getattr(cfg, field.name),
                     f"is read only with rope_scaling='yarn' (is 'none'): leave it at {field.default!r}")
        return
    if cfg.rope_factor < 1:
        fail(f"{own}.rope_factor", cfg.rope_factor, "must be >= 1 with rope_scaling='yarn'")
    if cfg.rope_original_max < 1:
        fail(f"{own}.rope_original_max", cfg.rope_original_max,
             "must be an int >= 1 with rope_scaling='yarn' (original_max_position_embeddings)")
    if cfg.yarn_beta_fast < cfg.yarn_beta_slow:
        fail(f"{own}.yarn_beta_fast", cfg.yarn_beta_fast, f"must be >= yarn_beta_slow ({cfg.yarn_beta_slow})")
