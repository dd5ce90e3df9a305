"""The Hugging Face MoE families fmoe reads and writes: config translation.

Each family is a ``model_type`` of ``config.json``: ``mixtral``, ``qwen3_moe``,
``olmoe``, ``qwen2_moe``, ``glm4_moe`` (GLM-4.5: sigmoid group-limited routing with
a selection bias, routed scaling, a shared expert, dense first layers, partial RoPE),
``deepseek_v3`` (the same MoE under multi-head latent attention with YaRN RoPE) and
``gpt_oss`` (GPT-OSS: softmax over the top-k router logits with a router bias, expert
and attention biases, the clamped SwiGLU, attention sinks, sliding-window layers,
YaRN). ``to_model_config`` turns a ``config.json`` dict into a ModelConfig, refusing
(ValueError naming the key) anything fmoe would compute differently; ``to_hf_config``
is its inverse for ``fmoe.hf.save``.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..config_fields import Activation, QkNorm, ScoreFunc
from .config_keys import check_fields, fail, model_config, require, yarn_fields
from .gpt_oss import gpt_oss_family, gpt_oss_fields, gpt_oss_hf_config

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# the families with DeepSeek-V3's MoE: sigmoid group-limited routing, a selection bias
# (``e_score_correction_bias``), routed scaling, shared experts, dense first layers
DEEPSEEK_MOE = ("glm4_moe", "deepseek_v3")
# the families whose routers hold a selection bias
WITH_EXPERT_BIAS = DEEPSEEK_MOE
# the families (besides gpt_oss, read on its own) that may scale RoPE with YaRN
WITH_YARN = ("deepseek_v3",)
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
_HF_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
# Fields of a ModelConfig that say how to train, not what the model computes: a plan
# may set them freely over a Hugging Face checkpoint.
TRAINING_FIELDS = ("glu_interleave", "pad_multiple", "capacity_factor", "aux_loss_coef", "z_loss_coef",
                   "expert_bias_rate", "init_std", "prob_placement")


def training_fields(cfg: ModelConfig) -> tuple[str, ...]:
    """The ``TRAINING_FIELDS`` a plan may change over a checkpoint whose model is ``cfg``:
    all of them, but ``prob_placement`` where the experts have an fc2 bias (GPT-OSS),
    since where the probability scales that bias changes what the model computes."""
    if cfg.expert_biases:
        return tuple(f for f in TRAINING_FIELDS if f != "prob_placement")
    return TRAINING_FIELDS


def rope(hf: dict, where: str, family: str) -> dict:
    """RoPE's ModelConfig fields from either form: top-level ``rope_theta`` /
    ``partial_rotary_factor`` / ``rope_scaling`` (released files) or ``rope_parameters``
    (written by transformers >= 5): the base, the fraction of each head it rotates and,
    for the families in ``WITH_YARN``, YaRN's settings; any other scaling is refused."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    kind, key = params.get("rope_type", params.get("type", "default")), "rope_parameters.rope_type"
    if scaling and kind == "default":  # the released form: the scaling beside a top-level theta
        params.update(scaling)
        kind, key = scaling.get("rope_type", scaling.get("type", "default")), "rope_scaling"
    allowed = ("default", "yarn") if family in WITH_YARN else ("default",)
    if kind not in allowed:
        fail(where, key, kind, f"{family}: allowed: {', '.join(map(repr, allowed))}")
    default = 0.5 if family == "glm4_moe" else 1.0  # as transformers' Glm4MoeConfig fills it in
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: neither 'rope_theta' nor 'rope_parameters.rope_theta'")
    fields = dict(rope_theta=float(theta),
                  rope_fraction=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default))))
    return fields if kind == "default" else {**fields, **yarn_fields(params, hf, where, key.split(".")[0])}


def fp8_block(hf: dict, where: str) -> tuple[int, int] | None:
    """The block of a checkpoint released in FP8 (``quantization_config``: ``quant_method
    'fp8'``, E4M3, ``weight_block_size``), whose weights load dequantised; None for one
    in plain floats. Other quantisations are refused by name."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "mxfp4" and hf.get("model_type") == "gpt_oss":
        return None  # GPT-OSS's experts as released (``mxfp4``); its other weights are plain floats
    if method != "fp8":
        fail(where, "quantization_config.quant_method", method, "fmoe reads 'fp8' (E4M3 with block scales) "
              "checkpoints, GPT-OSS's 'mxfp4' experts, or plain floats")
    if q.get("fmt", "e4m3") != "e4m3":
        fail(where, "quantization_config.fmt", q["fmt"], "allowed: 'e4m3'")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        fail(where, "quantization_config.weight_block_size", block, "must be [rows, columns] of positive ints")
    return tuple(block)


def mxfp4(hf: dict) -> bool:
    """Whether the checkpoint's experts are released in MXFP4 (``quantization_config``
    ``quant_method 'mxfp4'``, GPT-OSS's), stored as ``*_blocks`` and ``*_scales`` that
    load dequantised (``fp8_block`` refuses MXFP4 in the other families)."""
    return (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dense_layers(hf: dict, family: str) -> tuple[int, ...]:
    """The layers whose MLP is dense: GLM's and DeepSeek's first ``first_k_dense_replace``; Qwen's
    ``mlp_only_layers`` and those ``decoder_sparse_step`` skips."""
    layers = hf.get("num_hidden_layers") or 0
    if family in DEEPSEEK_MOE:
        default = 1 if family == "glm4_moe" else 3  # as transformers' configs fill it in
        return tuple(range(min(int(hf.get("first_k_dense_replace", default)), layers)))
    if family in ("qwen3_moe", "qwen2_moe"):
        step, only = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
        return tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return ()


def _check_unsupported(hf: dict, family: str, where: str) -> None:
    if hf.get("sliding_window") and (family == "mixtral" or hf.get("use_sliding_window")):
        fail(where, "sliding_window", hf["sliding_window"], "fmoe attends to the whole causal prefix; set it to null")
    if hf.get("router_jitter_noise"):
        fail(where, "router_jitter_noise", hf["router_jitter_noise"], "fmoe routes without noise; set it to 0")
    if hf.get("attention_bias") and family != "glm4_moe":  # GLM's bias is on q/k/v only, as fmoe's qkv_bias
        fail(where, "attention_bias", True, f"fmoe's {family} projections have no bias")
    if family == "deepseek_v3":
        _check_deepseek(hf, where)
    if hf.get("clip_qkv") is not None:
        fail(where, "clip_qkv", hf["clip_qkv"], "fmoe does not clamp q/k/v; set it to null")
    if family in DEEPSEEK_MOE and hf.get("n_shared_experts", 1) < 1:
        fail(where, "n_shared_experts", hf["n_shared_experts"], "fmoe's GLM-4.5 layers have a shared expert")
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        fail(where, "layer_types", sorted(kinds), "fmoe layers use full causal attention")
    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        fail(where, "hidden_act", act, "allowed: " + ", ".join(repr(a) for a in _ACTIVATIONS))


def _check_deepseek(hf: dict, where: str) -> None:
    """What of a DeepSeek-V3 config fmoe computes otherwise, by key, before any weight is read."""
    if hf.get("q_lora_rank") and not hf.get("kv_lora_rank"):
        fail(where, "kv_lora_rank", hf.get("kv_lora_rank"), "q_lora_rank is set: multi-head latent attention "
              "needs kv_lora_rank > 0 too")
    experts, groups = hf.get("n_routed_experts"), hf.get("n_group") or 1
    if isinstance(experts, int) and (not isinstance(groups, int) or groups < 1 or experts % groups):
        fail(where, "n_group", groups, f"must divide n_routed_experts ({experts})")
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        fail(where, "num_key_value_heads", hf["num_key_value_heads"], f"multi-head latent attention gives every "
              f"head its own key and value: must equal num_attention_heads ({heads})")
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, allowed) != allowed:
            fail(where, key, hf[key], f"fmoe computes DeepSeek-V3's {allowed!r}")


def to_model_config(hf: dict, where: str = "config.json") -> ModelConfig:
    """A ModelConfig computing what the Hugging Face model of ``hf`` computes.

    Arguments:
        hf: the parsed ``config.json``.
        where: how errors name the file.

    Returns:
        A ModelConfig with ``expert_bias_rate=0`` (a loaded model's expert bias, if its
        family has one, stays as released unless the run sets a rate) and the aux-loss
        coefficient the model trained with (0 unless it output router logits).
    """
    family = hf.get("model_type")
    if family not in FAMILIES:
        fail(where, "model_type", family, "allowed: " + ", ".join(repr(f) for f in FAMILIES))
    if family == "gpt_oss":
        fp8_block(hf, where)  # refused here, before any weight is read
        return model_config(gpt_oss_fields(hf, where), where)
    _check_unsupported(hf, family, where)
    fp8_block(hf, where)
    dim, heads = require(hf, where, "hidden_size"), require(hf, where, "num_attention_heads")
    head_dim = hf.get("head_dim") or dim // heads
    shared = family == "qwen2_moe"
    ffn_key = "intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size"
    dense = dense_layers(hf, family)
    fields = dict(
        vocab=require(hf, where, "vocab_size"), dim=dim, layers=require(hf, where, "num_hidden_layers"),
        heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=0 if head_dim * heads == dim else head_dim,
        experts=require(hf, where, "num_local_experts", "num_experts", "n_routed_experts"),
        topk=require(hf, where, "num_experts_per_tok"),
        ffn=require(hf, where, ffn_key), activation=_ACTIVATIONS[hf.get("hidden_act", "silu")],
        score_func="softmax", norm_topk_prob=True if family == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family, "none"),
        qkv_bias=shared and bool(hf.get("qkv_bias", True)),
        shared_ffn=require(hf, where, "shared_expert_intermediate_size") if shared else 0, shared_gate=shared,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), **rope(hf, where, family),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
        expert_bias_rate=0.0, dense_layers=dense, dense_ffn=require(hf, where, "intermediate_size") if dense else 0,
    )
    if family in DEEPSEEK_MOE:
        fields.update(score_func="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                      shared_ffn=fields["ffn"] * int(hf.get("n_shared_experts", 1)),
                      expert_groups=int(hf.get("n_group", 1)), topk_groups=int(hf.get("topk_group", 1)),
                      routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))
    if family == "glm4_moe":
        fields.update(qk_norm="head" if hf.get("use_qk_norm") else "none", qkv_bias=bool(hf.get("attention_bias")))
    elif family == "deepseek_v3":
        fields.update(_latent_attention(hf, where))
    return model_config(fields, where)


def _latent_attention(hf: dict, where: str) -> dict:
    """DeepSeek-V3's multi-head latent attention as ModelConfig fields."""
    nope, rot = require(hf, where, "qk_nope_head_dim"), require(hf, where, "qk_rope_head_dim")
    return dict(kv_heads=0, head_size=nope + rot, kv_lora_rank=require(hf, where, "kv_lora_rank"),
                q_lora_rank=hf.get("q_lora_rank") or 0, rope_head_dim=rot,
                v_head_size=require(hf, where, "v_head_dim"), rope_interleave=bool(hf.get("rope_interleave", True)))


def _sigmoid_family(cfg: ModelConfig, where: str) -> str:
    """``deepseek_v3`` (multi-head latent attention) or ``glm4_moe`` if one holds ``cfg``:
    sigmoid routing is theirs, with the same MoE (a shared expert a multiple of ffn wide,
    the first layers dense)."""
    first_k = tuple(range(len(cfg.dense_layers)))
    family = "deepseek_v3" if cfg.latent else "glm4_moe"
    checks = [
        ("activation", cfg.activation, cfg.activation_mode is Activation.SWIGLU),
        ("router_bias", cfg.router_bias, not cfg.router_bias),
        ("expert_biases", cfg.expert_biases, not cfg.expert_biases),
        ("out_bias", cfg.out_bias, not cfg.out_bias),
        ("shared_ffn", cfg.shared_ffn, cfg.shared_ffn > 0 and cfg.shared_ffn % cfg.ffn == 0),
        ("shared_gate", cfg.shared_gate, not cfg.shared_gate),
        ("attn_sinks", cfg.attn_sinks, not cfg.attn_sinks),
        ("window_layers", cfg.window_layers, not cfg.window_layers),
        ("dense_layers", cfg.dense_layers, cfg.dense_layers == first_k)]
    if family == "glm4_moe":
        checks += [("qk_norm", cfg.qk_norm, cfg.qk_norm_mode is not QkNorm.FULL),
                   ("rope_scaling", cfg.rope_scaling, cfg.rope_scaling == "none")]
    check_fields(cfg, where, checks, f"score_func='sigmoid' is written as {family} "
                  f"({'multi-head latent attention' if cfg.latent else 'GLM-4.5'}: a shared expert a multiple of "
                  "ffn wide, first layers dense), which has")
    return family


def family_of(cfg: ModelConfig, where: str = "fmoe.hf.save") -> str:
    """The family whose released layout computes what ``cfg`` computes (ValueError naming
    the ModelConfig field that none of them has)."""
    match cfg.score_func_mode:
        case ScoreFunc.SIGMOID:
            return _sigmoid_family(cfg, where)
        case ScoreFunc.TOPK_SOFTMAX:
            return gpt_oss_family(cfg, where)
    check_fields(cfg, where, (
        ("kv_lora_rank", cfg.kv_lora_rank, not cfg.latent),
        ("activation", cfg.activation, cfg.activation in _HF_ACTIVATIONS),
        ("router_bias", cfg.router_bias, not cfg.router_bias),
        ("expert_biases", cfg.expert_biases, not cfg.expert_biases),
        ("out_bias", cfg.out_bias, not cfg.out_bias),
        ("expert_groups", cfg.expert_groups, cfg.expert_groups == 1),
        ("routed_scaling", cfg.routed_scaling, cfg.routed_scaling == 1.0),
        ("rope_fraction", cfg.rope_fraction, cfg.rope_fraction == 1.0),
        ("rope_scaling", cfg.rope_scaling, cfg.rope_scaling == "none"),
        ("attn_sinks", cfg.attn_sinks, not cfg.attn_sinks),
        ("window_layers", cfg.window_layers, not cfg.window_layers)))
    if cfg.shared_ffn and not cfg.shared_gate:
        fail(where, "ModelConfig.shared_gate", False, "a shared expert is written as Qwen2-MoE's, which is gated")
    if cfg.qk_norm_mode is QkNorm.HEAD:
        family = "qwen3_moe"
    elif cfg.qk_norm_mode is QkNorm.FULL:
        family = "olmoe"
    elif cfg.shared_ffn:
        family = "qwen2_moe"
    else:
        family = "mixtral"
    if (cfg.shared_ffn > 0) != (family == "qwen2_moe"):
        fail(where, "ModelConfig.shared_ffn", cfg.shared_ffn, f"{family} has no shared expert")
    if cfg.qkv_bias and family != "qwen2_moe":
        fail(where, "ModelConfig.qkv_bias", True, f"{family} has no q/k/v bias (Qwen2-MoE, with a gated shared "
              "expert, has)")
    if family == "mixtral" and not cfg.norm_topk_prob:
        fail(where, "ModelConfig.norm_topk_prob", False, "Mixtral always renormalises the top-k probabilities")
    if cfg.dense_layers and family not in ("qwen3_moe", "qwen2_moe"):
        fail(where, "ModelConfig.dense_layers", cfg.dense_layers, f"{family} has no dense layers")
    return family


def _longest_context(cfg: ModelConfig) -> int:
    """``max_position_embeddings``: YaRN's extended context (GPT-OSS: 32 x 4096), else 32k."""
    return int(cfg.rope_factor * cfg.rope_original_max) if cfg.rope_scaling == "yarn" else 32768


def _hf_rope(cfg: ModelConfig) -> dict:
    """``rope_parameters`` as transformers >= 5 writes them (YaRN's unset mscales left out)."""
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        params.update(rope_type="yarn", factor=cfg.rope_factor, original_max_position_embeddings=cfg.rope_original_max,
                      beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow, truncate=cfg.yarn_truncate)
        for key, value in (("mscale", cfg.yarn_mscale), ("mscale_all_dim", cfg.yarn_mscale_all_dim),
                           ("attention_factor", cfg.yarn_attention_factor)):
            if value:
                params[key] = value
    return params


def to_hf_config(cfg: ModelConfig, family: str, dtype: str) -> dict:
    """``config.json`` for ``cfg`` written as ``family``, as ``from_pretrained`` reads it.

    Arguments:
        cfg: the ModelConfig (``family_of(cfg)`` holds it).
        family: a name of ``FAMILIES``.
        dtype: the weights' dtype, ``float32 | bfloat16 | float16``.

    Returns:
        The ``config.json`` dict.
    """
    hf = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": _HF_ACTIVATIONS.get(cfg.activation, "silu"), "num_experts_per_tok": cfg.topk,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": _hf_rope(cfg),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "output_router_logits": cfg.aux_loss_coef > 0, "router_aux_loss_coef": cfg.aux_loss_coef,
        "max_position_embeddings": _longest_context(cfg), "initializer_range": cfg.init_std, "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,
    }
    if family == "gpt_oss":
        hf.update(gpt_oss_hf_config(cfg))
    elif family == "mixtral":
        hf.update(num_local_experts=cfg.experts, intermediate_size=cfg.ffn, sliding_window=None,
                  router_jitter_noise=0.0)
    elif family in DEEPSEEK_MOE:
        hf.update(n_routed_experts=cfg.experts, n_shared_experts=cfg.shared_ffn // cfg.ffn,
                  moe_intermediate_size=cfg.ffn, intermediate_size=cfg.dense_ffn or cfg.ffn,
                  first_k_dense_replace=len(cfg.dense_layers), n_group=cfg.expert_groups,
                  topk_group=cfg.topk_groups, routed_scaling_factor=cfg.routed_scaling,
                  norm_topk_prob=cfg.norm_topk_prob, num_nextn_predict_layers=0)
    elif family == "olmoe":
        hf.update(num_experts=cfg.experts, norm_topk_prob=cfg.norm_topk_prob, intermediate_size=cfg.ffn,
                  clip_qkv=None)
    else:
        hf.update(num_experts=cfg.experts, norm_topk_prob=cfg.norm_topk_prob, moe_intermediate_size=cfg.ffn,
                  intermediate_size=cfg.dense_ffn or cfg.ffn, decoder_sparse_step=1,
                  mlp_only_layers=list(cfg.dense_layers), use_sliding_window=False, sliding_window=None)
    if family == "glm4_moe":
        hf.update(use_qk_norm=cfg.qk_norm_mode is QkNorm.HEAD, attention_bias=cfg.qkv_bias,
                  partial_rotary_factor=cfg.rope_fraction)
        hf["rope_parameters"]["partial_rotary_factor"] = cfg.rope_fraction
    elif family == "deepseek_v3":  # transformers' head_dim is the rotated part's
        hf.update(kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
                  qk_rope_head_dim=cfg.rope_head_dim, qk_nope_head_dim=cfg.head_dim - cfg.rope_head_dim,
                  v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave, head_dim=cfg.rope_head_dim)
    if family == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=cfg.shared_ffn, qkv_bias=cfg.qkv_bias)
    return hf


