"""Memory: ``Plan.remat='full'`` (recompute each layer before its backward),
``'selective'`` (kernels keep their GEMM outputs and recompute the elementwise work in
their backward) and ``Plan.loss_chunk`` (the head's loss piece by piece), on one process.

Recomputation re-runs the same kernels on the same inputs, so a step is bitwise the
``remat='none'`` step (fp32 on CPU), under either policy. The chunked loss computes each token's loss with
the same operations as the whole one; the matmuls over a piece may round differently
from the matmul over all tokens, and the head weight's gradient sums the pieces in
fp32, so it is a few fp32 roundings away (asserted at 1e-5 relative per leaf, measured
~2e-7), and exact up to float64 rounding in float64.
"""

import collections
import weakref

import optree
import pytest
import torch

import fmoe
from fmoe.layers.loss import cross_entropy_sum, linear_cross_entropy_sum
from fmoe.resolve import resolve
from fmoe.schedule import Backward, Node, Recompute

from . import reference as ref


def build_program(plan):
    return list(resolve(plan).train.actions)


PLAIN = fmoe.ModelConfig(vocab=64, dim=32, layers=2, heads=2, experts=4, topk=2, ffn=16, shared_ffn=8,
                         expert_biases=True, aux_loss_coef=0.01, z_loss_coef=0.001)
# GQA, per-head q/k norm, gated shared expert, GeGLU, probabilities in the activation,
# static capacity (dropped tokens), tied embeddings.
FANCY = fmoe.ModelConfig(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, head_size=16, qk_norm="head",
                         experts=4, topk=2, ffn=16, shared_ffn=16, shared_gate=True, activation="geglu",
                         prob_placement="activation", capacity_factor=1.0, tie_embeddings=True,
                         aux_loss_coef=0.01)
PLANS = {"plain": dict(), "2 microbatches": dict(microbatches=2),
         "1f1b + delayed wgrad": dict(microbatches=2, schedule="1f1b_overlap", delay_wgrad=True),
         "zero3 + double buffers": dict(microbatches=2, sharding="optim_grads_params", gather_buffers="double")}


def batch(seed=0, rows=4, seq=16, vocab=64):
    return {"tokens": torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))}


def assert_bitwise(a, b):
    assert torch.equal(a.loss, b.loss)
    ref.assert_trees_equal(a.grads, b.grads)


@pytest.mark.parametrize("remat", ["full", "selective"])
@pytest.mark.parametrize("cfg", [PLAIN, FANCY], ids=["plain", "fancy"])
@pytest.mark.parametrize("kw", PLANS.values(), ids=PLANS.keys())
def test_remat_is_bitwise_no_remat(cfg, kw, remat):
    plan = fmoe.Plan(model=cfg, **kw)
    params = ref.random_params(cfg, seed=4, dtype=torch.float32)
    tokens = batch(seed=7)
    assert_bitwise(fmoe.step(params, tokens, plan.replace(remat=remat)), fmoe.step(params, tokens, plan))


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_remat_under_compile_is_bitwise_compiled_no_remat(remat):
    plan = fmoe.Plan(model=FANCY, microbatches=2, compile=True)
    params = ref.random_params(FANCY, seed=4, dtype=torch.float32)
    tokens = batch(seed=8)
    assert_bitwise(fmoe.step(params, tokens, plan.replace(remat=remat)), fmoe.step(params, tokens, plan))


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """How often each aten op (overload packet) runs, forward and backward."""

    def __init__(self):
        super().__init__()
        self.runs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def test_selective_remat_reruns_the_elementwise_work_and_no_gemm():
    # SwiGLU (its silu), the norms (their rsqrt) and the router's softmax run again
    # in the backward; every matmul, grouped matmul and attention kernel runs as
    # often as without remat: their outputs are what is kept.
    cfg = PLAIN.replace(shared_ffn=0)
    plan = fmoe.Plan(model=cfg, microbatches=2)
    params, tokens = ref.random_params(cfg, seed=4, dtype=torch.float32), batch(seed=3)
    runs = {}
    for remat in ("none", "selective"):
        with _CountOps() as counter:
            fmoe.step(params, tokens, plan.replace(remat=remat))
        runs[remat] = counter.runs
    aten = torch.ops.aten
    for op in (aten.mm, aten.bmm, aten._scaled_dot_product_flash_attention_for_cpu):
        assert runs["selective"][op] == runs["none"][op], op
    for op in (aten.silu, aten.rsqrt, aten._softmax):
        assert runs["selective"][op] > runs["none"][op], op


def test_selective_recompute_runs_inside_the_nodes_backward():
    plan = fmoe.Plan(model=PLAIN, remat="selective")
    assert build_program(plan) == build_program(plan.replace(remat="none"))  # no action of its own
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fmoe.step(fmoe.init(plan, seed=0), batch(), plan)
    events = prof.events()
    backward = [e for e in events if e.name == "fmoe backward layers.1.experts mb0"]
    recomputed = [e for e in events if e.name == "fmoe selective experts"
                  and backward[0].time_range.start <= e.time_range.start <= backward[0].time_range.end]
    assert len(backward) == 1 and len(recomputed) == 1


def test_the_program_recomputes_each_layer_right_before_its_backward():
    plan = fmoe.Plan(model=PLAIN, microbatches=2, remat="full")
    program = build_program(plan)
    for mb in range(2):
        for i in range(PLAIN.layers):
            at = program.index(Recompute(Node("layer", i), mb, f"layers.{i}"))
            assert program[at + 1] == Backward(Node("combine", i), mb, None)
    assert not [a for a in build_program(plan.replace(remat="none")) if isinstance(a, Recompute)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fmoe.step(fmoe.init(plan, seed=0), batch(), plan)
    assert "fmoe recompute layers.1 mb0" in {e.name for e in prof.events()}


class _Saved:
    """What autograd keeps for one saved tensor (only the graph refers to it)."""

    def __init__(self, t):
        self.t = t


def test_full_remat_keeps_only_layer_inputs_until_the_backward():
    # The bytes autograd still holds when the first backward starts: with remat the
    # layers' forwards run under autograd but drop their graphs at once (their inputs
    # are kept by the executor), so only the embedding's and the head's remain.
    def held_by_the_forward(plan):
        saved, held = [], []

        def pack(t):
            box = _Saved(t.detach())  # the tensor itself would tie a saved output to its own graph
            saved.append((weakref.ref(box), t.numel() * t.element_size()))
            return box

        def unpack(box):
            if not held:
                held.append(sum(size for ref, size in saved if ref() is not None))
            return box.t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            fmoe.step(fmoe.init(plan, seed=0), batch(rows=8, seq=32), plan)
        return held[0]

    plan = fmoe.Plan(model=PLAIN.replace(layers=4))
    none, full = held_by_the_forward(plan), held_by_the_forward(plan.replace(remat="full"))
    head_only = held_by_the_forward(fmoe.Plan(model=PLAIN.replace(layers=1), remat="full"))
    assert full == head_only  # independent of the layer count
    assert full < none / 4


def test_full_remat_holds_layer_inputs_and_routing_until_each_recompute(monkeypatch):
    # Besides autograd's saves: what the executor itself holds for the recomputes is
    # each layer's [T, D] input and its routing, never the [T * K, D] permuted rows.
    import fmoe.schedule.executor as executor

    cfg = PLAIN.replace(layers=3, topk=4)
    plan = fmoe.Plan(model=cfg, remat="full")
    T = 4 * 16
    held = []
    recompute = executor.recompute

    def looking(run, *args):
        if not held:  # the microbatches' records, but for autograd's tapes and gradients
            values = [(mbf.stream and mbf.stream.h, [(layer.attended, layer.sent, layer.y, layer.landing,
                                     layer.kept and vars(layer.kept)) for layer in mbf.layers]) for mbf in run.mbs]
            held.extend(t for t in optree.tree_leaves(values, none_is_leaf=True)
                        if isinstance(t, torch.Tensor))
        return recompute(run, *args)

    monkeypatch.setattr(executor, "recompute", looking)
    fmoe.step(fmoe.init(plan, seed=0), batch(), plan)
    inputs = [t for t in held if t.shape == (4, 16, cfg.dim)]
    assert len(inputs) == cfg.layers
    assert not [t for t in held if t.dim() == 2 and t.shape[0] >= T * cfg.topk and t.shape[1] == cfg.dim]


@pytest.mark.parametrize("field,value,match", [
    ("remat", "sometimes", r"Plan.remat='sometimes' is invalid: allowed: 'none', 'selective', 'full'"),
    ("remat", True, r"Plan.remat=True is invalid"),
    ("loss_chunk", -1, r"Plan.loss_chunk=-1 is invalid: must be an int >= 0"),
    ("loss_chunk", 2.5, r"Plan.loss_chunk=2.5 is invalid"),
])
def test_bad_memory_settings_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        fmoe.Plan(model=PLAIN, **{field: value})


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
def test_chunked_loss_equals_the_whole_one(dtype, tol, chunk):
    gen = torch.Generator().manual_seed(chunk)
    x = torch.randn(30, 12, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(12, 50, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (30,), generator=gen)
    whole = cross_entropy_sum(x, w, targets)
    gx, gw = torch.autograd.grad(whole * 0.3, (x, w))
    pieces = linear_cross_entropy_sum(x, w, targets, chunk)
    cx, cw = torch.autograd.grad(pieces * 0.3, (x, w))
    torch.testing.assert_close(pieces, whole, rtol=tol, atol=0)
    for got, want in ((cx, gx), (cw, gw)):
        assert ((got - want).norm() / want.norm()).item() < tol


def test_chunked_loss_never_holds_all_the_logits():
    T, V, chunk = 64, 500, 16
    x = torch.randn(T, 8, requires_grad=True)
    w = torch.randn(8, V, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy_sum(x, w, targets, chunk)
    assert largest[0] < T * V  # x, w and the targets; no [T, V] logits kept for the backward
    loss.backward()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy_sum(x, w, targets)
    assert largest[0] >= T * V  # the whole loss does keep them (the check can fail)


@pytest.mark.parametrize("kw", [dict(), dict(microbatches=2, remat="full"), dict(compile=True)],
                         ids=["eager", "remat", "compiled"])
def test_step_with_a_chunked_loss_matches_the_whole_loss(kw):
    plan = fmoe.Plan(model=FANCY, **kw)
    params = ref.random_params(FANCY, seed=2, dtype=torch.float32)
    tokens = batch(seed=3)
    whole, pieces = fmoe.step(params, tokens, plan), fmoe.step(params, tokens, plan.replace(loss_chunk=24))
    torch.testing.assert_close(pieces.loss, whole.loss, rtol=1e-6, atol=0)
    for path, a, b in zip(optree.tree_paths(pieces.grads), optree.tree_leaves(pieces.grads),
                          optree.tree_leaves(whole.grads)):
        if b.norm() > 0:
            assert ((a - b).norm() / b.norm()).item() < 1e-5, path


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("remat,compile", [("full", False), ("full", True), ("selective", False)],
                         ids=["full-eager", "full-compiled", "selective-eager"])
def test_cuda_bf16_remat_matches_no_remat(compile, remat):
    # Bitwise where the GPU kernels are deterministic; if two runs without remat
    # already differ somewhere (a kernel summing with atomics), remat may differ there
    # by as much, not more.
    plan = fmoe.Plan(model=FANCY.replace(capacity_factor=0.0), microbatches=2, dtype="bfloat16", device="cuda",
                     compile=compile)
    params = optree.tree_map(lambda t: t.cuda(), ref.random_params(FANCY, seed=4, dtype=torch.float32))
    tokens = {"tokens": batch(seed=9, rows=4, seq=64)["tokens"].cuda()}
    none, again = fmoe.step(params, tokens, plan), fmoe.step(params, tokens, plan)
    recomputed = fmoe.step(params, tokens, plan.replace(remat=remat))
    for path, r, n, a in zip(optree.tree_paths(none.grads), optree.tree_leaves(recomputed.grads),
                             optree.tree_leaves(none.grads), optree.tree_leaves(again.grads)):
        spread = (a - n).abs().max().item()
        assert (r - n).abs().max().item() <= 2 * spread, (path, spread)
    assert torch.equal(recomputed.loss, none.loss) or not torch.equal(again.loss, none.loss)


@pytest.mark.gpu
def test_cuda_bf16_compiled_selective_remat_is_as_accurate_as_compiled_none():
    # Under compile the policy is applied by the partitioner, which fuses the recompute
    # into the backward kernels: an intermediate the plain forward rounded to bf16 before
    # saving it may be used unrounded, so gradients differ in bf16's last bits (~1e-3
    # absolute on the embedding, measured). Asserted: as close to the fp32 step as
    # compiled `none` is, within 2x per leaf; the forward (the loss) is the same graph.
    plan = fmoe.Plan(model=FANCY.replace(capacity_factor=0.0), microbatches=2, dtype="bfloat16", device="cuda",
                     compile=True)
    params = optree.tree_map(lambda t: t.cuda(), ref.random_params(FANCY, seed=4, dtype=torch.float32))
    tokens = {"tokens": batch(seed=9, rows=4, seq=64)["tokens"].cuda()}
    exact = fmoe.step(params, tokens, plan.replace(dtype="float32", compile=False))
    none = fmoe.step(params, tokens, plan)
    selective = fmoe.step(params, tokens, plan.replace(remat="selective"))
    torch.testing.assert_close(selective.loss, none.loss, rtol=1e-3, atol=0)
    worse = {}
    for path, s, n, e in zip(optree.tree_paths(exact.grads), optree.tree_leaves(selective.grads),
                             optree.tree_leaves(none.grads), optree.tree_leaves(exact.grads)):
        if e.norm() > 0 and _relative(s, e) > 2 * _relative(n, e):
            worse[path] = (_relative(s, e), _relative(n, e))
    assert not worse, f"selective's bf16 gradients further from fp32 than 2x compiled none's: {worse}"
