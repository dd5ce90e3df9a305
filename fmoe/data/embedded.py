"""The embedded corpus: Python's own documentation, as bytes.

``pydoc_data.topics`` ships with CPython (the text behind ``help('topic')``: about
0.45 MB of English prose and code from the language reference), so training needs
no download. Tokens are bytes (vocab 256).
"""

from __future__ import annotations


import torch


def corpus_bytes() -> bytes:
    """The corpus: every pydoc topic, sorted by name, UTF-8 encoded."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def train_heldout_split(data: bytes, heldout_fraction: float = 0.05):
    """Split into ``(train, heldout)`` LongTensors of byte ids; held-out is the tail."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(ids) * (1 - heldout_fraction))
    return ids[:cut], ids[cut:]


def random_windows(ids: torch.Tensor, batch: int, seq: int, generator: torch.Generator) -> dict:
    """``{"tokens": [batch, seq + 1]}`` windows at random offsets of ``ids``."""
    starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=generator)
    return {"tokens": torch.stack([ids[s:s + seq + 1] for s in starts.tolist()])}


def tiled_windows(ids: torch.Tensor, batch: int, seq: int, max_batches: int) -> list[dict]:
    """Non-overlapping windows covering ``ids`` in order, grouped into batches."""
    n = min((len(ids) - 1) // seq, batch * max_batches)
    n -= n % batch
    if n == 0:
        raise ValueError(f"held-out split of {len(ids)} bytes is shorter than one batch of {batch} x {seq}")
    windows = torch.stack([ids[i * seq:i * seq + seq + 1] for i in range(n)])
    return [{"tokens": w} for w in windows.split(batch)]
