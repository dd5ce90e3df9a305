"""``gather_full``: the unsharded pytree from every rank's shards (a collective)."""

from __future__ import annotations

import optree
import torch

from ..config import Plan
from ..params import named_leaves
from .comm import Group
from .spec import full_views, shard_spec, write_shard


def gather_full(tree, plan: Plan):
    """Full tensors for a pytree sharded like ``fmoe.init(plan)`` (params, grads, or
    an optimizer moment). Every rank must call it; every rank gets the same result.

    Arguments:
        tree: this rank's pytree in the plan's sharding.
        plan: the Plan.

    Returns:
        The pytree in the canonical full layout (the input itself when unsharded).
    """
    spec = shard_spec(plan)
    if not spec.sharded:
        return tree
    group = Group.world()
    named = named_leaves(tree)
    first = next(iter(named.values()))
    full = {}
    for u in spec.units:
        for layout in u.groups.values():
            shard = torch.empty(layout.shard_size, dtype=first.dtype, device=first.device)
            write_shard(named, layout, group.rank, shard)
            out = torch.empty(layout.full_size, dtype=first.dtype, device=first.device)
            group.all_gather(out, shard).wait()
            full.update(full_views(out, layout))
    return optree.tree_unflatten(optree.tree_structure(tree), [full[p] for p in named])
