"""``adamw(moments="bfloat16")``: Adam's moments kept in bf16 between steps, computed in
fp32 (the chain, and ``fused=True``'s per-leaf kernel or its torch path), against a
float64 reference; donation, checkpoints, the planner's memory and the errors (a skipped
step: ``test_fused_adamw.py``'s, for both moment dtypes)."""

import math

import optree
import pytest
import torch

import fmoe
from fmoe.optim.adamw_kernel import adamw_leaf_

from .reference import assert_same_structure, assert_trees_close
from .test_fused_adamw import kernel_device, random_grads, random_tree, standalone
from .test_optim_finite import assert_bitwise

B1, B2, EPS, WD, LR = 0.9, 0.95, 1e-8, 0.1, 1e-2
BF16_ULP = 2.0 ** -7  # a moment rounded on either side of the reference's rounding


@pytest.fixture(autouse=True)
def torch_path_on_the_cpu(request, monkeypatch):
    # The CPU tests hold the torch path (under FMOE_TRITON_INTERPRET=1 the kernel would take
    # CPU tensors, and the interpreter truncates bf16 casts); the kernel's own test is below.
    if "gpu" not in request.keywords:
        monkeypatch.setenv("FMOE_FUSED_KERNELS", "0")


def reference_steps(params: dict, grads: list) -> tuple:
    """AdamW in float64 leaf by leaf, the moments rounded to bf16 after each step (the
    update uses them before the rounding); decay on every leaf but ``expert_bias``'s,
    which stays as it is (frozen), and none on vectors."""
    p = optree.tree_map(lambda t: t.double(), params)
    m = optree.tree_map(lambda t: torch.zeros_like(t, dtype=torch.bfloat16), params)
    v = optree.tree_map(lambda t: torch.zeros_like(t, dtype=torch.bfloat16), params)
    for t, g in enumerate(grads, start=1):
        def one(path, p_, m_, v_, g_):
            g64 = g_.double()
            m64 = B1 * m_.double() + (1 - B1) * g64
            v64 = B2 * v_.double() + (1 - B2) * g64 * g64
            frozen, decayed = path[-1] == "expert_bias", p_.dim() >= 2
            step = (m64 / (1 - B1 ** t)) / ((v64 / (1 - B2 ** t)).sqrt() + EPS) + (WD * p_ if decayed else 0)
            return (p_ if frozen else p_ - LR * step), m64.to(torch.bfloat16), v64.to(torch.bfloat16)

        out = optree.tree_map_with_path(one, p, m, v, g)
        p, m, v = (optree.tree_map(lambda o, i=i: o[i], out, is_leaf=lambda x: isinstance(x, tuple)) for i in range(3))
    return p, m, v


def grads_for(params, steps=3):
    return [random_grads(params, 20 + i) for i in range(steps)]


@pytest.mark.parametrize("fused", [False, True], ids=["chain", "fused"])
def test_bf16_moments_follow_the_float64_reference(fused):
    params = random_tree(0)
    grads = grads_for(params)
    opt = fmoe.adamw(lr=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, fused=fused, moments="bfloat16")
    state = opt.init(params)
    for g in grads:
        params, state = opt.update(g, state, params)
    want_p, want_m, want_v = reference_steps(random_tree(0), grads)
    adam = state["adam"]
    assert {t.dtype for t in optree.tree_leaves((adam.mu, adam.nu))} == {torch.bfloat16}
    assert {t.dtype for t in optree.tree_leaves(params)} == {torch.float32}
    # fp32 arithmetic against float64: the params within fp32 rounding of 3 steps
    assert_trees_close(params, optree.tree_map(lambda t: t.float(), want_p), context="params", rtol=1e-5, atol=1e-6)
    # the moments: the reference's bf16 rounding, or the neighbour where fp32 landed across a tie
    assert_trees_close(adam.mu, want_m, context="mu", rtol=BF16_ULP, atol=0)
    assert_trees_close(adam.nu, want_v, context="nu", rtol=BF16_ULP, atol=0)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_the_fused_bf16_update_equals_the_chain_and_donating_equals_pure(clip):
    def make(**kw):
        return fmoe.adamw(lr=fmoe.warmup_cosine(1e-2, 2, 10), weight_decay=WD, max_grad_norm=clip,
                          moments="bfloat16", **kw)

    chain, fused, donating = make(), make(fused=True), make(fused=True, donate=True)
    ref, pure, donated = random_tree(0), random_tree(0), random_tree(0)
    s_ref, s_pure, s_don = chain.init(ref), fused.init(pure), donating.init(donated)
    for i in range(3):
        old, kept = (pure, s_pure), standalone((pure, s_pure))
        ref, s_ref = chain.update(random_grads(ref, 10 + i), s_ref, ref)
        pure, s_pure = fused.update(random_grads(ref, 10 + i), s_pure, pure)
        assert_bitwise(old, kept)  # pure: its params and state are left alone
        ptrs = [t.data_ptr() for t in optree.tree_leaves((donated, s_don["adam"].mu, s_don["adam"].nu))]
        donated, s_don = donating.update(random_grads(ref, 10 + i), s_don, donated)
        assert [t.data_ptr() for t in optree.tree_leaves((donated, s_don["adam"].mu, s_don["adam"].nu))] == ptrs
    assert_same_structure(s_pure, s_ref)
    # the chain and the kernel order their fp32 operations differently
    assert_trees_close(pure, ref, context="params", rtol=1e-6, atol=1e-7)
    assert_trees_close(s_pure["adam"], s_ref["adam"], context="moments", rtol=BF16_ULP, atol=0)
    assert_bitwise((pure, s_pure), (donated, s_don))


def test_bf16_moments_hold_half_the_bytes():
    params = random_tree(0)
    sizes = {}
    for moments in ("float32", "bfloat16"):
        adam = fmoe.adamw(moments=moments).init(params)["adam"]
        sizes[moments] = sum(t.numel() * t.element_size() for t in optree.tree_leaves((adam.mu, adam.nu)))
    assert sizes["bfloat16"] * 2 == sizes["float32"]


def test_bf16_moments_round_trip_a_checkpoint_and_an_optimizer_of_the_other_setting_refuses_them(tmp_path):
    cfg = fmoe.ModelConfig(vocab=64, dim=32, heads=2, layers=2, experts=4, topk=2, ffn=16)
    plan = fmoe.Plan(model=cfg)
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=LR, weight_decay=WD, fused=True, moments="bfloat16")
    state = opt.init(params)
    out = fmoe.step(params, {"tokens": torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))},
                    plan)
    params, state = opt.update(out.grads, state, params)
    fmoe.save(tmp_path / "ck", plan, params, opt_state=state, step=1)
    back = fmoe.load(tmp_path / "ck", plan)
    assert_bitwise((back.params, back.opt_state), (params, state))
    for other in (fmoe.adamw(lr=LR, weight_decay=WD, fused=True), fmoe.adamw(lr=LR, weight_decay=WD)):
        with pytest.raises(ValueError, match=r"holds moments in \['bfloat16'\].*keeps them in 'float32'"):
            other.update(out.grads, back.opt_state, back.params)


def test_moments_outside_the_allowed_dtypes_are_refused_by_name():
    for bad in ("float16", "fp32", torch.bfloat16):
        with pytest.raises(ValueError, match="adamw moments=.* is invalid: must be one of 'float32', 'bfloat16'"):
            fmoe.adamw(moments=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scale"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32_grads", "bf16_grads"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32_moments", "bf16_moments"])
def test_the_adamw_kernel_matches_its_torch_path(scaled, grad_dtype, moments, monkeypatch):
    device = kernel_device()
    gen = torch.Generator().manual_seed(3)
    n = 5000  # not a multiple of the kernel's block
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 0.1).to(moments)
    v = (torch.rand(n, generator=gen) * 0.1).to(moments)
    step = torch.tensor(4.0)
    scalars = dict(lr=torch.tensor(1e-2), c1=1 - B1 ** step, c2=1 - B2 ** step, b1=B1, b2=B2, eps=EPS,
                   weight_decay=WD, grad_scale=torch.tensor(2.5) if scaled else None)
    ran = [t.clone().to(device) for t in (p, g, m, v)]
    adamw_leaf_(*ran, **{k: x.to(device) if isinstance(x, torch.Tensor) else x for k, x in scalars.items()})
    want = [p.clone(), g, m.clone(), v.clone()]
    monkeypatch.setenv("FMOE_FUSED_KERNELS", "0")  # the torch path
    adamw_leaf_(*want, **scalars)
    assert torch.equal(ran[1].cpu(), g)  # the gradient is read, never written
    torch.testing.assert_close(ran[0].cpu(), want[0], rtol=1e-6, atol=1e-7)
    # bf16: one rounding of the same fp32 value, or its neighbour across a tie; fp32: the
    # same operations fused (FMA) or not, a few ulps of the terms (|b1 m|, |(1 - b1) g| < 2)
    # where m's two terms cancel
    rtol, atol = (BF16_ULP, 0) if moments == torch.bfloat16 else (1e-6, 1e-6)
    for got, ref in ((ran[2], want[2]), (ran[3], want[3])):
        assert got.dtype == moments
        torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=rtol, atol=atol)
    assert math.isfinite(float(ran[0].sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32_moments", "bf16_moments"])
def test_the_adamw_kernel_writes_nothing_on_a_skipped_step(moments):
    # found_inf set (apply_if_finite skipping a step): the kernel returns before any store
    device = kernel_device()
    gen = torch.Generator().manual_seed(5)
    p, g = torch.randn(3000, generator=gen), torch.randn(3000, generator=gen)
    m, v = (torch.randn(3000, generator=gen) * 0.1).to(moments), (torch.rand(3000, generator=gen) * 0.1).to(moments)
    ran = [t.clone().to(device) for t in (p, g, m, v)]
    scalars = dict(lr=torch.tensor(1e-2), c1=torch.tensor(0.1), c2=torch.tensor(0.05), grad_scale=torch.tensor(2.0),
                   found_inf=torch.tensor(1.0))
    adamw_leaf_(*ran, b1=B1, b2=B2, eps=EPS, weight_decay=WD, **{k: x.to(device) for k, x in scalars.items()})
    for got, before in zip(ran, (p, g, m, v)):
        assert torch.equal(got.cpu(), before)


def test_the_planner_counts_bf16_moments_at_half_the_bytes():
    from fmoe.plan.memory import estimate_memory

    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=64, dim=32, heads=2, layers=2, experts=4, topk=2, ffn=16))
    fp32, bf16 = (estimate_memory(plan, rows=4, seq=16, moments=m) for m in ("float32", "bfloat16"))
    assert bf16["optimizer"] * 2 == fp32["optimizer"] == 2 * fp32["params"]
    assert fp32["total"] - bf16["total"] == bf16["optimizer"]
    with pytest.raises(ValueError, match="moments='float16' is invalid"):
        estimate_memory(plan, rows=4, seq=16, moments="float16")
