"""Adapters from fmoe's pure core to the rest of the PyTorch world.

``FMoEModule`` wraps the whole model and ``MoELayer`` one MoE layer as
``nn.Module``s (plain autograd, canonical ``state_dict``); ``capture_step``,
``GraphedTrainStep`` and ``capture_scopes`` replay a step, a step with its update, or
its layer scopes from CUDA graphs. ``interop.te``
(imported on its own: it loads TransformerEngine) registers the ``te`` expert
backend; importing this package declares the name, so a plan may say ``te`` before.
The core never imports from here.
"""

from fmoe.backends import declare_expert_backend

from .cuda_graph import CaptureError, GraphedStep, GraphedTrainStep, capture_scopes, capture_step, check_capturable
from .module import FMoEModule, MoELayer

declare_expert_backend("te", "interop.te")

__all__ = ["CaptureError", "FMoEModule", "GraphedStep", "GraphedTrainStep", "MoELayer", "capture_scopes",
           "capture_step", "check_capturable"]
