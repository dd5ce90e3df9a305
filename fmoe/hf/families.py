"""The Hugging Face MoE families fmoe reads and writes: config translation.

Each family is a ``model_type`` of ``config.json``: ``mixtral``, ``qwen3_moe``,
``olmoe`` and ``qwen2_moe``. ``to_model_config`` turns a ``config.json`` dict into a
ModelConfig, refusing (ValueError naming the key) anything fmoe would compute
differently; ``to_hf_config`` is its inverse for ``fmoe.hf.save``.
"""

from __future__ import annotations

from ..config import ModelConfig

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
_HF_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
# Fields of a ModelConfig that say how to train, not what the model computes: a plan
# may set them freely over a Hugging Face checkpoint.
TRAINING_FIELDS = ("glu_interleave", "pad_multiple", "capacity_factor", "aux_loss_coef", "z_loss_coef",
                   "expert_bias_rate", "init_std", "prob_placement")


def _fail(where: str, key: str, value, why: str):
    raise ValueError(f"{where}: {key}={value!r} is not supported: {why}")


def _require(hf: dict, where: str, *keys: str):
    """The first of ``keys`` the config has (transformers renamed some over releases)."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ValueError(f"{where}: no {' or '.join(map(repr, keys))}")


def rope_theta(hf: dict, where: str) -> float:
    """RoPE's base from either form: top-level ``rope_theta`` (released files) or
    ``rope_parameters`` (written by transformers >= 5); scaled RoPE is refused."""
    params = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling"):
        _fail(where, "rope_scaling", hf["rope_scaling"], "fmoe implements unscaled RoPE only")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        _fail(where, "rope_parameters.rope_type", kind, "fmoe implements unscaled ('default') RoPE only")
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        _fail(where, "partial_rotary_factor", params.get("partial_rotary_factor", hf.get("partial_rotary_factor")),
              "fmoe rotates every feature of a head")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: neither 'rope_theta' nor 'rope_parameters.rope_theta'")
    return float(theta)


def _check_unsupported(hf: dict, family: str, where: str) -> None:
    if hf.get("sliding_window") and (family == "mixtral" or hf.get("use_sliding_window")):
        _fail(where, "sliding_window", hf["sliding_window"], "fmoe attends to the whole causal prefix; set it to null")
    if hf.get("router_jitter_noise"):
        _fail(where, "router_jitter_noise", hf["router_jitter_noise"], "fmoe routes without noise; set it to 0")
    if hf.get("attention_bias"):
        _fail(where, "attention_bias", True, "fmoe's output projection has no bias")
    if hf.get("clip_qkv") is not None:
        _fail(where, "clip_qkv", hf["clip_qkv"], "fmoe does not clamp q/k/v; set it to null")
    if hf.get("mlp_only_layers"):
        _fail(where, "mlp_only_layers", hf["mlp_only_layers"], "every fmoe layer is a MoE layer")
    if hf.get("decoder_sparse_step", 1) != 1:
        _fail(where, "decoder_sparse_step", hf["decoder_sparse_step"], "every fmoe layer is a MoE layer (use 1)")
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        _fail(where, "layer_types", sorted(kinds), "fmoe layers use full causal attention")
    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        _fail(where, "hidden_act", act, "allowed: " + ", ".join(repr(a) for a in _ACTIVATIONS))


def to_model_config(hf: dict, where: str = "config.json") -> ModelConfig:
    """A ModelConfig computing what the Hugging Face model of ``hf`` computes.

    Arguments:
        hf: the parsed ``config.json``.
        where: how errors name the file.

    Returns:
        A ModelConfig with ``expert_bias_rate=0`` (these families have no expert bias)
        and the aux-loss coefficient the model trained with (0 unless it output router logits).
    """
    family = hf.get("model_type")
    if family not in FAMILIES:
        _fail(where, "model_type", family, "allowed: " + ", ".join(repr(f) for f in FAMILIES))
    _check_unsupported(hf, family, where)
    dim, heads = _require(hf, where, "hidden_size"), _require(hf, where, "num_attention_heads")
    head_dim = hf.get("head_dim") or dim // heads
    shared = family == "qwen2_moe"
    ffn_key = "intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size"
    fields = dict(
        vocab=_require(hf, where, "vocab_size"), dim=dim, layers=_require(hf, where, "num_hidden_layers"),
        heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=0 if head_dim * heads == dim else head_dim,
        experts=_require(hf, where, "num_local_experts", "num_experts"),
        topk=_require(hf, where, "num_experts_per_tok"),
        ffn=_require(hf, where, ffn_key), activation=_ACTIVATIONS[hf.get("hidden_act", "silu")],
        score_func="softmax", norm_topk_prob=True if family == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family, "none"),
        qkv_bias=shared and bool(hf.get("qkv_bias", True)),
        shared_ffn=_require(hf, where, "shared_expert_intermediate_size") if shared else 0, shared_gate=shared,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(hf, where),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
        expert_bias_rate=0.0,
    )
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def family_of(cfg: ModelConfig, where: str = "fmoe.hf.save") -> str:
    """The family whose released layout computes what ``cfg`` computes (ValueError naming
    the ModelConfig field that none of them has)."""
    for name, value, ok in (("activation", cfg.activation, cfg.activation in _HF_ACTIVATIONS),
                            ("score_func", cfg.score_func, cfg.score_func == "softmax"),
                            ("expert_biases", cfg.expert_biases, not cfg.expert_biases),
                            ("expert_groups", cfg.expert_groups, cfg.expert_groups == 1),
                            ("routed_scaling", cfg.routed_scaling, cfg.routed_scaling == 1.0),
                            ("rope_fraction", cfg.rope_fraction, cfg.rope_fraction == 1.0)):
        if not ok:
            _fail(where, f"ModelConfig.{name}", value, "the Hugging Face MoE families have no such variant")
    if cfg.shared_ffn and not cfg.shared_gate:
        _fail(where, "ModelConfig.shared_gate", False, "a shared expert is written as Qwen2-MoE's, which is gated")
    if cfg.qk_norm == "head":
        family = "qwen3_moe"
    elif cfg.qk_norm == "full":
        family = "olmoe"
    elif cfg.shared_ffn:
        family = "qwen2_moe"
    else:
        family = "mixtral"
    if (cfg.shared_ffn > 0) != (family == "qwen2_moe"):
        _fail(where, "ModelConfig.shared_ffn", cfg.shared_ffn, f"{family} has no shared expert")
    if cfg.qkv_bias and family != "qwen2_moe":
        _fail(where, "ModelConfig.qkv_bias", True, f"{family} has no q/k/v bias (Qwen2-MoE, with a gated shared "
              "expert, has)")
    if family == "mixtral" and not cfg.norm_topk_prob:
        _fail(where, "ModelConfig.norm_topk_prob", False, "Mixtral always renormalises the top-k probabilities")
    return family


def to_hf_config(cfg: ModelConfig, family: str, dtype: str) -> dict:
    """``config.json`` for ``cfg`` written as ``family``, as ``from_pretrained`` reads it."""
    hf = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": _HF_ACTIVATIONS[cfg.activation], "num_experts_per_tok": cfg.topk,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "output_router_logits": cfg.aux_loss_coef > 0, "router_aux_loss_coef": cfg.aux_loss_coef,
        "max_position_embeddings": 32768, "initializer_range": cfg.init_std, "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,
    }
    if family == "mixtral":
        hf.update(num_local_experts=cfg.experts, intermediate_size=cfg.ffn, sliding_window=None,
                  router_jitter_noise=0.0)
    else:
        hf.update(num_experts=cfg.experts, norm_topk_prob=cfg.norm_topk_prob)
        if family == "olmoe":
            hf.update(intermediate_size=cfg.ffn, clip_qkv=None)
        else:
            hf.update(moe_intermediate_size=cfg.ffn, intermediate_size=cfg.ffn, decoder_sparse_step=1,
                      mlp_only_layers=[], use_sliding_window=False, sliding_window=None)
    if family == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=cfg.shared_ffn, qkv_bias=cfg.qkv_bias)
    return hf
