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

from ..config import Plan
from ..shard.layout import rows_cols
from ..params import param_table
from ..shard.spec import ep_index, local_full_shape, shard_rank, shard_spec


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


def local_boxes(path: str, global_shape: tuple, leaf: torch.Tensor, plan: Plan, world_rank: int):
    """``[(global offsets, view of leaf)]`` for a leaf laid out like parameter ``path``."""
    spec = shard_spec(plan)
    domain = param_table(plan.model)[path].domain
    local_shape = local_full_shape(path, global_shape, plan)
    rows, cols = rows_cols(local_shape)
    if spec.sharded(domain):
        layout = spec.layout_of(path, plan)
        index = next(i for i, s in enumerate(layout.slots) if s.path == path)
        _, first, last, _ = layout.local_slots(shard_rank(plan, world_rank, domain))[index]
    else:
        first, last = 0, rows
    as_rows = leaf.reshape(last - first, cols)
    expert_offset = ep_index(plan, world_rank) * spec.experts_per_rank if domain == "expert" else 0
    out = []
    for offsets, sizes, r0, r1 in row_boxes(local_shape, first, last):
        view = as_rows[r0 - first:r1 - first].view(sizes)
        out.append(((offsets[0] + expert_offset,) + tuple(offsets[1:]), view))
    return out
