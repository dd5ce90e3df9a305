"""Does fusing the permute's gather into fc1's grouped GEMM pay on Hopper? (issue 42, item 3)

    python benchmarks/gathered_gemm.py [--iters 20] [--repeats 5]
    FMOE_TRITON_INTERPRET=1 python benchmarks/gathered_gemm.py --check   # CPU: the kernel against torch

fc1's forward for tokens ``x [T, D]`` routed top-k: rows ``R = T x K`` grouped by expert
(``make_dispatch``), ``h [R, 2F] = x[token of row] @ w1[expert of row]``. Three ways, side by
side on the issue's two expert-MLP shapes (random top-k, uniform):

- ``torch``: the gather (``index_select``, what ``permute`` runs) then ``torch._grouped_mm``
  (CUTLASS, what the expert path runs);
- ``triton``: a Triton grouped GEMM over the already-gathered rows (how fast a Triton GEMM
  is here, without the gather);
- ``triton gathered``: the same kernel loading each tile's rows straight from ``x`` by token
  index, no gathered copy (the fusion the issue names).

Hopper's TMA cannot gather rows (its gather4 mode is Blackwell's), so the fused kernel
loads through registers (``cp.async``) where a contiguous operand could stream by TMA.
The experiment asks whether the saved copy (a write of ``R x D`` and its read) outweighs
that. Every kernel's output is checked against ``torch`` first (fp32 accumulation, bf16
out: equal up to summation order). Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

if os.environ.get("FMOE_TRITON_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fmoe.layers import make_dispatch  # noqa: E402
from kernel_time import median_ms  # noqa: E402

SHAPES = [(16384, 4, 2048, 1408, 16), (32768, 8, 4096, 1536, 32)]  # T, K, D, F, E (expert_mlp.py's)
CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64}, num_warps=w, num_stages=s)
           for bm, bn, w, s in [(128, 256, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 256, 4, 4),
                                (128, 256, 8, 4), (256, 128, 8, 3)]]


@triton.jit(do_not_specialize=["R"])
def _grouped_mm_kernel(x_ptr, index_ptr, w_ptr, out_ptr, ends_ptr, R, D, N, E,
                       GATHER: tl.constexpr, E_POW2: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (m tile, n tile); m tiles are numbered expert by expert, ceil(rows_e / BLOCK_M)
    # each, found from the segment ends on the device (no host read of the splits).
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m, tile_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    experts = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + experts, mask=experts < E, other=0)
    starts = tl.load(ends_ptr + experts - 1, mask=(experts > 0) & (experts < E), other=0)
    tiles = tl.where(experts < E, tl.cdiv(ends - starts, BLOCK_M), 0)
    after = tl.cumsum(tiles, 0)
    if tile_m >= tl.sum(tiles):
        return
    e = tl.sum((after <= tile_m).to(tl.int32))
    mine = experts == e
    first_row = tl.sum(tl.where(mine, starts, 0)) + (tile_m - tl.sum(tl.where(mine, after - tiles, 0))) * BLOCK_M
    end_row = tl.sum(tl.where(mine, ends, 0))
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < end_row
    src = tl.load(index_ptr + rows, mask=row_ok, other=0) if GATHER else rows
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + src.to(tl.int64)[:, None] * D + ks[None, :]
    b_ptrs = w_ptr + e.to(tl.int64) * D * N + ks[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(D, BLOCK_K)):  # D a multiple of BLOCK_K (checked by the caller)
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=(cols < N)[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 as raw bits
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


_tuned_kernel = triton.autotune(configs=CONFIGS, key=["D", "N", "GATHER"])(_grouped_mm_kernel)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_grouped_mm(x: torch.Tensor, w_EDN: torch.Tensor, ends_E: torch.Tensor,
                      index_R: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = x[index[r]] @ w[expert of r]`` (``x[r]`` without ``index``): rows grouped by
    expert, ``ends_E`` the int32 cumulative segment ends."""
    E, D, N = w_EDN.shape
    R = x.shape[0] if index_R is None else index_R.shape[0]
    if D % 64:
        raise ValueError(f"D={D} must be a multiple of 64 (the kernel's BLOCK_K)")
    # the interpreter truncates fp32 -> bf16 casts: it writes fp32 and torch rounds
    out = torch.empty(R, N, dtype=torch.float32 if INTERPRETED else x.dtype, device=x.device)

    def grid(meta):
        return ((triton.cdiv(R, meta["BLOCK_M"]) + E) * triton.cdiv(N, meta["BLOCK_N"]),)
    args = (x, x if index_R is None else index_R, w_EDN, out, ends_E, R, D, N, E)
    meta = dict(GATHER=index_R is not None, E_POW2=triton.next_power_of_2(E), UPCAST=INTERPRETED)
    if INTERPRETED:  # no autotuning without a GPU: one small tile
        _grouped_mm_kernel[grid](*args, **meta, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)
    else:
        _tuned_kernel[grid](*args, **meta)
    return out.to(x.dtype)


def _inputs(T, K, D, F, E, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    experts = torch.rand(T, E, device=device, generator=g).topk(K, dim=1).indices
    d = make_dispatch(experts, E)
    x = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, D, 2 * F, device=device, generator=g) / D ** 0.5).to(torch.bfloat16)
    return x, w, d, d.row_source_R // K


def check() -> None:
    """The kernel (both ways) against a float64 reference on small random shapes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for T, K, D, F, E in [(50, 2, 64, 48, 4), (37, 3, 128, 72, 5)]:
        x, w, d, token = _inputs(T, K, D, F, E, device, seed=T)
        rows = x.double().index_select(0, token)
        want = torch.cat([rows[s:e] @ w[i].double() for i, (s, e) in
                          enumerate(zip([0, *d.offsets_E[:-1].tolist()], d.offsets_E.tolist()))])
        for got in (triton_grouped_mm(x.index_select(0, token), w, d.offsets_E),
                    triton_grouped_mm(x, w, d.offsets_E, token)):
            err = (got.double() - want).abs().max().item()
            assert err <= 2e-2 * want.abs().max().item(), err
    print("check: the grouped kernel, gathered or not, matches the float64 reference")


def _measure(T: int, K: int, D: int, F: int, E: int, iters: int, repeats: int) -> list:
    """Table rows ``(rows, D, 2F, E, what, ms, TFLOP/s)`` for one shape, each way checked
    first: the median over ``repeats`` rounds of each way's median of ``iters`` calls."""
    x, w, d, token = _inputs(T, K, D, F, E, "cuda")
    rows = x.index_select(0, token)
    want = torch._grouped_mm(rows, w, offs=d.offsets_E)
    runs = {"torch (gather + _grouped_mm)": lambda: torch._grouped_mm(x.index_select(0, token), w, offs=d.offsets_E),
            "torch _grouped_mm alone": lambda: torch._grouped_mm(rows, w, offs=d.offsets_E),
            "gather alone": lambda: x.index_select(0, token),
            "triton, gathered rows": lambda: triton_grouped_mm(rows, w, d.offsets_E),
            "triton gathered (fused)": lambda: triton_grouped_mm(x, w, d.offsets_E, token)}
    for name in ("triton, gathered rows", "triton gathered (fused)"):
        got = runs[name]()
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 1e-2, (name, rel)
    flops = 2 * T * K * D * 2 * F
    times = {name: [] for name in runs}
    for _ in range(repeats):  # the ways interleaved, so clock drift falls on each alike
        for name, fn in runs.items():
            times[name].append(median_ms(fn, iters))
    table = []
    for name, ms_each in times.items():
        ms = statistics.median(ms_each)
        table.append((T * K, D, 2 * F, E, name, ms, float("nan") if name == "gather alone" else flops / ms / 1e9))
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="rounds, the ways interleaved in each")
    ap.add_argument("--check", action="store_true", help="only check the kernel against float64 (small shapes)")
    args = ap.parse_args()
    check()
    if args.check:
        return
    table = [row for shape in SHAPES for row in _measure(*shape, args.iters, args.repeats)]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; fc1 forward "
          f"(bf16, random top-k), median of {args.repeats} rounds of {args.iters} calls, the ways interleaved")
    print(f"{'rows':>7s} {'D':>5s} {'N':>5s} {'E':>3s} {'what':>30s} {'ms':>8s} {'TFLOP/s':>8s}")
    for rows, D, N, E, name, ms, tflops in table:
        print(f"{rows:7d} {D:5d} {N:5d} {E:3d} {name:>30s} {ms:8.3f} {tflops:8.1f}")


if __name__ == "__main__":
    main()
