"""How a plan lays parameters out over ranks: units, buffer groups, flat layouts.

A unit's parameters fall into buffer groups keyed ``(domain, dtype)``: the domain is
``dense`` (sharded over the whole world) or ``expert`` (this rank's ``E / ep``
experts, sharded over its expert-data-parallel group); the dtype is ``compute``,
``float32`` (router and biases stay fp32 in bf16 runs) or ``fp8`` (the dense products'
weights, gathered in FP8 under ``fp8='tensorwise'``: ``gathers_fp8``). Everything here
is a pure function of the plan (cached), so every rank derives the same layout without
talking to the others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..config import Plan
from ..params import Leaf, param_table
from ..units import unit_name
from .layout import FlatLayout, make_layout, rows_cols


def gathers_fp8(plan: Plan) -> bool:
    """Whether the dense products' weights are gathered already cast to FP8: under
    ``fp8='tensorwise'`` (one scale per weight, which every rank can agree on) when the
    dense weights are sharded. Half the bytes of a bf16 gather, and no cast after it."""
    return plan.fp8 == "tensorwise" and shard_sizes(plan)["dense"] > 1


def dtype_group(leaf: Leaf, plan: Plan) -> str:
    """Leaves kept in fp32 whatever the compute dtype form their own gather group, and
    so do the dense products' weights gathered in FP8 (``gathers_fp8``)."""
    if plan.compute_dtype != torch.float32 and leaf.fp32:
        return "float32"
    return "fp8" if leaf.linear and gathers_fp8(plan) else "compute"


GROUP_DTYPES = {"float32": torch.float32, "fp8": torch.float8_e4m3fn}  # "compute": the plan's


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP unit: its members and one flat layout per ``(domain, dtype)`` group."""

    name: str
    members: tuple[str, ...]
    groups: dict

    def dtype(self, key: tuple, plan: Plan) -> torch.dtype:
        return GROUP_DTYPES.get(key[1], plan.compute_dtype)


@dataclass(frozen=True)
class ShardSpec:
    """The plan's units and how many ranks share each domain's buffers.

    Attributes:
        units: the UnitSpecs in member order.
        sizes: ``{"dense": G, "expert": G}``; 1 means every rank holds the whole
            domain (full tensors, or its own experts under EP).
        experts_per_rank: ``E / ep``.
    """

    units: tuple[UnitSpec, ...]
    sizes: dict
    experts_per_rank: int

    def sharded(self, domain: str) -> bool:
        """Whether ``domain``'s params/grads at rest are row shards."""
        return self.sizes[domain] > 1

    def unit_of_member(self, member: str) -> UnitSpec:
        return next(u for u in self.units if member in u.members)

    def layout_of(self, path: str, plan: Plan) -> FlatLayout:
        leaf = param_table(plan.model)[path]
        return self.unit_of_member(leaf.member).groups[(leaf.domain, dtype_group(leaf, plan))]


def shard_sizes(plan: Plan) -> dict:
    """Ranks sharing each domain's buffers: world / edp under sharded strategies, else 1."""
    if plan.sharding == "no_shard":
        return {"dense": 1, "expert": 1}
    return {"dense": plan.dp * plan.ep, "expert": plan.dp}


def local_full_shape(path: str, shape: tuple, plan: Plan) -> tuple:
    """The shape a rank holds before row sharding: experts cut to ``E / ep``."""
    if param_table(plan.model)[path].domain == "expert":
        return (shape[0] // plan.ep,) + tuple(shape[1:])
    return tuple(shape)


@functools.lru_cache(maxsize=64)
def shard_spec(plan: Plan) -> ShardSpec:
    """The layout of ``plan``'s parameters (pure, cached per plan)."""
    sizes = shard_sizes(plan)
    units = []
    for members in plan.unit_groups:
        by_key: dict = {}
        for leaf in param_table(plan.model).leaves:
            if leaf.member in members:
                key = (leaf.domain, dtype_group(leaf, plan))
                by_key.setdefault(key, []).append((leaf.path, local_full_shape(leaf.path, leaf.shape, plan)))
        groups = {key: make_layout(named, sizes[key[0]]) for key, named in sorted(by_key.items())}
        units.append(UnitSpec(unit_name(members), members, groups))
    return ShardSpec(tuple(units), sizes, plan.model.experts // plan.ep)


def ep_index(plan: Plan, world_rank: int) -> int:
    """Which expert slice a rank holds: its column in the ``dp x ep`` mesh."""
    return world_rank % plan.ep


def shard_rank(plan: Plan, world_rank: int, domain: str) -> int:
    """A rank's index among those sharing ``domain``'s buffers (0 if none share):
    its world rank for dense groups, its row (``rank // ep``) for expert groups."""
    if not shard_spec(plan).sharded(domain):
        return 0
    return world_rank if domain == "dense" else world_rank // plan.ep


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
    """Copy this rank's leaves (``{path: tensor}``) into its flat shard ``out``, cast to
    ``out``'s dtype on the way, and zero its padding: two multi-tensor kernels."""
    with torch.no_grad():
        gaps = [out[lo:hi] for lo, hi in layout.local_gaps(rank)]
        if gaps:
            torch._foreach_zero_(gaps)
        views, leaves = [], []
        for i, slot in enumerate(layout.slots):
            view = local_leaf(out, layout, i, rank, sharded=True)
            if view.numel():
                views.append(view)
                leaves.append(named[slot.path].reshape(view.shape))
        if views:
            torch._foreach_copy_(views, leaves)
    return out


def full_views(full: torch.Tensor, layout: FlatLayout) -> dict:
    """``{path: full-shape view}`` of a gathered flat buffer."""
    return {s.path: full[s.start:s.end].view(s.shape) for s in layout.slots}


class Piece(NamedTuple):
    """What one rank holds of a full parameter.

    Attributes:
        experts: the global expert indices ``[first, last)`` it holds (expert leaves
            under EP), or None for the whole leading axis.
        first, last: its rows of that (expert-cut) leaf seen as ``[rows, cols]``.
        sharded: whether it holds the rows as ``[last - first, cols]`` (a row shard)
            rather than the expert-cut leaf in its full shape.
    """

    experts: tuple | None
    first: int
    last: int
    sharded: bool


def leaf_piece(path: str, shape: tuple, plan: Plan, world_rank: int) -> Piece:
    """Which part of the full parameter ``path`` (of full ``shape``) a rank holds:
    its experts (under EP), then its rows (when the domain is sharded)."""
    spec = shard_spec(plan)
    domain = param_table(plan.model)[path].domain
    experts = None
    if domain == "expert" and plan.ep > 1:
        first = ep_index(plan, world_rank) * spec.experts_per_rank
        experts = (first, first + spec.experts_per_rank)
    if not spec.sharded(domain):
        rows, _ = rows_cols(local_full_shape(path, shape, plan))
        return Piece(experts, 0, rows, False)
    layout = spec.layout_of(path, plan)
    index = next(i for i, s in enumerate(layout.slots) if s.path == path)
    _, first, last, _ = layout.local_slots(shard_rank(plan, world_rank, domain))[index]
    return Piece(experts, first, last, True)


def shard_leaf(full_leaf: torch.Tensor, path: str, plan: Plan, world_rank: int) -> torch.Tensor:
    """This rank's part of a full parameter (see ``leaf_piece``)."""
    piece = leaf_piece(path, tuple(full_leaf.shape), plan, world_rank)
    if piece.experts is not None:
        full_leaf = full_leaf[piece.experts[0]:piece.experts[1]]
    if not piece.sharded:
        return full_leaf.clone() if piece.experts is not None else full_leaf
    rows, cols = rows_cols(tuple(full_leaf.shape))
    return full_leaf.reshape(rows, cols)[piece.first:piece.last].clone()


def local_shapes(plan: Plan, world_rank: int) -> dict:
    """``{path: shape}`` of the leaves rank ``world_rank`` holds under ``plan`` (pure)."""
    spec = shard_spec(plan)
    shapes = {}
    for u in spec.units:
        for (domain, _), layout in u.groups.items():
            rank = shard_rank(plan, world_rank, domain)
            for slot, first, last, _ in layout.local_slots(rank):
                shapes[slot.path] = (last - first, slot.cols) if spec.sharded(domain) else slot.shape
    return {leaf.path: shapes[leaf.path] for leaf in param_table(plan.model).leaves}
