"""What every layer that talks to other ranks stands on: process groups and their
async collectives (``collectives``), the plan's mesh of groups (``mesh``) and the step's
trace events (``trace``). (Not ``dist/``: Python's ignore templates drop folders of that
name, the packaging output.) Below both ``fmoe.layers`` (the expert exchange) and
``fmoe.shard`` (gathers and reductions)."""

from .collectives import Group, Pending
from .mesh import Mesh, mesh_for
from .trace import Event, count, export_chrome_trace

__all__ = ["Event", "Group", "Mesh", "Pending", "count", "export_chrome_trace", "mesh_for"]
