"""One AdamW step over an fp32 parameter whose moments are kept in fp32 or bf16, in
place: one Triton kernel on CUDA (a pass that reads the parameter, its gradient and both
moments and writes the parameter and the moments: 28 bytes an element with fp32 moments,
20 with bf16 ones), the same arithmetic in torch ops elsewhere (the CPU, and the
reference the kernel is tested against). It is ``adamw(fused=True)``'s update on CUDA:
torch's fused AdamW takes moments only in the parameters' dtype, and with a gradient
scale it also writes the unscaled gradients back (4 more bytes an element); on an H200
it ran at 65-71% of the HBM copy ceiling where this kernel runs at 80-94% (BENCHMARKS.md).

The arithmetic, in fp32, as torch's fused AdamW's: ``g = grad / grad_scale``;
``p *= 1 - lr * weight_decay``; ``m' = b1 m + (1 - b1) g``; ``v' = b2 v + (1 - b2) g^2``;
``p -= lr (m' / c1) / (sqrt(v' / c2) + eps)`` with the bias corrections
``c1 = 1 - b1^t``, ``c2 = 1 - b2^t``; then ``m'`` and ``v'`` are rounded once to the
moments' dtype. Where ``found_inf`` is set nothing is written.
"""

from __future__ import annotations

import torch

from ..layers import triton_kernels as tk

_BLOCK = 1024


def adamw_leaf_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                lr: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, b1: float, b2: float, eps: float,
                weight_decay: float, grad_scale: torch.Tensor | None = None,
                found_inf: torch.Tensor | None = None) -> None:
    """Update ``p`` (fp32) and its moments ``m``, ``v`` (fp32 or bf16) in place by one AdamW step.

    Arguments:
        p, g, m, v: the parameter (fp32, as fmoe's params are), its gradient (any float
            dtype; left as it is) and moments, one shape, contiguous.
        lr, c1, c2: 0-dim fp32 tensors on ``p``'s device: the rate and the step's bias
            corrections ``1 - b1^t``, ``1 - b2^t``.
        b1, b2, eps, weight_decay: as ``adamw``'s.
        grad_scale: a 0-dim tensor the gradient is divided by (clipping), or None.
        found_inf: a 0-dim tensor; nonzero: the step writes nothing (a skipped step), or None.
    """
    if not all(t.is_contiguous() for t in (p, g, m, v)):
        raise ValueError("adamw_leaf_: the parameter, gradient and moments must be contiguous")
    if tk.fused_kernels_available(p) and p.numel():
        with tk.on_device_of(p):
            _kernel[(tk.triton.cdiv(p.numel(), _BLOCK),)](
                p, g, m, v, p.numel(), lr, c1, c2, b1, b2, eps, weight_decay,
                p if grad_scale is None else grad_scale, p if found_inf is None else found_inf,
                HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, BLOCK=_BLOCK, num_warps=4)
        return
    g32 = g.float() if grad_scale is None else g.float() / grad_scale
    m32 = b1 * m.float() + (1 - b1) * g32
    v32 = b2 * v.float() + (1 - b2) * g32 * g32
    new_p = p * (1 - lr * weight_decay) - lr * (m32 / c1) / ((v32 / c2).sqrt() + eps)
    if found_inf is not None:
        keep = found_inf != 0
        new_p = torch.where(keep, p, new_p)
        m32, v32 = torch.where(keep, m.float(), m32), torch.where(keep, v.float(), v32)
    p.copy_(new_p)
    m.copy_(m32)
    v.copy_(v32)


if tk.triton is not None:
    tl = tk.tl

    @tk.triton.jit
    def _kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, lr_ptr, c1_ptr, c2_ptr, b1, b2, eps, weight_decay, scale_ptr, inf_ptr,
                HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr):
        if HAS_INF:
            if tl.load(inf_ptr) != 0:
                return
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        p = tl.load(p_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr).to(tl.float32)
        lr = tl.load(lr_ptr)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p * (1 - lr * weight_decay) - lr * (m / tl.load(c1_ptr)) / (tl.sqrt(v / tl.load(c2_ptr)) + eps)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=ok)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=ok)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=ok)
