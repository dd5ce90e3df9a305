"""Schedules: a step as a program of lifecycle transitions and compute nodes."""

from .executor import Executed, check_program, execute
from .nodes import Kernels, Node
from .program import Action, build_program, double_buffer_slots, max_live_units, node_uses

__all__ = ["Action", "Executed", "Kernels", "Node", "build_program", "check_program", "double_buffer_slots", "execute", "max_live_units", "node_uses"]
