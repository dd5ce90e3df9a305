"""Dense layers beside MoE layers (``ModelConfig.dense_layers``): layout, checks, and
everything around the step (checkpoints, generation, modules, expert-bias balancing,
the main job's flag). The step itself is checked against the float64 reference in
``test_layers.py`` and across schedules in ``test_schedule.py`` and ``dist/``."""

import pytest
import torch

import fmoe
from fmoe.generate import empty_cache, forward_cached
from fmoe.layers import forward
from fmoe.trainer import options
from interop import FMoEModule

from . import reference as ref
from .reference import assert_trees_equal

CFG = fmoe.ModelConfig(vocab=40, dim=32, layers=3, heads=4, kv_heads=2, experts=4, topk=2, ffn=16,
                       shared_ffn=8, dense_layers=(0,), dense_ffn=24)
TOKENS = torch.randint(0, 40, (4, 9), generator=torch.Generator().manual_seed(0))


def test_a_dense_layer_holds_an_mlp_where_a_moe_layer_holds_its_moe():
    shapes = fmoe.params.flat_shapes(CFG)
    assert {k: v for k, v in shapes.items() if k.startswith("layers.0.mlp")} == {
        "layers.0.mlp.norm": (32,), "layers.0.mlp.fc1": (32, 48), "layers.0.mlp.fc2": (24, 32)}
    assert not any(k.startswith("layers.0.moe") for k in shapes) and "layers.1.moe.router" in shapes
    assert CFG.moe_layers == (1, 2)
    table = fmoe.params.param_table(CFG)
    assert table["layers.0.mlp.fc1"].node == "dense" and table["layers.0.attn.qkv"].node == "dense"
    assert table["layers.0.mlp.fc1"].glu and table["layers.0.mlp.fc1"].linear


@pytest.mark.parametrize("changes, field", [
    (dict(dense_layers=(0,), dense_ffn=0), "dense_ffn"),
    (dict(dense_ffn=8), "dense_ffn"),
    (dict(dense_layers=(3,), dense_ffn=8), "dense_layers"),
    (dict(dense_layers=(1, 0), dense_ffn=8), "dense_layers"),
    (dict(dense_layers=(0, 1, 2), dense_ffn=8), "dense_layers"),
    (dict(dense_layers=(0,), dense_ffn=6, glu_interleave=4, ffn=16, shared_ffn=8), "glu_interleave"),
])
def test_bad_dense_layers_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}="):
        fmoe.ModelConfig(**{**dict(vocab=40, dim=32, layers=3, heads=4, experts=4, topk=2, ffn=16), **changes})


def test_a_list_of_dense_layers_is_the_config_with_the_tuple():
    assert CFG.replace(dense_layers=[0]) == CFG


def test_checkpoints_keep_the_dense_layers(tmp_path):
    plan = fmoe.Plan(model=CFG)
    params = fmoe.init(plan, seed=1)
    fmoe.save(tmp_path / "ck", plan, params)
    assert fmoe.checkpoint.read_config(tmp_path / "ck") == CFG
    assert_trees_equal(fmoe.load(tmp_path / "ck", plan).params, params)


def test_cached_generation_runs_through_dense_layers():
    params = ref.random_params(CFG, dtype=torch.float32)
    full, stats = forward(params, TOKENS, CFG)
    assert len(stats) == 2  # one MoEStats per MoE layer
    cache = empty_cache(CFG, 4, 9, torch.float32, "cpu")
    first, cache = forward_cached(params, TOKENS[:, :6], CFG, cache)
    rest, cache = forward_cached(params, TOKENS[:, 6:], CFG, cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-5)


def test_the_module_and_expert_bias_balancing_take_dense_layers():
    plan = fmoe.Plan(model=CFG)
    params = fmoe.init(plan, seed=2)
    out = fmoe.step(params, {"tokens": TOKENS}, plan)
    assert out.metrics["expert_counts"].shape == (2, 4)
    module = FMoEModule(plan, params=params)
    torch.testing.assert_close(module({"tokens": TOKENS}), out.metrics["objective"], rtol=1e-6, atol=0)
    balanced = fmoe.update_expert_bias(params, out.metrics["expert_counts"], 0.5)
    assert balanced["layers"][0] is params["layers"][0]
    for i in (1, 2):
        assert not torch.equal(balanced["layers"][i]["moe"]["expert_bias"], params["layers"][i]["moe"]["expert_bias"])


def test_the_main_jobs_flag_names_dense_layers_by_index():
    settings, _ = options.resolve(["--layers", "3", "--dense-layers", "0,2", "--dense-ffn", "64"])
    cfg = options.model_config(settings)
    assert cfg.dense_layers == (0, 2) and cfg.dense_ffn == 64
    assert options.resolved(settings, fmoe.Plan(model=cfg))["dense_layers"] == "0,2"
    with pytest.raises(ValueError, match="dense_layers='0;2' is invalid"):
        options.model_config(dict(settings, dense_layers="0;2"))
