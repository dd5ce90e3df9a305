"""Parameters in flat storage: ``init`` and ``as_flat``.

``fmoe.step`` computes with one flat buffer per unit and ``(domain, dtype)`` group
(``fmoe.shard.spec``). Params whose leaves are views into fp32 buffers laid out that
way, each leaf at its place, are used as they are: a step's only work on them is
one cast per group into the compute dtype. ``init`` and ``as_flat`` return such
params, checkpoint and Hugging Face loads go through ``as_flat``, and
``adamw(fused=True)`` keeps its results that way. Any other pytree of the right
shapes still works: ``step`` then copies its leaves into fresh flat shards.

The pytree is what users see, save and test: the storage behind it changes how fast
a step starts, never a value.
"""

from __future__ import annotations

import optree
import torch

from .config import Plan
from .params import _full_leaves, _treedef, flat_shapes, named_leaves
from .runtime import check_runtime
from .shard.comm import Group
from .shard.spec import local_leaves, shard_rank, shard_leaf, shard_spec, stored_shard, write_shard


def _views_of(buffers: dict, plan: Plan, rank: int) -> dict:
    """``{path: leaf}`` viewing ``{(unit, group): flat shard}``."""
    spec, named = shard_spec(plan), {}
    for u in spec.units:
        for key, layout in u.groups.items():
            named.update(local_leaves(buffers[(u.name, key)], layout, shard_rank(plan, rank, key[0]),
                                      spec.sharded(key[0])))
    return named


def _to_tree(named: dict, plan: Plan) -> dict:
    return optree.tree_unflatten(_treedef(plan.model), [named[path] for path in flat_shapes(plan.model)])


def _new_buffers(plan: Plan) -> dict:
    """Zeroed fp32 flat shards, one per unit and group (the padding stays zero)."""
    spec = shard_spec(plan)
    return {(u.name, key): torch.zeros(layout.shard_size, dtype=torch.float32, device=plan.device)
            for u in spec.units for key, layout in u.groups.items()}


def init(plan: Plan, seed: int = 0) -> dict:
    """This rank's parameter pytree for ``plan``, deterministic per ``seed``.

    Arguments:
        plan: the Plan (its model, device and parallel layout).
        seed: the same seed gives the same full model whatever the plan.

    Returns:
        A nested dict of fp32 tensors in the canonical layout (``fmoe.params``): full
        tensors, or, when the plan shards parameters over several ranks, this rank's
        rows of each as ``[local_rows, last_dim]``. The leaves are views into flat
        storage (see this module), so ``step`` reads them without copying.
    """
    check_runtime(plan)
    rank = Group.world().rank
    buffers = _new_buffers(plan)
    named = _views_of(buffers, plan, rank)
    for path, full in _full_leaves(plan.model, seed):
        named[path].copy_(shard_leaf(full, path, plan, rank).reshape(named[path].shape))
    return _to_tree(named, plan)


def as_flat(params: dict, plan: Plan) -> dict:
    """``params`` with every leaf a view into flat storage laid out for ``plan``.

    Arguments:
        params: this rank's fp32 pytree under ``plan`` (as ``fmoe.step`` takes it).
        plan: the Plan it is laid out by.

    Returns:
        ``params`` itself where every leaf already lives in place; otherwise a new
        pytree holding copies of the values (the leaves passed are not modified).
    """
    spec, rank = shard_spec(plan), Group.world().rank
    named = named_leaves(params)
    buffers = {}
    for u in spec.units:
        for key, layout in u.groups.items():
            r = shard_rank(plan, rank, key[0])
            buffers[(u.name, key)] = stored_shard(named, layout, r, spec.sharded(key[0]))
    if all(b is not None for b in buffers.values()):
        return params
    for (unit, key), buf in buffers.items():
        if buf is None:
            layout = next(u for u in spec.units if u.name == unit).groups[key]
            out = torch.empty(layout.shard_size, dtype=torch.float32, device=plan.device)
            buffers[(unit, key)] = write_shard(named, layout, shard_rank(plan, rank, key[0]), out)
    return _to_tree(_views_of(buffers, plan, rank), plan)
