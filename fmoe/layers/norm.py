"""RMSNorm as a pure function."""

import torch
import torch.nn.functional as F

from .precision import upcast


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last axis, statistics in fp32.

    Arguments:
        x: ``[..., D]`` activations (any float dtype).
        weight: ``[D]`` scale.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x``'s dtype.
    """
    # Upcast so bf16 activations are normalised with fp32 statistics.
    y = F.rms_norm(upcast(x), (x.shape[-1],), upcast(weight), eps)
    return y.to(x.dtype)
