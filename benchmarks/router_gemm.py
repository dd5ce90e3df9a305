"""The router's fp32 product on tensor cores? (a lever issue 42's profile found; not in fmoe)

    python benchmarks/router_gemm.py [--iters 50]

``fmoe.layers.router.route`` computes ``logits = upcast(x) @ upcast(w)`` with ``x`` the
bf16 tokens and ``w`` the fp32 router weight, forward and both gradients in fp32, which
cuBLAS runs on FFMA kernels (no TF32: the router stays fp32). The same sums on bf16
tensor cores: ``x`` is exact in bf16 and ``w = w_hi + w_mid + w_lo`` splits exactly into
three bf16 parts, so ``x @ [w_hi | w_mid | w_lo]`` with an fp32 result holds the exact
products, summed in fp32 (in another order). Backward: the weight gradient splits the
fp32 output gradient the same way (``x^T @ [g_hi | g_mid | g_lo]``); the input gradient
takes the six products of split parts whose bits reach fp32's 24 (``g_hi w_hi``, ``g_hi
w_mid``, ``g_mid w_hi``, ``g_hi w_lo``, ``g_mid w_mid``, ``g_lo w_hi``) as one GEMM over ``6E``.

For each shape (tokens, D, E of the issue's coarse and fine models and qwen3-moe-medium),
forward + backward timed both ways (CUDA events, median), and each way's largest error
against float64, relative to the largest magnitude. Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_time import median_ms  # noqa: E402

SHAPES = {"coarse": (16384, 2048, 16, 8), "fine": (16384, 2048, 64, 8), "qwen3-moe-medium": (16384, 1536, 64, 16)}
BF16 = torch.bfloat16


def split3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bf16 tensors whose fp32 sum is ``w`` (to 24 bits, normal range)."""
    hi = w.to(BF16)
    rest = w - hi.float()
    mid = rest.to(BF16)
    return hi, mid, (rest - mid.float()).to(BF16)


def _sum3(parts_TN: torch.Tensor, n: int) -> torch.Tensor:
    return (parts_TN[:, :n] + parts_TN[:, n:2 * n]) + parts_TN[:, 2 * n:]


class _SplitLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_DE):
        ctx.save_for_backward(x_TD, w_DE)
        E = w_DE.shape[1]
        return _sum3(torch.mm(x_TD, torch.cat(split3(w_DE), dim=1), out_dtype=torch.float32), E)

    @staticmethod
    def backward(ctx, g_TE):
        x_TD, w_DE = ctx.saved_tensors
        E = w_DE.shape[1]
        g_hi, g_mid, g_lo = split3(g_TE.contiguous())
        grad_w = _sum3(torch.mm(x_TD.t(), torch.cat([g_hi, g_mid, g_lo], dim=1), out_dtype=torch.float32), E)
        w_hi, w_mid, w_lo = split3(w_DE)
        # the six products of parts whose bits reach 2^-24 of the largest, as one GEMM over 6E
        products = torch.mm(torch.cat([g_hi, g_hi, g_mid, g_hi, g_mid, g_lo], dim=1),
                            torch.cat([w_hi, w_mid, w_hi, w_lo, w_mid, w_hi], dim=1).t(), out_dtype=torch.float32)
        return products.to(x_TD.dtype), grad_w


def fp32_logits(x_TD, w_DE):
    """What ``route`` runs."""
    return x_TD.float() @ w_DE


def split_logits(x_TD, w_DE):
    return _SplitLogits.apply(x_TD, w_DE)


def _errors(fn, x, w, g, want) -> list[float]:
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    gx, gw = torch.autograd.grad(y, [x, w], g)
    return [float((got.detach().double() - ref).abs().max() / ref.abs().max()) for got, ref in zip((y, gx, gw), want)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    rows = []
    for name, (T, D, E, layers) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, D, device="cuda", generator=g).to(BF16)
        w = torch.randn(D, E, device="cuda", generator=g) / D ** 0.5
        grad = torch.randn(T, E, device="cuda", generator=g) * 1e-3
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        y64 = x64 @ w64
        want = [y64.detach(), *torch.autograd.grad(y64, [x64, w64], grad.double())]
        want[1] = want[1].to(BF16).double()  # the input gradient is a bf16 tensor either way
        for way, fn in (("fp32 (FFMA)", fp32_logits), ("split bf16", split_logits)):
            errors = _errors(fn, x, w, grad, want)

            def fwd_bwd():
                xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
                torch.autograd.grad(fn(xs, ws), [xs, ws], grad)
            ms = median_ms(fwd_bwd, args.iters)
            rows.append((name, T, D, E, way, ms, ms * layers, *errors))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; router logits forward + backward, "
          f"median of {args.iters}; errors: largest |got - float64| / largest |float64|")
    print(f"{'shape':>17s} {'T':>6s} {'D':>5s} {'E':>3s} {'way':>12s} {'ms':>7s} {'ms/step':>8s} "
          f"{'logits err':>11s} {'dx err':>9s} {'dw err':>9s}")
    for name, T, D, E, way, ms, step_ms, e_y, e_x, e_w in rows:
        print(f"{name:>17s} {T:6d} {D:5d} {E:3d} {way:>12s} {ms:7.3f} {step_ms:8.2f} {e_y:11.2e} {e_x:9.2e} {e_w:9.2e}")


if __name__ == "__main__":
    main()
