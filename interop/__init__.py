"""Adapters from fmoe's pure core to the rest of the PyTorch world.

``FMoEModule`` wraps the whole model as an ``nn.Module`` (plain autograd, canonical
``state_dict``). The core never imports from here.
"""

from .module import FMoEModule

__all__ = ["FMoEModule"]
