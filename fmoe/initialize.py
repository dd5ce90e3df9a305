"""``init``: this rank's parameters for a plan."""

from __future__ import annotations

import torch

from .config import Plan
from .comm.collectives import Group
from .params import initial_leaves
from .resolve import resolve
from .runtime import check_runtime


def init(plan: Plan, seed: int = 0) -> dict:
    """This rank's parameter pytree for ``plan``, deterministic per ``seed``.

    Arguments:
        plan: the Plan (its model, device and parallel layout).
        seed: the same seed gives the same full model whatever the plan.

    Returns:
        A nested dict of fp32 tensors in the canonical layout (``fmoe.params``): full
        tensors, or, when the plan shards parameters over several ranks, this rank's
        rows of each as ``[local_rows, last_dim]``. Each leaf is its own contiguous
        tensor on ``plan.device``.
    """
    check_runtime(plan)
    rank, spec = Group.world().rank, resolve(plan).spec
    shapes = spec.local_shapes(rank)
    local = {path: spec.shard_leaf(full, path, rank).reshape(shapes[path])
             .to(device=plan.device, dtype=torch.float32).contiguous()
             for path, full in initial_leaves(spec.table, plan.model, seed)}
    return spec.table.unflatten(local[leaf.path] for leaf in spec.table.leaves)
