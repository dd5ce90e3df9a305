"""fmoe.adamw against torch.optim.AdamW; clipping; the expert-bias update."""

import optree
import pytest
import torch

import fmoe

from .reference import assert_trees_close, assert_trees_equal


def tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 5, generator=g), "layers": [{"moe": {"expert_bias": torch.randn(3, generator=g),
                                                                     "norm": torch.randn(5, generator=g)}}]}


@pytest.mark.parametrize("fused", [False, True], ids=["chain", "fused"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_adamw_matches_torch_adamw(clip, fused):
    params = tree(0)
    lr, wd = 1e-2, 0.1
    opt = fmoe.adamw(lr=lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd, max_grad_norm=clip, fused=fused)
    state = opt.init(params)
    w, norm = params["w"].clone().requires_grad_(True), params["layers"][0]["moe"]["norm"].clone().requires_grad_(True)
    # Decay on matrices only, as fmoe.adamw does; the expert bias is not an optimizer leaf.
    torch_opt = torch.optim.AdamW([{"params": [w], "weight_decay": wd}, {"params": [norm], "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        grads = optree.tree_map(lambda t: torch.randn_like(t) * 3, params)
        grads["layers"][0]["moe"]["expert_bias"] = torch.zeros(3)  # as fmoe.step returns it
        params, state = opt.update(grads, state, params)
        w.grad, norm.grad = grads["w"].clone(), grads["layers"][0]["moe"]["norm"].clone()
        if clip:
            torch.nn.utils.clip_grad_norm_([w, norm], clip)
        torch_opt.step()
    torch.testing.assert_close(params["w"], w.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(params["layers"][0]["moe"]["norm"], norm.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(params["layers"][0]["moe"]["expert_bias"], tree(0)["layers"][0]["moe"]["expert_bias"])


def test_clip_by_global_norm_matches_torch():
    grads = tree(1)
    clipped, _ = fmoe.clip_by_global_norm(0.7).update(grads, None)
    ref = [t.clone().requires_grad_(True) for t in optree.tree_leaves(grads)]
    for r, g in zip(ref, optree.tree_leaves(grads)):
        r.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, 0.7)
    torch.testing.assert_close(fmoe.global_norm(grads), total)
    assert len(optree.tree_leaves(clipped)) == len(ref)
    for c, r in zip(optree.tree_leaves(clipped), ref):
        torch.testing.assert_close(c, r.grad, rtol=1e-5, atol=1e-7)
    small, _ = fmoe.clip_by_global_norm(1e3).update(grads, None)
    assert_trees_equal(small, grads)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fused_adamw_keeps_the_chain_state_and_update(clip):
    # Same state layout (checkpoints and the chain are interchangeable) and the same
    # update up to fp32 rounding (the kernel orders the arithmetic differently).
    chain, fused = (fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=clip, fused=f) for f in (False, True))
    params_c = params_f = tree(4)
    state_c, state_f = chain.init(params_c), fused.init(params_f)
    assert optree.tree_structure(state_c) == optree.tree_structure(state_f)
    for seed in range(4):
        grads = optree.tree_map(lambda t: torch.randn_like(t) * 3, tree(10 + seed))
        params_c, state_c = chain.update(grads, state_c, params_c)
        params_f, state_f = fused.update(grads, state_f, params_f)
    assert optree.tree_structure(state_c) == optree.tree_structure(state_f)
    assert_trees_close((params_c, state_c), (params_f, state_f), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["chain", "fused"])
def test_adamw_is_pure(fused):
    params = tree(2)
    before = optree.tree_map(torch.clone, params)
    opt = fmoe.adamw(lr=0.1, weight_decay=0.1, fused=fused)
    state = opt.init(params)
    grads = tree(3)
    new, state2 = opt.update(grads, state, params)
    assert_trees_equal(params, before)
    assert int(state["adam"].count) == 0 and int(state2["adam"].count) == 1
    assert not torch.equal(new["w"], params["w"])


def test_lr_schedule_is_called_with_the_count():
    seen = []
    opt = fmoe.adamw(lr=lambda n: seen.append(int(n)) or 0.0)
    params = tree(0)
    state = opt.init(params)
    for _ in range(3):
        new, state = opt.update(tree(1), state, params)
    assert seen == [0, 1, 2]
    assert torch.equal(new["w"], params["w"])


def test_warmup_cosine_shape():
    sched = fmoe.warmup_cosine(1.0, warmup=4, total=14, floor=0.1)
    values = [sched(torch.tensor(n)) for n in range(20)]
    assert values[0] == pytest.approx(0.25) and values[3] == pytest.approx(1.0)
    assert values[14] == pytest.approx(0.1) and values[19] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[3:], values[4:]))


@pytest.mark.parametrize("bad", [dict(b1=1.0), dict(b2=-0.1), dict(weight_decay=-1.0), dict(max_grad_norm=0.0)])
def test_adamw_rejects_bad_hyperparameters(bad):
    with pytest.raises(ValueError, match=list(bad)[0]):
        fmoe.adamw(**bad)


def test_expert_bias_update_moves_toward_balance():
    cfg = fmoe.ModelConfig(vocab=16, dim=16, heads=2, layers=2, experts=4, ffn=8)
    params = fmoe.init(fmoe.Plan(model=cfg), seed=0)
    counts = torch.tensor([[10, 2, 4, 4], [5, 5, 5, 5]])
    new = fmoe.update_expert_bias(params, counts, 0.01)
    torch.testing.assert_close(new["layers"][0]["moe"]["expert_bias"], torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert torch.equal(new["layers"][1]["moe"]["expert_bias"], torch.zeros(4))
    assert new["embed"] is params["embed"]
    assert torch.equal(params["layers"][0]["moe"]["expert_bias"], torch.zeros(4))


def test_donated_expert_bias_update_equals_the_pure_one_in_place():
    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=16, dim=16, heads=2, layers=2, experts=4, ffn=8))
    params = fmoe.init(plan, seed=0)
    counts = torch.tensor([[10, 2, 4, 4], [3, 5, 7, 5]])
    ptrs = [layer["moe"]["expert_bias"].data_ptr() for layer in params["layers"]]
    pure = fmoe.update_expert_bias(optree.tree_map(torch.clone, params), counts, 0.01)
    donated = fmoe.update_expert_bias(params, counts, 0.01, donate=True)
    assert donated is params  # the same pytree, its biases written where they were
    assert [layer["moe"]["expert_bias"].data_ptr() for layer in donated["layers"]] == ptrs
    assert_trees_equal(optree.tree_map(lambda t: t.view(torch.int32), pure),
                       optree.tree_map(lambda t: t.view(torch.int32), donated))
    # applied=False (a skipped optimizer step) keeps the biases bit for bit, in both forms
    before = optree.tree_map(torch.clone, donated)
    no = torch.tensor(False)
    kept = fmoe.update_expert_bias(donated, counts, 0.01, applied=no)
    fmoe.update_expert_bias(donated, counts, 0.01, donate=True, applied=no)
    assert_trees_equal(before, kept)
    assert_trees_equal(before, donated)


@pytest.mark.parametrize("fused", [False, True], ids=["chain", "fused"])
@pytest.mark.parametrize("clip,skip", [(0.5, 0), (None, 3), (0.5, 3)], ids=["clip", "skip", "clip+skip"])
def test_the_optimizer_keeps_the_norm_it_computed(clip, skip, fused):
    opt = fmoe.adamw(lr=1e-2, max_grad_norm=clip, skip_nonfinite=skip, fused=fused)
    params = tree(0)
    state = opt.init(params)
    assert float(fmoe.last_grad_norm(state)) == 0.0  # before the first update
    for seed in (1, 2):
        grads = tree(seed)
        grads["layers"][0]["moe"]["expert_bias"] = torch.zeros(3)
        expected = fmoe.global_norm(grads)
        params, state = opt.update(grads, state, params)
        assert torch.equal(fmoe.last_grad_norm(state), expected)  # the same reduction, not a second one
    if skip:  # a skipped step's norm is the non-finite one
        grads["w"][0, 0] = float("nan")
        _, state = opt.update(grads, state, params)
        assert torch.isnan(fmoe.last_grad_norm(state))
    # the chain and the fused kernel keep it in the same place
    other = fmoe.adamw(lr=1e-2, max_grad_norm=clip, skip_nonfinite=skip, fused=not fused)
    assert optree.tree_structure(other.init(tree(0))) == optree.tree_structure(opt.init(tree(0)))


def test_last_grad_norm_needs_an_optimizer_that_computes_one():
    with pytest.raises(ValueError, match="records no gradient norm"):
        fmoe.last_grad_norm(fmoe.adamw(lr=1e-2).init(tree(0)))
    # the outermost norm wins: apply_if_finite's (of the grads), not a clip's on Adam's updates inside
    opt = fmoe.optimizer(fmoe.apply_if_finite(fmoe.chain(fmoe.scale_by_adam(), fmoe.clip_by_global_norm(1.0)), 2))
    grads = tree(1)
    _, state = opt.update(grads, opt.init(tree(0)), tree(0))
    assert torch.equal(fmoe.last_grad_norm(state), fmoe.global_norm(grads))
    assert not torch.equal(state.inner_state[1].grad_norm, fmoe.global_norm(grads))


@pytest.mark.parametrize("fused", [False, True], ids=["chain", "fused"])
@pytest.mark.parametrize("kw", [dict(), dict(max_grad_norm=1.0), dict(max_grad_norm=1.0, skip_nonfinite=2)],
                         ids=["plain", "clip", "clip+skip"])
def test_adamw_states_are_named_and_a_positional_state_from_before_still_updates(fused, kw, tmp_path):
    # adamw's chain is a named_chain: its states are found by name. A checkpoint saved
    # before they were named holds a tuple in ADAMW_STATES order: fmoe.load renames it
    # once, and it updates exactly as the named one it stands for. update itself takes
    # only the named form (it migrates nothing on every step).
    from fmoe.optim.optimizers import ADAMW_STATES

    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=32, dim=32, heads=2, experts=4, ffn=16))
    opt = fmoe.adamw(lr=0.1, weight_decay=0.1, fused=fused, **kw)
    params = fmoe.init(plan, seed=0)
    grads = optree.tree_map(lambda t: torch.randn_like(t), params)
    state = opt.init(params)
    named = state.inner_state if "skip_nonfinite" in kw else state
    assert list(named) == [n for n in ADAMW_STATES if n != "clip" or "max_grad_norm" in kw]
    positional = tuple(named.values())
    if "skip_nonfinite" in kw:
        positional = state._replace(inner_state=positional)
    with pytest.raises(ValueError, match="migrate_state"):
        opt.update(grads, positional, params)
    fmoe.save(tmp_path / "old", plan, params, opt_state=positional)
    loaded = fmoe.load(tmp_path / "old", plan).opt_state
    assert optree.tree_structure(loaded) == optree.tree_structure(state)
    assert fmoe.optim.migrate_state(state) is state  # a current state is left as it is
    want = opt.update(grads, state, params)
    got = opt.update(grads, loaded, params)
    assert optree.tree_structure(got) == optree.tree_structure(want)
    assert_trees_equal(got, want)


def test_named_chain_threads_updates_in_order_and_refuses_a_repeated_name():
    t = fmoe.optim.named_chain(("scale", fmoe.optim.scale_by_learning_rate(0.5)),
                               ("decay", fmoe.optim.add_decayed_weights(0.1)))
    params, grads = tree(0), tree(1)
    updates, state = t.update(grads, t.init(params), params)
    assert list(state) == ["scale", "decay"]
    assert torch.equal(updates["w"], -0.5 * grads["w"] + 0.1 * params["w"])
    with pytest.raises(ValueError, match="named_chain names"):
        fmoe.optim.named_chain(("a", fmoe.optim.freeze()), ("a", fmoe.optim.freeze()))


@pytest.mark.parametrize("fused", [False, True], ids=["chain", "fused"])
def test_adamw_refuses_the_state_of_an_adamw_built_otherwise(fused):
    # a clipping optimizer handed a state without "clip" (e.g. resumed with other settings)
    params = tree(0)
    state = fmoe.adamw(lr=0.1, fused=fused).init(params)
    with pytest.raises(ValueError, match=r"the state holds \['adam', 'decay', 'freeze', 'lr'\].*'clip'"):
        fmoe.adamw(lr=0.1, max_grad_norm=1.0, fused=fused).update(tree(1), state, params)
