"""Grouped expert MLPs over permuted rows, and the activations they use."""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..backends import ExpertBackend, registered_backend
from ..config import ModelConfig
from ..config_fields import Activation
from . import triton_kernels
from .adapted import Adapted
from .fp8 import PLAIN, Gemms
from .precision import upcast
from .tensor_parallel import TensorParallel

QUICK_GELU_ALPHA = 1.702


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm takes fp32/bf16/fp16 and needs 16-byte aligned strides.
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    per_16_bytes = 16 // x.element_size()
    return x.shape[-1] % per_16_bytes == 0 and w.shape[-1] % per_16_bytes == 0


class DeferredWgrad:
    """Weight-gradient GEMMs of the experts, held back to run later (``Plan.delay_wgrad``).

    Passed to ``expert_mlp``; during backward each grouped matmul computes its input
    gradient at once and leaves its weight gradient here. ``run()`` computes them.
    """

    def __init__(self):
        self.pending: list = []

    def defer(self, weight: torch.Tensor, compute) -> None:
        self.pending.append((weight, compute))

    def run(self) -> list:
        """``[(weight, grad)]`` for every deferred GEMM, in the order they were deferred."""
        with torch.no_grad():
            done = [(w, compute()) for w, compute in self.pending]
        self.pending = []
        return done


def static_rows(segs) -> list | None:
    """Rows per expert segment when they are fixed by a static capacity (no host read)."""
    capacity = getattr(segs, "capacity", None)
    return None if capacity is None else [capacity] * segs.rows_E.shape[0]


def _per_expert(x_RD, w_EDN, rows, transpose_w=False):
    w = w_EDN.transpose(-2, -1) if transpose_w else w_EDN
    return torch.cat([seg @ w[e] for e, seg in enumerate(x_RD.split(rows))])


def _wgrad(x_RD, grad_RN, offsets_E, rows):
    if rows is None:
        return torch._grouped_mm(x_RD.t(), grad_RN, offs=offsets_E)
    return torch.stack([x.t() @ g for x, g in zip(x_RD.split(rows), grad_RN.split(rows))])


class _GroupedMatmul(torch.autograd.Function):
    # Explicit backward: autograd's rule for _grouped_mm rejects expanded (stride-0)
    # gradients, and the weight gradient must be separable for delayed wgrad.
    # ``rows`` (host list) selects the per-expert loop, None ``grouped`` and
    # ``grouped_grad`` (a Gemms' products: torch._grouped_mm, or FP8); the weight
    # gradient stays in bf16.
    @staticmethod
    def forward(ctx, x_RD, w_EDN, offsets_E, rows, deferred, grouped, grouped_grad):
        ctx.save_for_backward(x_RD, w_EDN, offsets_E)
        ctx.rows, ctx.deferred, ctx.grouped_grad = rows, deferred, grouped_grad
        ctx.weight = w_EDN if deferred is not None else None  # the key its deferred grad is filed under
        if rows is None:
            return grouped(x_RD, w_EDN, offsets_E, fast_accum=True)
        return _per_expert(x_RD, w_EDN, rows)

    @staticmethod
    def backward(ctx, grad_RN):
        x_RD, w_EDN, offsets_E = ctx.saved_tensors
        grad_RN = grad_RN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            if ctx.rows is None:
                grad_x = ctx.grouped_grad(grad_RN, w_EDN.transpose(-2, -1), offsets_E)
            else:
                grad_x = _per_expert(grad_RN, w_EDN, ctx.rows, transpose_w=True)
        if ctx.needs_input_grad[1]:
            rows = ctx.rows
            if ctx.deferred is None:
                grad_w = _wgrad(x_RD, grad_RN, offsets_E, rows)
            else:
                ctx.deferred.defer(ctx.weight, lambda: _wgrad(x_RD, grad_RN, offsets_E, rows))
        return grad_x, grad_w, None, None, None, None, None


class _AddExpertBias(torch.autograd.Function):
    # A bias's gradient sums each expert's rows: as one product with the rows' one-hot
    # expert matrix (accumulated in fp32 by the GEMM and, in bf16, rounded once, as the
    # weights' gradients are; no atomics, the same order every run). autograd's rule would scatter-add in bf16 with atomics; torch.segment_reduce
    # in fp32 was the step's costliest kernel at gpt-oss-medium (35 of 239 GPU ms on an
    # H100, plus the fp32 copy of the gradient it needs).
    @staticmethod
    def forward(ctx, h_RN, bias_EN, row_expert_R):
        ctx.save_for_backward(row_expert_R)
        ctx.experts = bias_EN.shape[0]
        return h_RN + bias_EN.index_select(0, row_expert_R).to(h_RN.dtype)

    @staticmethod
    def backward(ctx, grad_RN):
        (row_expert_R,) = ctx.saved_tensors
        experts_E = torch.arange(ctx.experts, device=row_expert_R.device)
        one_hot_ER = (row_expert_R[None, :] == experts_E[:, None]).to(grad_RN.dtype)
        grad_bias = upcast(one_hot_ER @ grad_RN)
        return grad_RN, grad_bias, None


def add_expert_bias(h_RN: torch.Tensor, bias_EN: torch.Tensor, segs) -> torch.Tensor:
    """``h[r] + bias[expert of row r]``; the bias gradient is summed in fp32."""
    return _AddExpertBias.apply(h_RN, bias_EN, segs.row_expert_R)


class ExpertBias(NamedTuple):
    """fc1's bias as the activation adds it first: ``bias_EN`` and each row's expert."""

    bias_EN: torch.Tensor
    row_expert_R: torch.Tensor


def grouped_matmul(x_RD: torch.Tensor, w_EDN: torch.Tensor, segs, backend: str = "torch",
                   deferred: DeferredWgrad | None = None, gemms: Gemms = PLAIN):
    """Row segment ``e`` of ``x`` times ``w[e]``, for every expert.

    Arguments:
        x_RD: ``[R, D]`` permuted rows.
        w_EDN: ``[E, D, N]`` stacked expert weights.
        segs: the segments (a Dispatch, or expert_parallel.Segments): ``rows_E``,
            ``offsets_E``, ``row_expert_R``.
        backend: ``torch`` uses ``torch._grouped_mm`` when dtype and strides allow,
            else (or with ``loop``) one matmul per expert: the same arithmetic.
        deferred: when given, the backward leaves ``w``'s gradient GEMM there.
        gemms: ``gemms.grouped`` runs the product and ``gemms.grouped_grad`` the input
            gradient when the ``torch`` backend's grouped GEMM applies (``fmoe.layers.fp8``).

    An ``Adapted`` ``w`` (``Plan.lora``) adds its adapter's two grouped products of rank
    ``R`` in the same segments, in ``x``'s dtype and never deferred (``w`` itself holds no
    gradient then).

    Returns:
        ``[R, N]``.
    """
    if isinstance(w_EDN, Adapted):
        a_EDK, b_EKN = w_EDN.operands(x_RD.dtype)
        xa_RK = grouped_matmul(x_RD, a_EDK, segs, backend)
        return grouped_matmul(x_RD, w_EDN.w, segs, backend, deferred, gemms) + grouped_matmul(xa_RK, b_EKN, segs, backend)
    rows = None if backend == "torch" and _grouped_mm_ok(x_RD, w_EDN) else segs.rows_E.tolist()
    return _GroupedMatmul.apply(x_RD, w_EDN, segs.offsets_E, rows, deferred, gemms.grouped, gemms.grouped_grad)


def glu_halves(h: torch.Tensor, interleave: int):
    """Split fc1's output into ``(gate, up)``: ``[gate | up]`` or alternating blocks."""
    if not interleave:
        return h.chunk(2, dim=-1)
    blocks = h.unflatten(-1, (h.shape[-1] // (2 * interleave), 2, interleave))
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def activation(h: torch.Tensor, cfg: ModelConfig, row_probs_R: torch.Tensor | None = None,
               bias: ExpertBias | None = None) -> torch.Tensor:
    """fc1 output ``[.., 2F]`` (GLU) or ``[.., F]`` (relu2) -> ``[.., F]``, each row times
    ``row_probs_R`` when given (``h`` then ``[R, N]``), after adding fc1's ``bias`` to
    each row's expert's when given.

    ``swiglu``: ``silu(gate) * up``; ``geglu``: ``gelu_tanh(gate) * up``;
    ``quick_geglu``: ``g * sigmoid(1.702 g) * (u + glu_offset)`` with
    ``g = min(gate, glu_limit)``, ``u = clamp(up, -glu_limit, glu_limit)``;
    ``relu2``: ``relu(h)^2``.

    On CUDA with Triton, ``swiglu`` (with the probabilities) runs as one fused kernel
    each way (``triton_kernels.swiglu_RF``); the torch code is the CPU and reference path.
    """
    if fused_activation(h, cfg, row_probs_R):
        if bias is not None:
            h = _AddExpertBias.apply(h, *bias)
        return triton_kernels.swiglu_RF(h, cfg.glu_interleave, row_probs_R)
    return torch_activation(h, cfg, row_probs_R, bias)


def fused_activation(h: torch.Tensor, cfg: ModelConfig, row_probs_R: torch.Tensor | None = None) -> bool:
    """Whether ``activation`` runs the fused Triton SwiGLU kernel for these inputs."""
    return cfg.activation_mode is Activation.SWIGLU and triton_kernels.swiglu_fusable(h, cfg.glu_interleave, row_probs_R)


def torch_activation(h: torch.Tensor, cfg: ModelConfig, row_probs_R: torch.Tensor | None = None,
                     bias: ExpertBias | None = None) -> torch.Tensor:
    """``activation`` in torch code (the CPU and reference path; what ``Plan.compile`` fuses)."""
    if bias is not None:
        h = _AddExpertBias.apply(h, *bias)
    mode = cfg.activation_mode
    if not mode.gated:  # relu2
        a = F.relu(h).square()
    else:
        gate, up = glu_halves(h, cfg.glu_interleave)
        match mode:
            case Activation.SWIGLU:
                a = F.silu(gate) * up
            case Activation.GEGLU:
                a = F.gelu(gate, approximate="tanh") * up
            case Activation.QUICK_GEGLU:
                gate = gate.clamp(max=cfg.glu_limit)
                up = up.clamp(-cfg.glu_limit, cfg.glu_limit)
                a = gate * torch.sigmoid(QUICK_GELU_ALPHA * gate) * (up + cfg.glu_offset)
    return a if row_probs_R is None else a * row_probs_R.to(a.dtype)[:, None]


def expert_mlp(p: dict, x_RD: torch.Tensor, segs, cfg: ModelConfig,
               row_probs_R: torch.Tensor | None = None, backend: str | ExpertBackend = "torch",
               deferred: DeferredWgrad | None = None, act: Callable = activation,
               gemms: Gemms = PLAIN) -> torch.Tensor:
    """``fc2(act(fc1(x) + b1) [* prob]) + b2`` per expert segment.

    Arguments:
        p: the ``experts`` subtree (``fc1 [E, D, 2F]``, ``fc2 [E, F, D]``, optional biases).
        x_RD: ``[R, D]`` permuted rows.
        segs: their expert segments (see ``grouped_matmul``).
        cfg: the ModelConfig.
        row_probs_R: when given, each row's activation is scaled by it before fc2.
        backend: see ``grouped_matmul``; a registered ExpertBackend (``bound_backend``),
            or the name given to ``register_expert_backend``.
        deferred: collects the fc1/fc2 weight-gradient GEMMs instead of running them
            in backward (delayed wgrad); the bias gradients are not deferred.
        act: the activation, ``activation``'s signature (``Plan.compile`` passes a
            compiled one); registered backends use their own.
        gemms: the grouped products (see ``grouped_matmul``).

    Returns:
        ``[R, D]``; rows of padding hold values that callers never read.
    """
    registered = backend if isinstance(backend, ExpertBackend) else registered_backend(backend)
    if registered is not None:
        return registered.mlp(p, x_RD, segs, cfg, row_probs_R, deferred)
    h = grouped_matmul(x_RD, p["fc1"], segs, backend, deferred, gemms)
    if "fc1_bias" in p:  # inside the activation: a compiled one fuses the add into it
        a = act(h, cfg, row_probs_R, ExpertBias(p["fc1_bias"], segs.row_expert_R))
    else:
        a = act(h, cfg, row_probs_R)
    y = grouped_matmul(a, p["fc2"], segs, backend, deferred, gemms)
    if "fc2_bias" in p:
        y = add_expert_bias(y, p["fc2_bias"], segs)
    return y


def experts_with(backend: str | ExpertBackend, gemms: Gemms = PLAIN, **bound) -> Callable:
    """``expert_mlp`` as the function the MoE calls, ``(p, rows_RD, segs, cfg, row_probs_R,
    deferred) -> y_RD``: ``backend`` and ``gemms`` (and ``bound``, e.g. a compiled
    activation) bound in once."""
    def experts(p, rows_RD, segs, cfg, row_probs_R=None, deferred=None):
        return expert_mlp(p, rows_RD, segs, cfg, row_probs_R, backend, deferred, gemms=gemms, **bound)
    return experts


def dense_mlp(p: dict, x_TD: torch.Tensor, cfg: ModelConfig, gemms: Gemms = PLAIN,
              tp: TensorParallel | None = None) -> torch.Tensor:
    """The shared expert: ``act(x @ fc1) @ fc2`` with the routed experts' activation,
    times ``sigmoid(x @ gate)`` per token when it has a ``gate`` (Qwen2-MoE); fc1 and
    fc2 through ``gemms.linear`` (the one-column gate stays a plain product).

    ``tp``: tensor parallelism: ``x`` holds this rank's tokens and ``p`` its slice of the
    hidden units; every rank's tokens are gathered and the partial outputs summed back
    into each rank's own (``fmoe.layers.tensor_parallel``)."""
    x_all = x_TD if tp is None else tp.gather(x_TD, 0)
    y = gemms.linear(activation(gemms.linear(x_all, p["fc1"]), cfg), p["fc2"])
    if tp is not None:
        y = tp.scatter(y, 0)
    if "gate" in p:
        y = y * torch.sigmoid(x_TD @ p["gate"])
    return y
