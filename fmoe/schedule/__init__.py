"""Schedules: a step as a program of typed actions (lifecycle transitions and node
runs), and the executor that interprets it."""

from ..layers.nodes import Kernels
from .actions import (Action, Backward, Forward, Gather, Land, Node, NodeRun, Recompute, Reduce, Release, Transition,
                      Wait, Wgrad)
from .compiled import compiled_kernels, kernels_for
from .executor import Executed, execute
from .program import EMBED, HEAD, build_program, double_buffer_slots, layer_nodes, max_live_units, node_uses

__all__ = ["EMBED", "HEAD", "Action", "Backward", "Executed", "Forward", "Gather", "Kernels", "Land", "Node", "NodeRun",
           "Recompute", "Reduce", "Release", "Transition", "Wait", "Wgrad", "build_program", "compiled_kernels",
           "double_buffer_slots", "execute", "kernels_for", "layer_nodes", "max_live_units", "node_uses"]
