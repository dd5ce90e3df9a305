"""Triton kernels for the non-GEMM work of the expert path and of attention (CUDA only; private).

- ``swiglu_RF``: ``silu(gate) * up [* prob]`` in one kernel each way. Eager torch runs
  two or three elementwise kernels forward (keeping ``silu(gate)`` and the product for
  backward) and, backward, three to five plus a ``cat`` to assemble fc1's ``[R, 2F]``
  gradient; here the backward writes ``grad_h`` directly, keeps only ``h``, and the
  probability's gradient is a fp32 row sum.
- ``unpermute_TD`` (``unpermute_fwd_TD`` / ``unpermute_bwd``): the K-way weighted
  gather-sum of ``dispatch.unpermute`` in fp32 registers (no fp32 copy of the rows), and its
  backward: rows' gradient and the weights' gradient in one pass over the token's rows.
- ``rope_BHSd``: rotary embedding of q and k in fp32 math with one read of the strided
  view and one write (eager: an upcast copy, four products, a ``cat`` and a downcast,
  and as many again backward; ~15 ms of a 150 ms step on the 1.4B benchmark model).
- ``gather_sum_TD``: the permute's backward, ``sum_k grad[pos[t, k]]``, on the unpermute's
  forward kernel (no ``[T, K, D]`` gather before the sum).

Each runs as a ``torch.library`` custom op (``fmoe::rope``,
``fmoe::swiglu``, ``fmoe::unpermute``, ``fmoe::gather_sum`` and the backward ops;
registered in ``kernel_ops.py``) with a fake (shape) rule and a registered backward, so
``torch.compile`` traces them as operators. The FP8 casts' kernels live in
``fp8_kernels.py`` and share this module's launch helpers.
``dispatch.py``, ``experts.py`` and ``attention.py`` call these when
``fused_kernels_available`` says so and keep their pure-torch code as the CPU and reference path; the results agree up to
fp32 summation order (bf16 outputs are rounded once from fp32, where the torch path
may round intermediates). ``FMOE_FUSED_KERNELS=0`` turns the kernels off (A/B runs).

Triton is optional: without it this module imports and reports the kernels
unavailable. ``FMOE_TRITON_INTERPRET=1`` (tests only) runs the kernels on CPU tensors
under Triton's interpreter; it must be set before this module is imported.
"""

import contextlib
import os

import torch

INTERPRET = os.environ.get("FMOE_TRITON_INTERPRET") == "1"
if INTERPRET:  # Triton picks the interpreter when ``triton.jit`` decorates, so set it first.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (CI): the torch path runs
    triton = None

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NUM_WARPS = 4
_TILE = 2048  # elements per program tile: 16 per thread at 4 warps (two 16-byte bf16 loads)


def fused_kernels_available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``t``: a CUDA tensor (or a CPU one
    under ``FMOE_TRITON_INTERPRET=1``), Triton importable, and ``FMOE_FUSED_KERNELS`` not 0."""
    if triton is None or os.environ.get("FMOE_FUSED_KERNELS", "1") == "0":
        return False
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def swiglu_fusable(h: torch.Tensor, interleave: int, prob_R: torch.Tensor | None = None) -> bool:
    """``swiglu_RF`` takes ``h`` (and ``prob_R``): kernels available, kernel dtypes, whole
    GLU blocks, ``[R]`` probabilities for ``[R, 2F]`` rows."""
    F = h.shape[-1] // 2
    if not (fused_kernels_available(h) and h.dtype in KERNEL_DTYPES and h.shape[-1] % 2 == 0
            and (not interleave or F % interleave == 0)):
        return False
    return prob_R is None or (h.dim() == 2 and prob_R.shape == h.shape[:1] and prob_R.dtype in KERNEL_DTYPES
                              and prob_R.device == h.device)


def unpermute_fusable(y_RD: torch.Tensor, w_TK: torch.Tensor | None) -> bool:
    """``unpermute_fwd_TD`` / ``unpermute_bwd`` take these: kernels available, kernel dtypes."""
    return (fused_kernels_available(y_RD) and y_RD.dtype in KERNEL_DTYPES and y_RD.dim() == 2
            and (w_TK is None or (w_TK.dtype in KERNEL_DTYPES and w_TK.device == y_RD.device)))


def _new(shape, dtype: torch.dtype, device) -> torch.Tensor:
    # A kernel's output buffer. Triton's interpreter truncates fp32 -> bf16/fp16 casts
    # (compiled code rounds to nearest even), so under it kernels write fp32 and
    # ``_done`` rounds with torch: interpreted tests then check the GPU's arithmetic.
    return torch.empty(shape, dtype=torch.float32 if INTERPRET else dtype, device=device)


def _done(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def on_device_of(t: torch.Tensor):
    """A context where Triton launches on ``t``'s device (it launches on the current one,
    and a rank may hold several GPUs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _blocks(width: int, max_cols: int = 512, tile: int = _TILE) -> tuple[int, int]:
    # (rows, cols) of a program's tile: up to ``max_cols`` columns (a power of two, at
    # most the width's next one) and as many rows as fill ``tile`` elements; small
    # widths get several rows per program so a launch has no idle lanes.
    cols = min(max_cols, triton.next_power_of_2(max(width, 1)))
    return max(1, tile // cols), cols


if triton is not None:
    # Row and token counts change with routing every step, so no kernel is specialised on
    # them (``do_not_specialize``): Triton would compile a variant whenever a count's
    # divisibility by 16 first changed, mid-run, while every other expert rank waits.

    @triton.jit
    def _glu_columns(cols, F, IL: tl.constexpr):
        # Columns of gate and up in a ``[.., 2F]`` row: ``[gate | up]`` (IL == 0) or
        # blocks of IL gate then IL up columns (``glu_interleave``).
        if IL == 0:
            gate = cols
            up = cols + F
        else:
            gate = (cols // IL) * (2 * IL) + cols % IL
            up = gate + IL
        return gate, up

    @triton.jit(do_not_specialize=["R"])
    def _swiglu_fwd_kernel(h_ptr, p_ptr, a_ptr, R, F, IL: tl.constexpr, HAS_P: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        # grid (row blocks, column blocks); rows on axis 0, whose limit is 2^31 - 1.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        row_ok = rows < R
        mask = row_ok[:, None] & (cols < F)[None, :]
        rows64 = rows.to(tl.int64)  # R * 2F may pass 2^31
        gate_c, up_c = _glu_columns(cols, F, IL)
        h_row = h_ptr + rows64[:, None] * (2 * F)
        g = tl.load(h_row + gate_c[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_row + up_c[None, :], mask=mask, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u
        if HAS_P:
            a = a * tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(a_ptr + rows64[:, None] * F + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["R"])
    def _swiglu_bwd_kernel(h_ptr, p_ptr, ga_ptr, gh_ptr, gp_ptr, R, F, IL: tl.constexpr,
                           HAS_P: tl.constexpr, NEED_GP: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        # grid (row blocks,): a program walks its rows' columns, so the probability's
        # gradient (a sum over the row) needs no second pass and no atomics.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        rows64 = rows.to(tl.int64)
        h_row = h_ptr + rows64[:, None] * (2 * F)
        gh_row = gh_ptr + rows64[:, None] * (2 * F)
        ga_row = ga_ptr + rows64[:, None] * F
        if HAS_P:
            p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        gp = tl.zeros([BLOCK_R], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            mask = row_ok[:, None] & (cols < F)[None, :]
            gate_c, up_c = _glu_columns(cols, F, IL)
            g = tl.load(h_row + gate_c[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(h_row + up_c[None, :], mask=mask, other=0.0).to(tl.float32)
            ga = tl.load(ga_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            silu = g * sig
            if NEED_GP:
                gp += tl.sum(ga * silu * u, axis=1)
            if HAS_P:
                ga = ga * p[:, None]
            d_gate = ga * u * sig * (1.0 + g * (1.0 - sig))  # silu'(g) = sig (1 + g (1 - sig))
            d_up = ga * silu
            tl.store(gh_row + gate_c[None, :], d_gate.to(gh_ptr.dtype.element_ty), mask=mask)
            tl.store(gh_row + up_c[None, :], d_up.to(gh_ptr.dtype.element_ty), mask=mask)
        if NEED_GP:
            tl.store(gp_ptr + rows, gp.to(gp_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit(do_not_specialize=["T", "R"])
    def _unpermute_fwd_kernel(y_ptr, w_ptr, pos_ptr, out_ptr, T, R, D, K: tl.constexpr,
                              HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        # grid (token blocks, column blocks): out[t] = sum_k w[t, k] y[pos[t, k]], summed
        # in fp32 registers in k order (the torch path's order); pos == R (dropped) adds 0.
        tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        tok_ok = tok < T
        col_ok = cols < D
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(K):
            pos = tl.load(pos_ptr + tok * K + k, mask=tok_ok, other=R).to(tl.int64)  # R * D may pass 2^31
            kept = tok_ok & (pos < R)
            y = tl.load(y_ptr + pos[:, None] * D + cols[None, :], mask=kept[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            if HAS_W:
                y = y * tl.load(w_ptr + tok * K + k, mask=tok_ok, other=0.0).to(tl.float32)[:, None]
            acc += y
        tl.store(out_ptr + tok[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["R"])
    def _unpermute_bwd_kernel(g_ptr, y_ptr, w_ptr, pos_ptr, gy_ptr, gw_ptr, R, D,
                              K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr,
                              NEED_GY: tl.constexpr, NEED_GW: tl.constexpr, BLOCK_D: tl.constexpr):
        # grid (tokens,): one program reads its token's gradient row once and, for each of
        # its K rows, writes grad_y[pos] = grad * w (a scatter with distinct targets: every
        # row holds at most one assignment, so no atomics and no order dependence) and
        # accumulates grad_w[t, k] = <grad, y[pos]> in fp32 over the column chunks.
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, KP)
        k_ok = ks < K
        pos = tl.load(pos_ptr + t * K + ks, mask=k_ok, other=R).to(tl.int64)
        kept = k_ok & (pos < R)
        if HAS_W:
            w = tl.load(w_ptr + t * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        dot = tl.zeros([KP], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_ok = cols < D
            mask = kept[:, None] & col_ok[None, :]
            g = tl.load(g_ptr + t * D + cols, mask=col_ok, other=0.0).to(tl.float32)
            at = pos[:, None] * D + cols[None, :]
            if NEED_GY:
                if HAS_W:
                    gy = g[None, :] * w[:, None]
                else:
                    gy = tl.broadcast_to(g[None, :], (KP, BLOCK_D))
                tl.store(gy_ptr + at, gy.to(gy_ptr.dtype.element_ty), mask=mask)
            if NEED_GW:
                y = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
                dot += tl.sum(y * g[None, :], axis=1)
        if NEED_GW:
            tl.store(gw_ptr + t * K + ks, dot.to(gw_ptr.dtype.element_ty), mask=k_ok)

    @triton.jit(do_not_specialize=["R", "TK"])
    def _zero_padding_rows_kernel(gy_ptr, src_ptr, R, D, TK, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # The token-major backward writes only rows that hold an assignment; padding rows
        # (row_source == T * K) get a zero gradient here, as the torch path's zero pad does.
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        row_ok = rows < R
        pad = row_ok & (tl.load(src_ptr + rows, mask=row_ok, other=0) == TK)
        zero = tl.zeros([BLOCK_R, BLOCK_D], dtype=gy_ptr.dtype.element_ty)
        tl.store(gy_ptr + rows[:, None] * D + cols[None, :], zero, mask=pad[:, None] & (cols < D)[None, :])


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, N, H, S, stride_b, stride_h, stride_s, HALF, D,
                     NEGATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
        # grid (row blocks,) over the B * H * S rows of a strided [B, H, S, D] view (q or k
        # straight out of the qkv projection): the first 2 * HALF features become
        # (x1 c - x2 s, x2 c + x1 s) in fp32, the rest (partial RoPE) pass as they are;
        # out is contiguous. NEGATE rotates back by -angle: the backward of the same rotation.
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_C)
        mask = (rows < N)[:, None] & (cols < HALF)[None, :]
        pos = rows % S
        head = (rows // S) % H
        batch = rows // (S * H)
        row_at = (batch * stride_b + head * stride_h + pos * stride_s)[:, None]
        x_at = row_at + cols[None, :]
        x1 = tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_at + HALF, mask=mask, other=0.0).to(tl.float32)
        table_at = pos[:, None] * HALF + cols[None, :]
        c = tl.load(cos_ptr + table_at, mask=mask, other=0.0)
        s = tl.load(sin_ptr + table_at, mask=mask, other=0.0)
        if NEGATE:
            s = -s
        out_row = rows[:, None] * D
        out_at = out_row + cols[None, :]
        tl.store(out_ptr + out_at, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + out_at + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)
        if BLOCK_P > 0:
            rest = 2 * HALF + tl.arange(0, BLOCK_P)
            rest_mask = (rows < N)[:, None] & (rest < D)[None, :]
            kept = tl.load(x_ptr + row_at + rest[None, :], mask=rest_mask, other=0.0)
            tl.store(out_ptr + out_row + rest[None, :], kept.to(out_ptr.dtype.element_ty), mask=rest_mask)


def rope_fusable(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor) -> bool:
    """``rope_BHSd`` takes ``x`` and the tables: kernels available, a kernel dtype, unit
    stride along d, one table row per position rotating at most d features."""
    return (fused_kernels_available(x_BHSd) and x_BHSd.dtype in KERNEL_DTYPES and x_BHSd.dim() == 4
            and cos_Sh.dim() == 2 and 2 * cos_Sh.shape[-1] <= x_BHSd.shape[-1] and x_BHSd.stride(-1) == 1)


def rotate_BHSd(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor, negate: bool) -> torch.Tensor:
    """``x`` with its first ``2h`` features rotated by the RoPE angles (``h``: the tables'
    width; ``negate``: by minus them, the backward) and the rest as they are, as a
    contiguous tensor in x's dtype; x needs unit stride along d."""
    B, H, S, d = x_BHSd.shape
    half = cos_Sh.shape[-1]
    out = _new((B, H, S, d), x_BHSd.dtype, x_BHSd.device)
    if out.numel():
        block_r, block_c = _blocks(half)
        kept = d - 2 * half
        block_p = triton.next_power_of_2(kept) if kept else 0
        with on_device_of(x_BHSd):
            _rope_kernel[(triton.cdiv(B * H * S, block_r),)](
                x_BHSd, cos_Sh, sin_Sh, out, B * H * S, H, S, *x_BHSd.stride()[:3], half, d, NEGATE=negate,
                BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_P=block_p, num_warps=NUM_WARPS)
    return _done(out, x_BHSd.dtype)


def rope_BHSd(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
    """``rope.apply_rope`` in one kernel each way (the ``fmoe::rope`` op): reads the
    (strided) view once, rotates in fp32, writes a contiguous result in x's dtype.
    Check ``rope_fusable`` first."""
    cos32, sin32 = (t.to(device=x_BHSd.device, dtype=torch.float32).contiguous() for t in (cos_Sh, sin_Sh))
    return torch.ops.fmoe.rope(x_BHSd, cos32, sin32, False)


def swiglu_fwd_RF(h_RN: torch.Tensor, prob_R: torch.Tensor | None, interleave: int) -> torch.Tensor:
    """``silu(gate) * up [* prob]`` of contiguous ``[R, 2F]`` -> ``[R, F]`` in h's dtype."""
    R, F = h_RN.shape[0], h_RN.shape[1] // 2
    a_RF = _new((R, F), h_RN.dtype, h_RN.device)
    if R and F:
        block_r, block_f = _blocks(F)
        with on_device_of(h_RN):
            _swiglu_fwd_kernel[(triton.cdiv(R, block_r), triton.cdiv(F, block_f))](
                h_RN, prob_R, a_RF, R, F, IL=interleave, HAS_P=prob_R is not None,
                BLOCK_R=block_r, BLOCK_F=block_f, num_warps=NUM_WARPS)
    return _done(a_RF, h_RN.dtype)


def swiglu_bwd_RN(h_RN: torch.Tensor, prob_R: torch.Tensor | None, grad_RF: torch.Tensor, interleave: int,
                  need_grad_prob: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad_h [R, 2F], grad_prob [R] or None)`` of ``swiglu_fwd_RF`` (contiguous inputs)."""
    R, F = grad_RF.shape
    grad_h = _new(h_RN.shape, h_RN.dtype, h_RN.device)
    need_gp = need_grad_prob and prob_R is not None
    grad_p = _new(prob_R.shape, prob_R.dtype, prob_R.device) if need_gp else None
    if R and F:
        # Half a tile: three inputs and two outputs live per element (on sm_90, Triton
        # 3.7: 150 registers a thread at 2048 elements, 64 at 1024, so more warps resident).
        block_r, block_f = _blocks(F, max_cols=256, tile=_TILE // 2)
        with on_device_of(h_RN):
            _swiglu_bwd_kernel[(triton.cdiv(R, block_r),)](
                h_RN, prob_R, grad_RF, grad_h, grad_p, R, F, IL=interleave, HAS_P=prob_R is not None,
                NEED_GP=need_gp, BLOCK_R=block_r, BLOCK_F=block_f, num_warps=NUM_WARPS)
    elif need_gp:
        grad_p.zero_()
    return _done(grad_h, h_RN.dtype), _done(grad_p, None if prob_R is None else prob_R.dtype)


def swiglu_RF(h: torch.Tensor, interleave: int = 0, prob_R: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of fc1's output ``[.., 2F]`` (halves as ``glu_halves`` splits
    them), times ``prob_R[r]`` per row when given (``h`` then ``[R, 2F]``); fp32 math,
    one rounding to h's dtype (the ``fmoe::swiglu`` op). Check ``swiglu_fusable`` first."""
    lead, N = h.shape[:-1], h.shape[-1]
    a = torch.ops.fmoe.swiglu(h.reshape(-1, N), prob_R, interleave)
    return a.view(*lead, N // 2)


def unpermute_fwd_TD(y_RD: torch.Tensor, w_TK: torch.Tensor | None, pos_TK: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * y[pos[t, k]]`` (``pos == R``: dropped, adds nothing), fp32
    sum, ``[T, D]`` in y's dtype. Inputs contiguous."""
    (T, K), (R, D) = pos_TK.shape, y_RD.shape
    out = _new((T, D), y_RD.dtype, y_RD.device)
    if T and D:
        block_t, block_d = _blocks(D)
        block_t = min(block_t, triton.next_power_of_2(T))
        with on_device_of(y_RD):
            _unpermute_fwd_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, block_d))](
                y_RD, w_TK, pos_TK, out, T, R, D, K=K, HAS_W=w_TK is not None,
                BLOCK_T=block_t, BLOCK_D=block_d, num_warps=NUM_WARPS)
    return _done(out, y_RD.dtype)


def unpermute_bwd(grad_TD: torch.Tensor, y_RD: torch.Tensor | None, w_TK: torch.Tensor | None,
                  pos_TK: torch.Tensor, row_source_R: torch.Tensor, R: int, dtype: torch.dtype,
                  dropping: bool, need_grad_rows: bool, need_grad_w: bool):
    """``(grad_y [R, D] or None, grad_w [T, K] or None)`` of ``unpermute_fwd_TD``.

    ``grad_y[r] = grad[t] * w[t, k]`` for the row holding assignment ``(t, k)``, zero on
    padding rows; ``grad_w[t, k] = <grad[t], y[pos[t, k]]>`` in fp32, zero if dropped.
    ``y_RD`` is read only for ``grad_w``; ``dropping``: an assignment may have no row
    (static capacity, where padding rows may exist even when ``R == T * K``, or a rank's
    share of a routing). Inputs contiguous.
    """
    (T, K), D = pos_TK.shape, grad_TD.shape[1]
    need_gw = need_grad_w and w_TK is not None
    grad_y = _new((R, D), dtype, grad_TD.device) if need_grad_rows else None
    grad_w = _new(w_TK.shape, w_TK.dtype, w_TK.device) if need_gw else None
    if T and D and (need_grad_rows or need_gw):
        block_d = min(triton.next_power_of_2(D), max(_TILE // triton.next_power_of_2(K), 32))
        with on_device_of(grad_TD):
            _unpermute_bwd_kernel[(T,)](
                grad_TD, y_RD, w_TK, pos_TK, grad_y, grad_w, R, D, K=K, KP=triton.next_power_of_2(K),
                HAS_W=w_TK is not None, NEED_GY=need_grad_rows, NEED_GW=need_gw, BLOCK_D=block_d,
                num_warps=NUM_WARPS)
    elif need_gw:
        grad_w.zero_()
    if need_grad_rows and R and D and (dropping or R != T * K):  # else every row holds an assignment
        block_r, block_d = _blocks(D)
        with on_device_of(grad_y):
            _zero_padding_rows_kernel[(triton.cdiv(R, block_r), triton.cdiv(D, block_d))](
                grad_y, row_source_R, R, D, T * K, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=NUM_WARPS)
    return _done(grad_y, dtype), _done(grad_w, None if w_TK is None else w_TK.dtype)


def unpermute_TD(y_RD: torch.Tensor, w_TK: torch.Tensor | None, pos_TK: torch.Tensor, row_source_R: torch.Tensor,
                 dropping: bool) -> torch.Tensor:
    """``dispatch.unpermute`` in one kernel each way (the ``fmoe::unpermute`` op), with
    ``dispatch.Dispatch``'s ``pos_TK`` and ``row_source_R``. Check ``unpermute_fusable`` first."""
    return torch.ops.fmoe.unpermute(y_RD, w_TK, pos_TK, row_source_R, dropping)


def gather_sum_TD(x_RD: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k x[pos[t, k]]`` (``pos == R`` adds nothing): the permute's backward,
    the unpermute's forward kernel without weights (``fmoe::gather_sum``, no autograd)."""
    return torch.ops.fmoe.gather_sum(x_RD, pos_TK)
