"""A step's batch as one value: the token ids, the targets that count, the documents.

``fmoe.step`` takes ``{"tokens": LongTensor[B, S+1], "loss_mask": BoolTensor[B, S],
"segments": IntTensor[B, S+1]}`` (the last two optional). ``read_batch`` checks it once
and turns it into a ``Batch``: target ``j`` of a row (``tokens[j+1]``) counts where
``loss_mask[j]`` holds and, with ``segments``, where ``segments[j] == segments[j+1]``
(a document's last token predicts nothing of the next one); a target that does not
count becomes ``IGNORE``, which the cross-entropy skips. So every loss path (whole,
in pieces, FP8, compiled, graphed) sums exactly the counted targets, and a batch
without those keys has ``targets = tokens[:, 1:]`` as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

IGNORE = -100
"""The target id the cross-entropy skips (``torch.nn.functional.cross_entropy``'s
``ignore_index``, and transformers' ``labels = -100``)."""

BATCH_KEYS = ("tokens", "loss_mask", "segments")


class Batch(NamedTuple):
    """A checked batch on the plan's device.

    Attributes:
        tokens: ``[B, S+1]`` ids; the model reads ``tokens[:, :-1]``.
        targets: ``[B, S]`` next-token ids, ``IGNORE`` where a target does not count.
        segments: ``[B, S+1]`` document id per position (packed documents), or None.
        counted: the number of counted targets in these rows (an int).
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    segments: torch.Tensor | None
    counted: int

    @classmethod
    def of_tokens(cls, tokens_BS1: torch.Tensor) -> "Batch":
        """Rows whose every target counts, one document each (ids not checked)."""
        return cls(tokens_BS1, tokens_BS1[:, 1:], None, tokens_BS1.shape[0] * (tokens_BS1.shape[1] - 1))

    @property
    def inputs(self) -> torch.Tensor:
        """``[B, S]``: the ids the model reads."""
        return self.tokens[:, :-1]

    @property
    def documents(self) -> torch.Tensor | None:
        """``[B, S]``: the document id of each input position, or None (one document a row)."""
        return None if self.segments is None else self.segments[:, :-1]

    def microbatches(self, n: int) -> list["Batch"]:
        """The rows split into ``n`` equal blocks, in order (``counted`` left as the whole's)."""
        segments = [None] * n if self.segments is None else self.segments.chunk(n)
        return [Batch(t, y, s, self.counted) for t, y, s in zip(self.tokens.chunk(n), self.targets.chunk(n), segments)]


def _describe(x) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _integer_dtype(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def read_batch(batch, vocab: int, microbatches: int, device, tp: int = 1, cp: int = 1) -> Batch:
    """Check ``batch`` (a dict with ``tokens`` and optionally ``loss_mask`` and
    ``segments``) and return it as a Batch on ``device``.

    Arguments:
        batch: the dict ``fmoe.step`` was given (this rank's rows).
        vocab: ids must lie in ``0..vocab-1``.
        microbatches: the row count must be a positive multiple of it.
        device: where the Batch's tensors go.
        tp: ``Plan.tp``: the positions of a row split over that many ranks, so the
            row length must be a multiple of it.
        cp: ``Plan.cp``: each of the rank's rows of the global batch comes as two rows,
            its two chunks (``local_batch``), which a microbatch keeps together: the
            row count must be a multiple of ``2 * microbatches``; no ``segments``.

    Returns:
        A Batch. One host read (of the ids' range, and with masks or segments their
        checks and the counted targets).

    Raises:
        ValueError: naming the key, what it holds and what is allowed.
    """
    if not isinstance(batch, dict) or "tokens" not in batch:
        raise ValueError("batch must be a dict with 'tokens': LongTensor[B, S+1] (and optionally 'loss_mask': "
                         "BoolTensor[B, S], 'segments': IntTensor[B, S+1])")
    unknown = [k for k in batch if k not in BATCH_KEYS]
    if unknown:
        raise ValueError(f"batch has unknown key {unknown[0]!r}; allowed keys: {', '.join(map(repr, BATCH_KEYS))}")
    tokens = batch["tokens"]
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.dim() != 2:
        raise ValueError(f"batch['tokens'] must be a LongTensor[B, S+1], got {_describe(tokens)}")
    for key in BATCH_KEYS:
        if isinstance(batch.get(key), torch.Tensor) and batch[key].device.type == "meta":
            raise ValueError(f"batch[{key!r}] is on the meta device, which holds no values; allowed: a device "
                             f"that holds data (they are moved to the plan's device {str(device)!r})")
    rows, cols = tokens.shape
    if cols < 2:
        raise ValueError(f"batch['tokens'] has {cols} column(s); it needs S+1 >= 2 (inputs and shifted targets)")
    if rows == 0 or rows % microbatches:
        raise ValueError(f"batch['tokens'] has {rows} rows, which Plan.microbatches={microbatches} "
                         f"does not divide (allowed: a positive multiple of {microbatches})")
    if cp > 1 and rows % (2 * microbatches):
        raise ValueError(f"batch['tokens'] has {rows} rows; under Plan.cp={cp} a rank's rows come in pairs, the "
                         f"two chunks of each of its sequences (fmoe.local_batch), and a microbatch keeps a pair "
                         f"together (allowed: a multiple of 2 * Plan.microbatches = {2 * microbatches})")
    if cols > 1 and (cols - 1) % tp:
        raise ValueError(f"batch['tokens'] holds {cols - 1} positions per row, which Plan.tp={tp} does not divide: "
                         f"sequence parallelism splits each row's positions over the tp ranks (allowed: a multiple "
                         f"of {tp})")
    if cp > 1 and batch.get("segments") is not None:
        raise ValueError(f"batch['segments'] (packed documents) is not supported under Plan.cp={cp} (context "
                         "parallelism assumes one sequence per row); allowed: no 'segments', or Plan.cp=1")
    mask, segments = batch.get("loss_mask"), batch.get("segments")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or tuple(mask.shape) != (rows, cols - 1)):
        raise ValueError(f"batch['loss_mask'] must be a BoolTensor[B, S] = [{rows}, {cols - 1}] (True: the target "
                         f"counts), got {_describe(mask)}")
    if segments is not None and (not isinstance(segments, torch.Tensor) or not _integer_dtype(segments)
                                 or tuple(segments.shape) != (rows, cols)):
        raise ValueError(f"batch['segments'] must be an integer tensor [B, S+1] = [{rows}, {cols}] (a document id "
                         f"per position), got {_describe(segments)}")

    tokens = tokens.to(device)
    targets = tokens[:, 1:]
    checks = [*torch.aminmax(tokens)]
    counted = None
    if mask is not None or segments is not None:
        keep = torch.ones(rows, cols - 1, dtype=torch.bool, device=device)
        if mask is not None:
            keep = keep & mask.to(device)
        if segments is not None:
            segments = segments.to(device=device, dtype=torch.int64)
            keep = keep & (segments[:, :-1] == segments[:, 1:])
            checks += [segments.min(), (segments[:, 1:] < segments[:, :-1]).sum()]
        checks.append(keep.sum())
        targets = targets.masked_fill(~keep, IGNORE)
    values = torch.stack([c.to(torch.int64) for c in checks]).tolist()  # the one host read
    lo, hi = values[:2]
    if lo < 0 or hi >= vocab:
        raise ValueError(f"batch['tokens'] holds ids in [{lo}, {hi}]; allowed: 0..{vocab - 1}")
    if segments is not None:
        if values[2] < 0:
            raise ValueError(f"batch['segments'] holds a negative document id ({values[2]}); allowed: ids >= 0")
        if values[3]:
            raise ValueError("batch['segments'] decreases along a row; allowed: document ids non-decreasing "
                             "along each row (one run of equal ids per document)")
    counted = values[-1] if len(values) > 2 else rows * (cols - 1)
    return Batch(tokens, targets, segments, counted)


def local_batch(global_batch: dict, plan, rank: int) -> dict:
    """What rank ``rank`` of ``plan`` passes to ``fmoe.step``: its part of the global batch.

    The ``dp x ep`` row blocks read rows of their own (expert parallelism splits the
    experts, not the data): the rows split into ``dp * ep`` equal blocks and a rank
    takes the block of its ``(d, e)`` coordinates (``fmoe.parallel_dims``); the ``tp``
    ranks of a block take the same rows. Under ``Plan.cp > 1`` each sequence of ``S``
    positions is cut into ``2 * cp`` chunks of ``L = S / (2 cp)`` and the rank of
    context index ``c`` takes chunks ``c`` and ``2 cp - 1 - c`` (the first and the last
    are as costly under causal attention as two in the middle), each with the token
    after it: its rows of ``L + 1`` tokens, two per sequence, in order (``loss_mask``'s
    ``L`` and ``segments``' ``L + 1`` cut alike). Together the ranks' losses and
    gradients equal one process's step on the whole batch.

    Arguments:
        global_batch: the dict ``fmoe.step`` would take on one process (``tokens`` and
            optionally ``loss_mask``, ``segments``).
        plan: the Plan the ranks run (its ``world`` and ``dims``).
        rank: this process's rank, ``0 <= rank < plan.world``.

    Returns:
        A dict with the same keys: views of the rank's rows, or under ``cp`` new tensors
        of its chunks.

    Raises:
        ValueError: naming ``rank``, the key, the row count or ``Plan.cp`` and the
            sequence length, before anything is cut.
    """
    world, dims = plan.world, plan.dims
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"local_batch: rank={rank!r}; allowed: an int in 0..{world - 1} (Plan.world={world})")
    if not isinstance(global_batch, dict) or not isinstance(global_batch.get("tokens"), torch.Tensor):
        raise ValueError("local_batch: the global batch must be a dict with 'tokens': LongTensor[B, S+1]")
    unknown = [k for k in global_batch if k not in BATCH_KEYS]
    if unknown:
        raise ValueError(f"local_batch: unknown key {unknown[0]!r}; allowed keys: {', '.join(map(repr, BATCH_KEYS))}")
    rows, blocks = global_batch["tokens"].shape[0], dims.dp * dims.ep
    if rows % blocks:
        raise ValueError(f"local_batch: batch['tokens'] has {rows} rows, which the Plan's dp * ep = {blocks} row "
                         f"blocks (each with rows of its own) do not divide (allowed: a multiple of {blocks})")
    for key, value in global_batch.items():
        if value is not None and (not isinstance(value, torch.Tensor) or value.shape[:1] != (rows,)):
            raise ValueError(f"local_batch: batch[{key!r}] must have the {rows} rows of batch['tokens'], "
                             f"got {_describe(value)}")
    seq = global_batch["tokens"].shape[1] - 1
    if dims.cp > 1 and seq % (2 * dims.cp):
        raise ValueError(f"local_batch: Plan.cp={dims.cp} cuts each sequence into 2 * cp = {2 * dims.cp} chunks, "
                         f"which do not divide its {seq} positions (allowed: a length that is a multiple of "
                         f"{2 * dims.cp})")
    per, block = rows // blocks, dims.row_block(rank)
    mine = {key: None if value is None else value[block * per:(block + 1) * per] for key, value in global_batch.items()}
    return context_chunks(mine, plan, rank)


def context_chunks(rows: dict, plan, rank: int) -> dict:
    """Rank ``rank``'s two chunks of each of ``rows``' sequences under ``Plan.cp > 1``, as
    consecutive rows (``local_batch``); ``rows`` itself under ``cp = 1``. The sequence
    length must be a multiple of ``2 * cp`` (``local_batch`` checks it)."""
    dims = plan.dims
    if dims.cp == 1:
        return rows
    length, c = (rows["tokens"].shape[1] - 1) // (2 * dims.cp), dims.coords(rank).c
    firsts = (c * length, (2 * dims.cp - 1 - c) * length)

    def chunks(value, extra: int):  # the two chunks of each row, as consecutive rows
        pieces = [value[:, first:first + length + extra] for first in firsts]
        return torch.stack(pieces, dim=1).flatten(0, 1)

    return {key: None if value is None else chunks(value, 0 if key == "loss_mask" else 1)
            for key, value in rows.items()}


def no_counted_target() -> ValueError:
    """The error of a global batch whose every target is masked out."""
    return ValueError("batch['loss_mask'] (with 'segments') leaves no counted target in the global batch; "
                      "allowed: at least one True in loss_mask at a position whose segment continues")


__all__ = ["BATCH_KEYS", "Batch", "IGNORE", "context_chunks", "local_batch", "no_counted_target", "read_batch"]
