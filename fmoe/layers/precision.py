"""Precision helper shared by the layers."""

import torch

def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32: bf16/fp16 go to fp32, fp32 and fp64 stay as they are.

    Statistics (norms, softmax, router scores, sums over experts) run at this precision.
    """
    return t.to(torch.promote_types(t.dtype, torch.float32))
