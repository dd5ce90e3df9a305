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
from .layout import rows_cols
from .spec import ShardSpec


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
    (``spec``: the plan's ShardSpec). A tensor-parallel piece maps to one box per part
    of its cut (``fmoe.tensor_split``); ranks holding the same copy of a part give the
    same box, which DCP writes once."""
    table_leaf = spec.table[path]
    local_shape = spec.local_full_shape(path, global_shape)
    _, cols = rows_cols(local_shape)
    piece = spec.leaf_piece(path, global_shape, world_rank)
    first, last = piece.first, piece.last
    as_rows = leaf.reshape(last - first, cols)
    expert_offset = spec.ep_index(world_rank) * spec.experts_per_rank if table_leaf.domain == Domain.EXPERT else 0
    pieces = ()
    if spec.cuts(path):
        pieces = table_leaf.split.pieces(spec.degree(table_leaf), spec.split_index(table_leaf, world_rank))
    out = []
    for offsets, sizes, r0, r1 in row_boxes(local_shape, first, last):
        view = as_rows[r0 - first:r1 - first].view(sizes)
        offsets = (offsets[0] + expert_offset,) + tuple(offsets[1:])
        out += _split_box(offsets, view, table_leaf.split.axis, pieces) if pieces else [(offsets, view)]
    return out


def _split_box(offsets: tuple, view: torch.Tensor, axis: int, pieces) -> list:
    """A box of the local (cut) leaf as boxes of the global one: its run along the cut
    ``axis`` falls into one or more pieces, each at its own place in the full axis."""
    lo, hi = offsets[axis], offsets[axis] + view.shape[axis]
    out = []
    for p in pieces:
        a, b = max(lo, p.local), min(hi, p.local + p.length)
        if a < b:
            at = list(offsets)
            at[axis] = p.start + a - p.local
            out.append((tuple(at), view.narrow(axis, a - lo, b - a)))
    return out
