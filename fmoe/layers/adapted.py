"""A frozen weight with its low-rank adapter beside it (``Plan.lora``'s products inside the layers).

Under ``Plan.lora`` the executor hands a node an ``Adapted`` in place of each weight a
LoRA adapts: the base's gathered view (a tensor or an ``Fp8Weight``, holding no gradient)
and this rank's piece of the adapter. Every product a weight enters takes it:
``adapting(linear)`` wraps ``Gemms.linear`` (attention's projections, the shared expert,
a dense MLP) and ``experts.grouped_matmul`` (the routed experts' fc1 and fc2) checks for
it, so ``y = x @ w + scale * (x @ a) @ b``. The base's product runs as it would (FP8 included);
the adapter's two products run in ``x``'s dtype, ``a`` and ``scale * b`` cast on the way, so
their gradients reach the fp32 pieces. Autograd then computes the input gradient through
``w`` and the adapter's gradients, and no gradient of ``w``.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch


class Adapted(NamedTuple):
    """A weight ``w [..., in, out]`` and its adapter's piece: ``a [..., in, R]``,
    ``b [..., R, out]`` (fp32; ``R`` the rank, or a multiple of it where several adapters
    share the weight, as ``q``, ``k``, ``v`` share ``qkv``) and the scale ``alpha / rank``."""

    w: object
    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    def operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``a`` and ``scale * b`` in ``dtype``: what the two products multiply by."""
        return self.a.to(dtype), (self.b * self.scale).to(dtype)


def low_rank(x: torch.Tensor, w: Adapted) -> torch.Tensor:
    """``scale * (x @ a) @ b`` in ``x``'s dtype."""
    a, b = w.operands(x.dtype)
    return (x @ a) @ b


@functools.cache
def adapting(linear: Callable) -> Callable:
    """``linear(x, w)`` that also takes an ``Adapted`` ``w``: ``linear(x, w.w) + low_rank(x, w)``.
    One function per ``linear`` (compiled regions guard on its identity)."""
    def product(x, w):
        if isinstance(w, Adapted):
            return linear(x, w.w) + low_rank(x, w)
        return linear(x, w)
    product.__name__ = f"adapting_{getattr(linear, '__name__', 'linear')}"
    return product


__all__ = ["Adapted", "adapting", "low_rank"]
