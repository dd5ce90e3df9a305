"""Triton kernels for the FP8 casts of ``fp8.py`` (CUDA only; private).

- ``quantize_rows_RW``: ``fp8.quantize_rows`` of a contiguous tensor, a row per program
  held in registers: one read, one FP8 write, the same bits as the torch code (inductor
  compiles that code for a symbolic width as a two-pass loop: 3x the time on the
  experts' rows).
- ``quantize_columns_KN``: ``fp8.quantize_columns`` of a contiguous tensor (the experts'
  weights, per output column), two passes over column blocks, the FP8 copy written
  transposed, the same bits as the torch code (inductor's reduction reads the columns
  across rows: 0.39 ms for the coarse model's fc1 weight, this kernel 0.24 ms).

Both are launched directly, not as custom ops: ``fp8._quantize`` calls them only
outside compiled regions (inside them inductor fuses the torch code with its
neighbours), and they have no gradient. They share ``triton_kernels``' switches
(``fused_kernels_available``, ``FMOE_FUSED_KERNELS``) and launch helpers.
"""

import torch

from .triton_kernels import KERNEL_DTYPES, NUM_WARPS, fused_kernels_available, on_device_of, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, W, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr,
                              TINY: tl.constexpr, BLOCK: tl.constexpr):
        # One row per program: amax, scale = max(amax, TINY) * (1 / FP8_MAX), q = x / scale
        # (IEEE division, then the clamp), cast to E4M3 rounding to nearest even: torch's
        # arithmetic, bit for bit. NaN propagates as in torch (a NaN makes the row's scale
        # NaN, an inf makes it inf), so a non-finite input stays visible downstream.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < W
        x = tl.load(x_ptr + row * W + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        amax = tl.where(tl.max((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)  # tl.max skips NaN
        scale = tl.maximum(amax, TINY, propagate_nan=tl.PropagateNan.ALL) * INV_MAX
        q = tl.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + row * W + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _quantize_columns_kernel(x_ptr, q_ptr, scale_ptr, K, N, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr,
                                 TINY: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        # grid (column blocks, matrices). The same arithmetic as _quantize_rows_kernel
        # along each column of a contiguous [K, N] matrix: a first pass over its rows
        # for the columns' amax, a second that writes q transposed, [N, K] contiguous.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        base = tl.program_id(1).to(tl.int64) * K * N
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        nans = tl.zeros([BLOCK_N], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)
            mask = (rows < K)[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
            nans = tl.maximum(nans, tl.max((x != x).to(tl.int32), axis=0))
        amax = tl.where(nans > 0, float("nan"), amax)  # tl.max skips NaN
        scale = tl.maximum(amax, TINY, propagate_nan=tl.PropagateNan.ALL) * INV_MAX
        for k0 in range(0, K, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)
            mask = (rows < K)[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            q = tl.div_rn(x, scale[None, :])
            q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                           propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + base + cols[None, :].to(tl.int64) * K + rows[:, None],
                     q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(scale_ptr + tl.program_id(1).to(tl.int64) * N + cols, scale, mask=col_ok)


QUANTIZE_MAX_WIDTH = 16384  # a row in registers: wider rows take the compiled torch code


def _castable(x: torch.Tensor) -> bool:
    # what both kernels read: a contiguous CUDA tensor of a kernel dtype, kernels on
    # (CUDA only: Triton's interpreter, which runs on CPU tensors, has no FP8 stores)
    return x.is_cuda and fused_kernels_available(x) and x.dtype in KERNEL_DTYPES and x.is_contiguous()


def quantize_fusable(x: torch.Tensor) -> bool:
    """``quantize_rows_RW`` takes ``x``: a contiguous CUDA tensor of a kernel dtype whose
    rows fit a program."""
    return _castable(x) and 0 < x.shape[-1] <= QUANTIZE_MAX_WIDTH


def quantize_columns_fusable(x: torch.Tensor) -> bool:
    """``quantize_columns_KN`` takes ``x``: a contiguous ``[E, K, N]`` CUDA tensor of a
    kernel dtype (the experts' weights: a program per expert and column block keeps the
    GPU busy, where one tall matrix would get too few programs)."""
    return _castable(x) and x.dim() == 3


def quantize_rows_RW(x: torch.Tensor, fp8_max: float, tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``fp8.quantize_rows`` for contiguous ``x`` (check
    ``quantize_fusable`` first): ``q`` E4M3 of x's shape, ``scale`` fp32 ``[..., 1]``."""
    W = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    rows = x.numel() // W
    if rows:
        block = triton.next_power_of_2(W)
        with on_device_of(x):
            _quantize_rows_kernel[(rows,)](x, q, scale, W, FP8_MAX=fp8_max, INV_MAX=1.0 / fp8_max, TINY=tiny,
                                           BLOCK=block, num_warps=8 if block >= 4096 else NUM_WARPS)
    return q, scale


def quantize_columns_KN(x: torch.Tensor, fp8_max: float, tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``fp8.quantize_columns`` for contiguous ``x`` of shape
    ``[..., K, N]`` (check ``quantize_columns_fusable`` first): ``q`` E4M3 ``[..., N, K]``
    contiguous, ``scale`` fp32 ``[..., N, 1]``, one per column of x."""
    K, N = x.shape[-2:]
    q = torch.empty((*x.shape[:-2], N, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-2], N, 1), dtype=torch.float32, device=x.device)
    matrices = x.numel() // max(K * N, 1)
    if matrices and K and N:
        with on_device_of(x):
            # 128 x 64 tiles: 1.2-1.4x faster than 64 x 64 on the benchmark shapes' fc1
            # weights, as fast on fc2's (a sweep of 32-128 rows and columns at 4 and 8
            # warps on an H200; BENCHMARKS.md)
            block_k, block_n = 128, 64
            _quantize_columns_kernel[(triton.cdiv(N, block_n), matrices)](
                x, q, scale, K, N, FP8_MAX=fp8_max, INV_MAX=1.0 / fp8_max, TINY=tiny, BLOCK_K=block_k,
                BLOCK_N=block_n, num_warps=NUM_WARPS)
    return q, scale
