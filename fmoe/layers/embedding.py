"""Token embedding: a gather forward whose backward sums duplicate ids deterministically."""

import torch

from .precision import upcast


class _Embed(torch.autograd.Function):
    # Autograd's rule for ``weight[tokens]`` is an index_put with accumulate over the
    # duplicate ids: on CPU with several threads a parallel atomic fp32 add (its order,
    # and so the rounding, varies run to run), in bf16 a bf16 sum. Here the gradient
    # rows are sorted by id (stably: token order inside an id) and each id's rows are
    # summed in fp32 by a segment sum over all V ids, so every gradient row is written
    # once, in a fixed order: the same bits on every run, thread count and device.
    # No value leaves the device (no unique, no bincount), so it is capturable.
    @staticmethod
    def forward(ctx, weight_VD, tokens):
        ctx.save_for_backward(tokens)
        ctx.vocab, ctx.dtype = weight_VD.shape[0], weight_VD.dtype
        return weight_VD.index_select(0, tokens.reshape(-1)).view(*tokens.shape, weight_VD.shape[1])

    @staticmethod
    def backward(ctx, grad_h):
        (tokens,) = ctx.saved_tensors
        ids, order = torch.sort(tokens.reshape(-1), stable=True)
        bounds = torch.searchsorted(ids, torch.arange(ctx.vocab + 1, device=ids.device))
        rows_ND = upcast(grad_h.reshape(-1, grad_h.shape[-1]).index_select(0, order))
        grad_VD = torch.segment_reduce(rows_ND, "sum", lengths=bounds.diff(), axis=0, unsafe=True)
        return grad_VD.to(ctx.dtype), None


def embed(weight_VD: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``weight[tokens]``: ``[V, D]`` rows gathered at any-shaped ids -> ``[*tokens.shape, D]``.

    The weight's gradient sums the rows of equal ids in fp32, in token order, without
    atomics: bitwise reproducible, whatever the thread count (autograd's own rule is
    a scatter-add whose order varies on CPU with several threads). It is returned in
    the weight's dtype. Ids must be in ``[0, V)``.
    """
    return _Embed.apply(weight_VD, tokens)
