"""fmoe.hf against transformers: tiny random Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5
(glm4_moe), DeepSeek-V3 and GPT-OSS (gpt_oss) models saved with ``save_pretrained``,
loaded into fmoe, and written back."""

import json
from pathlib import Path

import optree
import pytest
import torch

import fmoe
from fmoe.layers import forward

from .reference import assert_trees_equal

ROOT = Path(__file__).resolve().parents[1]

transformers = pytest.importorskip("transformers")

GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=16)),
    # a head size of its own (16, not 32 / 4) and renormalised top-k
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, head_dim=16, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, intermediate_size=16)),
    # q/k/v bias, a gated shared expert, tied embeddings
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       tie_word_embeddings=True)),
    # sigmoid routing over 2 groups of 2 (1 kept) with a selection bias and routed scaling,
    # a dense first layer, partial RoPE, q/k/v bias, a shared expert
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=4, moe_intermediate_size=16, intermediate_size=24, first_k_dense_replace=1,
                      n_group=2, topk_group=1, routed_scaling_factor=2.5, attention_bias=True, head_dim=16,
                      n_shared_experts=1, norm_topk_prob=True)),
    # multi-head latent attention (a low-rank query, value heads narrower than the q/k
    # heads, interleaved RoPE pairs) under YaRN with the softmax correction (mscale and
    # mscale_all_dim apart, so both factors are not 1), GLM's MoE
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=4, moe_intermediate_size=16, intermediate_size=24, first_k_dense_replace=1,
                         n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True,
                         num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=8, qk_rope_head_dim=4,
                         qk_nope_head_dim=8, v_head_dim=6, rope_interleave=True,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0,
                                              mscale=0.8, mscale_all_dim=1.0))),
    # a sliding-window layer (window 4, fewer than the 10 positions) and a full one, YaRN as
    # GPT-OSS's (truncate False; a ramp over the 8 frequencies), sinks, attention, router and
    # expert biases (all random), the SwiGLU's clamp reached (limit 0.5)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=4, intermediate_size=16, head_dim=16, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.5,
                     max_position_embeddings=256, rope_parameters=GPT_OSS_YARN)),
}
# fp32 on both sides; the differences are RoPE tables (fmoe: fp64, cast; transformers:
# fp32), SDPA vs eager softmax and summation order: measured <= 1e-6 on logits of ~2.
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)


def hf_model(family, seed=0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # every weight random: norms away from 1, biases away from 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # GLM's selection bias is a buffer
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    family = request.param
    model = hf_model(family)
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return family, model, path


def fmoe_logits(params, tokens, cfg):
    with torch.no_grad():
        return forward(params, tokens, cfg)[0]


def test_config_reads_the_family(saved):
    family, model, path = saved
    cfg = fmoe.hf.config(path)
    hf = model.config
    ds = family == "deepseek_v3"
    assert (cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.num_kv_heads, cfg.experts, cfg.topk) == \
        (64, 32, 2, 4, 4 if ds else 2, 4, 2)
    assert cfg.head_dim == {"qwen3_moe": 16, "glm4_moe": 16, "gpt_oss": 16, "deepseek_v3": 12}.get(family, 8)
    assert cfg.qk_norm == {"qwen3_moe": "head", "olmoe": "full"}.get(family, "none")
    assert cfg.norm_topk_prob == {"mixtral": True, "gpt_oss": False}.get(family, getattr(hf, "norm_topk_prob", None))
    assert (cfg.shared_ffn, cfg.shared_gate, cfg.qkv_bias, cfg.tie_embeddings) == {
        "qwen2_moe": (24, True, True, True), "glm4_moe": (16, False, True, False),
        "deepseek_v3": (16, False, False, False), "gpt_oss": (0, False, True, False)}.get(family, (0, False, False, False))
    assert cfg.norm_eps == hf.rms_norm_eps and cfg.expert_bias_rate == 0
    deepseek_moe = family in ("glm4_moe", "deepseek_v3")
    assert (cfg.score_func, cfg.expert_groups, cfg.topk_groups, cfg.routed_scaling) == \
        (("sigmoid", 2, 1, 2.5) if deepseek_moe else ("topk_softmax" if family == "gpt_oss" else "softmax", 1, 1, 1.0))
    assert cfg.rope_fraction == (0.5 if family == "glm4_moe" else 1.0)
    assert (cfg.dense_layers, cfg.dense_ffn) == (((0,), 24) if deepseek_moe else ((), 0))
    latent = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.rope_head_dim, cfg.v_head_dim, cfg.rope_interleave)
    assert latent == ((16, 8, 4, 6, True) if ds else (0, 0, 0, cfg.head_dim, False))
    if family != "gpt_oss":  # its YaRN: tests/test_hf.py's GPT_OSS_YARN cases
        yarn = (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max, cfg.yarn_mscale, cfg.yarn_mscale_all_dim)
        assert yarn == (("yarn", 4.0, 4, 0.8, 1.0) if ds else ("none", 1.0, 0, 1.0, 0.0))


def test_logits_and_loss_equal_transformers(saved):
    family, model, path = saved
    plan = fmoe.Plan(model=fmoe.hf.config(path))
    params = fmoe.hf.load(path, plan)
    tokens = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tokens[:, :-1])
        ref_loss = model(tokens, labels=tokens).loss
    torch.testing.assert_close(fmoe_logits(params, tokens[:, :-1], plan.model), ref.logits, **LOGIT_TOL)
    torch.testing.assert_close(fmoe.eval_loss(params, {"tokens": tokens}, plan), ref_loss, **LOGIT_TOL)


def test_one_sgd_step_on_fmoes_gradients_gives_transformers_logits_after_the_same_step(saved, tmp_path):
    """fmoe's gradients are transformers' (the loss as theirs: mean next-token CE, no
    router loss): the same SGD step taken on each side, fmoe's exported, computes the
    same logits."""
    family, model, path = saved
    plan = fmoe.Plan(model=fmoe.hf.config(path))
    params = fmoe.hf.load(path, plan)
    tokens = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(4))
    pad = model.config.pad_token_id  # OLMoE's: an nn.Embedding padding_idx, whose row transformers never updates
    if pad is not None:
        tokens[tokens == pad] = (pad + 1) % 64
    lr = 0.5
    grads = fmoe.step(params, {"tokens": tokens}, plan).grads
    stepped = optree.tree_map(lambda p, g: p - lr * g, params, grads)
    fmoe.hf.save(tmp_path / "stepped", stepped, plan)
    theirs = getattr(transformers, FAMILIES[family][1]).from_pretrained(path).eval()
    theirs(tokens, labels=tokens).loss.backward()
    with torch.no_grad():
        for p in theirs.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
        mine = type(theirs).from_pretrained(tmp_path / "stepped").eval()
        probe = tokens[:, :-1].flip(0)
        torch.testing.assert_close(mine(probe).logits, theirs(probe).logits, **LOGIT_TOL)


@pytest.mark.parametrize("dense", [dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)],
                         ids=["mlp_only_layers", "decoder_sparse_step"])
def test_qwen3_moes_dense_layers_load_compute_and_save_as_released(tmp_path, dense):
    model = hf_model("qwen3_moe", num_hidden_layers=3, intermediate_size=24, **dense)
    model.save_pretrained(tmp_path / "hf")
    cfg = fmoe.hf.config(tmp_path / "hf")
    assert (cfg.dense_layers, cfg.dense_ffn) == (((1,), 24) if "mlp_only_layers" in dense else ((0, 2), 24))
    plan = fmoe.Plan(model=cfg)
    params = fmoe.hf.load(tmp_path / "hf", plan)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(fmoe_logits(params, tokens, cfg), model(tokens).logits, **LOGIT_TOL)
    fmoe.hf.save(tmp_path / "out", params, plan)
    back = fmoe.hf.load(tmp_path / "out", fmoe.Plan(model=fmoe.hf.config(tmp_path / "out")))
    assert_trees_equal(back, params)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_multi_token_prediction_layers_are_kept_through_a_round_trip_and_said_so(tmp_path, family):
    from safetensors.torch import load_file, save_file

    hf_model(family).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    g = torch.Generator().manual_seed(6)
    mtp = {f"model.layers.2.{name}": torch.randn(shape, generator=g)  # as released: layer num_hidden_layers
           for name, shape in (("eh_proj.weight", (32, 64)), ("enorm.weight", (32,)),
                               ("self_attn.q_proj.weight", (64, 32)), ("mlp.gate.e_score_correction_bias", (4,)))}
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**tensors, **mtp}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    plan = fmoe.Plan(model=fmoe.hf.config(tmp_path / "hf"))
    with pytest.warns(UserWarning, match=r"4 tensors of multi-token-prediction layers .*writes them back unchanged"):
        params = fmoe.hf.load(tmp_path / "hf", plan)
    fmoe.hf.save(tmp_path / "kept", params, plan, source=tmp_path / "hf")
    written = load_file(tmp_path / "kept" / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in mtp.items())
    assert json.loads((tmp_path / "kept" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    fmoe.hf.save(tmp_path / "plain", params, plan)  # no source: a model without them
    assert not any(k.startswith("model.layers.2.") for k in load_file(tmp_path / "plain" / "model.safetensors"))
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def fp8_blocks(w, block):
    """``w`` quantised as released FP8 checkpoints are: E4M3 values and a scale per
    block (partial blocks at the edges)."""
    from torch.nn.functional import pad

    R, C = w.shape
    padded = pad(w, (0, -C % block[1], 0, -R % block[0]))
    blocks = padded.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))  # [R/b, b, C/b, b]
    scales = blocks.abs().amax((1, 3)) / 448.0
    q = (blocks / scales[:, None, :, None]).flatten(0, 1).flatten(1, 2)[:R, :C]
    return q.to(torch.float8_e4m3fn), scales


def test_a_checkpoint_released_in_fp8_blocks_loads_as_transformers_dequantises_it(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    block = [16, 8]  # v_proj [24, 32]: two row blocks, the second partial; four column blocks
    hf_model("qwen3_moe", head_dim=12).save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    fp8 = {}
    for key, w in tensors.items():
        if w.dim() == 2 and key.endswith("proj.weight"):  # the Linear weights, as DeepSeek-V3 ships them
            fp8[key], fp8[key + "_scale_inv"] = fp8_blocks(w, block)
    save_file({**tensors, **fp8}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))
    plan = fmoe.Plan(model=fmoe.hf.config(tmp_path / "hf"))
    params = fmoe.hf.load(tmp_path / "hf", plan)
    want = dict(tensors)
    for key in fp8:
        if not key.endswith("_scale_inv"):
            want[key] = _dequantize_fp8_weight(fp8[key], fp8[key + "_scale_inv"], block, torch.float32)
    from fmoe.hf.weights import SafetensorsDir

    down = SafetensorsDir(tmp_path / "hf", tuple(block)).slice("model.layers.0.mlp.experts.3.down_proj.weight")
    whole = down[:]  # what a rank reads of its rows and columns (the blocks cut anywhere) is the whole's
    assert torch.equal(down[5:20, 3:14], whole[5:20, 3:14]) and torch.equal(down[:, 9:16], whole[:, 9:16])
    attn = params["layers"][1]["attn"]["qkv"]  # [D, q | k | v] of q_proj, k_proj, v_proj transposed
    assert torch.equal(attn[:, -24:], want["model.layers.1.self_attn.v_proj.weight"].t())
    assert torch.equal(params["layers"][0]["moe"]["experts"]["fc2"][3],
                       want["model.layers.0.mlp.experts.3.down_proj.weight"].t())
    assert not torch.equal(want["model.layers.0.mlp.experts.3.down_proj.weight"],
                           tensors["model.layers.0.mlp.experts.3.down_proj.weight"])  # FP8 rounding happened
    fmoe.hf.save(tmp_path / "out", params, plan, source=tmp_path / "hf")  # plain floats, no quantization_config
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert written["model.layers.1.self_attn.v_proj.weight"].dtype == torch.float32
    assert torch.equal(written["model.layers.1.self_attn.v_proj.weight"], want["model.layers.1.self_attn.v_proj.weight"])


def test_deepseeks_latent_attention_released_in_fp8_blocks_loads_dequantised(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    block = [8, 8]
    hf_model("deepseek_v3").save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    fp8 = {}
    for key, w in tensors.items():
        if w.dim() == 2 and key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight"):
            fp8[key], fp8[key + "_scale_inv"] = fp8_blocks(w, block)
    save_file({**tensors, **fp8}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))
    params = fmoe.hf.load(tmp_path / "hf", fmoe.Plan(model=fmoe.hf.config(tmp_path / "hf")))
    attn, at = params["layers"][1]["attn"], "model.layers.1.self_attn"
    for leaf, key in (("q_down", "q_a_proj"), ("q_up", "q_b_proj"), ("kv_down", "kv_a_proj_with_mqa"),
                      ("kv_up", "kv_b_proj"), ("out", "o_proj")):
        k = f"{at}.{key}.weight"
        assert torch.equal(attn[leaf], _dequantize_fp8_weight(fp8[k], fp8[k + "_scale_inv"], block, torch.float32).t())


def test_an_fp8_weight_without_its_scales_names_both(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    key = "model.layers.0.self_attn.o_proj.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{key}' is stored in FP8 \(F8_E4M3\) without its block scales "
                                         rf"'{key}_scale_inv'"):
        fmoe.hf.load(tmp_path / "hf", fmoe.Plan(model=fmoe.hf.config(tmp_path / "hf")))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, quantization_config={
        "quant_method": "mxfp4"})))
    with pytest.raises(ValueError, match="quantization_config.quant_method='mxfp4' is not supported"):
        fmoe.hf.config(tmp_path / "hf")


def test_fmoe_to_hf_to_fmoe_round_trips_bitwise(saved, tmp_path):
    family, _, path = saved
    plan = fmoe.Plan(model=fmoe.hf.config(path))
    params = fmoe.hf.load(path, plan)
    out = fmoe.hf.save(tmp_path / "out", params, plan)
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    back = fmoe.hf.load(out, fmoe.Plan(model=fmoe.hf.config(out)))
    assert_trees_equal(back, params)


def test_from_pretrained_reads_what_fmoe_wrote(saved, tmp_path):
    """A model trained in fmoe (here: init + GLU interleave, so the layout must be
    converted) opens in transformers with every key used, and computes the same logits."""
    family, model, path = saved
    cfg = fmoe.hf.config(path).replace(glu_interleave=8)
    plan = fmoe.Plan(model=cfg)
    params = fmoe.init(plan, seed=3)
    fmoe.hf.save(tmp_path / "out", params, plan)
    loaded, info = type(model).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = loaded.eval()(tokens).logits
    torch.testing.assert_close(fmoe_logits(params, tokens, cfg), ref, **LOGIT_TOL)


def test_hf_files_are_written_back_unchanged(saved, tmp_path):
    from safetensors.torch import load_file

    family, _, path = saved
    plan = fmoe.Plan(model=fmoe.hf.config(path))
    fmoe.hf.save(tmp_path / "out", fmoe.hf.load(path, plan), plan, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    written = {}
    for name in set(index["weight_map"].values()):
        written.update(load_file(tmp_path / "out" / name))
    original = load_file(path / "model.safetensors")
    original.pop("lm_head.weight", None) if family == "qwen2_moe" else None  # tied: not a parameter of its own
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)


def test_released_config_form_with_top_level_rope_theta(saved, tmp_path):
    """Released config.json files (before transformers 5) give rope_theta at the top level,
    and RoPE's scaling beside it (DeepSeek-V3's ``rope_scaling``)."""
    family, _, path = saved
    hf = json.loads((path / "config.json").read_text())
    params = hf.pop("rope_parameters")
    theta = params.pop("rope_theta")
    if params["rope_type"] != "default":
        hf["rope_scaling"] = dict(params, type=params.pop("rope_type"))
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, rope_theta=theta * 2)))
    assert fmoe.hf.config(tmp_path) == fmoe.hf.config(path).replace(rope_theta=theta * 2)


@pytest.mark.parametrize("change,needle", [
    (dict(kv_lora_rank=None), "kv_lora_rank=None is not supported: q_lora_rank is set"),
    (dict(n_group=3), "n_group=3 is not supported: must divide n_routed_experts (4)"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
     "rope_parameters.rope_type='llama3' is not supported: deepseek_v3: allowed: 'default', 'yarn'"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(qk_rope_head_dim=3), "ModelConfig.rope_head_dim=3 is invalid"),
])
def test_deepseek_config_refuses_what_fmoe_cannot_represent(tmp_path, change, needle):
    hf = json.loads(hf_model("deepseek_v3").config.to_json_string())
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, **change)))
    with pytest.raises(ValueError, match="config.json") as err:
        fmoe.hf.config(tmp_path)
    assert needle in str(err.value)


@pytest.mark.parametrize("change,needle", [
    (dict(model_type="llama"), "model_type='llama' is not supported: allowed: 'mixtral'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type='yarn' is not supported"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling="),
    (dict(sliding_window=4096, use_sliding_window=True), "sliding_window=4096 is not supported"),
    (dict(hidden_act="relu"), "hidden_act='relu' is not supported: allowed: 'silu'"),
    (dict(mlp_only_layers=[0, 1]), "ModelConfig.dense_layers=(0, 1) is invalid: must leave at least one"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(num_attention_heads=3), "ModelConfig.kv_heads=2 is invalid: must divide heads (3)"),
    (dict(vocab_size=None), "no 'vocab_size'"),
])
def test_config_refuses_what_fmoe_cannot_represent(tmp_path, change, needle):
    hf = json.loads(hf_model("qwen3_moe").config.to_json_string())
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, **change)))
    with pytest.raises(ValueError, match="config.json") as err:
        fmoe.hf.config(tmp_path)
    assert needle in str(err.value)


def test_load_refuses_a_different_model_and_foreign_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    model = hf_model("mixtral")
    model.save_pretrained(tmp_path)
    cfg = fmoe.hf.config(tmp_path)
    with pytest.raises(ValueError, match=r"Plan.model differs .*experts=8 \(the checkpoint's: 4\)"):
        fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg.replace(experts=8)))
    # training fields may differ: interleaved GLU halves load converted
    inter = fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg.replace(glu_interleave=4)))
    plain = fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg))
    fc1 = plain["layers"][0]["moe"]["experts"]["fc1"]
    assert torch.equal(inter["layers"][0]["moe"]["experts"]["fc1"], fmoe.glu_to_interleaved(fc1, 4))
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no place for.*o_proj.bias"):
        fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg))
    del tensors["model.layers.0.self_attn.o_proj.bias"], tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor 'model.layers.1.self_attn.q_proj.weight'"):
        fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg))


def test_save_refuses_what_the_families_cannot_hold(tmp_path):
    cfg = fmoe.ModelConfig(vocab=64, dim=32, heads=4, experts=4, ffn=16)
    plan = fmoe.Plan(model=cfg)
    params = fmoe.init(plan, seed=0)
    params["layers"][1]["moe"]["expert_bias"] = torch.full((4,), 0.01)
    with pytest.raises(ValueError, match="layers.1.moe.expert_bias is non-zero"):
        fmoe.hf.save(tmp_path / "a", params, plan)
    for bad, needle in ((dict(score_func="sigmoid"), "ModelConfig.shared_ffn=0 is not supported: "
                                                     "score_func='sigmoid' is written as glm4_moe"),
                        (dict(shared_ffn=16), "ModelConfig.shared_gate=False"),
                        (dict(norm_topk_prob=False), "ModelConfig.norm_topk_prob=False"),
                        (dict(activation="relu2"), "ModelConfig.activation='relu2'")):
        p2 = fmoe.Plan(model=cfg.replace(**bad))
        with pytest.raises(ValueError, match=needle):
            fmoe.hf.save(tmp_path / "b", fmoe.init(p2, seed=0), p2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        fmoe.hf.save(tmp_path / "c", fmoe.init(plan, seed=0), plan)
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


def test_a_write_failure_leaves_the_old_directory_and_no_temporary(tmp_path, monkeypatch):
    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=64, dim=32, heads=4, experts=4, ffn=16))
    first = fmoe.hf.save(tmp_path / "m", fmoe.init(plan, seed=0), plan)
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def disk_full(self, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmoe.hf.api._ShardWriter, "add", disk_full)
    with pytest.raises(OSError, match=r"fmoe.hf.save to .*m failed on rank 0: OSError: .*No space left"):
        fmoe.hf.save(tmp_path / "m", fmoe.init(plan, seed=1), plan)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_truncated_safetensors_file_is_named(tmp_path):
    model = hf_model("mixtral")
    model.save_pretrained(tmp_path)
    cfg = fmoe.hf.config(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"{weights}: not a readable safetensors file"):
        fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg))


def test_export_of_a_fine_tuned_run_keeps_the_source_config_and_loads_in_transformers(tmp_path):
    from fmoe.hf.export import main as export_main
    from fmoe.train import main as train_main

    # a source whose config says what fmoe does not model: token ids, context length,
    # an aux-loss coefficient it was trained with, Qwen3's dense intermediate_size
    source = tmp_path / "hf"
    model = hf_model("qwen3_moe", vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     max_position_embeddings=4096, router_aux_loss_coef=0.002, intermediate_size=48)
    model.save_pretrained(source)
    (source / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    run = tmp_path / "run"
    fmoe.data.prepare.prepare([ROOT / "README.md"], tmp_path / "bytes", quiet=True)  # the source has no tokenizer
    train_main(["--init-from-hf", str(source), "--data", str(tmp_path / "bytes"), "--steps", "2", "--batch", "4", "--seq", "16", "--eval-every", "2",
                "--eval-batches", "1", "--no-progress", "--sample-tokens", "0", "--threads", "1", "--out", str(run)])
    out = export_main(["export", str(run / "checkpoint"), "--out", str(tmp_path / "export"), "--dtype", "float32"])
    got = json.loads((out / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "router_aux_loss_coef",
                "intermediate_size", "moe_intermediate_size", "head_dim", "vocab_size"):
        assert got[key] == model.config.to_dict()[key], key
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    # transformers reads it, and computes what fmoe computes with the trained weights
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    cfg = fmoe.checkpoint.read_config(run / "checkpoint")
    params = fmoe.load(run / "checkpoint", fmoe.Plan(model=cfg)).params
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = loaded(tokens).logits
    torch.testing.assert_close(theirs, fmoe_logits(params, tokens, cfg), **LOGIT_TOL)


def test_the_main_jobs_default_run_exports_and_a_trained_expert_bias_says_what_to_change(tmp_path):
    from fmoe.hf.export import main as export_main
    from fmoe.train import main as train_main

    common = ["--steps", "2", "--batch", "2", "--seq", "16", "--dim", "32", "--eval-every", "2", "--eval-batches", "1",
              "--no-progress", "--sample-tokens", "0", "--threads", "1"]
    train_main(common + ["--out", str(tmp_path / "a")])  # the defaults: balanced by the aux loss
    out = export_main(["export", str(tmp_path / "a" / "checkpoint"), "--out", str(tmp_path / "a-hf")])
    assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
    transformers.AutoModelForCausalLM.from_pretrained(out)
    train_main(common + ["--expert-bias-rate", "0.01", "--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit, match=r"fmoe.hf export: .*expert_bias is non-zero.*train with expert_bias_rate=0"):
        export_main(["export", str(tmp_path / "b" / "checkpoint"), "--out", str(tmp_path / "b-hf")])


def test_gpt_oss_config_reads_windows_yarn_and_biases_and_the_released_form_alike(tmp_path):
    """GPT-OSS's config.json as transformers >= 5 writes it (``rope_parameters``) and as
    released (top-level ``rope_scaling`` and ``rope_theta``) give the same ModelConfig,
    and transformers reads both alike."""
    model = hf_model("gpt_oss")
    model.save_pretrained(tmp_path / "v5")
    cfg = fmoe.hf.config(tmp_path / "v5")
    assert (cfg.activation, cfg.glu_limit, cfg.glu_offset, cfg.score_func, cfg.norm_topk_prob) == \
        ("quick_geglu", 0.5, 1.0, "topk_softmax", False)
    assert (cfg.router_bias, cfg.expert_biases, cfg.qkv_bias, cfg.out_bias, cfg.attn_sinks) == (True,) * 5
    assert (cfg.sliding_window, cfg.window_layers, cfg.prob_placement) == (4, (0,), "output")
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max, cfg.yarn_beta_fast,
            cfg.yarn_beta_slow, cfg.yarn_truncate, cfg.yarn_mscale_all_dim) == ("yarn", 1000.0, 4.0, 64, 32.0, 1.0,
                                                                             False, 0.0)
    hf = json.loads((tmp_path / "v5" / "config.json").read_text())
    rope = dict(hf.pop("rope_parameters"))
    released = dict(hf, rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    (tmp_path / "released").mkdir()
    (tmp_path / "released" / "config.json").write_text(json.dumps(released))
    assert fmoe.hf.config(tmp_path / "released") == cfg
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "released")
    assert theirs.rope_parameters == model.config.rope_parameters


def mxfp4_checkpoint(path, seed=0):
    """A tiny GPT-OSS checkpoint with its experts' weights as released: MXFP4 ``*_blocks``
    (random FP4 codes) and ``*_scales`` (E8M0 exponents around 2 ** 0), the rest in fp32.
    Returns the released tensors."""
    from safetensors.torch import load_file, save_file

    hf_model("gpt_oss", hidden_size=64, intermediate_size=32).save_pretrained(path)  # groups of 32: D and F
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        experts, rows, cols = tensors.pop(key).shape  # [E, in, out]: stored [E, out, in / 32, 16]
        tensors[key + "_blocks"] = torch.randint(0, 256, (experts, cols, rows // 32, 16), generator=g,
                                                 dtype=torch.uint8)
        tensors[key + "_scales"] = torch.randint(121, 128, (experts, cols, rows // 32), generator=g,
                                                 dtype=torch.uint8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                  "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))
    return tensors


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantises_them(tmp_path):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from fmoe.hf.weights import SafetensorsDir

    released = mxfp4_checkpoint(tmp_path / "hf")
    plan = fmoe.Plan(model=fmoe.hf.config(tmp_path / "hf"))
    params = fmoe.hf.load(tmp_path / "hf", plan)
    key = "model.layers.1.mlp.experts.{}"
    want = {n: convert_moe_packed_tensors(released[key.format(n) + "_blocks"], released[key.format(n) + "_scales"],
                                          dtype=torch.float32) for n in ("gate_up_proj", "down_proj")}
    experts = params["layers"][1]["moe"]["experts"]
    assert torch.equal(fmoe.glu_to_interleaved(experts["fc1"], 1), want["gate_up_proj"])  # GPT-OSS's: gate, up, ...
    assert torch.equal(experts["fc2"], want["down_proj"])
    down = SafetensorsDir(tmp_path / "hf", mxfp4=True).slice(key.format("down_proj"))
    assert torch.equal(down[1:3, 5:20, 7:40], want["down_proj"][1:3, 5:20, 7:40])  # a rank's rows: only their groups
    # transformers' model with the same dequantised experts computes what fmoe computes
    model = hf_model("gpt_oss", hidden_size=64, intermediate_size=32)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                k = f"model.layers.{i}.mlp.experts.{name}"
                getattr(layer.mlp.experts, name).copy_(
                    convert_moe_packed_tensors(released[k + "_blocks"], released[k + "_scales"], dtype=torch.float32))
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
        want_logits = model(tokens).logits
        # Dequantised experts reach 6 in magnitude (block scales up to 2^0), ~60x the other
        # tests' weights, and two fp32 implementations' rounding grows with them: 1.7e-5 apart
        # on logits up to 2.9 with transformers 5.24 (3e-6 with both in float64: its RoPE
        # tables stay fp32). So the tolerance scales with the logits; a wrong dequantisation
        # is off by O(1).
        torch.testing.assert_close(fmoe_logits(params, tokens, plan.model), want_logits, rtol=1e-5,
                                   atol=5e-5 * float(want_logits.abs().max()))
    fmoe.hf.save(tmp_path / "out", params, plan, source=tmp_path / "hf")  # plain floats, no quantization_config
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in written)
    assert torch.equal(written[key.format("gate_up_proj")], want["gate_up_proj"])


@pytest.mark.parametrize("missing", ["_scales", "_blocks"])
def test_gpt_oss_mxfp4_blocks_without_scales_name_both(tmp_path, missing):
    from safetensors.torch import save_file

    tensors = mxfp4_checkpoint(tmp_path)
    key = "model.layers.0.mlp.experts.down_proj"
    del tensors[key + missing]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{key}' is stored in MXFP4 as .* without '{key}{missing}'.*"
                                         rf"needs both '{key}_blocks' and '{key}_scales'"):
        fmoe.hf.load(tmp_path, fmoe.Plan(model=fmoe.hf.config(tmp_path)))


@pytest.mark.parametrize("change,needle", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]),
     "layer_types[1]='chunked_attention' is not supported: allowed: 'full_attention', 'sliding_attention'"),
    (dict(layer_types=["full_attention"]), "must name one kind per layer (num_hidden_layers=2)"),
    (dict(sliding_window=None), "sliding_window=None is not supported: layers [0] are 'sliding_attention'"),
    (dict(rope_parameters=dict(GPT_OSS_YARN, rope_type="linear")), "rope_parameters.rope_type='linear' is not"),
    (dict(rope_scaling=dict(GPT_OSS_YARN, rope_type="dynamic")), "rope_scaling.rope_type='dynamic' is not"),
    (dict(rope_parameters=dict(GPT_OSS_YARN, mscale_all_dim=1.0)), "rope_parameters.mscale_all_dim=1.0 is not"),
    (dict(rope_parameters=dict(GPT_OSS_YARN, partial_rotary_factor=0.5)), "partial_rotary_factor=0.5 is not"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5 is not supported"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config.quant_method='bitsandbytes'"),
])
def test_gpt_oss_config_refuses_what_fmoe_cannot_represent(tmp_path, change, needle):
    hf = json.loads(hf_model("gpt_oss").config.to_json_string())
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, **change)))
    with pytest.raises(ValueError, match="config.json") as err:
        fmoe.hf.config(tmp_path)
    assert needle in str(err.value)


GPT_OSS_CFG = fmoe.ModelConfig(vocab=64, dim=32, heads=4, experts=4, ffn=16, activation="quick_geglu",
                               score_func="topk_softmax", router_bias=True, expert_biases=True, attn_sinks=True)


@pytest.mark.parametrize("cfg,needle", [
    (GPT_OSS_CFG.replace(router_bias=False), "ModelConfig.router_bias=False is not supported: score_func='topk_softmax' "
                                             "is written as gpt_oss"),
    (GPT_OSS_CFG.replace(activation="swiglu"), "ModelConfig.activation='swiglu'"),
    (GPT_OSS_CFG.replace(prob_placement="activation"), "ModelConfig.prob_placement='activation'"),
    (GPT_OSS_CFG.replace(out_bias=True), "ModelConfig.out_bias=True"),
    (GPT_OSS_CFG.replace(attn_sinks=False), "ModelConfig.attn_sinks=False"),
    (GPT_OSS_CFG.replace(qk_norm="head"), "ModelConfig.qk_norm='head'"),
    # the other families keep refusing what only GPT-OSS holds
    (fmoe.ModelConfig(attn_sinks=True), "ModelConfig.attn_sinks=True"),
    (fmoe.ModelConfig(out_bias=True), "ModelConfig.out_bias=True"),
    (fmoe.ModelConfig(sliding_window=4, window_layers=(0,)), "ModelConfig.window_layers=(0,)"),
    (fmoe.ModelConfig(rope_scaling="yarn", rope_original_max=64), "ModelConfig.rope_scaling='yarn'"),
    (fmoe.ModelConfig(score_func="sigmoid", shared_ffn=512, attn_sinks=True), "ModelConfig.attn_sinks=True"),
])
def test_family_of_refuses_what_gpt_oss_cannot_hold(cfg, needle):
    with pytest.raises(ValueError, match="fmoe.hf.save") as err:
        fmoe.hf.family_of(cfg)
    assert needle in str(err.value)


def test_family_of_writes_topk_softmax_as_gpt_oss():
    # norm_topk_prob either way: the softmax over the k logits already sums to 1
    for cfg in (GPT_OSS_CFG, GPT_OSS_CFG.replace(norm_topk_prob=False, qkv_bias=True, out_bias=True)):
        assert fmoe.hf.family_of(cfg) == "gpt_oss"


def test_gpt_oss_load_refuses_another_prob_placement(tmp_path):
    """Where the probability scales the fc2 bias is what GPT-OSS computes, not a training choice."""
    hf_model("gpt_oss").save_pretrained(tmp_path)
    cfg = fmoe.hf.config(tmp_path)
    with pytest.raises(ValueError, match=r"Plan.model differs .*prob_placement='activation'"):
        fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg.replace(prob_placement="activation")))


def test_gpt_oss_ranks_read_only_their_experts_and_rows_of_the_stacked_mxfp4_tensors(tmp_path):
    """What ``load`` reads on each rank of a ZeRO-3 x EP plan (stacked experts cut to the
    rank's experts and rows, MXFP4 groups read in part) is that rank's shard of the whole."""
    from fmoe.hf.weights import SafetensorsDir, read_local_leaf, recipes
    from fmoe.params import named_leaves
    from fmoe.resolve import resolve

    mxfp4_checkpoint(tmp_path)
    cfg = fmoe.hf.config(tmp_path)
    whole = named_leaves(fmoe.hf.load(tmp_path, fmoe.Plan(model=cfg)))
    plan = fmoe.Plan(model=cfg, dp=2, ep=2, sharding="optim_grads_params")  # 4 ranks, resolved in one process
    spec, files, by_path = resolve(plan).spec, SafetensorsDir(tmp_path, mxfp4=True), recipes(cfg, "gpt_oss")
    cuts = set()
    for rank in range(plan.world):
        for path, shape in spec.table.shapes().items():
            if path in by_path:
                piece = spec.leaf_piece(path, shape, rank)
                got = read_local_leaf(files, by_path[path], cfg, spec.local_full_shape(path, shape), *piece)
                assert torch.equal(got, spec.shard_leaf(whole[path], path, rank)), (path, rank)
                if path.endswith("experts.fc1") and piece.last > piece.first:
                    cuts.add(piece.first % shape[1] % 32)  # where in a 32-value MXFP4 group its rows start
    assert cuts - {0}, "no rank's rows start inside an MXFP4 group"
