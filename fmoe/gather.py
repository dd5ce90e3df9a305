"""``gather_full``: the unsharded pytree from every rank's shards (a collective)."""

from __future__ import annotations

from typing import Iterator

import optree
import torch

from .config import Plan
from .lora import adapter_shapes
from .params import Domain, named_leaves
from .resolve import resolve
from .shard.spec import full_views, write_shard


def gather_full(tree, plan: Plan):
    """Full tensors for a pytree laid out like ``fmoe.init(plan)`` (params, grads, or
    an optimizer moment). Every rank must call it; every rank gets the same result.

    Row shards are gathered over the ranks that split them; tensor-parallel pieces
    over the ``tp`` (or, for the experts, ``etp``) group and put back together; under
    expert parallelism each rank's experts are then gathered over the EP group; under
    pipeline parallelism the stage holding a unit broadcasts it to the others.

    Arguments:
        tree: this rank's pytree in the plan's layout.
        plan: the Plan.

    Under ``plan.lora`` a tree of adapters (or their gradients, ``out.grads``) is whole on
    every rank already, and is returned as it is.

    Returns:
        The pytree in the canonical full layout (the input itself on one rank).
    """
    named = named_leaves(tree)
    if plan.world == 1 or (plan.lora is not None and named.keys() == adapter_shapes(plan).keys()):
        return tree
    full = {}
    for views in iter_full(named, plan):
        full.update(views)
    return optree.tree_unflatten(optree.tree_structure(tree), [full[p] for p in named])


def iter_full(named: dict, plan: Plan) -> Iterator[dict]:
    """``gather_full`` one unit and buffer group at a time, so a caller that streams the
    model out (``fmoe.hf.save``) holds one unit's full tensors at once. A collective.

    Arguments:
        named: this rank's ``{path: leaf}`` in the plan's layout (``fmoe.params.named_leaves``).
        plan: the Plan.

    Yields:
        ``{path: full tensor}`` for each unit's buffer group, in unit order.
    """
    setup = resolve(plan)
    spec, mesh = setup.spec, setup.mesh
    first = next(iter(named.values()))
    for u in spec.units:
        for key, layout in u.groups.items():
            views = _held_full(named, spec, mesh, plan, key, layout, first) if u.stage == setup.stage else \
                {s.path: first.new_empty(spec.table[s.path].shape) for s in layout.slots}
            if plan.pp > 1:  # from the stage that holds the unit to the others
                at = plan.dims.coords(mesh.world.rank)
                owner = plan.dims.rank_of(at.d, at.e, at.c, at.t, u.stage)
                for path in views:
                    views[path] = mesh.pp.broadcast(views[path].contiguous(), owner)
            yield views


def _held_full(named: dict, spec, mesh, plan: Plan, key, layout, like: torch.Tensor) -> dict:
    """``{path: full tensor}`` of one buffer group of a unit this rank's stage holds."""
    domain = key.domain
    if spec.sharded(domain):
        shard = torch.empty(layout.shard_size, dtype=like.dtype, device=like.device)
        write_shard(named, layout, spec.shard_rank(mesh.world.rank, domain), shard)
        out = torch.empty(layout.full_size, dtype=like.dtype, device=like.device)
        mesh.shard_group(domain, spec.sizes[domain]).all_gather(out, shard).wait()
        views = full_views(out, layout)
    else:
        views = {s.path: named[s.path] for s in layout.slots}
    for path in [p for p in views if spec.cuts(p)]:
        leaf = spec.table[path]
        group = mesh.etp if leaf.domain == Domain.EXPERT else mesh.tp
        local = views[path].contiguous()
        every = local.new_empty((group.size,) + tuple(local.shape))
        group.all_gather(every.view(-1), local.view(-1)).wait()
        views[path] = leaf.split.assemble(list(every.unbind(0)), group.size)
    if domain == Domain.EXPERT and plan.ep > 1:
        for path, local in views.items():
            every = local.new_empty((plan.model.experts,) + tuple(local.shape[1:]))
            mesh.ep.all_gather(every.view(-1), local.contiguous().view(-1)).wait()
            views[path] = every
    return views
