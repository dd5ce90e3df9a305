"""How a plan lays parameters out over ranks: units, buffer groups, flat layouts.

A unit's parameters fall into buffer groups (``GroupKey``). The domain is where a leaf
is placed (``ShardSpec.placement``): ``DENSE`` (every rank holds all of it; sharded
over the whole world), ``TENSOR`` (under ``Plan.tp > 1``, the leaves tensor
parallelism cuts: each rank holds its slice, sharded over the ranks with the same
slice) or ``EXPERT`` (this rank's ``E / ep`` experts, cut by ``Plan.etp``, sharded over
its expert-data-parallel group). The dtype is the plan's compute dtype, fp32 (router
and biases stay fp32 in bf16 runs) or FP8 (the dense products' weights, gathered in
FP8 under ``fp8='tensorwise'``: ``ShardSpec.gathers_fp8``). ``shard_spec`` derives it
all once per plan (``fmoe.resolve``), so every rank derives the same layout without
talking to the others; the ShardSpec answers every question about it.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..model_config import ModelConfig
from ..parallel_dims import ParallelDims
from ..params import Domain, Leaf, ParamTable, param_table
from ..units import unit_name
from .layout import FlatLayout, make_layout, rows_cols


class Sharding(enum.StrEnum):
    """``Plan.sharding`` as a value, with what each strategy means for a step."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def reduces_every_microbatch(self) -> bool:
        """ZeRO-2/3 reduce-scatter after each microbatch; DDP and ZeRO-1 once, on the last."""
        return self in (Sharding.OPTIM_GRADS, Sharding.OPTIM_GRADS_PARAMS)

    @property
    def regathers(self) -> bool:
        """ZeRO-3 gathers a unit for each span of use and releases it after; the others
        gather every unit once per step."""
        return self is Sharding.OPTIM_GRADS_PARAMS


class GroupDtype(enum.StrEnum):
    """The dtype of a buffer group: the plan's ``COMPUTE`` dtype, ``FLOAT32`` (router and
    biases stay fp32 in bf16 runs) or ``FP8`` (the dense products' weights, gathered in
    FP8 under ``fp8='tensorwise'``)."""

    COMPUTE = "compute"
    FLOAT32 = "float32"
    FP8 = "fp8"


class GroupKey(NamedTuple):
    """A unit's buffer group: the parameters of one domain kept in one dtype."""

    domain: Domain
    dtype: GroupDtype


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP unit: its members, one flat layout per buffer group, and the pipeline
    stage that holds it."""

    name: str
    members: tuple[str, ...]
    groups: dict  # {GroupKey: FlatLayout}
    stage: int = 0


@dataclass(frozen=True)
class ShardSpec:
    """How a plan lays its parameters out over the ranks, derived once (``shard_spec``).

    Attributes:
        units: the UnitSpecs in member order.
        sizes: ``{Domain: G}``, how many ranks share each domain's buffers; 1 means
            every rank holds the whole domain (its slice of it: full tensors, its own
            experts under EP, its tensor-parallel cut).
        experts_per_rank: ``E / ep``.
        ep: the expert-parallel degree.
        dims: the plan's ParallelDims (which rank holds which slice; under pipeline
            parallelism a rank holds only its stage's units: the other leaves as zero
            rows).
        sharding: the strategy.
        compute_dtype: the plan's compute dtype (the ``COMPUTE`` groups').
        gathers_fp8: whether the dense products' weights are gathered already cast to
            FP8: under ``fp8='tensorwise'`` (one scale per weight, which every rank can
            agree on) when the dense weights are sharded. Half the bytes of a bf16
            gather, and no cast after it.
        table: the model's ParamTable.
    """

    units: tuple[UnitSpec, ...]
    sizes: dict
    experts_per_rank: int
    ep: int
    sharding: Sharding
    compute_dtype: torch.dtype
    gathers_fp8: bool
    table: ParamTable
    dims: ParallelDims

    def placement(self, leaf: Leaf) -> Domain:
        """The domain whose buffers hold ``leaf``: ``TENSOR`` for a dense leaf that
        ``Plan.tp > 1`` cuts, else the leaf's own."""
        return placement(leaf, self.dims)

    def degree(self, leaf: Leaf) -> int:
        """How many ranks cut ``leaf`` (``tp`` for a dense leaf, ``etp`` for an expert's)."""
        return self.dims.etp if leaf.domain == Domain.EXPERT else self.dims.tp

    def cuts(self, path: str) -> bool:
        """Whether ranks hold pieces of ``path``'s columns or rows beyond its experts
        (``tp`` or ``etp`` cut it)."""
        leaf = self.table[path]
        return leaf.split is not None and self.degree(leaf) > 1

    def split_index(self, leaf: Leaf, world_rank: int) -> int:
        """Which piece of ``leaf``'s cut a rank holds."""
        if leaf.domain == Domain.EXPERT:
            return self.dims.token_index(world_rank) % self.dims.etp
        return self.dims.coords(world_rank).t

    def copies(self, path: str) -> tuple[tuple[int, int, int], ...]:
        """Where ranks that together hold one copy of the model hold the same values
        twice: ``(first column, end column, copies)`` of the local leaf's last axis
        (key/value heads copied under ``tp``, an expert's ``fc2_bias`` under ``etp``);
        empty when none do. What a global norm counts once."""
        leaf = self.table[path]
        degree = self.degree(leaf)
        if degree == 1:
            return ()
        if leaf.split is None:
            if leaf.domain == Domain.EXPERT:  # fc2_bias: added once per row, on every etp rank
                return ((0, self.local_full_shape(path, leaf.shape)[-1], degree),)
            return ()
        last = leaf.split.axis == len(leaf.shape) - 1
        return tuple((p.local, p.local + p.length, p.copies) for p in leaf.split.pieces(degree, 0)
                     if p.copies > 1 and last)

    def stage_units(self, stage: int) -> tuple[UnitSpec, ...]:
        """The units pipeline stage ``stage`` holds (every unit without pipeline parallelism)."""
        return tuple(u for u in self.units if u.stage == stage)

    def holds(self, path: str, world_rank: int) -> bool:
        """Whether a rank's stage holds parameter ``path``."""
        return self.unit_of_member(self.table[path].member).stage == self.dims.stage(world_rank)

    def sharded(self, domain: Domain) -> bool:
        """Whether ``domain``'s params/grads at rest are row shards."""
        return self.sizes[domain] > 1

    def unit(self, name: str) -> UnitSpec:
        return next(u for u in self.units if u.name == name)

    def unit_of_member(self, member: str) -> UnitSpec:
        return next(u for u in self.units if member in u.members)

    def dtype(self, key: GroupKey) -> torch.dtype:
        """The dtype group ``key``'s buffers hold."""
        return GROUP_DTYPES.get(key.dtype, self.compute_dtype)

    def layout_of(self, path: str) -> FlatLayout:
        leaf = self.table[path]
        key = group_key(leaf, self.placement(leaf), self.compute_dtype, self.gathers_fp8)
        return self.unit_of_member(leaf.member).groups[key]

    def local_full_shape(self, path: str, shape: tuple) -> tuple:
        """The shape a rank holds before row sharding: experts cut to ``E / ep``, then
        its tensor-parallel piece (``Leaf.split``)."""
        leaf = self.table[path]
        return _local_full_shape(leaf, shape, self.ep, self.degree(leaf))

    def ep_index(self, world_rank: int) -> int:
        """Which expert slice a rank holds: its ``e`` coordinate."""
        return self.dims.coords(world_rank).e

    def shard_rank(self, world_rank: int, domain: Domain) -> int:
        """A rank's index among those sharing ``domain``'s buffers (0 if none share):
        in the world for dense groups, in ``tensor_data`` for tensor-parallel slices, in
        ``edp`` for expert groups."""
        if not self.sharded(domain):
            return 0
        return self.dims.index(Domain(domain).data_group, world_rank)

    def leaf_piece(self, path: str, shape: tuple, world_rank: int) -> "Piece":
        """Which part of the full parameter ``path`` (of full ``shape``) a rank holds:
        its experts (under EP), its tensor-parallel cut (``split_cut``), then its rows
        (when its domain is sharded); no rows when another pipeline stage holds it."""
        domain = self.placement(self.table[path])
        if not self.holds(path, world_rank):
            return Piece(None, 0, 0, True)
        experts = None
        if domain == Domain.EXPERT and self.ep > 1:
            first = self.ep_index(world_rank) * self.experts_per_rank
            experts = (first, first + self.experts_per_rank)
        if not self.sharded(domain):
            rows, _ = rows_cols(self.local_full_shape(path, shape))
            return Piece(experts, 0, rows, False)
        layout = self.layout_of(path)
        index = next(i for i, s in enumerate(layout.slots) if s.path == path)
        _, first, last, _ = layout.local_slots(self.shard_rank(world_rank, domain))[index]
        return Piece(experts, first, last, True)

    def split_cut(self, leaf_ED: torch.Tensor, path: str, world_rank: int) -> torch.Tensor:
        """A rank's tensor-parallel piece of ``leaf_ED``, the parameter ``path`` already
        cut to the rank's experts (itself when nothing cuts it)."""
        leaf = self.table[path]
        if leaf.split is None:
            return leaf_ED
        return leaf.split.cut(leaf_ED, self.degree(leaf), self.split_index(leaf, world_rank))

    def shard_leaf(self, full_leaf: torch.Tensor, path: str, world_rank: int, experts_cut: bool = False) -> torch.Tensor:
        """This rank's part of a full parameter (see ``leaf_piece``); ``experts_cut``:
        ``full_leaf`` holds only the rank's experts already."""
        piece = self.leaf_piece(path, self.table[path].shape, world_rank)
        if not self.holds(path, world_rank):
            return full_leaf.new_empty((0, rows_cols(self.local_full_shape(path, full_leaf.shape))[1]))
        local = full_leaf
        if piece.experts is not None and not experts_cut:
            local = local[piece.experts[0]:piece.experts[1]]
        local = self.split_cut(local, path, world_rank)
        if not piece.sharded:
            return local if local is full_leaf else local.clone()  # a leaf of its own, never a view
        rows, cols = rows_cols(tuple(local.shape))
        return local.reshape(rows, cols)[piece.first:piece.last].clone()

    def local_shapes(self, world_rank: int) -> dict:
        """``{path: shape}`` of the leaves rank ``world_rank`` holds, in table order (under
        pipeline parallelism another stage's as ``(0, cols)``)."""
        shapes, stage = {}, self.dims.stage(world_rank)
        for u in self.units:
            for key, layout in u.groups.items():
                rank = self.shard_rank(world_rank, key.domain)
                for slot, first, last, _ in layout.local_slots(rank):
                    if u.stage != stage:
                        shapes[slot.path] = (0, slot.cols)
                    else:
                        shapes[slot.path] = (last - first, slot.cols) if self.sharded(key.domain) else slot.shape
        return {leaf.path: shapes[leaf.path] for leaf in self.table.leaves}


def _local_full_shape(leaf: Leaf, shape: tuple, ep: int, degree: int) -> tuple:
    if leaf.domain == Domain.EXPERT:
        shape = (shape[0] // ep,) + tuple(shape[1:])
    return leaf.split.local_shape(tuple(shape), degree) if leaf.split is not None else tuple(shape)


def placement(leaf: Leaf, dims: ParallelDims) -> Domain:
    """``ShardSpec.placement``: ``TENSOR`` for a dense leaf cut by ``tp > 1``."""
    if leaf.domain == Domain.DENSE and leaf.split is not None and dims.tp > 1:
        return Domain.TENSOR
    return leaf.domain


GROUP_DTYPES = {GroupDtype.FLOAT32: torch.float32, GroupDtype.FP8: torch.float8_e4m3fn}  # COMPUTE: the plan's


def group_key(leaf: Leaf, domain: Domain, compute_dtype: torch.dtype, gathers_fp8: bool) -> GroupKey:
    """A leaf placed in ``domain`` goes to that domain's group of its dtype: leaves kept in
    fp32 whatever the compute dtype form their own, and so do the dense products' weights
    gathered in FP8 (``ShardSpec.gathers_fp8``)."""
    if compute_dtype != torch.float32 and leaf.fp32:
        dtype = GroupDtype.FLOAT32
    else:
        dtype = GroupDtype.FP8 if leaf.linear and gathers_fp8 else GroupDtype.COMPUTE
    return GroupKey(domain, dtype)


@functools.lru_cache(maxsize=64)
def shard_spec(model: ModelConfig, dims: ParallelDims, sharding: Sharding, stages: tuple, unit_groups: tuple,
               compute_dtype: torch.dtype, fp8_tensorwise: bool) -> ShardSpec:
    """The layout of a plan's parameters (pure, cached; ``fmoe.resolve`` reads the arguments
    from the plan).

    Arguments:
        model: the ModelConfig; ``dims``: the parallel degrees; ``sharding``: the strategy.
        stages: the members of each pipeline stage in forward order (``Plan.stages``).
        unit_groups: the members of each FSDP unit (``Plan.unit_groups``).
        compute_dtype: the dtype the products run in.
        fp8_tensorwise: ``Plan.fp8='tensorwise'``: the dense products' weights are gathered
            in FP8 where they are sharded.
    """
    table = param_table(model)
    if sharding is Sharding.NO_SHARD:
        sizes = {Domain.DENSE: 1, Domain.TENSOR: 1, Domain.EXPERT: 1}
    else:  # world, the ranks of one tensor-parallel slice, edp
        sizes = {Domain.DENSE: dims.stage_size, Domain.TENSOR: dims.stage_size // dims.tp, Domain.EXPERT: dims.edp}
    fp8 = fp8_tensorwise and sizes[Domain.DENSE] > 1
    ep = dims.ep
    units, stage_of = [], {m: s % dims.pp for s, members in enumerate(stages) for m in members}
    for members in unit_groups:
        by_key: dict = {}
        for leaf in table.leaves:
            if leaf.member in members:
                shape = _local_full_shape(leaf, leaf.shape, ep, dims.etp if leaf.domain == Domain.EXPERT else dims.tp)
                key = group_key(leaf, placement(leaf, dims), compute_dtype, fp8)
                by_key.setdefault(key, []).append((leaf.path, shape))
        groups = {key: make_layout(named, sizes[key.domain]) for key, named in sorted(by_key.items())}
        units.append(UnitSpec(unit_name(members), members, groups, stage_of[members[0]]))
    return ShardSpec(tuple(units), sizes, model.experts // ep, ep, sharding, compute_dtype, fp8, table, dims)


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
