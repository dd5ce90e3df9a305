"""Do the experts' input gradients pay in FP8 with their casts fused? (issue 42, item 4)

    python benchmarks/fp8_expert_grads.py [--iters 20] [--repeats 3] [--shapes coarse fine large]

The expert path (``permute`` -> fc1 -> SwiGLU -> fc2 -> ``unpermute`` weighted by the router
probabilities, fmoe's default placement), forward + backward, random top-k routing, five ways
side by side:

- ``bf16``: fmoe's path with ``fp8.PLAIN``;
- ``fp8 forward``: the committed recipe's experts (``scaled_grouped_mm`` forward, bf16
  gradients), what ``Plan.fp8="rowwise"`` and ``"tensorwise"`` run;
- ``fp8 dgrad``: fmoe's path with the input gradients in FP8 too (``Gemms.grouped_grad =
  scaled_grouped_mm``): each gradient quantised by ``fp8_kernels.quantize_rows_RW``, a
  separate read of the bf16 gradient;
- ``fp8 dgrad fused``: the same products, the casts fused into the kernels that produce the
  gradients: the unpermute's backward writes fc2's row gradient in bf16 (for the weight
  gradient) and its FP8 copy with one scale per row, the SwiGLU's backward fc1's; one autograd
  function for the path after the permute carries the copies to the grouped GEMMs;
- ``fp8 dgrad fused, fast``: that with Hopper's fast accumulation in the gradients' GEMMs.

The weight gradients stay bf16 in every way (``torch._scaled_grouped_mm`` needs per-expert
column scales over 16-row-aligned segments for them on sm_90). Before timing, on the first
two shapes: the fused way's gradients against ``fp8 dgrad``'s (the same casts and GEMMs: bit
for bit, but for the probabilities' gradient, which no cast feeds and another kernel sums in
another order: within one bf16 step) and every way's against float64 (fmoe's per-expert
loop). Times: median of ``--repeats`` interleaved rounds of each way's median of ``--iters``
calls, eager and replayed from a CUDA graph (the GPU alone, as inside a graphed step).
Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fmoe  # noqa: E402
from fmoe.layers import expert_mlp, make_dispatch, permute, unpermute  # noqa: E402
from fmoe.layers.fp8 import E4M3, E4M3_MAX, PLAIN, TENSORWISE, TINY, Gemms, _quantize, scaled_grouped_mm  # noqa: E402
from fmoe.layers.triton_kernels import NUM_WARPS, _blocks, _TILE, swiglu_fwd_RF, unpermute_fwd_TD  # noqa: E402
from kernel_time import graph_median_ms, median_ms  # noqa: E402

SHAPES = {"coarse": (16384, 4, 2048, 1408, 16), "fine": (16384, 8, 2048, 704, 64),
          "large": (32768, 8, 4096, 1536, 32)}  # T, K, D, F, E: the step benchmarks' and expert_mlp.py's large
FP8_DGRAD = Gemms(TENSORWISE.linear, scaled_grouped_mm, scaled_grouped_mm, name="fp8 dgrad")


@triton.jit
def _to_fp8(x, scale, q_ptr, FP8_MAX: tl.constexpr):
    # fp8_kernels._quantize_rows_kernel's arithmetic: IEEE division, clamp, round to nearest even
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit(do_not_specialize=["R"])
def _unpermute_bwd_fp8_kernel(g_ptr, y_ptr, w_ptr, pos_ptr, gy_ptr, q_ptr, s_ptr, gw_ptr, R, D, K: tl.constexpr,
                              KP: tl.constexpr, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    # triton_kernels._unpermute_bwd_kernel (weights on, dropless) plus the rows' FP8 copy:
    # a first pass writes grad_y = grad[t] * w[t, k] in bf16 and finds each row's amax of
    # those bf16 values, a second computes them again and writes them scaled to E4M3.
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    k_ok = ks < K
    pos = tl.load(pos_ptr + t * K + ks, mask=k_ok, other=R).to(tl.int64)
    kept = k_ok & (pos < R)
    w = tl.load(w_ptr + t * K + ks, mask=k_ok, other=0.0).to(tl.float32)
    dot = tl.zeros([KP], dtype=tl.float32)
    amax = tl.zeros([KP], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = kept[:, None] & (cols < D)[None, :]
        g = tl.load(g_ptr + t * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        at = pos[:, None] * D + cols[None, :]
        gy = (g[None, :] * w[:, None]).to(gy_ptr.dtype.element_ty)
        tl.store(gy_ptr + at, gy, mask=mask)
        amax = tl.maximum(amax, tl.max(tl.abs(gy.to(tl.float32)), axis=1))
        y = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(y * g[None, :], axis=1)
    scale = tl.maximum(amax, TINY) * INV_MAX
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        g = tl.load(g_ptr + t * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        gy = (g[None, :] * w[:, None]).to(gy_ptr.dtype.element_ty).to(tl.float32)
        tl.store(q_ptr + pos[:, None] * D + cols[None, :], _to_fp8(gy, scale[:, None], q_ptr, FP8_MAX),
                 mask=kept[:, None] & (cols < D)[None, :])
    tl.store(s_ptr + pos, scale, mask=kept)
    tl.store(gw_ptr + t * K + ks, dot.to(gw_ptr.dtype.element_ty), mask=k_ok)


@triton.jit
def _swiglu_grads(h_row, ga_row, cols, F, mask):
    g = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_row + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ga = tl.load(ga_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    return ga * u * sig * (1.0 + g * (1.0 - sig)), ga * silu  # triton_kernels._swiglu_bwd_kernel's


@triton.jit(do_not_specialize=["R"])
def _swiglu_bwd_fp8_kernel(h_ptr, ga_ptr, gh_ptr, q_ptr, s_ptr, R, F, FP8_MAX: tl.constexpr,
                           INV_MAX: tl.constexpr, TINY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    # triton_kernels._swiglu_bwd_kernel ([gate | up], no probabilities) plus grad_h's FP8
    # copy, one scale per row: the same two passes as the unpermute's above.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    h_row = h_ptr + rows64[:, None] * (2 * F)
    ga_row = ga_ptr + rows64[:, None] * F
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        d_gate, d_up = _swiglu_grads(h_row, ga_row, cols, F, mask)
        d_gate, d_up = d_gate.to(gh_ptr.dtype.element_ty), d_up.to(gh_ptr.dtype.element_ty)
        at = rows64[:, None] * (2 * F) + cols[None, :]
        tl.store(gh_ptr + at, d_gate, mask=mask)
        tl.store(gh_ptr + at + F, d_up, mask=mask)
        amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(d_gate.to(tl.float32)), axis=1),
                                           tl.max(tl.abs(d_up.to(tl.float32)), axis=1)))
    scale = tl.maximum(amax, TINY) * INV_MAX
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        d_gate, d_up = _swiglu_grads(h_row, ga_row, cols, F, mask)
        at = rows64[:, None] * (2 * F) + cols[None, :]
        d_gate = d_gate.to(gh_ptr.dtype.element_ty).to(tl.float32)
        d_up = d_up.to(gh_ptr.dtype.element_ty).to(tl.float32)
        tl.store(q_ptr + at, _to_fp8(d_gate, scale[:, None], q_ptr, FP8_MAX), mask=mask)
        tl.store(q_ptr + at + F, _to_fp8(d_up, scale[:, None], q_ptr, FP8_MAX), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


def unpermute_bwd_fp8(grad_TD, y_RD, w_TK, pos_TK):
    """``(grad_y [R, D] bf16, its E4M3 copy, scales [R], grad_w [T, K])``, dropless rows."""
    (T, K), (R, D) = pos_TK.shape, y_RD.shape
    grad_y = torch.empty(R, D, dtype=y_RD.dtype, device=y_RD.device)
    q = torch.empty(R, D, dtype=E4M3, device=y_RD.device)
    scale = torch.empty(R, dtype=torch.float32, device=y_RD.device)
    grad_w = torch.empty_like(w_TK)
    block_d = min(triton.next_power_of_2(D), max(_TILE // triton.next_power_of_2(K), 32))
    _unpermute_bwd_fp8_kernel[(T,)](grad_TD, y_RD, w_TK, pos_TK, grad_y, q, scale, grad_w, R, D, K=K,
                                    KP=triton.next_power_of_2(K), FP8_MAX=E4M3_MAX, INV_MAX=1.0 / E4M3_MAX,
                                    TINY=TINY, BLOCK_D=block_d, num_warps=NUM_WARPS)
    return grad_y, q, scale, grad_w


def swiglu_bwd_fp8(h_RN, grad_RF):
    """``(grad_h [R, 2F] bf16, its E4M3 copy, scales [R])`` of ``silu(gate) * up``."""
    R, F = grad_RF.shape
    grad_h = torch.empty_like(h_RN)
    q = torch.empty(h_RN.shape, dtype=E4M3, device=h_RN.device)
    scale = torch.empty(R, dtype=torch.float32, device=h_RN.device)
    block_r, block_f = _blocks(F, max_cols=256, tile=_TILE // 2)
    _swiglu_bwd_fp8_kernel[(triton.cdiv(R, block_r),)](h_RN, grad_RF, grad_h, q, scale, R, F, FP8_MAX=E4M3_MAX,
                                                       INV_MAX=1.0 / E4M3_MAX, TINY=TINY, BLOCK_R=block_r,
                                                       BLOCK_F=block_f, num_warps=NUM_WARPS)
    return grad_h, q, scale


def _dgrad(q_RN, scale_R, w_EKN, offsets_E, fast_accum):
    # segment e of the gradient times w[e]^T: the weight quantised along N, as fp8.scaled_grouped_mm
    # quantises it for Gemms.grouped_grad
    qw_EKN, sw_EK1 = _quantize(w_EKN)
    return torch._scaled_grouped_mm(q_RN, qw_EKN.transpose(-2, -1), scale_R, sw_EK1.squeeze(-1), offs=offsets_E,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


class _Fp8GradExperts(torch.autograd.Function):
    # rows -> fc1 -> SwiGLU -> fc2 -> weighted unpermute; forward as fmoe's FP8 recipe runs it,
    # backward with the input gradients' casts fused into the kernels that produce them
    @staticmethod
    def forward(ctx, x_RD, w1_EDN, w2_EFD, probs_TK, pos_TK, offsets_E, fast_accum):
        h_RN = scaled_grouped_mm(x_RD, w1_EDN, offsets_E, fast_accum=True)
        a_RF = swiglu_fwd_RF(h_RN, None, 0)
        y_RD = scaled_grouped_mm(a_RF, w2_EFD, offsets_E, fast_accum=True)
        ctx.save_for_backward(x_RD, w1_EDN, w2_EFD, probs_TK, pos_TK, offsets_E, h_RN, a_RF, y_RD)
        ctx.fast_accum = fast_accum
        return unpermute_fwd_TD(y_RD, probs_TK, pos_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        x_RD, w1_EDN, w2_EFD, probs_TK, pos_TK, offsets_E, h_RN, a_RF, y_RD = ctx.saved_tensors
        gy_RD, q_gy, s_gy, grad_probs = unpermute_bwd_fp8(grad_TD.contiguous(), y_RD, probs_TK, pos_TK)
        ga_RF = _dgrad(q_gy, s_gy, w2_EFD, offsets_E, ctx.fast_accum)
        grad_w2 = torch._grouped_mm(a_RF.t(), gy_RD, offs=offsets_E)
        gh_RN, q_gh, s_gh = swiglu_bwd_fp8(h_RN, ga_RF)
        grad_x = _dgrad(q_gh, s_gh, w1_EDN, offsets_E, ctx.fast_accum)
        grad_w1 = torch._grouped_mm(x_RD.t(), gh_RN, offs=offsets_E)
        return grad_x, grad_w1, grad_w2, grad_probs, None, None, None


def _inputs(T, K, D, F, E, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    experts = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    probs = torch.rand(T, K, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w1 = (torch.randn(E, D, 2 * F, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    cfg = fmoe.ModelConfig(dim=D, ffn=F, experts=E, topk=K, heads=16)
    return experts, (x, probs, w1, w2), grad_out, cfg


def _ways(experts, leaves, grad_out, cfg):
    """``{way: () -> grads of (x, probs, w1, w2)}``."""
    x, probs, w1, w2 = leaves
    E = w1.shape[0]

    def fmoe_path(gemms, backend="torch"):
        def run():
            d = make_dispatch(experts, E)
            y = unpermute(expert_mlp({"fc1": w1, "fc2": w2}, permute(x, d), d, cfg, None, backend, gemms=gemms),
                          d, probs)
            return torch.autograd.grad(y, leaves, grad_out)
        return run

    def fused(fast_accum):
        def run():
            d = make_dispatch(experts, E)
            y = _Fp8GradExperts.apply(permute(x, d), w1, w2, probs, d.pos_TK, d.offsets_E, fast_accum)
            return torch.autograd.grad(y, leaves, grad_out)
        return run

    return {"bf16": fmoe_path(PLAIN), "fp8 forward": fmoe_path(TENSORWISE), "fp8 dgrad": fmoe_path(FP8_DGRAD),
            "fp8 dgrad fused": fused(False), "fp8 dgrad fused, fast": fused(True)}


def _errors(experts, leaves, grad_out, cfg, ways) -> dict:
    """Each way's relative error (the largest over the four gradients, Frobenius) against float64,
    after checking the fused way against ``fp8 dgrad``: bit for bit where a cast feeds the
    gradient (a difference is printed)."""
    fused, unfused = ways["fp8 dgrad fused"](), ways["fp8 dgrad"]()
    for name, a, b in zip(("x", "probs", "fc1", "fc2"), fused, unfused):
        # No cast feeds the probabilities' gradient, a fp32 dot product rounded to bf16 once:
        # another kernel sums it in another order, so it may differ by one bf16 step.
        ulp = 0 if name != "probs" else 2.0 ** -7 * b.float().abs()
        if ((a.float() - b.float()).abs() > ulp).any():  # reported; the timing goes on
            print(f"CHECK FAILED: fused vs unfused FP8 casts, grad of {name}: max |diff| "
                  f"{(a.float() - b.float()).abs().max().item():.3e}", flush=True)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    want = _ways(experts, leaves64, grad_out.double(), cfg)["bf16"]()  # fmoe's torch path in float64
    errors = {}
    for way, run in ways.items():
        got = run()
        errors[way] = max(((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want))
    return errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="rounds, the ways interleaved in each")
    args = ap.parse_args()
    table = []
    for shape in args.shapes:
        T, K, D, F, E = SHAPES[shape]
        experts, leaves, grad_out, cfg = _inputs(T, K, D, F, E)
        ways = _ways(experts, leaves, grad_out, cfg)
        errors = _errors(experts, leaves, grad_out, cfg, ways) if shape != "large" else {}
        print(f"{shape}: errors against float64", {way: f"{e:.4e}" for way, e in errors.items()}, flush=True)
        eager, graphed = {w: [] for w in ways}, {w: [] for w in ways}
        for _ in range(args.repeats):
            for way, run in ways.items():
                eager[way].append(median_ms(run, args.iters))
                graphed[way].append(graph_median_ms(run, args.iters))
        flops = 3 * (2 * T * K * D * 2 * F + 2 * T * K * F * D)
        base = statistics.median(graphed["bf16"])
        for way in ways:
            ms, graph_ms = statistics.median(eager[way]), statistics.median(graphed[way])
            table.append((shape, way, ms, graph_ms, flops / graph_ms / 1e9, base / graph_ms, errors.get(way)))
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; expert path "
          f"(permute, fc1, SwiGLU, fc2, weighted unpermute) fwd+bwd, random top-k; median of {args.repeats} "
          f"interleaved rounds of {args.iters} calls")
    print(f"{'shape':>6s} {'way':>22s} {'eager ms':>9s} {'graph ms':>9s} {'TFLOP/s':>8s} {'bf16/this':>9s} "
          f"{'rel err':>8s}")
    for shape, way, ms, graph_ms, tflops, ratio, err in table:
        err_text = "" if err is None else f"{err:8.2e}"
        print(f"{shape:>6s} {way:>22s} {ms:9.3f} {graph_ms:9.3f} {tflops:8.1f} {ratio:9.3f} {err_text:>8s}")


if __name__ == "__main__":
    main()
