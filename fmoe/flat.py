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

import torch

from .config import Plan
from .params import initial_leaves, named_leaves, param_table
from .runtime import check_runtime
from .shard.comm import Group
from .shard.spec import flat_shard, local_leaves, shard_leaf, shard_rank, shard_spec


def _groups(plan: Plan, rank: int):
    """``(unit, key, layout, shard rank, sharded)`` of every unit's buffer groups."""
    spec = shard_spec(plan)
    for u in spec.units:
        for key, layout in u.groups.items():
            yield u.name, key, layout, shard_rank(plan, rank, key[0]), spec.sharded(key[0])


def _params_viewing(buffers: dict, plan: Plan, rank: int) -> dict:
    """The params pytree whose leaves view ``{(unit, key): flat shard}``."""
    named = {}
    for unit, key, layout, r, sharded in _groups(plan, rank):
        named.update(local_leaves(buffers[(unit, key)], layout, r, sharded))
    table = param_table(plan.model)
    return table.unflatten(named[leaf.path] for leaf in table.leaves)


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
    # zeroed: the padding between leaves stays zero (the fused AdamW runs over it)
    buffers = {(unit, key): torch.zeros(layout.shard_size, dtype=torch.float32, device=plan.device)
               for unit, key, layout, _, _ in _groups(plan, rank)}
    params = _params_viewing(buffers, plan, rank)
    named = named_leaves(params)
    for path, full in initial_leaves(plan.model, seed):
        named[path].copy_(shard_leaf(full, path, plan, rank).reshape(named[path].shape))
    return params


def as_flat(params: dict, plan: Plan) -> dict:
    """``params`` with every leaf a view into flat storage laid out for ``plan``.

    Arguments:
        params: this rank's fp32 pytree under ``plan`` (as ``fmoe.step`` takes it).
        plan: the Plan it is laid out by.

    Returns:
        ``params`` itself where every leaf already lives in place; otherwise a new
        pytree whose groups already in place keep their buffer and the others hold
        copies (the leaves passed are not modified).
    """
    rank = Group.world().rank
    named = named_leaves(params)
    shards = {(unit, key): flat_shard(named, layout, r, sharded, plan.device)
              for unit, key, layout, r, sharded in _groups(plan, rank)}
    if not any(copied for _, copied in shards.values()):
        return params
    return _params_viewing({k: buf for k, (buf, _) in shards.items()}, plan, rank)
