"""Flat buffers: where each parameter of a unit lives, whole and sharded.

A unit's parameters (of one dtype group) are laid out back to back in one flat
buffer of ``G * S`` elements; rank ``k`` of the ``G``-rank shard group owns elements
``[k*S, (k+1)*S)``. Padding is inserted *between* parameters only, so every
parameter stays one contiguous, aligned view of the gathered buffer (no copy-out),
and it is placed so that every shard boundary falling inside it falls between two
rows (a row is the last axis): each rank owns whole rows of every parameter.
Ranks may own different amounts of real data (uneven shards); the buffer sizes
are equal, as ``all_gather_into_tensor`` needs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

# Element alignment of every parameter start and of the shard size: 16-byte aligned
# for fp32 and bf16 (what torch._grouped_mm and vectorised kernels want), and more.
ALIGN = 32


def rows_cols(shape: tuple) -> tuple[int, int]:
    """A parameter seen as rows of its last axis; a vector is one row."""
    cols = shape[-1] if shape else 1
    return (math.prod(shape[:-1]) if len(shape) > 1 else 1), cols


@dataclass(frozen=True)
class Slot:
    """One parameter in a flat buffer.

    Attributes:
        path: dotted path in the params pytree.
        shape: full shape.
        start: offset of its first element in the full flat buffer.
        rows, cols: the parameter as ``[rows, cols]``.
    """

    path: str
    shape: tuple
    start: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def end(self) -> int:
        return self.start + self.numel

    def local_rows(self, rank: int, shard_size: int) -> tuple[int, int]:
        """Rows ``[first, last)`` of this parameter owned by ``rank``."""
        lo, hi = rank * shard_size, (rank + 1) * shard_size
        first = min(max(lo - self.start, 0), self.numel)
        last = min(max(hi - self.start, 0), self.numel)
        return -(-first // self.cols), -(-last // self.cols)


@dataclass(frozen=True)
class FlatLayout:
    """Parameters of one unit and dtype group in a flat buffer split over ``group_size`` ranks."""

    slots: tuple[Slot, ...]
    group_size: int
    shard_size: int

    @property
    def full_size(self) -> int:
        return self.group_size * self.shard_size

    @functools.cached_property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` ranges of the full buffer that no parameter covers (padding)."""
        out, pos = [], 0
        for s in sorted(self.slots, key=lambda s: s.start):
            if s.start > pos:
                out.append((pos, s.start))
            pos = max(pos, s.end)
        if self.full_size > pos:
            out.append((pos, self.full_size))
        return tuple(out)

    def local_gaps(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The padding ``[start, end)`` ranges inside ``rank``'s shard, shard-relative."""
        return self._gaps_by_rank[rank]

    @functools.cached_property
    def _gaps_by_rank(self) -> tuple:
        by_rank = []
        for rank in range(self.group_size):
            lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
            by_rank.append(tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in self.gaps if a < hi and b > lo))
        return tuple(by_rank)

    def local_slots(self, rank: int) -> tuple:
        """``(slot, first_row, last_row, offset_in_shard)`` for each parameter on ``rank``."""
        return self._slots_by_rank[rank]

    @functools.cached_property
    def _slots_by_rank(self) -> tuple:
        # computed once: every step asks for them leaf by leaf
        by_rank = []
        for rank in range(self.group_size):
            out = []
            for s in self.slots:
                first, last = s.local_rows(rank, self.shard_size)
                offset = s.start + first * s.cols - rank * self.shard_size if last > first else 0
                out.append((s, first, last, offset))
            by_rank.append(tuple(out))
        return tuple(by_rank)


def _place(sizes, group_size: int, shard_size: int):
    """Greedy placement; returns starts, or the shard size to retry with."""
    starts, pos = [], 0
    for rows, cols in sizes:
        numel = rows * cols
        start = -(-pos // ALIGN) * ALIGN
        # Slide the start (aligned steps) until the first boundary inside falls between rows.
        step_limit = cols // math.gcd(cols, ALIGN) + 1
        for _ in range(step_limit):
            boundary = (start // shard_size + 1) * shard_size
            if boundary >= start + numel or (boundary - start) % cols == 0:
                break
            start += ALIGN
        else:
            return None, shard_size + ALIGN
        crossings = (start + numel - 1) // shard_size - start // shard_size
        if crossings > 1 and shard_size % cols:
            # Every boundary inside must be a row boundary: the period must divide by cols.
            period = math.lcm(cols, ALIGN)
            return None, -(-shard_size // period) * period
        starts.append(start)
        pos = start + numel
    if pos > group_size * shard_size:
        return None, shard_size + max(ALIGN, -(-(pos - group_size * shard_size) // group_size // ALIGN) * ALIGN)
    return starts, shard_size


def make_layout(named_shapes: list[tuple[str, tuple]], group_size: int) -> FlatLayout:
    """Lay out ``(path, shape)`` parameters for a shard group of ``group_size`` ranks.

    Arguments:
        named_shapes: the unit's parameters in a fixed order.
        group_size: ranks sharing the buffer (1: one rank holds everything).

    Returns:
        A FlatLayout whose shard size is the smallest found that keeps rows whole.
    """
    sizes = [rows_cols(shape) for _, shape in named_shapes]
    total = sum(r * c for r, c in sizes) + ALIGN * len(sizes)
    shard_size = max(ALIGN, -(-total // group_size // ALIGN) * ALIGN)
    while True:
        starts, shard_size = _place(sizes, group_size, shard_size)
        if starts is not None:
            break
    slots = tuple(Slot(path, tuple(shape), start, r, c)
                  for (path, shape), start, (r, c) in zip(named_shapes, starts, sizes))
    return FlatLayout(slots, group_size, shard_size)
