"""Layout conversions and plain state-dict export: exact round trips, same training."""

import pytest
import torch

import fmoe
from fmoe.checkpoint import (
    convert_glu,
    export_state_dict,
    from_per_expert,
    import_state_dict,
    map_param_trees,
    to_per_expert,
)

from . import reference as ref
from .reference import assert_trees_equal

CFG = fmoe.ModelConfig(vocab=32, dim=16, layers=2, heads=2, experts=4, topk=2, ffn=8, shared_ffn=4,
                       expert_biases=True)
BATCH = {"tokens": torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))}


def test_per_expert_round_trip_is_exact_and_uses_linear_layout():
    full = ref.random_params(CFG, dtype=torch.float32)
    flat = to_per_expert(full)
    w = full["layers"][1]["moe"]["experts"]
    assert torch.equal(flat["layers.1.moe.experts.fc1.weight3"], w["fc1"][3].t())  # [2F, D], y = x @ W.T
    assert torch.equal(flat["layers.1.moe.experts.fc2.bias2"], w["fc2_bias"][2])
    assert "layers.1.moe.experts.fc1" not in flat and "layers.1.attn.qkv" in flat
    assert_trees_equal(from_per_expert(flat, CFG), full)


def test_per_expert_import_names_what_is_missing():
    flat = to_per_expert(ref.random_params(CFG, dtype=torch.float32))
    del flat["layers.0.moe.experts.fc2.weight1"]
    with pytest.raises(ValueError, match="lacks expert 1 of 'layers.0.moe.experts.fc2'"):
        from_per_expert(flat, CFG)
    with pytest.raises(ValueError, match="has no 'layers.0.moe.experts.fc1_bias'"):
        from_per_expert(to_per_expert(ref.random_params(CFG.replace(expert_biases=False))), CFG)


def test_glu_round_trip_is_exact():
    full = ref.random_params(CFG, dtype=torch.float32)
    inter, cfg4 = convert_glu(full, CFG, 4)
    assert cfg4.glu_interleave == 4
    assert not torch.equal(inter["layers"][0]["moe"]["experts"]["fc1"], full["layers"][0]["moe"]["experts"]["fc1"])
    back, cfg0 = convert_glu(inter, cfg4, 0)
    assert cfg0 == CFG
    assert_trees_equal(back, full)
    with pytest.raises(ValueError, match="glu_interleave"):
        convert_glu(full, CFG, 3)


def steps(plan, params, opt, state, n):
    losses = []
    for _ in range(n):
        out = fmoe.step(params, BATCH, plan)
        losses.append(out.loss)
        params, state = opt.update(out.grads, state, params)
    return params, state, torch.stack(losses)


def test_a_glu_converted_checkpoint_trains_to_the_same_losses(tmp_path):
    plan = fmoe.Plan(model=CFG)
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1)
    params = fmoe.init(plan, seed=0)
    params, state, _ = steps(plan, params, opt, opt.init(params), 2)
    fmoe.save(tmp_path / "ck", plan, params, opt_state=state, step=2)
    _, _, expected = steps(plan, params, opt, state, 3)

    ck = fmoe.load(tmp_path / "ck", plan)
    converted, cfg4 = convert_glu(ck.params, CFG, 4)
    moments = map_param_trees(ck.opt_state, lambda tree: convert_glu(tree, CFG, 4)[0], CFG)
    plan4 = fmoe.Plan(model=cfg4)
    fmoe.save(tmp_path / "ck4", plan4, converted, opt_state=moments, step=2)
    ck4 = fmoe.load(tmp_path / "ck4", plan4)
    _, _, got = steps(plan4, ck4.params, opt, ck4.opt_state, 3)
    # The same dot products in another column order: equal to fp32 rounding of the
    # matmul blocking (bitwise here on CPU), stated loosely.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt,suffix", [("torch", ".pt"), ("safetensors", ".safetensors")])
@pytest.mark.parametrize("per_expert", [False, True])
def test_export_import_round_trip(tmp_path, fmt, suffix, per_expert):
    full = ref.random_params(CFG, dtype=torch.float32)
    path = export_state_dict(tmp_path / f"model{suffix}", full, per_expert=per_expert, format=fmt)
    assert_trees_equal(import_state_dict(path, CFG), full)
    with pytest.raises(ValueError, match="has shape"):
        import_state_dict(path, CFG.replace(ffn=16))


def test_export_rejects_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="format='npz' is invalid"):
        export_state_dict(tmp_path / "x", ref.random_params(CFG), format="npz")
