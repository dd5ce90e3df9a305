"""Packing conversations into rows of a fixed length: where a long one may be cut
(``split_points``) and the best-fit packer over a bounded set of open rows (``Packer``)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Callable

import numpy as np

# at most this many rows wait for more conversations: enough for best-fit to leave
# little padding, bounded memory
OPEN_ROWS = 64


def split_points(length: int, cuts: list[int], row_tokens: int,
                 preferred: list[int] = ()) -> tuple[list[tuple[int, int]], bool]:
    """Pieces ``[(start, end), ...]`` of a conversation of ``length`` tokens, each at most
    ``row_tokens`` long and cut only at ``cuts`` (token indices where messages start),
    each as long as it may be, cut at one of ``preferred`` (where a user or system
    message starts: a piece then opens with a prompt, not with a reply to nothing) when
    one fits. A message longer than a row keeps its first ``row_tokens`` tokens; its rest
    is dropped.

    Returns:
        ``(pieces, truncated)``: truncated when tokens were dropped.
    """
    bounds = sorted({c for c in cuts if 0 < c < length} | {length})
    better = sorted({c for c in preferred if 0 < c < length} | {length})
    pieces, at, truncated = [], 0, False
    while at < length:
        for candidates in (better, bounds):
            k = bisect_right(candidates, at + row_tokens) - 1
            if k >= 0 and candidates[k] > at:
                pieces.append((at, candidates[k]))
                at = candidates[k]
                break
        else:  # the message starting at ``at`` does not fit a row
            pieces.append((at, at + row_tokens))
            truncated = True
            at = bounds[bisect_right(bounds, at)]
    return pieces, truncated


class Packer:
    """Best-fit packing of documents into rows of ``row_tokens``: each goes to the open
    row with the least room that holds it; when none does, a new row is opened, after
    closing the fullest when ``open_rows`` are open. Closed rows go to ``emit(ids,
    flags, segments)``.

    A document's first token is never a target; padding is ``pad_id``, not a target,
    and one more document of its row.
    """

    def __init__(self, row_tokens: int, pad_id: int, dtype: np.dtype, emit: Callable, open_rows: int = OPEN_ROWS):
        self.row_tokens, self.pad_id, self.dtype, self.emit, self.open_rows = row_tokens, pad_id, dtype, emit, open_rows
        self.rows: dict[int, list] = {}  # serial -> [ids, flags, segments, used, documents]
        self.room: list[tuple[int, int]] = []  # (free tokens, serial) of the open rows, sorted
        self.serial = 0
        self.closed = self.trained = self.content = self.max_id = 0

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        n = len(ids)
        k = bisect_left(self.room, (n, -1))
        if k < len(self.room):
            free, serial = self.room.pop(k)
        else:
            if len(self.room) >= self.open_rows:
                self._close(self.room.pop(0)[1])
            free, serial = self.row_tokens, self.serial
            self.serial += 1
            self.rows[serial] = [np.empty(self.row_tokens, self.dtype), np.empty(self.row_tokens, np.uint8),
                                 np.empty(self.row_tokens, np.uint32), 0, 0]
        row = self.rows[serial]
        ids_R, flags_R, segments_R, used, documents = row
        ids_R[used:used + n] = ids
        flags_R[used:used + n] = flags
        flags_R[used] = 0  # nothing in its document precedes a document's first token
        segments_R[used:used + n] = documents
        row[3], row[4] = used + n, documents + 1
        if free > n:
            insort(self.room, (free - n, serial))
        else:
            self._close(serial)

    def _close(self, serial: int) -> None:
        ids_R, flags_R, segments_R, used, documents = self.rows.pop(serial)
        ids_R[used:] = self.pad_id
        flags_R[used:] = 0
        segments_R[used:] = documents
        self.closed += 1
        self.content += used
        self.trained += int(flags_R.sum())
        self.max_id = max(self.max_id, int(ids_R.max()))
        self.emit(ids_R, flags_R, segments_R)

    def finish(self) -> None:
        """Close every open row, in the order they were opened."""
        for serial in sorted(self.rows):
            self._close(serial)
        self.room.clear()
