"""GPT-OSS (``gpt_oss``) as a Hugging Face family: its ``config.json`` read into a
ModelConfig (sliding-window layers from ``layer_types``, YaRN with GptOssConfig's
defaults, the clamped SwiGLU), the ModelConfig fields it can hold, and its own keys
written back."""

from __future__ import annotations

from ..checks import is_int, is_number
from ..config import ModelConfig
from ..config_fields import Activation
from ..layers.experts import QUICK_GELU_ALPHA
from .config_keys import check_fields, fail, require, yarn_fields


# GPT-OSS's layer kinds (``layer_types``): whether the layer has the sliding window.
_GPT_OSS_LAYER_KINDS = {"full_attention": False, "sliding_attention": True}
# What GptOssConfig fills in for a config.json without RoPE settings.
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_GPT_OSS_THETA = 150000.0  # GptOssConfig.default_theta


def _gpt_oss_windows(hf: dict, where: str, layers: int) -> tuple[int, tuple]:
    """``sliding_window`` and the layers it applies to (``window_layers``) from
    ``layer_types`` (absent: transformers' default, the even layers slide)."""
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        fail(where, "layer_types", kinds, f"must name one kind per layer (num_hidden_layers={layers})")
    for i, kind in enumerate(kinds):
        if kind not in _GPT_OSS_LAYER_KINDS:
            fail(where, f"layer_types[{i}]", kind, "allowed: " + ", ".join(map(repr, _GPT_OSS_LAYER_KINDS)))
    sliding = tuple(i for i, kind in enumerate(kinds) if _GPT_OSS_LAYER_KINDS[kind])
    if not sliding:
        return 0, ()  # no layer reads the window
    window = hf.get("sliding_window")
    if not (is_int(window) and window > 0):
        fail(where, "sliding_window", window, f"layers {list(sliding)} are 'sliding_attention': it must be an int > 0")
    return window, sliding


def _gpt_oss_rope(hf: dict, where: str) -> dict:
    """The ModelConfig RoPE fields of GPT-OSS, from the released top-level ``rope_scaling``
    (with ``rope_theta``) or transformers >= 5's ``rope_parameters``, read as
    transformers reads them (``rope_scaling`` first; absent keys as GptOssConfig and
    ``_compute_yarn_parameters`` fill them in)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or _GPT_OSS_ROPE
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        fail(where, key, params, "fmoe applies one RoPE to every layer (a dict of rope_type, rope_theta, ...)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", _GPT_OSS_THETA)))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if fraction != 1.0:
        fail(where, "partial_rotary_factor", fraction, "GPT-OSS rotates whole heads")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        fail(where, f"{key}.rope_type", kind, "GPT-OSS's RoPE in fmoe is 'yarn' or unscaled ('default')")
    if params.get("mscale_all_dim"):
        # GptOssAttention keeps the softmax scale at head_dim ** -0.5; fmoe's yarn_mscale_all_dim
        # also rescales it (DeepSeek-V3's correction), so the two would differ
        fail(where, f"{key}.mscale_all_dim", params["mscale_all_dim"], "GPT-OSS's attention does not rescale "
              "its softmax by it; set it to null")
    return dict(rope_theta=theta, **yarn_fields(params, hf, where, key, default_max=131072))  # GptOssConfig's context


def gpt_oss_fields(hf: dict, where: str) -> dict:
    """ModelConfig fields of a ``gpt_oss`` config.json (``hidden_act`` is ignored, as
    GptOssExperts ignores it: its activation is the clamped SwiGLU of ``swiglu_limit``)."""
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        fail(where, "swiglu_alpha", alpha, f"fmoe's quick_geglu gates with sigmoid({QUICK_GELU_ALPHA} * gate)")
    limit = hf.get("swiglu_limit", 7.0)
    if not is_number(limit):
        fail(where, "swiglu_limit", limit, "GPT-OSS's experts clamp: it must be a number")
    dim, heads, layers = (require(hf, where, k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
    head_dim = hf.get("head_dim", 64) or dim // heads  # GptOssConfig's default is 64, not dim / heads
    window, sliding = _gpt_oss_windows(hf, where, layers)
    bias = bool(hf.get("attention_bias", True))  # one switch for q/k/v and o_proj
    return dict(
        vocab=require(hf, where, "vocab_size"), dim=dim, layers=layers, heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads, head_size=0 if head_dim * heads == dim else head_dim,
        experts=require(hf, where, "num_local_experts", "num_experts"),
        topk=require(hf, where, "num_experts_per_tok"),
        ffn=require(hf, where, "intermediate_size"), activation="quick_geglu", glu_limit=float(limit), glu_offset=1.0,
        score_func="topk_softmax", norm_topk_prob=False, router_bias=True, expert_biases=True,
        qkv_bias=bias, out_bias=bias, attn_sinks=True, sliding_window=window, window_layers=sliding,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
        expert_bias_rate=0.0, **_gpt_oss_rope(hf, where))


def gpt_oss_family(cfg: ModelConfig, where: str) -> str:
    """``gpt_oss`` if it holds ``cfg`` (softmax over the top-k logits is GPT-OSS's)."""
    check_fields(cfg, where, (
        ("kv_lora_rank", cfg.kv_lora_rank, not cfg.latent),
        ("activation", cfg.activation, cfg.activation_mode is Activation.QUICK_GEGLU),
        ("glu_offset", cfg.glu_offset, cfg.glu_offset == 1.0),
        ("router_bias", cfg.router_bias, cfg.router_bias),
        ("expert_biases", cfg.expert_biases, cfg.expert_biases),
        ("prob_placement", cfg.prob_placement, cfg.prob_placement == "output"),  # scales the fc2 bias too
        ("attn_sinks", cfg.attn_sinks, cfg.attn_sinks),
        ("out_bias", cfg.out_bias, cfg.out_bias == cfg.qkv_bias),  # one attention_bias for q/k/v and o_proj
        ("qk_norm", cfg.qk_norm, cfg.qk_norm_widths is None),
        ("shared_ffn", cfg.shared_ffn, cfg.shared_ffn == 0),
        ("dense_layers", cfg.dense_layers, not cfg.dense_layers),
        ("expert_groups", cfg.expert_groups, cfg.expert_groups == 1),
        ("routed_scaling", cfg.routed_scaling, cfg.routed_scaling == 1.0),
        ("rope_fraction", cfg.rope_fraction, cfg.rope_fraction == 1.0),
        ("yarn_mscale_all_dim", cfg.yarn_mscale_all_dim, cfg.yarn_mscale_all_dim == 0)),
        "score_func='topk_softmax' is written as gpt_oss (GPT-OSS: the clamped SwiGLU with expert biases, "
        "a router bias, attention sinks, one bias switch for q/k/v and o_proj), which has")
    # norm_topk_prob may be either: the softmax over the k logits already sums to 1
    return "gpt_oss"


def gpt_oss_hf_config(cfg: ModelConfig) -> dict:
    """``gpt_oss``'s own keys (``hidden_act`` stays ``silu``, GptOssConfig's name for
    what its experts ignore)."""
    kinds = ["sliding_attention" if i in cfg.window_layers else "full_attention" for i in range(cfg.layers)]
    return dict(num_local_experts=cfg.experts, intermediate_size=cfg.ffn, swiglu_limit=cfg.glu_limit,
                swiglu_alpha=QUICK_GELU_ALPHA, attention_bias=cfg.qkv_bias, layer_types=kinds,
                sliding_window=cfg.sliding_window or None)
