"""Parameters in flat storage: ``init``/``as_flat`` lay leaves into per-unit buffers,
``step`` uses them without copying and computes exactly what it computes from
standalone leaves, and ``adamw(fused=True)`` keeps them flat, purely or donating."""

import optree
import pytest
import torch

import fmoe
from fmoe.params import named_leaves
from fmoe.shard.spec import shard_spec, stored_shard

from .test_optim_finite import assert_bitwise

CFG = fmoe.ModelConfig(vocab=64, dim=32, heads=2, layers=2, experts=4, topk=2, ffn=16)


def plan(**kw):
    return fmoe.Plan(model=CFG, **kw)


def batch(seed=0):
    return {"tokens": torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(seed))}


def buffers(params, p):
    """``stored_shard`` of every unit and group: the buffer its leaves live in, or None."""
    spec, named = shard_spec(p), named_leaves(params)
    return [stored_shard(named, layout, 0, False) for u in spec.units for layout in u.groups.values()]


def standalone(params):
    return optree.tree_map(lambda t: t.clone(), params)


def test_init_puts_every_leaf_in_its_units_buffer_and_as_flat_keeps_values():
    p = plan(dtype="float32")
    params = fmoe.init(p, seed=3)
    found = buffers(params, p)
    assert all(b is not None for b in found) and len(found) == sum(len(u.groups) for u in shard_spec(p).units)
    assert fmoe.as_flat(params, p) is params
    loose = standalone(params)
    assert all(b is None for b in buffers(loose, p))
    again = fmoe.as_flat(loose, p)
    assert all(b is not None for b in buffers(again, p))
    assert_bitwise(again, params)
    for b in buffers(again, p):  # padding between leaves is zero, never stale memory
        covered = torch.zeros(b.numel(), dtype=torch.bool)
        for leaf in named_leaves(again).values():
            if leaf._base is b:
                off = leaf.storage_offset() - b.storage_offset()
                covered[off:off + leaf.numel()] = True
        assert torch.equal(b[~covered], torch.zeros(int((~covered).sum())))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_from_flat_storage_equals_step_from_standalone_leaves(dtype):
    p = plan(dtype=dtype, microbatches=2)
    params = fmoe.init(p, seed=1)
    flat_out = fmoe.step(params, batch(), p)
    loose_out = fmoe.step(standalone(params), batch(), p)
    assert torch.equal(flat_out.loss, loose_out.loss)
    assert_bitwise(flat_out.grads, loose_out.grads)


def test_step_reads_flat_fp32_params_in_place_and_changes_nothing(monkeypatch):
    import fmoe.shard.lifecycle as lc

    p = plan(dtype="float32")
    params = fmoe.init(p, seed=2)
    before = standalone(params)
    built = []
    real = lc.build_shards
    monkeypatch.setattr(lc, "build_shards", lambda *a: built.append(real(*a)) or built[-1])
    fmoe.step(params, batch(), p)
    ptrs = {b.data_ptr() for b in buffers(params, p)}
    assert {s.data_ptr() for unit in built[0].values() for s in unit.values()} == ptrs
    assert_bitwise(params, before)


def flat_tree(seed, pad=3):
    """A small pytree whose leaves view one buffer, ``pad`` zeros between leaves."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"b": (6, 3), "layers": [{"moe": {"expert_bias": (3,), "norm": (5,)}}], "w": (4, 5)}
    leaves, treedef = optree.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    n = sum(torch.Size(s).numel() + pad for s in leaves)
    base, views, off = torch.zeros(n), [], pad
    for s in leaves:
        k = torch.Size(s).numel()
        views.append(base[off:off + k].view(s))
        views[-1].copy_(torch.randn(s, generator=g))
        off += k + pad
    return optree.tree_unflatten(treedef, views)


def grads_like(params, seed):
    """Grads laid out like ``params``' buffer (as fmoe.step returns them), random values."""
    base = params["w"]._base
    g = torch.zeros_like(base)
    out = optree.tree_map(lambda t: g[t.storage_offset() - base.storage_offset():][:t.numel()].view(t.shape), params)
    for leaf in optree.tree_leaves(out):
        leaf.copy_(torch.randn(leaf.shape, generator=torch.Generator().manual_seed(seed)) * 3)
    out["layers"][0]["moe"]["expert_bias"].zero_()
    return out


@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_fused_adamw_over_buffers_equals_per_leaf_and_keeps_them_flat(clip):
    opt = fmoe.adamw(lr=fmoe.warmup_cosine(1e-2, 2, 10), weight_decay=0.1, max_grad_norm=clip, fused=True)
    donating = fmoe.adamw(lr=fmoe.warmup_cosine(1e-2, 2, 10), weight_decay=0.1, max_grad_norm=clip, fused=True,
                          donate=True)
    flat = flat_tree(0)
    loose = standalone(flat)
    given = standalone(flat)
    donated = flat_tree(0)
    s_flat, s_loose, s_don = opt.init(flat), opt.init(loose), donating.init(donated)
    assert s_flat["adam"].mu["w"]._base is not None  # moments laid out like the params
    for i in range(3):
        g = grads_like(flat, 10 + i)
        g_don = grads_like(donated, 10 + i)
        flat, s_flat = opt.update(g, s_flat, flat)
        loose, s_loose = opt.update(standalone(g), s_loose, loose)
        ptr = donated["w"].data_ptr()
        donated, s_don = donating.update(g_don, s_don, donated)
        assert donated["w"].data_ptr() == ptr  # written where it was
        if i == 0:
            assert_bitwise(given, flat_tree(0))  # the pure update left its inputs alone
    # The kernel is elementwise, but its vector/scalar split falls elsewhere in one
    # buffer than in one tensor per leaf: equal up to fp32 rounding, not bitwise.
    for a, b in zip(optree.tree_leaves((flat, s_flat)), optree.tree_leaves((loose, s_loose))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert_bitwise((flat, s_flat), (donated, s_don))
    bases = {id(t._base) for t in optree.tree_leaves(flat)}
    assert len(bases) == 1 and None not in {t._base for t in optree.tree_leaves(flat)}
    assert torch.equal(flat["layers"][0]["moe"]["expert_bias"], flat_tree(0)["layers"][0]["moe"]["expert_bias"])


def test_donated_skip_of_a_bad_step_writes_no_bit():
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, fused=True, donate=True, skip_nonfinite=2)
    params = flat_tree(1)
    state = opt.init(params)
    params, state = opt.update(grads_like(params, 5), state, params)
    before = standalone((params, state.inner_state))
    bad = grads_like(params, 6)
    bad["b"][2, 1] = float("nan")
    params, state = opt.update(bad, state, params)
    assert_bitwise((params, state.inner_state), before)
    assert [int(n) for n in fmoe.skipped_steps(state)] == [1, 1]


def test_moments_from_elsewhere_are_moved_into_buffers_once():
    opt = fmoe.adamw(lr=1e-2, fused=True)
    params = flat_tree(2)
    state = opt.init(standalone(params))  # e.g. a state read from a checkpoint: standalone leaves
    assert state["adam"].mu["w"]._base is None
    g = grads_like(params, 3)
    new, new_state = opt.update(g, state, params)
    ref, ref_state = opt.update(g, opt.init(params), params)
    assert new_state["adam"].mu["w"]._base is not None
    for a, b in zip(optree.tree_leaves((new, new_state)), optree.tree_leaves((ref, ref_state))):
        assert torch.equal(a, b)


def test_donate_needs_fused():
    with pytest.raises(ValueError, match="adamw donate=True is invalid: must be False, or True with fused=True"):
        fmoe.adamw(donate=True)


def test_a_training_step_with_donation_matches_the_pure_one():
    p = plan(dtype="float32")
    pure, donating = (fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, fused=True, donate=d, plan=p)
                      for d in (False, True))
    a = b = fmoe.init(p, seed=4)
    b = standalone(b)
    b = fmoe.as_flat(b, p)
    sa, sb = pure.init(a), donating.init(b)
    for i in range(2):
        a, sa = pure.update(fmoe.step(a, batch(i), p).grads, sa, a)
        b, sb = donating.update(fmoe.step(b, batch(i), p).grads, sb, b)
    assert_bitwise((a, sa), (b, sb))
    assert all(x is not None for x in buffers(b, p))


def _copy_warnings(params, p):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fmoe.step(params, batch(), p)
    return [str(w.message) for w in seen if "copied unit group" in str(w.message)]


def test_a_step_that_has_to_copy_a_unit_group_says_so_once(monkeypatch):
    import fmoe.shard.lifecycle as lc

    monkeypatch.setattr(lc, "_REPORTED_COPIES", set())  # as in a fresh process
    p = plan(dtype="float32")
    params = fmoe.init(p, seed=5)
    counts = fmoe.step(params, batch(), p).metrics["expert_counts"]
    # the donated bias update keeps flat storage: nothing to copy, nothing said
    params = fmoe.update_expert_bias(params, counts, 0.01, donate=True)
    assert _copy_warnings(params, p) == []
    # params with no leaf in flat storage (built by hand, or adamw's chain) are copied as documented, silently
    assert _copy_warnings(standalone(params), p) == []
    # the pure one replaces the bias leaves by new tensors: their unit groups are copied
    params = fmoe.update_expert_bias(params, counts, 0.01)
    said = _copy_warnings(params, p)
    assert len(said) == 1 and "layers.0 (dense, compute), layers.1 (dense, compute) into new flat" in said[0]
    assert "embed" not in said[0] and "fmoe.as_flat" in said[0] and "donate=True" in said[0]
    assert _copy_warnings(params, p) == []  # once per process and unit group, not once per step
    assert _copy_warnings(fmoe.as_flat(params, p), p) == []
