"""Precision helper shared by the layers."""

import torch

# Routing is decided in fp32 from fp32 weights whatever the compute dtype; expert
# biases stay fp32 so their row-summed gradients are accumulated in fp32.
FP32_LEAVES = ("router", "expert_bias", "fc1_bias", "fc2_bias")


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32: bf16/fp16 go to fp32, fp32 and fp64 stay as they are.

    Statistics (norms, softmax, router scores, sums over experts) run at this precision.
    """
    return t.to(torch.promote_types(t.dtype, torch.float32))
