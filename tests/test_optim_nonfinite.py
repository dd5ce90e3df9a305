"""fmoe.adamw's default (skip_nonfinite=None): no non-finite update is ever written. A
step whose gradients hold a NaN or an inf changes no bit of params or state (its record
apart), is counted in ``fmoe.skipped_steps``, and the default never gives up; a finite
step computes exactly what ``skip_nonfinite=0`` does; a state saved without the record
loads and updates. (That no update reads a value back to the host, computes the norm
twice or lets ranks decide apart is checked for the default beside apply_if_finite, in
test_optim_finite.py.)"""

import json

import optree
import pytest
import torch

import fmoe

from .test_optim_finite import FUSED, INF, NAN, assert_bitwise, counts, poisoned, small_model, tree


def make(fused, clip, **kw):
    return fmoe.adamw(lr=fmoe.warmup_cosine(1e-2, warmup=2, total=10), weight_decay=0.1, max_grad_norm=clip,
                      fused=fused, **kw)


def without_record(state):
    """adamw's state with its record of skipped steps taken out (what a skip keeps)."""
    return dict(state, adam=state["adam"]._replace(skips=None))


CLIP = pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])


@pytest.mark.parametrize("bad", [NAN, -INF], ids=["nan", "-inf"])
@CLIP
@FUSED
def test_the_default_skips_a_bad_step_bit_for_bit_and_the_run_goes_on_as_without_it(fused, clip, bad):
    opt = make(fused, clip)
    params_a = params_b = tree(0)
    state_a = state_b = opt.init(params_a)
    assert list(state_a) == ["adam", "decay", "lr", "freeze"] if clip is None else ["clip", "adam", "decay", "lr",
                                                                                    "freeze"]
    for i, g in enumerate(tree(10 + i) for i in range(3)):
        params_a, state_a = opt.update(g, state_a, params_a)
        if i == 1:  # run B sees a poisoned step between the first and second good ones
            before = (params_b, without_record(state_b))
            params_b, state_b = opt.update(poisoned(g, bad), state_b, params_b)
            after = without_record(state_b)
            if clip:  # the clip keeps the norm of the step's gradients, skipped or not
                assert not torch.isfinite(after.pop("clip").grad_norm)
                before[1].pop("clip")
            assert_bitwise((params_b, after), before)
            assert counts(state_b) == [1, 1] and not bool(state_b["adam"].skips.applied)
        params_b, state_b = opt.update(g, state_b, params_b)
    assert_bitwise((params_a, without_record(state_a)), (params_b, without_record(state_b)))
    assert counts(state_b) == [0, 1] and counts(state_a) == [0, 0]


@CLIP
@FUSED
def test_a_finite_step_computes_exactly_what_skip_nonfinite_0_computes(fused, clip):
    default, off = make(fused, clip), make(fused, clip, skip_nonfinite=0)
    p_def = p_off = tree(0)
    s_def, s_off = default.init(p_def), off.init(p_off)
    assert s_off["adam"].skips is None  # skip_nonfinite=0: the layout of states saved before the record
    for seed in (1, 2, 3):
        p_def, s_def = default.update(tree(seed), s_def, p_def)
        p_off, s_off = off.update(tree(seed), s_off, p_off)
    assert_bitwise((p_def, without_record(s_def)), (p_off, s_off))


@FUSED
def test_nan_params_give_a_nan_loss_and_every_step_is_skipped(fused):
    plan, params, batch = small_model()
    params["layers"][1]["moe"]["norm"][7] = NAN
    out = fmoe.step(params, batch, plan)
    assert torch.isnan(out.loss)
    opt = fmoe.adamw(lr=1e-3, fused=fused)
    state = opt.init(params)
    new = params
    for _ in range(3):  # the default never gives up: the params stay as they are
        new, state = opt.update(out.grads, state, new)
    assert_bitwise(new, params)
    assert counts(state) == [3, 3]
    # the opt-out writes the NaN update: into the params the NaN reached, the head among them
    written, _ = fmoe.adamw(lr=1e-3, fused=fused, skip_nonfinite=0).update(out.grads, opt.init(params), params)
    assert torch.isnan(written["head"]).all() and not torch.isnan(params["head"]).any()


@FUSED
def test_a_state_saved_without_the_record_loads_and_updates_like_a_new_one(fused, tmp_path):
    plan, params, batch = small_model()
    grads = fmoe.step(params, batch, plan).grads
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, fused=fused)
    fmoe.save(tmp_path / "ck", plan, params, opt_state=opt.init(params), step=0)
    # an older fmoe wrote Adam's state with three fields: take the fourth out of the file
    meta_file = tmp_path / "ck" / "fmoe.json"
    meta = json.loads(meta_file.read_text())
    adam = meta["opt_state"]["dict"]["adam"]
    assert adam["state"] == "ScaleByAdamState" and len(adam["fields"]) == 4
    adam["fields"] = adam["fields"][:3]
    meta_file.write_text(json.dumps(meta))
    old = fmoe.load(tmp_path / "ck", plan).opt_state
    assert old["adam"].skips is None
    want = opt.update(grads, opt.init(params), params)
    got = opt.update(grads, old, params)
    assert_bitwise(got, want)
    _, state = opt.update(optree.tree_map(lambda g: g * INF, grads), got[1], got[0])
    assert counts(state) == [1, 1]
