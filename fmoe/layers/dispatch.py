"""Permute tokens into per-expert segments and back (dropless, optional padding).

The permuted buffer has ``R`` rows: expert 0's tokens, then expert 1's, ... in token
order inside each segment. With ``pad_multiple = m > 0`` each segment is padded with
zero rows up to a multiple of ``m``; padded rows are never read back, so they cannot
reach outputs or gradients.

Both directions are gathers, forward and backward: no scatter-add with duplicate
indices, so results are deterministic on every backend.
"""

from typing import NamedTuple

import torch

from .precision import upcast


class Dispatch(NamedTuple):
    """Where every (token, k) assignment goes.

    Attributes:
        pos_TK: ``[T, K]`` row of each assignment in the permuted buffer.
        row_source_R: ``[R]`` flat assignment index ``t * K + k`` of each row;
            ``T * K`` marks a padding row.
        row_expert_R: ``[R]`` expert owning each row.
        counts_E: ``[E]`` real assignments per expert.
        rows_E: ``[E]`` rows per expert segment (``counts_E`` rounded up when padding).
        offsets_E: ``[E]`` int32 cumulative segment ends (``torch._grouped_mm``'s ``offs``).
    """

    pos_TK: torch.Tensor
    row_source_R: torch.Tensor
    row_expert_R: torch.Tensor
    counts_E: torch.Tensor
    rows_E: torch.Tensor
    offsets_E: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_source_R.shape[0]

    @property
    def padded_rows(self) -> int:
        return self.num_rows - self.pos_TK.numel()


def make_dispatch(indices_TK: torch.Tensor, num_experts: int, pad_multiple: int = 0) -> Dispatch:
    """Build the permutation for a routing decision.

    Arguments:
        indices_TK: ``[T, K]`` chosen experts.
        num_experts: E.
        pad_multiple: 0 for no padding, else the segment size multiple.

    Returns:
        A Dispatch. Without padding no value leaves the device (``R = T * K``); with
        padding, ``R`` is read on the host once.
    """
    T, K = indices_TK.shape
    flat = indices_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if pad_multiple:
        rows = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
        num_rows = int(rows.sum())
    else:
        rows, num_rows = counts, T * K
    seg_start = torch.cumsum(counts, 0) - counts
    row_start = torch.cumsum(rows, 0) - rows
    sorted_expert = flat[order]
    rank_in_expert = torch.arange(T * K, device=flat.device) - seg_start[sorted_expert]
    dest = row_start[sorted_expert] + rank_in_expert
    pos = torch.empty_like(flat)
    pos[order] = dest
    row_source = torch.full((num_rows,), T * K, dtype=torch.long, device=flat.device)
    row_source[dest] = order
    row_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), rows, output_size=num_rows
    )
    offsets = torch.cumsum(rows, 0).to(torch.int32)
    return Dispatch(pos.view(T, K), row_source, row_expert, counts, rows, offsets)


def _gather_rows_with_zero_pad(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` where ``index == len(src)`` yields a zero row."""
    padded = torch.cat([src, src.new_zeros((1,) + src.shape[1:])])
    return padded.index_select(0, index)


class _Permute(torch.autograd.Function):
    # Autograd's backward for a gather with repeated indices is a scatter-add
    # (atomics, order-dependent on GPU); the reverse gather + sum over k is exact.
    @staticmethod
    def forward(ctx, x_TD, row_token_R, pos_TK):
        ctx.save_for_backward(pos_TK)
        if row_token_R.shape[0] == pos_TK.numel():
            return x_TD.index_select(0, row_token_R)
        return _gather_rows_with_zero_pad(x_TD, row_token_R)

    @staticmethod
    def backward(ctx, grad_RD):
        (pos_TK,) = ctx.saved_tensors
        T, K = pos_TK.shape
        grad_TKD = grad_RD.index_select(0, pos_TK.reshape(-1)).view(T, K, -1)
        return grad_TKD.sum(1), None, None


def permute(x_TD: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """``[T, D]`` tokens -> ``[R, D]`` rows grouped by expert (zeros on padding rows)."""
    K = d.pos_TK.shape[1]
    return _Permute.apply(x_TD, d.row_source_R // K, d.pos_TK)


def row_weights(w_TK: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """Per-assignment weights ``[T, K]`` -> per-row ``[R]`` (0 on padding rows)."""
    return _gather_rows_with_zero_pad(w_TK.reshape(-1), d.row_source_R)


def unpermute(y_RD: torch.Tensor, d: Dispatch, w_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Combine rows back into tokens: ``y[t] = sum_k w[t, k] * y_R[pos[t, k]]``.

    Arguments:
        y_RD: ``[R, D]`` expert outputs.
        d: the Dispatch that produced the rows.
        w_TK: optional ``[T, K]`` weights (the router probabilities); the sum runs in
            at least fp32.

    Returns:
        ``[T, D]`` in ``y_RD``'s dtype.
    """
    T, K = d.pos_TK.shape
    y_TKD = y_RD.index_select(0, d.pos_TK.reshape(-1)).view(T, K, -1)
    if w_TK is None:
        return upcast(y_TKD).sum(1).to(y_RD.dtype)
    return torch.einsum("tkd,tk->td", upcast(y_TKD), w_TK.to(upcast(y_TKD).dtype)).to(y_RD.dtype)
