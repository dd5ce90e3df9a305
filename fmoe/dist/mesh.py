"""The process groups of a plan: a ``dp x ep`` DeviceMesh over the world.

Rank ``r`` sits at ``(r // ep, r % ep)``: the ``ep`` ranks of one row hold
different experts and exchange tokens; the ``dp`` ranks of one column hold the same
experts (the expert-data-parallel group, "edp") and shard them between themselves.
Dense parameters shard over the whole world.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist

from ..config import Plan
from .comm import Group

LOCAL = Group(1, 0, None)


@dataclass(frozen=True)
class Mesh:
    """This rank's groups.

    Attributes:
        world: every rank (dense parameters, the data-parallel gradient sum).
        ep: the ranks this rank exchanges tokens with (size ``plan.ep``).
        edp: the ranks holding the same experts (size ``plan.dp``).
    """

    world: Group
    ep: Group
    edp: Group

    def data_group(self, domain: str) -> Group:
        """Ranks whose gradients of ``domain`` parameters must be summed."""
        return self.world if domain == "dense" else self.edp

    def shard_group(self, domain: str, size: int) -> Group:
        """Ranks sharing ``domain``'s flat buffers (one rank when ``size`` is 1)."""
        return self.data_group(domain) if size > 1 else LOCAL


def _subgroup(mesh, dim: str) -> Group:
    group = mesh.get_group(dim)
    return Group(dist.get_world_size(group), dist.get_rank(group), group)


@functools.lru_cache(maxsize=8)
def _device_mesh(dp: int, ep: int, device_type: str):
    # The DeviceMesh refers to its groups by name; process-group objects are looked up
    # per call and never cached, so destroy_process_group() really releases them
    # (a cached gloo group outliving it can abort the interpreter at exit).
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))


def mesh_for(plan: Plan) -> Mesh:
    """The plan's groups on this process. A mesh with one dimension of size 1 needs no
    subgroup (the other dimension is the world); a full ``dp x ep`` mesh is created
    once per layout."""
    world = Group.world()
    if plan.ep == 1:
        return Mesh(world, LOCAL, world)
    if plan.dp == 1:
        return Mesh(world, world, LOCAL)
    import torch

    mesh = _device_mesh(plan.dp, plan.ep, torch.device(plan.device).type)
    return Mesh(world, _subgroup(mesh, "ep"), _subgroup(mesh, "dp"))
