"""A frozen weight with its low-rank adapter beside it (``Plan.lora``'s products inside the layers).

Under ``Plan.lora`` the executor hands a node an ``Adapted`` in place of each weight a
LoRA adapts: the base's gathered view (a tensor or an ``Fp8Weight``, holding no gradient)
and this rank's piece of the adapter. Every product a weight enters takes it:
``adapting(linear)`` wraps ``Gemms.linear`` (attention's projections, the shared expert,
a dense MLP) and ``experts.grouped_matmul`` (the routed experts' fc1 and fc2) checks for
it, so ``y = x @ w + (x @ a) @ b``. The base's product runs as it would (FP8 included);
the adapter's two products run in ``x``'s dtype, ``a`` and ``b`` cast on the way, so their
gradients reach the fp32 pieces. Autograd then computes the input gradient through
``w`` and the adapter's gradients, and no gradient of ``w``.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch


class Adapted(NamedTuple):
    """A weight ``w [..., in, out]`` and its adapter's piece: ``a [..., in, R]``,
    ``b [..., R, out]`` (fp32, the scale ``alpha / rank`` folded into ``b``; ``R`` the
    rank, or a multiple of it where several adapters share the weight, as ``q``, ``k``,
    ``v`` share ``qkv``)."""

    w: object
    a: torch.Tensor
    b: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.w.shape


def low_rank(x: torch.Tensor, w: Adapted) -> torch.Tensor:
    """``(x @ a) @ b`` in ``x``'s dtype."""
    return (x @ w.a.to(x.dtype)) @ w.b.to(x.dtype)


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
