"""Full-size models to plan for (``python -m fmoe.plan --model NAME``): the released
models' ``config.json`` values (the keys that set a shape or what a layer computes; token
ids, dtypes and such left out), read into ModelConfigs by ``fmoe.hf``'s own mapping
(``to_model_config``), so a planned model is the one ``fmoe.hf.config`` reads from the
checkpoint. Planning needs shapes only; nothing here is allocated.

``RELEASED`` holds the figures the releases state (total and active parameters, in
billions) for the tests that hold the shapes against them.
"""

from __future__ import annotations

import functools

from ..config import ModelConfig
from ..hf.families import to_model_config

_QWEN3 = dict(model_type="qwen3_moe", head_dim=128, hidden_act="silu", decoder_sparse_step=1, mlp_only_layers=[],
              norm_topk_prob=True, num_experts=128, num_experts_per_tok=8, rms_norm_eps=1e-6, rope_scaling=None,
              rope_theta=1000000.0, sliding_window=None, use_sliding_window=False, tie_word_embeddings=False,
              attention_bias=False, output_router_logits=False, router_aux_loss_coef=0.001, vocab_size=151936,
              max_position_embeddings=40960)
_MIXTRAL = dict(model_type="mixtral", hidden_act="silu", num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
                rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, output_router_logits=False,
                vocab_size=32000)
_GPT_OSS = dict(model_type="gpt_oss", attention_bias=True, head_dim=64, hidden_act="silu", hidden_size=2880,
                intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, num_experts_per_tok=4,
                experts_per_token=4, rms_norm_eps=1e-5, sliding_window=128, swiglu_limit=7.0, rope_theta=150000,
                rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                              "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                initial_context_length=4096, max_position_embeddings=131072, tie_word_embeddings=False,
                output_router_logits=False, router_aux_loss_coef=0.9, vocab_size=201088,
                quantization_config={"quant_method": "mxfp4"})
_GLM = dict(model_type="glm4_moe", attention_bias=True, head_dim=128, hidden_act="silu", partial_rotary_factor=0.5,
            norm_topk_prob=True, num_attention_heads=96, num_key_value_heads=8, n_group=1, topk_group=1,
            n_shared_experts=1, routed_scaling_factor=2.5, num_experts_per_tok=8, rms_norm_eps=1e-5,
            rope_theta=1000000, max_position_embeddings=131072, num_nextn_predict_layers=1,
            tie_word_embeddings=False, vocab_size=151552)


def _gpt_oss_layers(layers: int) -> dict:
    # layer_types as released: sliding and full attention alternate, the first sliding
    return dict(num_hidden_layers=layers,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])


CONFIG_JSON = {
    "qwen3-30b-a3b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48),
    "qwen3-235b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                       num_attention_heads=64, num_key_value_heads=4, num_hidden_layers=94),
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_act="silu", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        first_k_dense_replace=3, moe_layer_freq=1, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rms_norm_eps=1e-6, rope_theta=10000, max_position_embeddings=163840,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        num_nextn_predict_layers=1, attention_bias=False, tie_word_embeddings=False, vocab_size=129280,
        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "weight_block_size": [128, 128]}),
    "mixtral-8x7b": dict(_MIXTRAL, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=32, max_position_embeddings=32768,
                         router_aux_loss_coef=0.02),
    "mixtral-8x22b": dict(_MIXTRAL, hidden_size=6144, intermediate_size=16384, num_attention_heads=48,
                          num_key_value_heads=8, num_hidden_layers=56, max_position_embeddings=65536,
                          router_aux_loss_coef=0.001),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_act="silu", hidden_size=2048, intermediate_size=1024,
                        num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=16, num_experts=64,
                        num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None, attention_bias=False,
                        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
                        tie_word_embeddings=False, output_router_logits=False, router_aux_loss_coef=0.01,
                        vocab_size=50304),
    "gpt-oss-20b": dict(_GPT_OSS, num_local_experts=32, **_gpt_oss_layers(24)),
    "gpt-oss-120b": dict(_GPT_OSS, num_local_experts=128, **_gpt_oss_layers(36)),
    "glm-4.5": dict(_GLM, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                    num_hidden_layers=92, n_routed_experts=160, first_k_dense_replace=3, use_qk_norm=True),
    "glm-4.5-air": dict(_GLM, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                        num_hidden_layers=46, n_routed_experts=128, first_k_dense_replace=1, use_qk_norm=False),
}

# (total, active) parameters in billions, as each release states them
RELEASED = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b": (235.0, 22.0), "deepseek-v3": (671.0, 37.0),
            "mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141.0, 39.0), "olmoe-1b-7b": (6.9, 1.3),
            "gpt-oss-20b": (21.0, 3.6), "gpt-oss-120b": (117.0, 5.1), "glm-4.5": (355.0, 32.0),
            "glm-4.5-air": (106.0, 12.0)}


@functools.cache
def model(name: str) -> ModelConfig:
    """The ModelConfig of released model ``name`` (a key of ``CONFIG_JSON``).

    Raises:
        ValueError: naming ``--model`` and the names it takes.
    """
    if name not in CONFIG_JSON:
        raise ValueError(f"--model={name!r} is invalid: must be one of {', '.join(CONFIG_JSON)}")
    return to_model_config(CONFIG_JSON[name], f"--model {name}")


MODELS = tuple(CONFIG_JSON)
