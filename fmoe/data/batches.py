"""The batches the main job draws from a corpus (``fmoe.data.tokens``): random windows
of a plain corpus or random whole rows of a packed one for training, the held-out split
in order for evaluation, each rank taking its rows of the global batch.

Batches are drawn at offsets from a generator seeded by ``(seed, step)`` alone, so any
number of ranks sees the same global batch and a resumed run draws exactly what an
uninterrupted one draws at the same step.
"""

from __future__ import annotations

import numpy as np
import torch

from .tokens import TokenCorpus


def _windows(ids: np.ndarray, starts: list[int], seq: int) -> torch.Tensor:
    rows = np.stack([np.asarray(ids[s:s + seq + 1], dtype=np.int64) for s in starts]) if starts else \
        np.zeros((0, seq + 1), dtype=np.int64)
    return torch.from_numpy(rows)


def _rank_rows(batch: int, rank: int, world: int) -> tuple[int, int]:
    if world < 1 or not 0 <= rank < world or batch % world:
        raise ValueError(f"a batch of {batch} rows does not split over {world} rank(s) (rank {rank})")
    per = batch // world
    return rank * per, (rank + 1) * per


def _filled(have: int, first: int, last: int) -> tuple[list[int], torch.Tensor]:
    """Rows ``first..last`` of one batch over a split of ``have`` rows: which split row each
    reads (past the split, its last again) and whether it counts (``[rows, 1]`` bool)."""
    rows = range(first, last)
    return [min(r, have - 1) for r in rows], torch.tensor([r < have for r in rows])[:, None]


def sample_batch(ids, batch: int, seq: int, seed: int, step: int, rank: int = 0, world: int = 1) -> dict:
    """This rank's rows of step ``step``'s global batch of random windows.

    The offsets come from ``numpy.random.SeedSequence([seed, step])``: a specified hash,
    so they depend on ``(seed, step)`` only (no generator state to save on resume) and
    not on the numpy or torch version; distinct pairs never share a stream.

    Arguments:
        ids: 1-D token ids (array, memmap or tensor).
        batch, seq: the global batch's rows and each row's tokens (``seq + 1`` with the target).
        seed, step: non-negative ints; the offsets depend on these only.
        rank, world: this rank takes rows ``rank * batch / world ... (rank + 1) * batch / world``.

    Returns:
        ``{"tokens": LongTensor[batch // world, seq + 1]}``, each row ``ids[s:s + seq + 1]``.
    """
    if len(ids) < seq + 1:
        raise ValueError(f"the corpus has {len(ids)} tokens; a window needs seq + 1 = {seq + 1}")
    if min(seed, step) < 0:
        raise ValueError(f"seed={seed} and step={step} must be >= 0")
    first, last = _rank_rows(batch, rank, world)
    # every rank hashes the whole global batch (cheap) and keeps its rows; the modulo's
    # bias is below n / 2**64
    state_B = np.random.SeedSequence([seed, step]).generate_state(batch, np.uint64)
    starts_B = state_B % np.uint64(len(ids) - seq)
    return {"tokens": _windows(ids, starts_B[first:last].tolist(), seq)}


def _rows(ids, mask, segments, row: int, which: list[int]) -> dict:
    """Whole packed rows as a fine-tuning batch (``fmoe.batch``)."""
    def take(a):
        return torch.from_numpy(np.stack([np.asarray(a[r * row:(r + 1) * row], dtype=np.int64) for r in which]))

    return {"tokens": take(ids), "loss_mask": take(mask)[:, 1:].bool(), "segments": take(segments)}


def check_packed_seq(corpus: TokenCorpus, seq: int) -> None:
    """ValueError unless a packed corpus's rows are ``seq + 1`` positions long."""
    if corpus.packed is not None and corpus.packed.row != seq + 1:
        longer = "longer" if corpus.packed.row > seq + 1 else "shorter"
        raise ValueError(f"--data {corpus.source}: its rows hold {corpus.packed.row} positions (packed for "
                         f"--seq {corpus.packed.row - 1}), {longer} than --seq={seq} + 1; allowed: --seq "
                         f"{corpus.packed.row - 1} (or leave --seq out), or prepare the data again with --seq {seq}")


def train_batch(corpus: TokenCorpus, batch: int, seq: int, seed: int, step: int, rank: int = 0,
                world: int = 1) -> dict:
    """This rank's rows of step ``step``'s global batch: random windows of a plain
    corpus (``sample_batch``), random whole rows of a packed one (with ``loss_mask`` and
    ``segments``), chosen by ``(seed, step)`` alone either way."""
    if corpus.packed is None:
        return sample_batch(corpus.train, batch, seq, seed, step, rank, world)
    p = corpus.packed
    first, last = _rank_rows(batch, rank, world)
    state_B = np.random.SeedSequence([seed, step]).generate_state(batch, np.uint64)
    which = (state_B % np.uint64(len(corpus.train) // p.row))[first:last].tolist()
    return _rows(corpus.train, p.train_mask, p.train_segments, p.row, which)


def heldout_rows(corpus: TokenCorpus, seq: int) -> int:
    """How many held-out rows ``heldout_set`` can cut: windows of ``seq`` positions (and
    the target after) of a plain corpus, the packed rows of a packed one."""
    if corpus.packed is None:
        return (len(corpus.heldout) - 1) // seq
    return len(corpus.heldout) // corpus.packed.row


def heldout_set(corpus: TokenCorpus, batch: int, seq: int, max_batches: int, rank: int = 0,
                world: int = 1) -> list[dict]:
    """The held-out batches: ``heldout_batches`` of a plain corpus; of a packed one its
    rows in order (a batch's rows that train on nothing left out: every evaluation
    batch has targets to count; fewer rows than one batch: one batch, filled with rows
    that count nothing)."""
    if corpus.packed is None:
        return heldout_batches(corpus.heldout, batch, seq, max_batches, rank, world)
    p = corpus.packed
    rows = len(corpus.heldout) // p.row
    if rows == 0 or not np.asarray(p.heldout_mask[:rows * p.row]).any():
        raise ValueError(f"--data {corpus.source}: its held-out split holds no row that trains on a token "
                         "(raise --heldout-fraction)")
    first, last = _rank_rows(batch, rank, world)
    if rows < batch:  # one batch: the rows there are, then rows that count nothing (as heldout_batches)
        which, counts = _filled(rows, first, last)
        padded = _rows(corpus.heldout, p.heldout_mask, p.heldout_segments, p.row, which)
        padded["loss_mask"] &= counts
        return [padded]
    out = []
    for b in range(min(rows // batch, max_batches)):
        if not np.asarray(p.heldout_mask[b * batch * p.row:(b + 1) * batch * p.row]).any():
            continue
        out.append(_rows(corpus.heldout, p.heldout_mask, p.heldout_segments, p.row,
                         [b * batch + r for r in range(first, last)]))
    if not out:
        raise ValueError(f"--data {corpus.source}: its held-out rows train on no token (loss_mask.bin is 0 there)")
    return out


def heldout_batches(ids, batch: int, seq: int, max_batches: int, rank: int = 0, world: int = 1) -> list[dict]:
    """Non-overlapping windows covering ``ids`` in order (as ``tiled_windows``), at most
    ``max_batches`` global batches. Fewer windows than one batch (the embedded corpus's 12
    rows of 2048 against a batch of 8 a GPU over several): one batch, the windows there are
    followed by rows whose targets count nothing (``loss_mask`` False), so the batch keeps
    its shape and every window counts.

    Returns:
        ``[{"tokens": LongTensor[batch // world, seq + 1]}, ...]``: this rank's rows of each
        (with ``"loss_mask": BoolTensor[batch // world, seq]`` in the padded batch).

    Raises:
        ValueError: ``ids`` hold no window of ``seq + 1`` tokens.
    """
    windows = (len(ids) - 1) // seq
    if windows <= 0:
        raise ValueError(f"the held-out split of {len(ids)} tokens is shorter than one row of {seq} positions "
                         f"(and its target): lower --seq or raise --heldout-fraction")
    first, last = _rank_rows(batch, rank, world)
    if windows < batch:
        which, counts = _filled(windows, first, last)
        return [{"tokens": _windows(ids, [w * seq for w in which], seq),
                 "loss_mask": counts.expand(-1, seq).contiguous()}]
    n = min(windows, batch * max_batches)
    n -= n % batch
    return [{"tokens": _windows(ids, [(b * batch + r) * seq for r in range(first, last)], seq)}
            for b in range(n // batch)]
