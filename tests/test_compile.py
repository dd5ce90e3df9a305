"""``Plan.compile``: the node kernels through ``torch.compile`` give eager's results.

Tolerances, and why:
- fp32: eager against eager is bitwise here (one thread). Compiled kernels fuse
  reductions (the norms' mean of squares, softmax, log-sum-exp) and sum in another
  order, a few fp32 roundings apart per op; measured 1e-7 to 1e-6 relative per leaf,
  asserted at 1e-5 (2-norm of the difference over the 2-norm of eager's gradient).
- bf16: eager rounds every intermediate to bf16 while compiled code keeps fused
  intermediates in fp32, so the two differ by bf16 roundings (~1e-2 on these tiny
  models). The test holds compiled to eager's own standard: each gradient's distance
  from the fp32 step must be at most twice eager bf16's (measured: at most 1.3x).
  ``topk = experts`` there, so rounding cannot flip a routing choice (a flipped
  choice changes a gradient by O(1) in any two runs that round differently).
"""

import optree
import pytest
import torch

import fmoe
from fmoe.params import named_leaves

from . import reference as ref
from .reference import assert_trees_equal, rel_err

PLAIN = fmoe.ModelConfig(vocab=128, dim=32, layers=2, heads=4, experts=4, topk=2, ffn=32, pad_multiple=8)
# Every optional piece the compiled regions trace: GQA, per-head q/k norm, a gated
# shared expert, expert biases (the torch-code activation), tied embeddings, router losses.
FANCY = fmoe.ModelConfig(vocab=128, dim=32, layers=2, heads=4, kv_heads=2, head_size=16, qk_norm="head",
                         experts=4, topk=4, ffn=16, shared_ffn=16, shared_gate=True, expert_biases=True,
                         activation="geglu", tie_embeddings=True, prob_placement="activation",
                         aux_loss_coef=0.01, z_loss_coef=0.001)


def batch(seed, rows=4, seq=32, vocab=128):
    return {"tokens": torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))}


def leaf_errors(got, want) -> dict:
    """``{path: relative 2-norm error}`` of every gradient leaf that is not all zeros."""
    assert optree.tree_structure(got) == optree.tree_structure(want)
    return {p: rel_err(g, w) for (p, w), g in zip(named_leaves(want).items(), optree.tree_leaves(got)) if w.any()}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_plan_compile_must_be_a_bool():
    with pytest.raises(ValueError, match=r"Plan\.compile"):
        fmoe.Plan(model=PLAIN, compile="yes")
    assert not fmoe.Plan(model=PLAIN).compile


@pytest.mark.parametrize("cfg", [PLAIN, FANCY], ids=["plain", "every-feature"])
def test_compiled_fp32_step_matches_eager_leaf_by_leaf(cfg):
    plan = fmoe.Plan(model=cfg, microbatches=2)
    params = ref.random_params(cfg, seed=1, dtype=torch.float32)
    eager = fmoe.step(params, batch(1), plan)
    compiled = fmoe.step(params, batch(1), plan.replace(compile=True))
    assert torch.equal(compiled.metrics["expert_counts"], eager.metrics["expert_counts"])
    assert rel_err(compiled.loss, eager.loss) < 1e-6
    errors = leaf_errors(compiled.grads, eager.grads)
    assert len(errors) >= len(named_leaves(params)) - 2 * cfg.layers  # only expert_bias has no gradient
    assert max(errors.values()) < 1e-5, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("cfg", [PLAIN.replace(topk=PLAIN.experts), FANCY], ids=["plain", "every-feature"])
def test_compiled_bf16_step_is_as_accurate_as_eager(cfg):
    plan = fmoe.Plan(model=cfg, microbatches=2, dtype="bfloat16")
    params = ref.random_params(cfg, seed=2, dtype=torch.float32)
    exact = fmoe.step(params, batch(2), plan.replace(dtype="float32"))
    eager = leaf_errors(fmoe.step(params, batch(2), plan).grads, exact.grads)
    compiled = leaf_errors(fmoe.step(params, batch(2), plan.replace(compile=True)).grads, exact.grads)
    worse = {p: (compiled[p], eager[p]) for p in eager if compiled[p] > 2 * eager[p]}
    assert not worse, f"compiled bf16 gradients further from fp32 than 2x eager's: {worse}"


def test_compiles_once_and_never_again_as_routing_changes_the_row_count():
    torch._dynamo.reset()  # count this test's compilations from zero
    stats = torch._dynamo.utils.counters["stats"]
    plan = fmoe.Plan(model=PLAIN, microbatches=2, compile=True)
    params = fmoe.init(plan, seed=0)
    before = stats["unique_graphs"]
    out = fmoe.step(params, batch(3), plan)
    assert stats["unique_graphs"] - before == 4  # attention half, router, the experts' activation, head
    assert not torch._dynamo.utils.counters["graph_break"]
    rows_seen = {int(out.metrics["padded_rows"])}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (4, 5, 6):
            out = fmoe.step(params, batch(seed), plan)
            rows_seen.add(int(out.metrics["padded_rows"]))
    assert len(rows_seen) > 1  # the padded row count did change between steps


def test_delayed_wgrad_and_1f1b_under_compile_change_no_bit():
    # Schedules reorder work, compiled or not: bitwise equal to the compiled standard schedule.
    plan = fmoe.Plan(model=PLAIN, microbatches=2, compile=True)
    params = ref.random_params(PLAIN, seed=3, dtype=torch.float32)
    want = fmoe.step(params, batch(7), plan)
    for variant in (dict(delay_wgrad=True), dict(schedule="1f1b_overlap", delay_wgrad=True)):
        got = fmoe.step(params, batch(7), plan.replace(**variant))
        assert torch.equal(got.loss, want.loss), variant
        assert_trees_equal(got.grads, want.grads, context=variant)


def test_eval_loss_under_compile_matches_the_step_loss():
    plan = fmoe.Plan(model=PLAIN, microbatches=2, compile=True)
    params = ref.random_params(PLAIN, seed=4, dtype=torch.float32)
    assert torch.equal(fmoe.eval_loss(params, batch(8), plan), fmoe.step(params, batch(8), plan).loss)


# --- GPU (run on the device): the Triton kernels inside compiled graphs ----------------

GPU_CFG = fmoe.ModelConfig(vocab=512, dim=256, layers=2, heads=4, experts=8, topk=8, ffn=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_compiled_step_with_triton_kernels_matches_eager(dtype):
    # topk = experts: no routing choice can flip. The Triton RoPE runs inside the compiled
    # attention, SwiGLU and unpermute beside it. fp32: eager and compiled are a few
    # roundings apart (rtol 1e-4: cuBLAS and fused reductions block sums differently).
    # bf16: as on the CPU, compiled must be as close to the fp32 step as eager is (2x).
    from fmoe.layers import triton_kernels

    plan = fmoe.Plan(model=GPU_CFG, microbatches=2, dtype=dtype, device="cuda")
    params = optree.tree_map(lambda t: t.cuda(), ref.random_params(GPU_CFG, seed=5, dtype=torch.float32))
    tokens = batch(9, rows=4, seq=256, vocab=GPU_CFG.vocab)
    assert triton_kernels.fused_kernels_available(params["embed"])
    eager = fmoe.step(params, tokens, plan)
    compiled = fmoe.step(params, tokens, plan.replace(compile=True))
    if dtype == "float32":
        errors = leaf_errors(compiled.grads, eager.grads)
        assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda kv: kv[1])
    else:
        exact = fmoe.step(params, tokens, plan.replace(dtype="float32"))
        e, c = leaf_errors(eager.grads, exact.grads), leaf_errors(compiled.grads, exact.grads)
        worse = {p: (c[p], e[p]) for p in e if c[p] > 2 * e[p]}
        assert not worse, f"compiled bf16 gradients further from fp32 than 2x eager's: {worse}"


@pytest.mark.parametrize("pad_multiple,capacity", [(0, None), (0, 5), (4, None)], ids=["dropless", "capacity",
                                                                                     "padded"])
def test_compiled_dispatch_is_bitwise_make_dispatch(pad_multiple, capacity):
    # Index arithmetic only: compiled or not, every index and count is exact. Padded
    # dropless routing reads its row count on the host, so it stays eager.
    from fmoe.layers.dispatch import make_dispatch
    from fmoe.schedule.compiled import compiled_kernels

    dispatch = compiled_kernels().dispatch
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # a second routing of the same shape reuses the graph
        indices = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(20)])
        want = make_dispatch(indices, 8, pad_multiple, capacity)
        got = dispatch((0, 0), indices, 8, pad_multiple, capacity)
        for name, a, b in zip(want._fields, got, want):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
