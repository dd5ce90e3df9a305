"""FP8 GEMMs (``Plan.fp8='rowwise'`` or ``'tensorwise'``), and the value that picks them.

A layer's weights enter two kinds of product: a dense one (``x @ w``: attention's
q/k/v and output projections, the shared expert) and a grouped one (each expert's row
segment times its ``[D, N]`` slice, whose input gradient is a grouped product too).
``Gemms`` holds the function for each, and the layer functions take it as an argument,
so which products run in FP8 is a value a reader can see (``GEMMS[plan.fp8]``), bound
into the schedule's ``Kernels`` by ``fmoe.resolve.plan_kernels(plan)``.

The FP8 recipe (``ROWWISE``): before each product both operands are cast to
``float8_e4m3fn`` with one fp32 scale per row of the left operand and per column of
the right one, ``scale = amax * (1 / 448)`` over the contraction axis; the GEMM
(``torch._scaled_mm``, ``torch._scaled_grouped_mm``) writes bf16 with both scales
applied. The forward products use Hopper's fast accumulation (as torchao's float8
forward; 1.2-1.3x faster on the probe's shapes); the backward's accumulate in fp32.
The backward quantises the same way along the other axes:

- dense: the input gradient ``g @ w.T`` and the weight gradient ``x.T @ g`` both in
  FP8 E4M3: a scale per row or column of the gradient gives it the range E5M2's wider
  exponent would, at E4M3's precision. When the token count is not a multiple of 16
  (the weight gradient's contraction axis), that product runs in bf16.
- grouped: the forward product in FP8; the input and weight gradients in bf16. The
  input gradient in FP8 (``scaled_grouped_mm``, which ``Gemms.grouped_grad`` can
  name) measured 3% slower on the fine-grained model: its casts cost more than its
  GEMMs save at those sizes. The weight gradient's contraction axis is each expert's
  rows, whose scales would be per segment, and ``torch._scaled_grouped_mm`` needs
  those segments 16-row aligned on sm_90.

The tensorwise recipe (``TENSORWISE``) changes the dense products and runs the head's
in FP8 too (``Gemms.head``): one fp32 scale per operand, ``amax(|t|) * (1 / max)`` of
the format (cuBLASLt's tensor-scaled kernels, forward and backward: on the coarse
model they take the time rowwise's take, and the step replayed as a CUDA graph gains
on the casts). Activations and weights are E4M3, the output gradient E5M2 (two
mantissa bits, five exponent bits: one scale over a whole gradient must cover its
outlier rows and its small ones, the trade torchao's and TransformerEngine's
tensor-scaled recipes make). One scale serves every layout, so the forward casts ``x``
and ``w`` once, writing each in the layouts the forward and backward GEMMs read, and
saves those FP8 copies instead of the bf16 operands: the backward casts only the fresh
gradient, once (when the weight gradient falls back to bf16, ``x`` is saved in bf16).
The routed experts keep the rowwise forward product (``torch._scaled_grouped_mm`` takes
rowwise scales only on sm_90).

FP8 gathers: when a tensorwise plan shards the dense weights (any ``sharding`` but
``no_shard``, on more than one rank), the dense products' weights (``Leaf.linear``)
are gathered already cast, as FSDP2 with torchao's float8 all-gather does: each rank
casts its rows with the weight's scale, ``tensor_scale`` of its amax over every rank
(one all-reduce per step for the whole model), and the gather yields an
``Fp8Weight``, which ``tensorwise_linear`` multiplies without casting it again. Half
the bytes of a bf16 gather, and the same bits: ``q`` is what ``quantize_tensor`` makes
of the gathered bf16 weight (``fmoe/shard/lifecycle.py``, ``build_shards``). Rowwise
scales run along each weight's rows, which ranks split, and its input gradient needs
the weights scaled along the other axis, so rowwise plans and the routed experts
gather bf16.

Scales are computed on the fly from the current tensor (no history); nothing here
changes what is stored: params, gradients and optimizer state stay fp32. Inside a
compiled kernel (``Plan.compile``) inductor fuses the casts with the norm or
activation before them; eager on CUDA a contiguous operand is cast by one Triton
kernel (``fp8_kernels.quantize_rows_RW``), the experts' weights by another
(``quantize_columns_KN``), any other transposed operand and every tensorwise cast by
a compiled function (a 64 MiB operand: 0.33 ms as separate eager kernels, 0.10 ms
compiled, against 0.55 ms for its bf16 GEMM).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from . import fp8_kernels
from .adapted import adapting

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E5M2 = torch.float8_e5m2  # the tensorwise recipe's gradients: 2 mantissa bits, 5 exponent bits
TINY = 1e-12  # the amax of a row of zeros: its scale stays finite, its values 0


def _scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    # times the reciprocal (what torch's CUDA division by a number computes), so the
    # Triton kernels reproduce these bits
    return amax.float().clamp_min(TINY) * (1.0 / top)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``q * scale ~ x``: ``q`` contiguous ``float8_e4m3fn`` of
    ``x``'s shape, ``scale`` fp32 ``[..., 1]``, one per row (over the last axis)."""
    scale = _scale(x.abs().amax(dim=-1, keepdim=True), E4M3_MAX)
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.contiguous(), scale


def quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` of ``x``'s transpose (its last two axes): ``q`` contiguous
    ``[..., C, R]``, one scale per column of ``x``."""
    return quantize_rows(x.transpose(-2, -1))


def tensor_scale(amax: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """The fp32 scale one tensor of absolute maximum ``amax`` gets in ``dtype``."""
    return _scale(amax, float(torch.finfo(dtype).max))


def cast_scaled(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``x / scale`` in ``dtype`` (an FP8 format), saturated at its largest value."""
    top = float(torch.finfo(dtype).max)
    return (x.float() / scale).clamp(-top, top).to(dtype)


def quantize_tensor(x: torch.Tensor, dtype: torch.dtype = E4M3,
                    transposed: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(q, q_t, scale)`` with ``q * scale ~ x``: one fp32 scale (0-d) for the whole
    2-D ``x``, ``q`` contiguous ``dtype`` (an FP8 format) of ``x``'s shape and ``q_t``
    its transpose, contiguous too, or None unless ``transposed`` (a scaled GEMM reads
    each operand in one of the two layouts)."""
    scale = tensor_scale(x.abs().amax(), dtype)
    q = cast_scaled(x, scale, dtype)
    return q.contiguous(), q.t().contiguous() if transposed else None, scale


class Fp8Weight(NamedTuple):
    """A dense product's weight gathered already in FP8 (``Plan.fp8='tensorwise'`` with
    the dense weights sharded): ``q * scale`` is the weight ``quantize_tensor`` would
    have cast after a bf16 gather, bit for bit.

    Attributes:
        q: ``[K, N]`` ``float8_e4m3fn``, contiguous.
        scale: its fp32 scale (0-d): ``tensor_scale`` of the whole weight's amax.
        grad_leaf: a ``[K, N]`` tensor of the compute dtype with no storage of its own
            (a 0-d zero expanded): what autograd differentiates for the weight's
            gradient, since FP8 tensors carry none.
    """

    q: torch.Tensor
    scale: torch.Tensor
    grad_leaf: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def cast_weight(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``cast_scaled(x, scale)`` to E4M3: a rank's rows of a weight gathered in FP8
    (``Fp8Weight``), by one compiled function on CUDA. Elementwise, so the rows get the
    bits ``quantize_tensor`` gives them in the whole weight (given its scale)."""
    return _run(cast_scaled, x, scale)


@functools.cache
def _compiled(quantize):
    # dynamic: one graph for every size; each function sees contiguous inputs of two
    # ranks only, so it compiles a handful of graphs, not one per layout
    return torch.compile(quantize, dynamic=True, fullgraph=True)


def _run(cast, t: torch.Tensor, *args):
    """``cast(t, *args)``: traced inside a compiled kernel (fused with its neighbours),
    one compiled function eager on CUDA, plain torch on the CPU (tests only: a plan
    refuses fp8 there)."""
    if torch.compiler.is_compiling() or not t.is_cuda:
        return cast(t, *args)
    return _compiled(cast)(t, *args)


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(t)`` as ``_run`` runs it, except eager on CUDA: a contiguous
    tensor through a Triton kernel (one read per row, ``fp8_kernels.quantize_rows_RW``),
    the experts' weights (a transposed view of ``[E, K, N]``) through another
    (``quantize_columns_KN``), any other transposed view's storage through one compiled
    function that reads it as columns."""
    if torch.compiler.is_compiling() or not t.is_cuda:
        return quantize_rows(t)
    if fp8_kernels.quantize_fusable(t):
        return fp8_kernels.quantize_rows_RW(t, E4M3_MAX, TINY)
    if t.is_contiguous():
        return _compiled(quantize_rows)(t)
    if fp8_kernels.quantize_columns_fusable(t.transpose(-2, -1)):
        return fp8_kernels.quantize_columns_KN(t.transpose(-2, -1), E4M3_MAX, TINY)
    if t.transpose(-2, -1).is_contiguous():
        return _compiled(quantize_columns)(t.transpose(-2, -1))
    return _compiled(quantize_rows)(t.contiguous())


def _quantize_tensor(t: torch.Tensor, dtype: torch.dtype,
                     transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``quantize_tensor(t, dtype, transposed)`` as ``_run`` runs it (eager on CUDA: a
    reduction, then one pass writing the layouts)."""
    return _run(quantize_tensor, t, dtype, transposed)


def scaled_mm(a_MK: torch.Tensor, b_KN: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """``a @ b`` (bf16 out) with both operands quantised here: ``a`` per row, ``b`` per
    column (the scaled GEMM's layout: ``a`` row-major, ``b`` column-major)."""
    qa_MK, sa_M1 = _quantize(a_MK)
    qb_NK, sb_N1 = _quantize(b_KN.t())
    return torch._scaled_mm(qa_MK, qb_NK.t(), scale_a=sa_M1, scale_b=sb_N1.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def scaled_grouped_mm(a_RK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor,
                      fast_accum: bool = False) -> torch.Tensor:
    """Row segment ``e`` of ``a`` times ``b[e]`` (bf16 out), quantised here: ``a`` per
    row, each ``b[e]`` per column. ``offsets_E``: int32 segment ends."""
    qa_RK, sa_R1 = _quantize(a_RK)
    qb_ENK, sb_EN1 = _quantize(b_EKN.transpose(-2, -1))
    return torch._scaled_grouped_mm(qa_RK, qb_ENK.transpose(-2, -1), sa_R1.squeeze(-1), sb_EN1.squeeze(-1),
                                    offs=offsets_E, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


class _RowwiseLinear(torch.autograd.Function):
    # x_MK @ w_KN with the forward product in FP8, the backward's too when ``fp8_grads``
    # (see the module doc).
    @staticmethod
    def forward(ctx, x_MK, w_KN, fp8_grads):
        ctx.save_for_backward(x_MK, w_KN)
        ctx.fp8_grads = fp8_grads
        return scaled_mm(x_MK, w_KN, fast_accum=True)

    @staticmethod
    def backward(ctx, g_MN):
        x_MK, w_KN = ctx.saved_tensors
        g_MN = g_MN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g_MN, w_KN.t()) if ctx.fp8_grads else g_MN @ w_KN.t()
        if ctx.needs_input_grad[1]:
            fits = x_MK.shape[0] % 16 == 0  # the contraction axis here is the tokens
            grad_w = scaled_mm(x_MK.t(), g_MN) if ctx.fp8_grads and fits else x_MK.t() @ g_MN
        return grad_x, grad_w, None


def rowwise_linear(x: torch.Tensor, w_KN: torch.Tensor, fp8_grads: bool = True) -> torch.Tensor:
    """``x @ w`` for ``x`` of shape ``[..., K]`` with an FP8 rowwise product forward, and
    backward too unless ``fp8_grads=False`` (then the gradients' products are bf16)."""
    y_MN = _RowwiseLinear.apply(x.reshape(-1, x.shape[-1]), w_KN, fp8_grads)
    return y_MN.view(*x.shape[:-1], w_KN.shape[-1])


class _TensorwiseLinear(torch.autograd.Function):
    # x_MK @ w_KN, forward and backward in FP8 with one scale per tensor: x and w E4M3,
    # the gradient E5M2. The forward's casts are saved in the layouts the backward reads,
    # so nothing is quantised twice.
    # A weight gathered in FP8 comes as ``qw_KN`` and ``sw`` (``Fp8Weight``); ``w_KN`` is
    # then its ``grad_leaf``, there for the gradient only.
    @staticmethod
    def forward(ctx, x_MK, w_KN, qw_KN=None, sw=None):
        # the tokens are the weight gradient's contraction: FP8 needs a multiple of 16
        ctx.fp8_wgrad = x_MK.shape[0] % 16 == 0
        x_transposed = ctx.needs_input_grad[1] and ctx.fp8_wgrad
        qx_MK, qx_KM, sx = _quantize_tensor(x_MK, E4M3, transposed=x_transposed)
        if qw_KN is None:
            qw_KN, qw_NK, sw = _quantize_tensor(w_KN, E4M3, transposed=True)
        else:
            qw_NK = qw_KN.t().contiguous()
        x_for_wgrad = qx_KM if x_transposed else (x_MK if ctx.needs_input_grad[1] else None)
        ctx.save_for_backward(x_for_wgrad, sx, qw_KN, sw)
        return torch._scaled_mm(qx_MK, qw_NK.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    @staticmethod
    def backward(ctx, g_MN):
        x_saved, sx, qw_KN, sw = ctx.saved_tensors
        fp8_wgrad = ctx.needs_input_grad[1] and ctx.fp8_wgrad
        qg_MN, qg_NM, sg = _quantize_tensor(g_MN, E5M2, transposed=fp8_wgrad)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._scaled_mm(qg_MN, qw_KN.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16)
        if ctx.needs_input_grad[1]:
            grad_w = (torch._scaled_mm(x_saved, qg_NM.t(), scale_a=sx, scale_b=sg, out_dtype=torch.bfloat16)
                      if fp8_wgrad else x_saved.t() @ g_MN)
        return grad_x, grad_w, None, None


def tensorwise_linear(x: torch.Tensor, w_KN: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``x @ w`` for ``x`` of shape ``[..., K]``, forward and backward in FP8 with one
    scale per operand (``Plan.fp8='tensorwise'``: see the module doc). ``w`` is a
    tensor, cast here, or an ``Fp8Weight`` gathered already cast (same result, bit for
    bit; its gradient goes to ``w.grad_leaf``)."""
    x_MK = x.reshape(-1, x.shape[-1])
    if isinstance(w_KN, Fp8Weight):
        y_MN = _TensorwiseLinear.apply(x_MK, w_KN.grad_leaf, w_KN.q, w_KN.scale)
    else:
        y_MN = _TensorwiseLinear.apply(x_MK, w_KN)
    return y_MN.view(*x.shape[:-1], w_KN.shape[-1])


def plain_grouped_mm(a_RK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor,
                     fast_accum: bool = False) -> torch.Tensor:
    return torch._grouped_mm(a_RK, b_EKN, offs=offsets_E)


class Gemms(NamedTuple):
    """The products a layer's weights enter.

    Attributes:
        linear: ``(x_..K, w_KN) -> y_..N``, differentiable (attention's projections,
            the shared expert); ``TENSORWISE``'s also takes an ``Fp8Weight``, and each
            an ``Adapted`` (``fmoe.layers.adapted``).
        grouped: ``(a_RK, b_EKN, offsets_E, fast_accum) -> y_RN``, segment ``e`` of
            ``a`` times ``b[e]``: ``experts.grouped_matmul``'s forward product
            (``fast_accum=True``; not differentiated itself).
        grouped_grad: the same signature, for the grouped product's input gradient.
        head: ``(x_TD, w_DV) -> logits_TV``, differentiable: the head's product
            (``TENSORWISE``'s also takes an ``Fp8Weight``).
        name: the ``Plan.fp8`` value it stands for.
    """

    linear: Callable = adapting(torch.matmul)
    grouped: Callable = plain_grouped_mm
    grouped_grad: Callable = plain_grouped_mm
    head: Callable = torch.matmul
    name: str = "none"


PLAIN = Gemms()
# The experts' input gradients stay bf16: in FP8 they cost 3% of the fine-grained
# model's step and gained nothing on the coarse one, under either recipe (BENCHMARKS.md,
# issue 25).
ROWWISE = Gemms(adapting(rowwise_linear), scaled_grouped_mm, plain_grouped_mm, name="rowwise")
# torch's FP8 grouped GEMM takes rowwise scales only on sm_90, so the experts keep them.
# The head's product in FP8 took the coarse model's graphed step from 1.03x to 1.06-1.07x
# bf16's speed; 300 steps of the main job ended within 0.1% of the bf16 head's held-out
# loss (BENCHMARKS.md, issue 25).
TENSORWISE = Gemms(adapting(tensorwise_linear), scaled_grouped_mm, plain_grouped_mm, tensorwise_linear, "tensorwise")
GEMMS = {"none": PLAIN, "rowwise": ROWWISE, "tensorwise": TENSORWISE}

__all__ = ["E4M3", "E4M3_MAX", "E5M2", "GEMMS", "PLAIN", "ROWWISE", "TENSORWISE", "Fp8Weight", "Gemms", "TINY",
           "cast_scaled", "cast_weight", "plain_grouped_mm", "quantize_columns", "quantize_rows", "quantize_tensor",
           "rowwise_linear", "scaled_grouped_mm", "scaled_mm", "tensor_scale", "tensorwise_linear"]
