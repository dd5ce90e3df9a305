"""GPT-OSS's attention sinks and sliding-window layers on a GPU: the CUDA step, eager
and compiled (FlexAttention's block masks and lse for packed rows), against the CPU."""

import functools
import importlib

import pytest
import torch

import fmoe
from fmoe.layers import attend, block_masks

from . import reference as ref
from .test_gpu import to

pytestmark = pytest.mark.gpu
F64 = torch.float64

# heads of 32 features: packed rows take FlexAttention (it needs at least 16)
GPT_OSS = fmoe.ModelConfig(vocab=64, dim=64, layers=3, heads=4, kv_heads=2, head_size=32, experts=8, topk=2,
                           ffn=32, attn_sinks=True, sliding_window=5, window_layers=(0, 2), qkv_bias=True)


def batch(seed, packed=False):
    g = torch.Generator().manual_seed(seed)
    out = {"tokens": torch.randint(0, 64, (8, 33), generator=g)}
    if packed:  # documents of random lengths, some longer than the window
        out["segments"] = (torch.rand(8, 33, generator=g) < 0.1).long().cumsum(1)
    return out


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_sinks_window_step_on_the_gpu_matches_the_cpu(packed, compile):
    # another device, and compiled kernels that fuse: fp32 agreement, not bitwise
    params = ref.random_params(GPT_OSS, seed=3, dtype=torch.float32)
    b = batch(3, packed)
    cpu = fmoe.step(params, b, fmoe.Plan(model=GPT_OSS, microbatches=2))
    gpu_b = {k: v.cuda() for k, v in b.items()}
    gpu = fmoe.step(to(params, "cuda"), gpu_b, fmoe.Plan(model=GPT_OSS, microbatches=2, device="cuda",
                                                          compile=compile))
    torch.testing.assert_close(gpu.loss.cpu(), cpu.loss, rtol=1e-5, atol=1e-5)
    ref.assert_trees_close(to(gpu.grads, "cpu"), cpu.grads, rtol=1e-4, atol=1e-5)


def test_sinks_window_schedules_are_bitwise_the_standard_step_on_the_gpu():
    params = to(fmoe.init(fmoe.Plan(model=GPT_OSS), seed=4), "cuda")
    b = {k: v.cuda() for k, v in batch(4, packed=True).items()}
    base = fmoe.Plan(model=GPT_OSS, device="cuda", dtype="bfloat16", microbatches=2, sharding="optim_grads_params")
    want = fmoe.step(params, b, base)
    got = fmoe.step(params, b, base.replace(schedule="1f1b_overlap", remat="full"))
    assert torch.equal(got.loss, want.loss)
    ref.assert_trees_equal(got.grads, want.grads)



@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_selective_remat_of_the_flex_paths_matches_the_plain_compiled_step(packed):
    # the policy keeps FlexAttention's output (out and lse) and recomputes the rest
    # from the same inputs with the same kernels: bitwise where the partitioner keeps
    # the same fusions, else fp32 reassociation
    params = to(ref.random_params(GPT_OSS, seed=5, dtype=torch.float32), "cuda")
    b = {k: v.cuda() for k, v in batch(5, packed).items()}
    plan = fmoe.Plan(model=GPT_OSS, microbatches=2, device="cuda", compile=True)
    want = fmoe.step(params, b, plan)
    got = fmoe.step(params, b, plan.replace(remat="selective"))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    ref.assert_trees_close(got.grads, want.grads, rtol=1e-5, atol=1e-6)

# Plain rows (no packed documents) with a window or sinks: compiled FlexAttention under
# the cached causal/window block mask, never the [S, S] scores of the written-out path.

attention_module = importlib.import_module("fmoe.layers.attention")  # also the name of a function in fmoe.layers


def qkv(S, d=64, e=64, H=4, K=2, seed=0):
    """``[2, H, S, d]`` queries, ``[2, K, S, d]`` keys, ``[2, K, S, e]`` values and ``[H]``
    sinks, float64 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, H, S, d, generator=g, dtype=F64), torch.randn(2, K, S, d, generator=g, dtype=F64),
            torch.randn(2, K, S, e, generator=g, dtype=F64), torch.randn(H, generator=g, dtype=F64))


def fwd_bwd(q, k, v, sinks=None, attend_fn=attend, **kw):
    """``attend``'s output and the gradients of ``(out * g).sum()`` (``g`` fixed) w.r.t.
    ``q, k, v`` (and the sinks when given)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, sinks) if t is not None]
    out = attend_fn(*leaves[:3], sinks_H=leaves[3] if sinks is not None else None, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(out)
    return out, torch.autograd.grad((out * g).sum(), leaves)


def assert_close_to(got, want, tol, grad_tol):
    """``got = (out, grads)`` on the GPU against ``want`` in float64 on the CPU."""
    torch.testing.assert_close(got[0].cpu().to(F64), want[0], rtol=tol, atol=tol)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a.cpu().to(F64), b, rtol=grad_tol, atol=grad_tol)


@pytest.fixture
def paths(monkeypatch):
    """Which of attend's kernels ran: their names, appended as they are called."""
    ran = []
    for name in ("_flex_attend", "_explicit_attend", "_sdpa"):
        original = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name,
                            lambda *a, _name=name, _fn=original, **kw: ran.append(_name) or _fn(*a, **kw))
    torch._dynamo.reset()  # the compiled flex_attention's recompile limit stays far off
    return ran


def rounded(tensors, dtype):
    """The float64 copies of ``tensors`` rounded to ``dtype`` (the sinks, fp32 params,
    to fp32): what the GPU run sees, so the reference differs only by its arithmetic."""
    *qkv_, sinks = tensors
    return [t.to(dtype).to(F64) for t in qkv_] + [None if sinks is None else sinks.float().to(F64)]


@pytest.mark.parametrize("e", [64, 32], ids=["e=d", "e<d"])
@pytest.mark.parametrize("window, sinks", [(0, True), (50, False), (50, True)], ids=["sinks", "window", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plain_rows_take_flex_and_match_the_reference(paths, dtype, window, sinks, e):
    # 300 positions: three blocks of 128, the last cut short; GQA (4 query heads, 2 kv)
    q, k, v, s_H = qkv(300, e=e)
    inputs = rounded((q, k, v, s_H if sinks else None), dtype)
    want = fwd_bwd(*inputs, window=window)  # the CPU's: SDPA's exact mask or the written-out softmax
    paths.clear()
    got = fwd_bwd(*(None if t is None else t.cuda() for t in
                    [t.to(dtype) for t in inputs[:3]] + [None if inputs[3] is None else inputs[3].float()]),
                  window=window)
    assert paths == ["_flex_attend"]
    if dtype == torch.float32:
        # Flex's fp32 products are IEEE (float32_matmul_precision "highest"): rounding
        # over sums of up to 300 terms of size ~1
        assert_close_to(got, want, 2e-5, 1e-4)
    else:
        # bf16 probabilities and output: relative rounding 2**-8 on values of size ~1
        # to 3 (the reference sees the same rounded inputs); CPU's bf16 paths land
        # within 1.4e-2 of it, a third of these
        assert_close_to(got, want, 3e-2, 5e-2)


def test_decoding_over_a_cache_sees_what_the_flex_rows_see(paths):
    # the whole row through Flex, its last queries over the cached keys through the
    # exact mask and the written-out softmax: the same window and sinks, fp32 rounding
    q, k, v, s_H = (t.float().cuda() for t in qkv(300, e=32))
    whole = attend(q, k, v, window=50, sinks_H=s_H)
    rest = attend(q[:, :, 290:], k, v, start=290, window=50, sinks_H=s_H)
    assert paths == ["_flex_attend", "_explicit_attend"]
    torch.testing.assert_close(rest, whole[:, 290:], rtol=2e-5, atol=2e-5)


def test_plain_rows_with_a_window_and_sinks_never_hold_s_by_s():
    # S = 16384: one [S, S] boolean mask alone is 256 MiB, the fp32 scores of one head
    # 1 GiB; the flex path's forward and backward (inputs' grads, output and the sinks'
    # fp32 products, ~150 MiB) stay under one such mask
    torch._dynamo.reset()
    S = 16384
    q, k, v = (torch.randn(1, H, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for H in (8, 2, 2))
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    attend(q, k, v, window=128, sinks_H=sinks).sum().backward()  # compile and build the mask first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    attend(q, k, v, window=128, sinks_H=sinks).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < S * S


def test_the_compiled_region_takes_the_mask_as_a_constant():
    # fullgraph: the block mask is no graph break; dynamo calls its cache while tracing
    # (one entry, made by the compiled call: a traced mask would leave the cache
    # empty) and the second call does not rebuild it. Compiled and eager run the same
    # Flex kernel under the same mask, up to fusion's fp32 reassociation.
    torch._dynamo.reset()
    block_masks.row_mask_parts.cache_clear()
    q, k, v, s_H = (t.float().cuda() for t in qkv(256, e=32))
    compiled = torch.compile(functools.partial(attend, window=100), fullgraph=True, dynamic=False)
    for _ in range(2):
        got = fwd_bwd(q, k, v, s_H, attend_fn=compiled)
    info = block_masks.row_mask_parts.cache_info()
    assert (info.misses, info.hits) == (1, 0)
    eager = fwd_bwd(q, k, v, s_H, window=100)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_narrower_value_heads_on_the_causal_sdpa_path(paths, dtype):
    # MLA's shape, q/k heads of 192 features and v heads of 128: whichever SDPA kernel
    # takes it (cuDNN or memory-efficient; flash refuses e != d)
    q, k, v, _ = qkv(200, d=192, e=128)
    inputs = rounded((q, k, v, None), dtype)[:3]
    want = fwd_bwd(*inputs)
    paths.clear()
    got = fwd_bwd(*(t.to(dtype).cuda() for t in inputs))
    assert paths == ["_sdpa"] and got[0].shape == (2, 200, 4 * 128)
    if dtype == torch.float32:
        assert_close_to(got, want, 2e-5, 1e-4)  # as the flex test's, over 200 keys
    else:
        assert_close_to(got, want, 3e-2, 5e-2)


def test_a_compiled_gpt_oss_step_with_expert_biases_matches_the_cpu():
    # GPT-OSS's experts: biases (fc1's added inside the compiled clamped GLU), top-k
    # softmax routing with a router bias; fp32 agreement, not bitwise
    cfg = GPT_OSS.replace(expert_biases=True, router_bias=True, score_func="topk_softmax", activation="quick_geglu",
                          glu_limit=0.5, glu_interleave=1, out_bias=True)
    params = ref.random_params(cfg, seed=6, dtype=torch.float32)
    b = batch(6)
    cpu = fmoe.step(params, b, fmoe.Plan(model=cfg, microbatches=2))
    gpu = fmoe.step(to(params, "cuda"), {k: v.cuda() for k, v in b.items()},
                    fmoe.Plan(model=cfg, microbatches=2, device="cuda", compile=True))
    torch.testing.assert_close(gpu.loss.cpu(), cpu.loss, rtol=1e-5, atol=1e-5)
    ref.assert_trees_close(to(gpu.grads, "cpu"), cpu.grads, rtol=1e-4, atol=1e-5)
