"""Adapters from fmoe's pure core to the rest of the PyTorch world.

``FMoEModule`` wraps the whole model and ``MoELayer`` one MoE layer as
``nn.Module``s (plain autograd, canonical ``state_dict``). The core never imports
from here.
"""

from .module import FMoEModule, MoELayer

__all__ = ["FMoEModule", "MoELayer"]
