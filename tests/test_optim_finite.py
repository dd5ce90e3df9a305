"""fmoe.optim.apply_if_finite and adamw(skip_nonfinite=n): a step whose gradients hold a
NaN or an inf changes no bit of params or state, is counted, and after n in a row the
next one is applied; no update reads a value back to the host; the norm is computed
once per step; every rank takes the same decision; the state checkpoints.
(The settings' validation is in test_bad_inputs.py.)"""

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fmoe
from fmoe.optim import ApplyIfFiniteState, apply_if_finite, skipped_steps

from .ranks.harness import run_ranks

NAN, INF = float("nan"), float("inf")
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["chain", "fused"])


def tree(seed):
    g = torch.Generator().manual_seed(seed)
    t = {"w": torch.randn(4, 5, generator=g), "b": torch.randn(6, 3, generator=g),
         "layers": [{"moe": {"expert_bias": torch.randn(3, generator=g), "norm": torch.randn(5, generator=g)}}]}
    t["w"][0, 0] = -0.0  # a skip that adds +0.0 instead of keeping the old bits turns this into +0.0
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern (NaN payloads and signed zeros compare as what they are)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_bitwise(a, b):
    assert optree.tree_structure(a) == optree.tree_structure(b)
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y))


def poisoned(grads, value):
    bad = optree.tree_map(torch.clone, grads)
    bad["b"][2, 1] = value
    return bad


def counts(state):
    return [int(n) for n in skipped_steps(state)]


def make(fused, clip, max_skips=3):
    sched = fmoe.warmup_cosine(1e-2, warmup=2, total=10)
    return fmoe.adamw(lr=sched, weight_decay=0.1, max_grad_norm=clip, fused=fused, skip_nonfinite=max_skips)


def small_model():
    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=32, dim=32, heads=2, experts=4, ffn=16))
    return plan, fmoe.init(plan, seed=0), {"tokens": torch.randint(0, 32, (2, 9), generator=torch.Generator())}


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
@FUSED
def test_a_bad_step_changes_no_bit_and_the_run_goes_on_as_without_it(fused, clip, bad):
    opt = make(fused, clip)
    grads = [tree(10 + i) for i in range(3)]
    params_a = params_b = tree(0)
    state_a = state_b = opt.init(params_a)
    for i, g in enumerate(grads):
        params_a, state_a = opt.update(g, state_a, params_a)
        if i == 1:  # run B sees a poisoned step between the first and second good ones
            before = (params_b, state_b.inner_state)
            params_b, state_b = opt.update(poisoned(g, bad), state_b, params_b)
            assert_bitwise((params_b, state_b.inner_state), before)
            assert counts(state_b) == [1, 1] and not bool(state_b.last_finite) and not bool(state_b.applied)
        params_b, state_b = opt.update(g, state_b, params_b)
    # inner_state holds Adam's moments and count and the schedule's count
    assert_bitwise((params_a, state_a.inner_state), (params_b, state_b.inner_state))
    assert counts(state_b) == [0, 1] and bool(state_b.last_finite)


@FUSED
def test_nan_params_from_a_real_step_are_left_exactly_as_they_were(fused):
    plan, params, batch = small_model()
    params["layers"][1]["moe"]["norm"][7] = NAN
    out = fmoe.step(params, batch, plan)
    assert not torch.isfinite(out.loss)
    opt = fmoe.adamw(lr=1e-3, max_grad_norm=1.0, fused=fused, skip_nonfinite=2)
    state = opt.init(params)
    new, new_state = opt.update(out.grads, state, params)
    assert_bitwise(new, params)
    assert_bitwise(new_state.inner_state, state.inner_state)
    assert counts(new_state) == [1, 1]


@FUSED
def test_after_max_skips_in_a_row_the_next_bad_update_is_applied_and_a_finite_step_resets(fused):
    opt = fmoe.adamw(lr=1e-2, fused=fused, skip_nonfinite=2)
    params = tree(0)
    state = opt.init(params)
    nan = poisoned(tree(1), NAN)
    for expected in (1, 2):
        new, state = opt.update(nan, state, params)
        assert_bitwise(new, params)
        assert counts(state) == [expected, expected]
    params, state = opt.update(nan, state, params)  # the third in a row: given up, applied
    assert bool(state.applied) and torch.isnan(params["b"][2, 1]) and torch.isfinite(params["w"]).all()
    assert counts(state) == [3, 3]
    _, state = opt.update(tree(2), state, tree(0))
    assert counts(state) == [0, 3]
    _, state = opt.update(nan, state, tree(0))  # protected again after a finite step
    assert counts(state) == [1, 4] and not bool(state.applied)


def test_inside_a_chain_a_skip_keeps_params_and_the_wrapped_state():
    # later transforms still run (here: weight decay, which would move the params), but
    # the Optimizer keeps the params wherever an apply_if_finite skipped
    opt = fmoe.optimizer(fmoe.chain(apply_if_finite(fmoe.scale_by_adam(), max_skips=2),
                                    fmoe.optim.add_decayed_weights(0.1), fmoe.optim.scale_by_learning_rate(0.1)))
    params = tree(0)
    state = opt.init(params)
    new, new_state = opt.update(poisoned(tree(1), INF), state, params)
    assert_bitwise(new, params)
    assert_bitwise(new_state[0].inner_state, state[0].inner_state)
    assert counts(new_state) == [1, 1]
    new, _ = opt.update(tree(1), new_state, params)
    assert not torch.equal(new["w"], params["w"])


class _HostReads(TorchDispatchMode):
    """Records the ops that hand a tensor's value to Python: ``.item()``, ``bool()``,
    ``float()``, ``int()``, ``if t:`` (all ``_local_scalar_dense``) and ``torch.equal``."""

    READS = ("aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


# skip_nonfinite: apply_if_finite around the chain (3), or the default's record in Adam's state (None)
SKIPS = pytest.mark.parametrize("skips", [3, None], ids=["max_skips", "default"])


def finite_record(state) -> ApplyIfFiniteState:
    return state if isinstance(state, ApplyIfFiniteState) else state["adam"].skips


@SKIPS
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
@FUSED
def test_an_update_reads_no_value_back_to_the_host(fused, clip, skips):
    opt = make(fused, clip, skips)
    params = tree(0)
    state = opt.init(params)
    with _HostReads() as reads:
        for g in (tree(1), poisoned(tree(2), NAN), tree(3)):
            params, state = opt.update(g, state, params)
        bool(finite_record(state).last_finite)  # the probe sees this one read, so it would see one in the update
    assert reads.seen == ["aten._local_scalar_dense.default"]
    # Meta tensors have no values at all: .tolist(), .cpu() or .item() raise on them.
    meta = optree.tree_map(lambda t: t.to("meta"), tree(0))
    opt = fmoe.adamw(lr=1e-2 if fused else fmoe.warmup_cosine(1e-2, 2, 10),  # no meta kernel for a tensor lr
                     max_grad_norm=clip, fused=fused, skip_nonfinite=skips)
    opt.update(meta, opt.init(meta), meta)


@SKIPS
@pytest.mark.parametrize("fused,clip", [(False, 0.5), (True, 0.5), (False, None), (True, None)])
def test_the_norm_is_computed_once_per_step(monkeypatch, fused, clip, skips):
    calls = []

    def counting(self, tree, _real=fmoe.optim.transforms.NormFn.__call__):
        calls.append(1)
        return _real(self, tree)

    monkeypatch.setattr(fmoe.optim.transforms.NormFn, "__call__", counting)  # every norm goes through one
    opt = make(fused, clip, skips)
    params = tree(0)
    state = opt.init(params)
    for g in (tree(1), poisoned(tree(2), NAN)):
        params, state = opt.update(g, state, params)
    assert len(calls) == 2 and counts(state) == [1, 1]


def test_apply_if_finite_wraps_any_transform_and_its_state_checkpoints_and_resumes(tmp_path):
    # the clip after Adam sees Adam's updates, not the grads: it computes its own norm
    opt = fmoe.optimizer(apply_if_finite(fmoe.chain(fmoe.scale_by_adam(), fmoe.clip_by_global_norm(1.0)),
                                         max_skips=4))
    plan, params, batch = small_model()
    state = opt.init(params)
    grads = fmoe.step(params, batch, plan).grads
    params, state = opt.update(grads, state, params)
    params, state = opt.update(optree.tree_map(lambda g: g * INF, grads), state, params)
    assert isinstance(state, ApplyIfFiniteState) and counts(state) == [1, 1]
    fmoe.save(tmp_path / "ck", plan, params, opt_state=state, step=2)
    loaded = fmoe.load(tmp_path / "ck", plan)
    assert_bitwise(loaded.opt_state, state)
    assert_bitwise(opt.update(grads, loaded.opt_state, loaded.params), opt.update(grads, state, params))


def _without_record(state):
    """The state less its record of skipped steps (what a skipped step keeps bit for bit)."""
    if isinstance(state, ApplyIfFiniteState):
        return state.inner_state
    return dict(state, adam=state["adam"]._replace(skips=None))


def _rank_skips(rank, world, skips):
    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=32, dim=32, heads=2, experts=4, ffn=16), dp=world,
                     sharding="optim_grads_params")
    params = fmoe.init(plan, seed=0)
    batch = {"tokens": torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))}
    grads = fmoe.step(params, batch, plan).grads
    if rank == 1:  # only this rank's shard holds the NaN
        grads["layers"][1]["moe"]["experts"]["fc2"].view(-1)[0] = NAN
    # apply_if_finite reads the clip's plan-wide norm; the default with no plan and no clip
    # checks each rank's own gradients, then all-reduces one flag
    opt = fmoe.adamw(lr=1e-2, max_grad_norm=1.0, plan=plan, skip_nonfinite=3) if skips else fmoe.adamw(lr=1e-2)
    state = opt.init(params)
    new, new_state = opt.update(grads, state, params)
    after = optree.tree_leaves((new, _without_record(new_state)))
    before = optree.tree_leaves((params, _without_record(state)))
    unchanged = all(torch.equal(bits(a), bits(b)) for a, b in zip(after, before))
    return {"unchanged": unchanged, "skipped": counts(new_state)}


@SKIPS
def test_every_rank_skips_when_one_rank_has_a_nan(skips):
    assert run_ranks(2, _rank_skips, skips) == [{"unchanged": True, "skipped": [1, 1]}] * 2
