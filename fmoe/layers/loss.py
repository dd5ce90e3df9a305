"""The head's loss: logits and the fp32 cross-entropy, whole or in pieces of tokens."""

import functools

import torch
import torch.nn.functional as F

from ..batch import IGNORE
from .fp8 import Fp8Weight
from .norm import rms_norm
from .precision import upcast
from .tensor_parallel import TensorParallel, vocab_parallel_cross_entropy


def cross_entropy_sum(x_TD: torch.Tensor, w_DV: torch.Tensor, targets_T: torch.Tensor,
                      matmul=torch.matmul, tp: TensorParallel | None = None) -> torch.Tensor:
    """``sum_t CE(x_t @ w, target_t)`` over the targets that are not ``IGNORE``, the
    softmax in fp32 whatever x's dtype; the logits' product through ``matmul``
    (``Gemms.head``: FP8 under ``Plan.fp8='tensorwise'``). ``tp``: ``w`` is this rank's
    vocabulary columns (``vocab_parallel_cross_entropy``)."""
    if tp is not None:
        return vocab_parallel_cross_entropy(matmul(x_TD, w_DV), targets_T, tp)
    return F.cross_entropy(upcast(matmul(x_TD, w_DV)), targets_T, reduction="sum", ignore_index=IGNORE)


def _head_weight(w_DV: torch.Tensor, q_DV: torch.Tensor | None, scale: torch.Tensor | None):
    return w_DV if q_DV is None else Fp8Weight(q_DV, scale, w_DV)


class _Chunked(torch.autograd.Function):
    # Saves x and w only. Forward and backward each run cross_entropy_sum on one piece
    # of tokens at a time (the backward through autograd on that piece), so one
    # piece's [chunk, V] logits and their fp32 copy are the most that ever exist.
    # A head gathered in FP8 comes as its grad_leaf (w_DV) with q_DV and scale, saved
    # too: a Function differentiates its tensor arguments, not the tensors in a tuple.
    @staticmethod
    def forward(ctx, x_TD, w_DV, targets_T, chunk, piece, q_DV=None, scale=None):
        ctx.save_for_backward(x_TD, w_DV, targets_T, q_DV, scale)
        ctx.chunk, ctx.piece = chunk, piece
        total = torch.zeros((), dtype=torch.promote_types(x_TD.dtype, torch.float32), device=x_TD.device)
        w = _head_weight(w_DV, q_DV, scale)
        for lo in range(0, x_TD.shape[0], chunk):
            total += piece(x_TD[lo:lo + chunk], w, targets_T[lo:lo + chunk])
        return total

    @staticmethod
    def backward(ctx, grad_total):
        x_TD, w_DV, targets_T, q_DV, scale = ctx.saved_tensors
        grad_x = torch.empty_like(x_TD)
        grad_w = torch.zeros(w_DV.shape, dtype=torch.promote_types(w_DV.dtype, torch.float32), device=w_DV.device)
        w = w_DV.detach().requires_grad_()
        weight = _head_weight(w, q_DV, scale)
        for lo in range(0, x_TD.shape[0], ctx.chunk):
            x = x_TD[lo:lo + ctx.chunk].detach().requires_grad_()
            with torch.enable_grad():
                loss = ctx.piece(x, weight, targets_T[lo:lo + ctx.chunk])
            gx, gw = torch.autograd.grad(loss, (x, w), grad_total)
            grad_x[lo:lo + ctx.chunk] = gx
            grad_w += gw
        return grad_x, grad_w.to(w_DV.dtype), None, None, None, None, None


def linear_cross_entropy_sum(x_TD: torch.Tensor, w_DV: torch.Tensor, targets_T: torch.Tensor,
                             chunk: int = 0, piece=cross_entropy_sum, tp: TensorParallel | None = None) -> torch.Tensor:
    """Summed cross-entropy of the logits ``x @ w`` (fp32 softmax), ``chunk`` tokens at a time.

    Arguments:
        x_TD: ``[T, D]`` final hidden states (normalised).
        w_DV: ``[D, V]`` output projection, or an ``Fp8Weight`` (gathered in FP8).
        targets_T: ``[T]`` target ids (``IGNORE``: not counted).
        chunk: tokens per piece; 0 (or >= T): all at once, as plain autograd would.
        piece: the function each piece runs, ``cross_entropy_sum``'s signature (a
            ``torch.compile``d one under ``Plan.compile``).
        tp: ``w`` holds this rank's vocabulary columns (passed on to ``piece``).

    Returns:
        A fp32 scalar (float64 for float64 inputs). In pieces the same operations run
        on fewer rows, so results differ from the whole only by rounding: a matmul over
        fewer rows may sum in another order, the total adds the pieces' sums, and
        ``w``'s gradient adds the pieces' products in fp32, each rounded to ``w``'s
        dtype first (in bf16 that rounding is the larger part; in fp32 the gradients
        agree to ~1e-7 relative, in float64 to ~1e-15).
    """
    if tp is not None:
        piece = functools.partial(piece, tp=tp)
    if not chunk or chunk >= x_TD.shape[0]:
        return piece(x_TD, w_DV, targets_T)
    if isinstance(w_DV, Fp8Weight):
        return _Chunked.apply(x_TD, w_DV.grad_leaf, targets_T, chunk, piece, w_DV.q, w_DV.scale)
    return _Chunked.apply(x_TD, w_DV, targets_T, chunk, piece)


def head_weight(params: dict) -> torch.Tensor:
    """The ``[D, V]`` output projection: ``head``, or ``embed.T`` when embeddings are tied."""
    return params["head"] if "head" in params else params["embed"].t()


def head_loss_sum(weights: dict, h_BSD: torch.Tensor, targets_BS: torch.Tensor, eps: float,
                  chunk: int = 0, piece=cross_entropy_sum, tp: TensorParallel | None = None) -> torch.Tensor:
    """Final norm, logits and the fp32 cross-entropy summed over ``targets_BS``
    (``chunk`` tokens at a time: ``Plan.loss_chunk``; each piece through ``piece``).

    ``tp``: tensor parallelism: ``h`` holds this rank's positions and the head (or the
    tied ``embed``) its vocabulary slice; the normalised positions are gathered and
    the loss of every target, the same on every rank, is computed without any rank
    holding all of the vocabulary."""
    x_BSD = rms_norm(h_BSD, weights["final_norm"], eps)
    x_TD = (x_BSD if tp is None else tp.gather(x_BSD, 1)).flatten(0, 1)
    return linear_cross_entropy_sum(x_TD, head_weight(weights), targets_BS.flatten(), chunk, piece, tp)
