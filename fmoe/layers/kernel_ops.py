"""The Triton kernels of ``triton_kernels.py`` registered as ``torch.library`` custom ops.

torch.compile sees each kernel as an operator with a shape rule (``register_fake``)
and a registered backward, traced like any aten op: no graph break, and the gradients
are the ones eager runs (a Python autograd.Function launching Triton inside a compiled
region lost them). Eager calls go through the same operators (``triton_kernels``'
``rope_BHSd``, ``swiglu_RF``, ``unpermute_TD``, ``gather_sum_TD``). Outputs are always
tensors (an empty one where a gradient is not wanted), as custom ops require. The ops
call the launchers through the module, so a test can watch them. Imported by
``fmoe.layers``, which registers the ops.
"""

import torch

from . import triton_kernels as tk


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _nothing(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


@torch.library.custom_op("fmoe::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, negate: bool) -> torch.Tensor:
    return tk.rotate_BHSd(x if x.stride(-1) == 1 else x.contiguous(), cos, sin, negate)


@_rope_op.register_fake
def _(x, cos, sin, negate):
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, negate = inputs
    ctx.save_for_backward(cos, sin)
    ctx.negate = negate


def _rope_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return torch.ops.fmoe.rope(grad, cos, sin, not ctx.negate), None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


@torch.library.custom_op("fmoe::swiglu", mutates_args=())
def _swiglu_op(h: torch.Tensor, prob: torch.Tensor | None, interleave: int) -> torch.Tensor:
    return tk.swiglu_fwd_RF(h.contiguous(), _contiguous(prob), interleave)


@_swiglu_op.register_fake
def _(h, prob, interleave):
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@torch.library.custom_op("fmoe::swiglu_backward", mutates_args=())
def _swiglu_backward_op(h: torch.Tensor, prob: torch.Tensor | None, grad: torch.Tensor, interleave: int,
                        need_grad_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    grad_h, grad_p = tk.swiglu_bwd_RN(h.contiguous(), _contiguous(prob), grad.to(h.dtype).contiguous(), interleave,
                                   need_grad_prob)
    return grad_h, _nothing(h) if grad_p is None else grad_p


@_swiglu_backward_op.register_fake
def _(h, prob, grad, interleave, need_grad_prob):
    return h.new_empty(h.shape), prob.new_empty(prob.shape) if need_grad_prob and prob is not None else _nothing(h)


def _swiglu_setup(ctx, inputs, output):
    h, prob, interleave = inputs
    ctx.save_for_backward(h, prob)
    ctx.interleave = interleave


def _swiglu_backward(ctx, grad):
    h, prob = ctx.saved_tensors
    need_gp = prob is not None and ctx.needs_input_grad[1]
    grad_h, grad_p = torch.ops.fmoe.swiglu_backward(h, prob, grad, ctx.interleave, need_gp)
    return grad_h, grad_p if need_gp else None, None


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


@torch.library.custom_op("fmoe::gather_sum", mutates_args=())
def _gather_sum_op(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return tk.unpermute_fwd_TD(x.contiguous(), None, pos.contiguous())


@_gather_sum_op.register_fake
def _(x, pos):
    return x.new_empty((pos.shape[0], x.shape[1]))


@torch.library.custom_op("fmoe::unpermute", mutates_args=())
def _unpermute_op(y: torch.Tensor, w: torch.Tensor | None, pos: torch.Tensor, row_source: torch.Tensor,
                  dropping: bool) -> torch.Tensor:
    return tk.unpermute_fwd_TD(y.contiguous(), _contiguous(w), pos.contiguous())


@_unpermute_op.register_fake
def _(y, w, pos, row_source, dropping):
    return y.new_empty((pos.shape[0], y.shape[1]))


@torch.library.custom_op("fmoe::unpermute_backward", mutates_args=())
def _unpermute_backward_op(grad: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor | None, pos: torch.Tensor,
                           row_source: torch.Tensor, num_rows: int, dtype: torch.dtype, dropping: bool,
                           need_grad_rows: bool, need_grad_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    grad_y, grad_w = tk.unpermute_bwd(grad.contiguous(), _contiguous(y), _contiguous(w), pos.contiguous(),
                                   row_source.contiguous(), num_rows, dtype, dropping, need_grad_rows, need_grad_w)
    return (_nothing(grad) if grad_y is None else grad_y), (_nothing(grad) if grad_w is None else grad_w)


@_unpermute_backward_op.register_fake
def _(grad, y, w, pos, row_source, num_rows, dtype, dropping, need_grad_rows, need_grad_w):
    grad_y = grad.new_empty((num_rows, grad.shape[1]), dtype=dtype) if need_grad_rows else _nothing(grad)
    grad_w = w.new_empty(w.shape) if need_grad_w and w is not None else _nothing(grad)
    return grad_y, grad_w


def _unpermute_setup(ctx, inputs, output):
    y, w, pos, row_source, dropping = inputs
    # only the weights' gradient reads the rows
    ctx.save_for_backward(None if w is None else y, w, pos, row_source)
    ctx.num_rows, ctx.dtype, ctx.dropping = y.shape[0], y.dtype, dropping


def _unpermute_backward(ctx, grad):
    y, w, pos, row_source = ctx.saved_tensors
    need_rows, need_w = ctx.needs_input_grad[0], w is not None and ctx.needs_input_grad[1]
    grad_y, grad_w = torch.ops.fmoe.unpermute_backward(grad, y, w, pos, row_source, ctx.num_rows, ctx.dtype,
                                                       ctx.dropping, need_rows, need_w)
    return grad_y if need_rows else None, grad_w if need_w else None, None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
