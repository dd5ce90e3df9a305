"""Schedules: a step as a program of lifecycle transitions and compute nodes."""

from .compiled import compiled_kernels, kernels_for
from .executor import Executed, check_program, execute
from .nodes import Kernels, Node
from .program import Action, build_program, double_buffer_slots, max_live_units, node_uses

__all__ = ["Action", "Executed", "Kernels", "Node", "build_program", "check_program", "compiled_kernels",
           "double_buffer_slots", "execute", "kernels_for", "max_live_units", "node_uses"]
