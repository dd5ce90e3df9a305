"""What every layer that talks to other ranks stands on: process groups and their
async collectives (``comm``), the plan's ``dp x ep`` mesh (``mesh``) and the step's
trace events (``trace``). Below both ``fmoe.layers`` (the expert exchange) and
``fmoe.shard`` (gathers and reductions)."""

from .comm import Group, Pending
from .mesh import Mesh, mesh_for
from .trace import Event, count, export_chrome_trace

__all__ = ["Event", "Group", "Mesh", "Pending", "count", "export_chrome_trace", "mesh_for"]
