"""How a plan lays parameters out over ranks: units, dtype groups, flat layouts.

Everything here is a pure function of the plan (cached), so every rank derives the
same layout without talking to the others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import Plan
from ..layers.model import FP32_LEAVES
from ..params import flat_shapes
from .comm import Group
from .layout import FlatLayout, make_layout
from .units import member_of, unit_name


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP unit: its members and one flat layout per dtype group.

    ``groups`` maps a dtype name (``"compute"`` or ``"float32"``) to the layout of the
    unit's parameters gathered in that dtype.
    """

    name: str
    members: tuple[str, ...]
    groups: dict

    def dtype(self, group: str, plan: Plan) -> torch.dtype:
        return torch.float32 if group == "float32" else plan.compute_dtype


@dataclass(frozen=True)
class ShardSpec:
    """The plan's units and the number of ranks sharing each flat buffer."""

    units: tuple[UnitSpec, ...]
    group_size: int

    @property
    def sharded(self) -> bool:
        """Whether params/grads at rest are row shards (else full tensors)."""
        return self.group_size > 1

    def shard_rank(self, rank: int) -> int:
        """A rank's index among those sharing the buffers (0 when nothing is shared)."""
        return rank if self.sharded else 0

    def unit_of_member(self, member: str) -> UnitSpec:
        return next(u for u in self.units if member in u.members)


def dtype_group(path: str, plan: Plan) -> str:
    """Leaves kept in fp32 whatever the compute dtype form their own gather group."""
    if plan.compute_dtype != torch.float32 and path.rsplit(".", 1)[-1] in FP32_LEAVES:
        return "float32"
    return "compute"


def shard_group_size(plan: Plan) -> int:
    """Ranks a unit's buffers are split over: the world for sharded strategies."""
    return 1 if plan.sharding == "no_shard" else plan.dp * plan.ep


@functools.lru_cache(maxsize=64)
def shard_spec(plan: Plan) -> ShardSpec:
    """The layout of ``plan``'s parameters (pure, cached per plan)."""
    shapes = flat_shapes(plan.model)
    size = shard_group_size(plan)
    units = []
    for members in plan.unit_groups:
        by_group: dict = {}
        for path, shape in shapes.items():
            if member_of(path) in members:
                by_group.setdefault(dtype_group(path, plan), []).append((path, shape))
        groups = {g: make_layout(named, size) for g, named in sorted(by_group.items())}
        units.append(UnitSpec(unit_name(members), members, groups))
    return ShardSpec(tuple(units), size)


def local_leaf(flat: torch.Tensor, layout: FlatLayout, index: int, rank: int, sharded: bool) -> torch.Tensor:
    """The view of parameter ``index`` that rank ``rank`` holds inside its flat shard.

    Sharded: ``[local_rows, cols]``; unsharded (one-rank group): the full shape.
    """
    slot, first, last, offset = layout.local_slots(rank)[index]
    piece = flat[offset:offset + (last - first) * slot.cols]
    return piece.view(last - first, slot.cols) if sharded else piece.view(slot.shape)


def local_leaves(flat: torch.Tensor, layout: FlatLayout, rank: int, sharded: bool) -> dict:
    """``{path: view}`` for every parameter of ``layout`` in this rank's flat shard."""
    return {s.path: local_leaf(flat, layout, i, rank, sharded) for i, s in enumerate(layout.slots)}


def write_shard(named: dict, layout: FlatLayout, rank: int, out: torch.Tensor) -> torch.Tensor:
    """Copy this rank's leaves (``{path: tensor}``) into its flat shard ``out`` (padding zeroed)."""
    out.zero_()
    for i, slot in enumerate(layout.slots):
        view = local_leaf(out, layout, i, rank, sharded=True)
        view.copy_(named[slot.path].reshape(view.shape))
    return out


def full_views(full: torch.Tensor, layout: FlatLayout) -> dict:
    """``{path: full-shape view}`` of a gathered flat buffer."""
    return {s.path: full[s.start:s.end].view(s.shape) for s in layout.slots}


def shard_leaf(full_leaf: torch.Tensor, path: str, plan: Plan, rank: int) -> torch.Tensor:
    """This rank's part of a full parameter: its own rows, or all of it when unsharded."""
    spec = shard_spec(plan)
    if not spec.sharded:
        return full_leaf
    layout = spec.unit_of_member(member_of(path)).groups[dtype_group(path, plan)]
    index = next(i for i, s in enumerate(layout.slots) if s.path == path)
    slot, first, last, _ = layout.local_slots(rank)[index]
    return full_leaf.reshape(slot.rows, slot.cols)[first:last].clone()


def group(plan: Plan) -> Group:
    """The process group a plan shards over (the world here)."""
    return Group.world()
