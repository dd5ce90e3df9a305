"""TransformerEngine as fmoe's expert backend: ``Plan(expert_backend="te")``.

Importing this module registers the backend with the core. The expert MLP then runs
TE's grouped GEMM (``general_grouped_gemm``, the kernel behind
``transformer_engine.pytorch.ops.GroupedLinear``) and TE's scaled GLU kernels (those
of ``ops.ScaledSwiGLU`` and ``ops.ScaledClampedQGeGLU``; the router probability is
their row scale under ``prob_placement="activation"``).

The weights are the ``[E, D, N]`` tensors fmoe gathered itself, passed to the GEMM
expert by expert as views: fmoe stores ``[in, out]`` where TE's modules store
``[out, in]``, so the GEMM runs with the transposed layout flags (``NN`` forward,
``TN`` for the input gradient, ``NT`` for the weight gradient) instead of copying.
No TE module, parameter or hook is involved, so FSDP units, delayed wgrad
(``fmoe.layers.DeferredWgrad``) and the schedules work as with the torch backend.

TE's op fuser fuses a grouped MLP (GEMM + GLU + GEMM in one kernel chain) only for
MXFP8/NVFP4 on compute capability 10.x; on Hopper in bf16 it runs the same unfused
kernels this backend calls.

The grouped GEMM takes each expert's row count on the host: dropless routing reads
them once per expert MLP; a static capacity fixes them, so nothing is read.
"""

from __future__ import annotations

import importlib

import torch

from fmoe import Plan
from fmoe.config_fields import Activation
from fmoe.layers import QUICK_GELU_ALPHA, ExpertBackend, add_expert_bias, register_expert_backend, static_rows

try:  # TE is an optional extra: fmoe[te]
    importlib.import_module("transformer_engine.pytorch")  # loads what the extension links against
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm
    IMPORT_ERROR: Exception | None = None
except (ImportError, OSError, RuntimeError) as err:  # not installed, or built for another CUDA/torch
    IMPORT_ERROR = err

ACTIVATIONS = ("swiglu", "quick_geglu")


def check(plan: Plan) -> None:
    """Raise ValueError unless ``plan`` can run its experts on TE here."""
    if IMPORT_ERROR is not None:
        raise ValueError(f"Plan.expert_backend='te' needs TransformerEngine, which failed to import here "
                         f"({type(IMPORT_ERROR).__name__}: {IMPORT_ERROR}); install 'fmoe[te]' or use "
                         f"expert_backend 'torch'")
    if torch.device(plan.device).type != "cuda":
        raise ValueError(f"Plan.expert_backend='te' runs on CUDA only, but Plan.device={plan.device!r} "
                         f"(allowed with 'te': 'cuda', 'cuda:N')")
    if plan.model.activation not in ACTIVATIONS:
        raise ValueError(f"Plan.expert_backend='te' supports ModelConfig.activation in "
                         f"{', '.join(map(repr, ACTIVATIONS))}, got {plan.model.activation!r} "
                         f"(use expert_backend 'torch' for it)")


def _grouped_gemm(a: list, b: list, out: list, rows: list, layout: str, single_output: bool) -> None:
    general_grouped_gemm(a, b, out, [None] * len(a), out[0].dtype, layout=layout, m_splits=rows,
                         single_output=single_output, use_split_accumulator=True)


def _weight_grad(x_RD: torch.Tensor, grad_RN: torch.Tensor, w_EDN: torch.Tensor, rows: list) -> torch.Tensor:
    grad_EDN = torch.empty_like(w_EDN)
    _grouped_gemm(list(grad_RN.split(rows)), list(x_RD.split(rows)), list(grad_EDN.unbind(0)), rows, "NT", False)
    for e, r in enumerate(rows):
        if r == 0:  # an expert without rows has a zero gradient; the GEMM skips it
            grad_EDN[e].zero_()
    return grad_EDN


class _TEGroupedLinear(torch.autograd.Function):
    # y[rows of e] = x[rows of e] @ w[e] with w in fmoe's [E, in, out] layout.
    @staticmethod
    def forward(ctx, x_RD, w_EDN, rows, deferred):
        x_RD = x_RD.contiguous()
        ctx.save_for_backward(x_RD, w_EDN)
        ctx.rows, ctx.deferred = rows, deferred
        y_RN = torch.empty(x_RD.shape[0], w_EDN.shape[-1], dtype=x_RD.dtype, device=x_RD.device)
        _grouped_gemm(list(w_EDN.unbind(0)), list(x_RD.split(rows)), [y_RN], rows, "NN", True)
        return y_RN

    @staticmethod
    def backward(ctx, grad_RN):
        x_RD, w_EDN = ctx.saved_tensors
        grad_RN, rows = grad_RN.contiguous(), ctx.rows
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x_RD)
            _grouped_gemm(list(w_EDN.unbind(0)), list(grad_RN.split(rows)), [grad_x], rows, "TN", True)
        if ctx.needs_input_grad[1]:
            if ctx.deferred is None:
                grad_w = _weight_grad(x_RD, grad_RN, w_EDN, rows)
            else:
                ctx.deferred.defer(w_EDN, lambda: _weight_grad(x_RD, grad_RN, w_EDN, rows))
        return grad_x, grad_w, None, None


def _glu_kernels(cfg):
    """``(forward(h, scales), backward(grad, h, scales, want_scale_grad))`` of TE's scaled GLU."""
    interleave = cfg.glu_interleave
    if cfg.activation_mode is Activation.SWIGLU:
        return (lambda h, s: tex.scaled_swiglu(h, s, None, interleave),
                lambda g, h, s, ds: tex.scaled_dswiglu(g, h, s, None, interleave, ds))
    limit, offset = float(cfg.glu_limit), float(cfg.glu_offset)
    alpha = QUICK_GELU_ALPHA
    return (lambda h, s: tex.scaled_clamped_swiglu(h, s, None, limit, alpha, offset, interleave),
            lambda g, h, s, ds: tex.scaled_clamped_dswiglu(g, h, s, None, limit, alpha, offset, interleave, ds))


class _TEScaledGLU(torch.autograd.Function):
    # act(gate, up) * scale[row], one TE kernel each way.
    @staticmethod
    def forward(ctx, h_RN, scales_R, cfg):
        h_RN, scales_R = h_RN.contiguous(), scales_R.contiguous()
        ctx.save_for_backward(h_RN, scales_R)
        ctx.cfg = cfg
        return _glu_kernels(cfg)[0](h_RN, scales_R)

    @staticmethod
    def backward(ctx, grad_RF):
        h_RN, scales_R = ctx.saved_tensors
        want_scale_grad = ctx.needs_input_grad[1]
        grad_h, grad_scales = _glu_kernels(ctx.cfg)[1](grad_RF.contiguous(), h_RN, scales_R, want_scale_grad)
        return grad_h, grad_scales if want_scale_grad else None, None


def expert_mlp(p: dict, x_RD: torch.Tensor, segs, cfg, row_probs_R=None, deferred=None) -> torch.Tensor:
    """``fmoe.layers.expert_mlp`` on TransformerEngine kernels (same arguments and result)."""
    rows = static_rows(segs) or segs.rows_E.tolist()  # TE's grouped GEMM splits rows on the host
    h = _TEGroupedLinear.apply(x_RD, p["fc1"], rows, deferred)
    if "fc1_bias" in p:
        h = add_expert_bias(h, p["fc1_bias"], segs)
    scales = torch.ones(h.shape[0], dtype=h.dtype, device=h.device) if row_probs_R is None \
        else row_probs_R.to(h.dtype)
    a = _TEScaledGLU.apply(h, scales, cfg)
    y = _TEGroupedLinear.apply(a, p["fc2"], rows, deferred)
    if "fc2_bias" in p:
        y = add_expert_bias(y, p["fc2_bias"], segs)
    return y


register_expert_backend("te", ExpertBackend(expert_mlp, check))
