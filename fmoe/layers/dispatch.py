"""Permute tokens into per-expert segments and back.

The permuted buffer has ``R`` rows: expert 0's tokens, then expert 1's, ... in token
order inside each segment.
- Dropless (default): every assignment gets a row. With ``pad_multiple = m > 0`` each
  segment is padded with zero rows up to a multiple of ``m`` (R is read on the host).
- Static capacity (``capacity = C``): every segment has exactly ``C`` rows, so no
  value leaves the device; an expert's assignments beyond the first ``C`` in token
  order are dropped (they contribute nothing to the output), the rest is padding.
Padding and dropped rows are never read back, so they cannot reach outputs or
gradients. Both directions are gathers, forward and backward: no scatter-add with
duplicate indices, so results are deterministic on every backend.
"""

import math
from typing import NamedTuple

import torch

from . import triton_kernels
from .precision import upcast
from .router import expert_counts


class Dispatch(NamedTuple):
    """Where every (token, k) assignment goes.

    Attributes:
        pos_TK: ``[T, K]`` row of each assignment; ``R`` (one past the end) if dropped.
        row_source_R: ``[R]`` flat assignment index ``t * K + k`` of each row;
            ``T * K`` marks a padding row.
        row_expert_R: ``[R]`` expert owning each row.
        counts_E: ``[E]`` assignments routed to each expert (before any drop).
        rows_E: ``[E]`` rows per expert segment.
        offsets_E: ``[E]`` int32 cumulative segment ends (``torch._grouped_mm``'s ``offs``).
        dropped: long scalar, assignments dropped by the capacity.
        capacity: rows per expert in static-capacity mode, else None.
        partial: some assignments have no row here (their ``pos`` is ``R``): the part
            of a routing one rank holds (``without_missing``).
    """

    pos_TK: torch.Tensor
    row_source_R: torch.Tensor
    row_expert_R: torch.Tensor
    counts_E: torch.Tensor
    rows_E: torch.Tensor
    offsets_E: torch.Tensor
    dropped: torch.Tensor
    capacity: int | None = None
    partial: bool = False

    @property
    def num_rows(self) -> int:
        return self.row_source_R.shape[0]

    @property
    def may_drop(self) -> bool:
        """Whether an assignment may have no row (``pos == R``)."""
        return self.capacity is not None or self.partial

    @property
    def padded_rows(self) -> int:
        """Rows holding no assignment (an int for dropless, a device scalar with capacity)."""
        if self.partial:
            return 0
        if self.capacity is None:
            return self.num_rows - self.pos_TK.numel()
        return self.num_rows - (self.pos_TK.numel() - self.dropped)


def capacity_rows(tokens: int, topk: int, experts: int, factor: float, pad_multiple: int = 0) -> int:
    """Rows per expert for ``factor`` x the even share ``tokens * topk / experts``,
    rounded up (to ``pad_multiple`` too when set)."""
    rows = max(1, math.ceil(factor * tokens * topk / experts))
    return -(-rows // pad_multiple) * pad_multiple if pad_multiple else rows


def make_dispatch(indices_TK: torch.Tensor, num_experts: int, pad_multiple: int = 0,
                  capacity: int | None = None) -> Dispatch:
    """Build the permutation for a routing decision.

    Arguments:
        indices_TK: ``[T, K]`` chosen experts.
        num_experts: E.
        pad_multiple: dropless only: 0 for no padding, else the segment size multiple.
        capacity: rows per expert for static-capacity mode (see ``capacity_rows``), or
            None for dropless.

    Returns:
        A Dispatch. Without padding, or with a capacity, no value leaves the device.
    """
    T, K = indices_TK.shape
    device = indices_TK.device
    flat = indices_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    sorted_expert = flat[order]
    rank_in_expert = torch.arange(T * K, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    if capacity is not None:
        rows = torch.full((num_experts,), capacity, dtype=torch.long, device=device)
        num_rows = num_experts * capacity
        kept = rank_in_expert < capacity
        dest = torch.where(kept, sorted_expert * capacity + rank_in_expert, num_rows)
        dropped = (~kept).sum()
    else:
        rows = (counts + pad_multiple - 1) // pad_multiple * pad_multiple if pad_multiple else counts
        num_rows = int(rows.sum()) if pad_multiple else T * K
        dest = (torch.cumsum(rows, 0) - rows)[sorted_expert] + rank_in_expert
        dropped = torch.zeros((), dtype=torch.long, device=device)
    pos = torch.empty_like(flat)
    pos[order] = dest
    # One spare slot takes every dropped assignment's write; it is cut off after.
    row_source = torch.full((num_rows + 1,), T * K, dtype=torch.long, device=device)
    row_source[dest] = order
    row_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), rows, output_size=num_rows)
    offsets = torch.cumsum(rows, 0).to(torch.int32)
    return Dispatch(pos.view(T, K), row_source[:num_rows], row_expert, counts, rows, offsets, dropped, capacity)


def without_missing(d: Dispatch, num_rows: int, groups: int, tokens: int | None = None) -> Dispatch:
    """``d``, made by ``make_dispatch`` with one group more than ``groups`` for the
    assignments that have no row (sorted last), cut to its first ``groups`` groups and
    ``num_rows`` rows: those assignments' ``pos`` becomes ``num_rows`` (``partial``).
    ``tokens``: cut to the first ``tokens`` tokens too (the rest must have no row)."""
    pos = d.pos_TK if tokens is None else d.pos_TK[:tokens]
    pos = torch.where(pos < num_rows, pos, num_rows)
    return Dispatch(pos, d.row_source_R[:num_rows], d.row_expert_R[:num_rows], d.counts_E[:groups],
                    d.rows_E[:groups], d.offsets_E[:groups], d.dropped, None, partial=True)


def _gather_rows_with_zero_pad(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` where ``index == len(src)`` yields a zero row."""
    padded = torch.cat([src, src.new_zeros((1,) + src.shape[1:])])
    return padded.index_select(0, index)


def _rows_at(src: torch.Tensor, index: torch.Tensor, may_miss: bool) -> torch.Tensor:
    return _gather_rows_with_zero_pad(src, index) if may_miss else src.index_select(0, index)


class _Permute(torch.autograd.Function):
    # Autograd's backward for a gather with repeated indices is a scatter-add
    # (atomics, order-dependent on GPU); the reverse gather + sum over k is exact.
    @staticmethod
    def forward(ctx, x_TD, row_token_R, pos_TK, padded, dropping):
        ctx.save_for_backward(pos_TK)
        ctx.dropping = dropping
        return _rows_at(x_TD, row_token_R, padded)

    @staticmethod
    def backward(ctx, grad_RD):
        (pos_TK,) = ctx.saved_tensors
        if triton_kernels.unpermute_fusable(grad_RD, None):  # one pass, fp32 sum over k, no [T, K, D] copy
            return triton_kernels.gather_sum_TD(grad_RD, pos_TK), None, None, None, None
        T, K = pos_TK.shape
        grad_TKD = _rows_at(grad_RD, pos_TK.reshape(-1), ctx.dropping).view(T, K, grad_RD.shape[1])
        return grad_TKD.sum(1), None, None, None, None


def permute(x_TD: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """``[T, D]`` tokens -> ``[R, D]`` rows grouped by expert (zeros on padding rows)."""
    K = d.pos_TK.shape[1]
    padded = d.capacity is not None or (not d.partial and d.num_rows != d.pos_TK.numel())
    return _Permute.apply(x_TD, d.row_source_R // K, d.pos_TK, padded, d.may_drop)


def row_weights(w_TK: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """Per-assignment weights ``[T, K]`` -> per-row ``[R]`` (0 on padding rows)."""
    return _gather_rows_with_zero_pad(w_TK.reshape(-1), d.row_source_R)


def unpermute(y_RD: torch.Tensor, d: Dispatch, w_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Combine rows back into tokens: ``y[t] = sum_k w[t, k] * y_R[pos[t, k]]``
    (a dropped assignment adds nothing).

    Arguments:
        y_RD: ``[R, D]`` expert outputs.
        d: the Dispatch that produced the rows.
        w_TK: optional ``[T, K]`` weights (the router probabilities); the sum runs in
            at least fp32.

    Returns:
        ``[T, D]`` in ``y_RD``'s dtype.
    """
    if triton_kernels.unpermute_fusable(y_RD, w_TK):
        return triton_kernels.unpermute_TD(y_RD, w_TK, d.pos_TK, d.row_source_R, d.may_drop)
    return _Unpermute.apply(y_RD, w_TK, d.pos_TK, d.row_source_R, d.may_drop)


class _Unpermute(torch.autograd.Function):
    # Forward: each token's K rows, gathered and multiply-added into a fp32 sum one k
    # at a time (no fp32 copy of the rows, no batched GEMM). Backward: every row holds
    # at most one assignment, so the rows' gradient is a gather by row_source, not the
    # index_add autograd would run for the forward gather.
    # On CUDA with Triton, ``unpermute`` runs the fused kernels instead
    # (triton_kernels.unpermute_TD: the same sums, the backward's rows and weights'
    # gradient in one pass); this is the CPU and reference path.
    @staticmethod
    def forward(ctx, y_RD, w_TK, pos_TK, row_source_R, dropping):
        T, K = pos_TK.shape
        keep_rows = w_TK is not None and ctx.needs_input_grad[1]  # only the weights' gradient reads them
        ctx.dropping, ctx.dtype = dropping, y_RD.dtype
        y_TKD = _rows_at(y_RD, pos_TK.reshape(-1), dropping).view(T, K, y_RD.shape[1])  # (T may be 0)
        acc = upcast(y_TKD[:, 0])
        acc = acc.clone() if w_TK is None else acc * w_TK[:, :1].to(acc.dtype)
        for k in range(1, K):
            if w_TK is None:
                acc.add_(y_TKD[:, k])
            else:
                acc.addcmul_(y_TKD[:, k], w_TK[:, k:k + 1].to(acc.dtype))
        ctx.save_for_backward(y_RD if keep_rows else None, w_TK, pos_TK, row_source_R)
        return acc.to(y_RD.dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        y_RD, w_TK, pos_TK, row_source_R = ctx.saved_tensors
        T, K = pos_TK.shape
        g_up = upcast(grad_TD)
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            per_k = g_up[:, None, :].expand(T, K, -1) if w_TK is None else g_up[:, None, :] * w_TK[:, :, None].to(g_up)
            grad_y = _gather_rows_with_zero_pad(per_k.to(ctx.dtype).reshape(T * K, g_up.shape[1]), row_source_R)
        if w_TK is not None and ctx.needs_input_grad[1]:
            y_TKD = _rows_at(y_RD, pos_TK.reshape(-1), ctx.dropping).view(T, K, y_RD.shape[1])
            grad_w = torch.einsum("td,tkd->tk", g_up, upcast(y_TKD)).to(w_TK.dtype)
        return grad_y, grad_w, None, None, None
