"""Where each rank's pieces sit inside the global tensors: boxes.

A checkpoint stores every tensor in its global shape (experts as ``[E, ...]``). A
rank holds a contiguous run of rows of each parameter (``fmoe.shard``), possibly of
its own experts only; such a run is at most three boxes of the global tensor (the
tail of one expert, whole experts, the head of another). Saving writes this rank's
boxes; loading asks for the boxes of the *target* plan and lets DCP read whatever
overlaps them, which is how a checkpoint moves between plans.
"""

from __future__ import annotations

import torch

from ..params import Domain
from ..shard.layout import rows_cols
from ..shard.spec import ShardSpec


def row_boxes(shape: tuple, first: int, last: int) -> list[tuple[tuple, tuple, int, int]]:
    """Rows ``[first, last)`` of ``shape`` seen as ``[prod(shape[:-1]), shape[-1]]``, as
    boxes ``(offsets, sizes, row_start, row_end)`` of ``shape``."""
    if first >= last:
        return []
    if len(shape) == 1:
        return [((0,), tuple(shape), first, last)]
    if len(shape) == 2:
        return [((first, 0), (last - first, shape[1]), first, last)]
    if len(shape) != 3:
        raise ValueError(f"row boxes are defined for 1-3 dims, got shape {shape}")
    _, D, C = shape
    boxes, r = [], first
    while r < last:
        e, i = divmod(r, D)
        if i or last - r < D:  # part of one expert
            n = min(D - i, last - r)
            boxes.append(((e, i, 0), (1, n, C), r, r + n))
        else:  # whole experts
            k = (last - r) // D
            boxes.append(((e, 0, 0), (k, D, C), r, r + k * D))
        r = boxes[-1][3]
    return boxes


def local_boxes(path: str, global_shape: tuple, leaf: torch.Tensor, spec: ShardSpec, world_rank: int):
    """``[(global offsets, view of leaf)]`` for a leaf laid out like parameter ``path``
    (``spec``: the plan's ShardSpec)."""
    domain = spec.table[path].domain
    local_shape = spec.local_full_shape(path, global_shape)
    _, cols = rows_cols(local_shape)
    piece = spec.leaf_piece(path, global_shape, world_rank)
    first, last = piece.first, piece.last
    as_rows = leaf.reshape(last - first, cols)
    expert_offset = spec.ep_index(world_rank) * spec.experts_per_rank if domain == Domain.EXPERT else 0
    out = []
    for offsets, sizes, r0, r1 in row_boxes(local_shape, first, last):
        view = as_rows[r0 - first:r1 - first].view(sizes)
        out.append(((offsets[0] + expert_offset,) + tuple(offsets[1:]), view))
    return out
