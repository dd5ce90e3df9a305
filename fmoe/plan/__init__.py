"""The planner: a plan's whole step checked and timed before any GPU runs it.

``simulate(plan, rows, seq)`` builds every pipeline stage's program, checks them together
(transfers met in order, no stage waiting on another in a circle, each stage's FSDP
lifecycle kept) and times them with a
``CostModel``; ``estimate_memory`` adds up what a rank holds; ``python -m fmoe.plan``
prints both, a per-stage timeline and a Chrome trace, and ``--search`` ranks the plans
that fit a memory budget on a number of GPUs (``search``), each with its bubble and exposed
communication; either way it prints the ``fmoe.train`` command that runs the plan
(``command``). ``models`` holds the released models' shapes (``--model``).
"""

from .costs import Calibration, CostModel, Links, node_flops
from .simulate import PlanError, Simulation, simulate

__all__ = ["Calibration", "CostModel", "Links", "PlanError", "Simulation", "node_flops", "simulate"]
