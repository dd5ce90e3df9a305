"""Full-size models to plan for (``python -m fmoe.plan --model NAME``): the released
configurations' shapes as ModelConfig fields. Planning needs shapes only; nothing here
is allocated."""

MODELS = {
    # Qwen3-235B-A22B: 94 layers of 128 experts (top 8, width 1536), GQA 64 / 4 heads of 128
    "qwen3-235b": dict(vocab=151936, dim=4096, layers=94, heads=64, kv_heads=4, head_size=128, qk_norm="head",
                       experts=128, topk=8, ffn=1536, norm_topk_prob=True, rope_theta=1e6, norm_eps=1e-6),
    # DeepSeek-V3 (671B, 37B active): multi-head latent attention, 3 dense layers, 256 routed experts
    # top 8 in 8 groups (top 4 groups), one shared expert
    "deepseek-v3": dict(vocab=129280, dim=7168, layers=61, heads=128, head_size=192, kv_lora_rank=512,
                        q_lora_rank=1536, rope_head_dim=64, v_head_size=128, experts=256, topk=8, ffn=2048,
                        shared_ffn=2048, dense_layers=(0, 1, 2), dense_ffn=18432, score_func="sigmoid",
                        expert_groups=8, topk_groups=4, routed_scaling=2.5, norm_topk_prob=True),
}
