"""The process groups of a plan, from DeviceMeshes over its ParallelDims.

The plan's ranks form one DeviceMesh with named dimensions ``("pp", "dp", "ep", "cp",
"tp")`` (``tp`` innermost: ``fmoe.parallel_dims``); the groups that cut across it are
more views of the same ranks: ``("pp", "stage")`` (a pipeline stage's ranks),
``("pp", "tensor_data", "tp")`` (the ranks sharing a tensor-parallel slice) and
``("pp", "edp", "ep", "etp")`` (the experts' data- and tensor-parallel groups).
Dimensions of size 1 are left out, and a group that is the whole world or every rank
alone needs no new process group.

Which groups sum which gradients: dense parameters replicated over ``tp`` (norms,
router, ...) over their stage; tensor-parallel slices over ``tensor_data``; expert
slices over ``edp``. Each is also the group its buffers shard over.
"""

from __future__ import annotations

import enum
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Plan
from ..parallel_dims import STAGE_GROUPS, GroupName, ParallelDims
from ..params import Domain
from .collectives import Group

LOCAL = Group(1, 0, None)


@dataclass(frozen=True)
class Mesh:
    """This rank's groups.

    Attributes:
        world: every rank (the loss, the metrics, the target count).
        ep: the ranks this rank exchanges tokens with (size ``plan.ep``).
        edp: the ranks holding the same slice of the same experts.
        tp, cp, etp: its tensor-, context- and expert-tensor-parallel groups.
        tensor_data: the ranks holding the same tensor-parallel slice (``stage / tp``).
        stage: the ranks of its pipeline stage (the world without pipeline
            parallelism; the sum of gradients replicated over ``tp``); ``pp``: the ranks
            of its place in every stage (who hand each other activations).
        pp_gradients: under interleaved pipelining (``Plan.virtual_stages > 1``) a
            second group of every rank, on which the stream's gradients travel apart
            from the stream: both then pass between the same two ranks in the same
            direction, and point-to-point messages on one group are matched in order.
    """

    world: Group
    ep: Group
    edp: Group
    tp: Group = LOCAL
    cp: Group = LOCAL
    etp: Group = LOCAL
    tensor_data: Group | None = None
    stage: Group | None = None
    pp: Group = LOCAL
    pp_gradients: Group | None = None

    def group(self, name: GroupName) -> Group:
        """This rank's group ``name`` (one of ``_GROUPS``)."""
        match name:
            case GroupName.TP:
                return self.tp
            case GroupName.CP:
                return self.cp
            case GroupName.EP:
                return self.ep
            case GroupName.PP:
                return self.pp
            case GroupName.STAGE:
                return self.stage
            case GroupName.TENSOR_DATA:
                return self.tensor_data
            case GroupName.ETP:
                return self.etp
            case GroupName.EDP:
                return self.edp
        raise KeyError(f"a Mesh holds no {name!r} group; it holds {', '.join(_GROUPS)}")

    def data_group(self, domain: Domain) -> Group:
        """Ranks whose gradients of ``domain`` parameters must be summed
        (``Domain.data_group``: a dense leaf's over the stage, a tensor-parallel slice's
        over ``tensor_data``, an expert's over ``edp``)."""
        return self.group(Domain(domain).data_group)

    def shard_group(self, domain: Domain, size: int) -> Group:
        """Ranks sharing ``domain``'s flat buffers (one rank when ``size`` is 1)."""
        return self.data_group(domain) if size > 1 else LOCAL


def _subgroup(mesh, dim: str) -> Group:
    group = mesh.get_group(dim)
    return Group(dist.get_world_size(group), dist.get_rank(group), group)


def _expert_ranks(dims: ParallelDims) -> torch.Tensor:
    """World ranks as ``[pp, edp, ep, etp]``: rank ``(s, g, e, j)`` is the one of stage
    ``s`` and expert index ``e`` whose token index is ``g * etp + j``."""
    out = torch.empty(dims.pp, dims.edp, dims.ep, dims.etp, dtype=torch.int64)
    for r in range(dims.world):
        at, n = dims.coords(r), dims.token_index(r)
        out[at.s, n // dims.etp, at.e, n % dims.etp] = r
    return out


class _View(enum.StrEnum):
    """Which DeviceMesh of a layout holds a group (``_view_of``)."""

    DENSE = "dense"  # pp x dp x ep x cp x tp
    PIPELINE = "pipeline"  # pp x stage
    TENSOR = "tensor"  # pp x tensor_data x tp
    GRADIENTS = "gradients"  # every rank, apart from the default group
    EXPERT = "expert"  # pp x edp x ep x etp


@functools.lru_cache(maxsize=32)  # a layout uses up to five: two layouts in turn must not evict each other
def _device_mesh(dims: ParallelDims, view: _View, device_type: str):
    # The DeviceMesh refers to its groups by name; process-group objects are looked up
    # per call and never cached, so destroy_process_group() really releases them
    # (a cached gloo group outliving it can abort the interpreter at exit). Dimensions
    # of size 1 are left out: each would cost a collective group creation for nothing.
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(dims.world)
    match view:
        case _View.DENSE:
            shape = {"pp": dims.pp, "dp": dims.dp, "ep": dims.ep, "cp": dims.cp, "tp": dims.tp}
            ranks = ranks.view(*shape.values())
        case _View.PIPELINE:
            shape = {"pp": dims.pp, "stage": dims.stage_size}
            ranks = ranks.view(*shape.values())
        case _View.TENSOR:
            shape = {"pp": dims.pp, "tensor_data": dims.stage_size // dims.tp, "tp": dims.tp}
            ranks = ranks.view(*shape.values())
        case _View.GRADIENTS:
            shape = {"pp_gradients": dims.world}
        case _View.EXPERT:
            shape = {"pp": dims.pp, "edp": dims.edp, "ep": dims.ep, "etp": dims.etp}
            ranks = _expert_ranks(dims)
    kept = [i for i, size in enumerate(shape.values()) if size > 1]
    ranks = ranks.squeeze(tuple(i for i in range(len(shape)) if i not in kept))
    names = tuple(list(shape)[i] for i in kept)
    if view != _View.GRADIENTS:
        return DeviceMesh(device_type, ranks, mesh_dim_names=names)
    # a dimension of every rank is the default group unless its backend is named
    return DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=((dist.get_backend(), None),))


def separate_world_group_supported() -> bool:
    """Whether this torch can make a group of every rank apart from the default one
    through DeviceMesh (``backend_override``, torch >= 2.9): interleaved pipelining's
    ``pp_gradients`` needs it."""
    from torch.distributed.device_mesh import DeviceMesh

    return "backend_override" in inspect.signature(DeviceMesh.__init__).parameters


def _view_of(dims: ParallelDims, name: GroupName) -> tuple[_View, str]:
    """Which DeviceMesh (and dimension) holds group ``name``: the dense one where it is
    one of its dimensions (``edp`` too when only ``dp`` and ``ep`` are above 1)."""
    match name:
        case GroupName.TP | GroupName.CP | GroupName.EP | GroupName.PP:
            return _View.DENSE, name
        case GroupName.STAGE:
            return _View.PIPELINE, name
        case GroupName.TENSOR_DATA:
            return _View.TENSOR, name
        case GroupName.EDP if dims.etp == dims.cp == dims.tp == 1:
            return _View.DENSE, "dp"
    return _View.EXPERT, name


_GROUPS = (*STAGE_GROUPS, GroupName.PP)  # a Mesh's groups besides the world's


def _group(dims: ParallelDims, name: GroupName, world: Group, device_type: str) -> Group:
    partition = dims.groups(name)
    if len(partition) == 1:
        return world
    if len(partition[0]) == 1:
        return LOCAL
    view, dim = _view_of(dims, name)
    return _subgroup(_device_mesh(dims, view, device_type), dim)


def mesh_for(plan: Plan) -> Mesh:
    """The plan's groups on this process (DeviceMeshes created once per layout)."""
    dims, world = plan.dims, Group.world()
    device_type = torch.device(plan.device).type
    groups = {name: _group(dims, name, world, device_type) for name in _GROUPS}
    gradients = None
    if plan.pp > 1 and plan.virtual_stages > 1:  # created once per layout, as the others
        gradients = _subgroup(_device_mesh(dims, _View.GRADIENTS, device_type), "pp_gradients")
    return Mesh(world, groups[GroupName.EP], groups[GroupName.EDP], groups[GroupName.TP], groups[GroupName.CP],
                groups[GroupName.ETP], groups[GroupName.TENSOR_DATA], groups[GroupName.STAGE], groups[GroupName.PP],
                gradients)
