"""A step's copy of the params as flat shards (``build_shards``), and the views of a
gathered unit (``gathered_views``): full-shape tensors, or ``Fp8Weight``s for a group
gathered in FP8 (``fp8='tensorwise'``), cast with scales agreed over the ranks."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm.mesh import Mesh
from ..layers.fp8 import E4M3, Fp8Weight, cast_weight, tensor_scale
from .spec import Domain, GroupDtype, ShardSpec, UnitSpec, full_views, local_leaves, write_shard


class Shards(NamedTuple):
    """What a step gathers from (``build_shards``).

    Attributes:
        flat: ``{unit: {(domain, dtype): flat shard in that dtype}}``.
        scales: ``{path: fp32 scale (0-d)}`` of each weight in an ``fp8`` group, the
            same on every rank.
    """

    flat: dict
    scales: dict


def build_shards(params_named: dict, spec: ShardSpec, units, mesh: Mesh, device) -> Shards:
    """This rank's leaves copied into new flat shards, cast to each group's dtype on the
    way. This is the step's one pass over the params before it gathers: in a bf16 step
    it is the cast to bf16 any step pays; in an fp32 one a copy, held for the step beside
    the params. The params are plain tensors and the step never writes into them.
    An ``fp8`` group is written in bf16 first, then cast (``_cast_to_fp8``). ``units``:
    the UnitSpecs this rank holds (its pipeline stage's)."""
    rank = mesh.world.rank
    flat, staged = {}, []
    for u in units:
        flat[u.name] = {}
        for key, layout in u.groups.items():
            r = spec.shard_rank(rank, key.domain)
            dtype = spec.compute_dtype if key.dtype == GroupDtype.FP8 else spec.dtype(key)
            out = torch.empty(layout.shard_size, dtype=dtype, device=device)
            flat[u.name][key] = write_shard(params_named, layout, r, out)
            if key.dtype == GroupDtype.FP8:
                staged.append((u.name, key, layout, r))
    return Shards(flat, _cast_to_fp8(flat, staged, spec, mesh) if staged else {})


def _cast_to_fp8(flat: dict, staged: list, spec: ShardSpec, mesh: Mesh) -> dict:
    """Replace each staged bf16 shard ``flat[unit][key]`` by its cast to E4M3, and return
    the weights' scales. A weight's scale comes from its amax over every rank's rows (one
    all-reduce for the whole model, before any gather) and its rows are cast with it, so
    a gather yields what ``quantize_tensor`` makes of the gathered bf16 weight."""
    rows = {}  # path: this rank's rows of the weight, in bf16
    for name, key, layout, r in staged:
        rows.update(local_leaves(flat[name][key], layout, r, sharded=True))
    amax = torch.stack([w.abs().amax().float() if w.numel() else w.new_zeros((), dtype=torch.float32)
                        for w in rows.values()])
    # (a NaN in a weight makes its scale NaN in quantize_tensor; a MAX over ranks may
    # drop it, leaving only the NaN rows NaN: the loss is NaN either way)
    mesh.shard_group(Domain.DENSE, spec.sizes[Domain.DENSE]).all_reduce(amax, dist.ReduceOp.MAX).wait()
    # each its own allocation: cuBLASLt wants a scale's address 16-byte aligned
    scales = {path: scale.clone() for path, scale in zip(rows, tensor_scale(amax).unbind())}
    for name, key, layout, r in staged:
        q = torch.empty(layout.shard_size, dtype=E4M3, device=amax.device)
        for path, out in local_leaves(q, layout, r, sharded=True).items():
            if out.numel():
                out.copy_(cast_weight(rows[path], scales[path]))
        for lo, hi in layout.local_gaps(r):
            q[lo:hi].zero_()
        flat[name][key] = q
    return scales


def gathered_views(buffers: dict, unit: UnitSpec, scales: dict, compute_dtype: torch.dtype) -> dict:
    """``{path: full-shape view}`` of a unit's gathered ``buffers`` (``{GroupKey: flat}``);
    an ``FP8`` group's weights as ``Fp8Weight``s."""
    views = {}
    for key, layout in unit.groups.items():
        views.update(full_views(buffers[key], layout))
        if key.dtype == GroupDtype.FP8:
            views.update(_fp8_weights(views, layout, scales, compute_dtype))
    return views


def _fp8_weights(views: dict, layout, scales: dict, dtype: torch.dtype) -> dict:
    """``{path: Fp8Weight}`` for the gathered FP8 views of ``layout``'s weights, each with
    its scale and a storage-less leaf of the weight's shape for its gradient."""
    zero = _zero(dtype, scales[layout.slots[0].path].device)
    return {s.path: Fp8Weight(views[s.path], scales[s.path], zero.expand(s.shape)) for s in layout.slots}


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # one per process: a grad_leaf keeps its address from step to step, so a graphed
    # scope (interop.cuda_graph) finds it where it was captured and copies nothing
    return torch.zeros((), dtype=dtype, device=device)
