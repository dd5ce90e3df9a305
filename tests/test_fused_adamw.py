"""``adamw(fused=True)``: torch's multi-tensor AdamW over every leaf (on CUDA the per-leaf
kernel of ``fmoe.optim.adamw_kernel``), pure or donating;
and the flat shards a step builds from plain params (leaves at their slots, cast,
padding zeroed, the params never written)."""

import optree
import pytest
import torch

import fmoe
from fmoe.params import named_leaves
from fmoe.resolve import resolve
from fmoe.shard.spec import local_leaf, write_shard

from .reference import assert_trees_close, assert_trees_equal
from .test_optim_finite import assert_bitwise

CFG = fmoe.ModelConfig(vocab=64, dim=32, heads=2, layers=2, experts=4, topk=2, ffn=16)


def plan(**kw):
    return fmoe.Plan(model=CFG, **kw)


def batch(seed=0):
    return {"tokens": torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(seed))}


def standalone(params):
    return optree.tree_map(lambda t: t.clone(), params)


def test_init_gives_every_leaf_its_own_storage():
    params = fmoe.init(plan(), seed=3)
    leaves = optree.tree_leaves(params)
    assert all(t.is_contiguous() and t.dtype == torch.float32 for t in leaves)
    assert len({t.untyped_storage().data_ptr() for t in leaves}) == len(leaves)
    assert_bitwise(fmoe.init(plan(), seed=3), params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_shard_casts_each_leaf_into_its_slot_and_zeroes_the_padding(dtype):
    p = plan(dp=2, sharding="optim_grads_params")
    full = fmoe.init(plan(), seed=7)  # every rank's rows come from the full leaves
    spec = resolve(p).spec
    assert sum(len(layout.gaps) for u in spec.units for layout in u.groups.values()) > 4  # padding to zero
    for u in spec.units:
        for (domain, _), layout in u.groups.items():
            for rank in range(2):
                named = {s.path: spec.shard_leaf(named_leaves(full)[s.path], s.path, rank) for s in layout.slots}
                out = write_shard(named, layout, rank, torch.full((layout.shard_size,), float("nan"), dtype=dtype))
                covered = torch.zeros(layout.shard_size, dtype=torch.bool)
                for i, slot in enumerate(layout.slots):
                    view = local_leaf(out, layout, i, rank, sharded=True)
                    assert torch.equal(view, named[slot.path].reshape(view.shape).to(dtype))
                    if view.numel():
                        off = view.storage_offset()
                        covered[off:off + view.numel()] = True
                assert torch.equal(out[~covered], torch.zeros(int((~covered).sum()), dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_never_writes_into_the_params_it_is_given(dtype):
    p = plan(dtype=dtype, microbatches=2)
    params = fmoe.init(p, seed=2)
    before = standalone(params)
    out = fmoe.step(params, batch(), p)
    assert_bitwise(params, before)
    ptrs = {t.untyped_storage().data_ptr() for t in optree.tree_leaves(params)}
    assert not ptrs & {g.untyped_storage().data_ptr() for g in optree.tree_leaves(out.grads)}


def random_tree(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {"b": (6, 3), "layers": [{"moe": {"expert_bias": (3,), "norm": (5,)}}], "w": (4, 5)}
    return optree.tree_map(lambda s: torch.randn(s, generator=g), shapes, is_leaf=lambda x: isinstance(x, tuple))


def random_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    out = optree.tree_map(lambda t: torch.randn(t.shape, generator=g) * 3, params)
    out["layers"][0]["moe"]["expert_bias"].zero_()
    return out


@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_fused_adamw_equals_the_chain_and_donating_equals_pure(clip):
    def make(**kw):
        return fmoe.adamw(lr=fmoe.warmup_cosine(1e-2, 2, 10), weight_decay=0.1, max_grad_norm=clip, **kw)

    chain, fused, donating = make(), make(fused=True), make(fused=True, donate=True)
    ref, pure, donated = random_tree(0), random_tree(0), random_tree(0)
    s_ref, s_pure, s_don = chain.init(ref), fused.init(pure), donating.init(donated)
    for i in range(3):
        old, kept = (pure, s_pure), standalone((pure, s_pure))
        g, g_pure = random_grads(ref, 10 + i), random_grads(ref, 10 + i)
        ref, s_ref = chain.update(g, s_ref, ref)
        pure, s_pure = fused.update(g_pure, s_pure, pure)
        assert_bitwise(old, kept)  # the pure update left its params, state and grads alone
        assert_bitwise(g_pure, random_grads(ref, 10 + i))

        def storage(tree, state):
            return [t.data_ptr() for t in optree.tree_leaves((tree, state["adam"].mu, state["adam"].nu))]

        ptrs = storage(donated, s_don)
        donated, s_don = donating.update(random_grads(ref, 10 + i), s_don, donated)
        assert storage(donated, s_don) == ptrs  # written where they were
    # torch's kernel and the chain order their float ops differently: equal up to fp32 rounding
    assert_trees_close((pure, s_pure), (ref, s_ref), rtol=1e-6, atol=1e-7)
    assert_bitwise((pure, s_pure), (donated, s_don))
    assert torch.equal(pure["layers"][0]["moe"]["expert_bias"], random_tree(0)["layers"][0]["moe"]["expert_bias"])
    # pure: no leaf of the result is a tensor passed in, frozen ones included
    given = random_tree(0)
    out, _ = fused.update(random_grads(given, 9), fused.init(given), given)
    assert not {id(t) for t in optree.tree_leaves(out)} & {id(t) for t in optree.tree_leaves(given)}


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_donated_skip_of_a_bad_step_writes_no_bit(moments):
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, fused=True, donate=True, skip_nonfinite=2,
                     moments=moments)
    params = random_tree(1)
    state = opt.init(params)
    params, state = opt.update(random_grads(params, 5), state, params)
    before = standalone((params, state.inner_state))
    bad = random_grads(params, 6)
    bad["b"][2, 1] = float("nan")
    params, state = opt.update(bad, state, params)
    assert_bitwise((params, state.inner_state), before)
    assert [int(n) for n in fmoe.skipped_steps(state)] == [1, 1]


def test_donate_needs_fused():
    with pytest.raises(ValueError, match="adamw donate=True is invalid: must be False, or True with fused=True"):
        fmoe.adamw(donate=True)


def test_a_training_step_with_donation_matches_the_pure_one():
    p = plan(dtype="float32")
    pure, donating = (fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, fused=True, donate=d, plan=p)
                      for d in (False, True))
    a, b = fmoe.init(p, seed=4), fmoe.init(p, seed=4)
    ptrs = [t.data_ptr() for t in optree.tree_leaves(b)]
    sa, sb = pure.init(a), donating.init(b)
    for i in range(2):
        a, sa = pure.update(fmoe.step(a, batch(i), p).grads, sa, a)
        b, sb = donating.update(fmoe.step(b, batch(i), p).grads, sb, b)
        b = fmoe.update_expert_bias(b, torch.tensor([[3, 1, 2, 2], [1, 1, 4, 2]]), 0.01, donate=True)
        a = fmoe.update_expert_bias(a, torch.tensor([[3, 1, 2, 2], [1, 1, 4, 2]]), 0.01)
    assert_bitwise((a, sa), (b, sb))
    assert [t.data_ptr() for t in optree.tree_leaves(b)] == ptrs


def kernel_device() -> str:
    """Where ``adamw_leaf_``'s Triton kernel runs here: CUDA, or the CPU under
    FMOE_TRITON_INTERPRET=1 (whose interpreter truncates the bf16 casts where compiled
    code rounds: one bf16 ulp either way); skips the test otherwise."""
    from fmoe.layers import triton_kernels as tk

    device = "cpu" if tk.INTERPRET else "cuda"
    if tk.triton is None or not tk.fused_kernels_available(torch.empty(0, device=device)):
        pytest.skip("needs Triton on CUDA, or FMOE_TRITON_INTERPRET=1")
    return device


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_the_fused_update_on_cuda_equals_the_chain_and_leaves_the_gradients_alone(clip):
    # on CUDA fused=True runs adamw_kernel's per-leaf kernel (fp32 moments here; bf16 ones
    # take the same path, test_bf16_moments.py): three steps against the chain, which orders
    # its fp32 operations otherwise; the gradients passed in are left as they were
    # (torch's fused kernel unscaled them in place)
    device = kernel_device()

    def make(**kw):
        return fmoe.adamw(lr=fmoe.warmup_cosine(1e-2, 2, 10), weight_decay=0.1, max_grad_norm=clip, **kw)

    def on(tree):
        return optree.tree_map(lambda t: t.to(device), tree)

    chain, fused = make(), make(fused=True)
    ref, got = random_tree(0), on(random_tree(0))
    s_ref, s_got = chain.init(ref), fused.init(got)
    for i in range(3):
        grads = random_grads(ref, 10 + i)
        ref, s_ref = chain.update(grads, s_ref, ref)
        on_device = on(grads)
        got, s_got = fused.update(on_device, s_got, got)
        assert_trees_equal(optree.tree_map(torch.Tensor.cpu, on_device), grads, context="the gradients passed in")
    got, adam = optree.tree_map(torch.Tensor.cpu, (got, s_got["adam"]))
    assert_trees_close(got, ref, context="params", rtol=1e-5, atol=1e-7)
    assert_trees_close(adam, s_ref["adam"], context="moments", rtol=1e-5, atol=1e-12)
