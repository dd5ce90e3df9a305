"""From input files to token ids, shared by both corpus writers (``prepare``'s text,
``chat``'s conversations) and ``tokens.embedded_corpus``: the input files, a
``tokenizer.json`` opened, and the text encoder (``load_encoder``).

Imports only ``fmoe.data.format`` of the package.
"""

from __future__ import annotations

import os
from itertools import chain
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from .format import token_dtype

GLOBS = ("*.txt", "*.md", "*.rst", "*.py", "*.jsonl")  # the text files taken from directories by default
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>")
SEPARATOR = "\n\n"  # after each document when there is no end-of-document token
# a writer encodes IN_FLIGHT batches at once, in threads (the tokenizer releases the
# GIL), so that a batch's last long document, or a batch of one long document, leaves
# no thread idle
IN_FLIGHT = min(8, max(2, os.cpu_count() or 2))


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def find_inputs(paths, globs=GLOBS) -> list[Path]:
    """Every input file: files as given, directories walked recursively for ``globs``
    (each directory's files sorted, so the order is deterministic; hidden files and
    folders, such as ``.git`` or ``.venv``, skipped)."""
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise ValueError(f"input {p} does not exist")
        if p.is_dir():
            files += sorted({f for g in globs for f in p.rglob(g) if f.is_file() and not _hidden(f, p)})
        else:
            files.append(p)
    if not files:
        raise ValueError(f"no files matching {' '.join(globs)} under {', '.join(map(str, paths))}")
    return files


class Encoder(NamedTuple):
    """A batch of documents -> their ids, concatenated, each document's ending with its
    separator."""

    encode: Callable[[list[str]], np.ndarray]  # of ``dtype``
    vocab: int
    eos_id: int | None
    tokenizer: Path | None  # the tokenizer.json, or None for UTF-8 bytes

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab)


def _encode_bytes(docs: list[str]) -> np.ndarray:
    if not docs:
        return np.empty(0, np.uint16)
    return np.frombuffer((SEPARATOR.join(docs) + SEPARATOR).encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def open_tokenizer(tokenizer) -> tuple:
    """A ``tokenizer.json`` as ``(tokenizers.Tokenizer, vocab)``: ``vocab`` covers every
    id, added tokens included (ValueError naming the file, or the missing package)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the tokenizers package: pip install tokenizers "
                         "(or the extra fmoe[data])") from None
    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(f"{tokenizer}: not a readable tokenizer.json ({err})") from None
    # added tokens may sit past the model vocab's ids: the vocab must cover the largest
    vocab = max(tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab(True).values(), default=-1) + 1)
    return tok, vocab


def load_encoder(tokenizer=None, eos: str | None = None) -> Encoder:
    """The encoder of a ``tokenizer.json`` (``eos`` None: found; ``""``: none), or
    byte-level when ``tokenizer`` is None."""
    if tokenizer is None:
        if eos:
            raise ValueError(f"--eos {eos!r} names a token of a tokenizer; byte-level data has none")
        return Encoder(_encode_bytes, 256, None, None)
    tok, vocab = open_tokenizer(tokenizer)
    names = [eos] if eos is not None else [c for c in EOS_CANDIDATES if tok.token_to_id(c) is not None][:1]
    eos_id = tok.token_to_id(names[0]) if names and names[0] else None
    if eos and eos_id is None:
        raise ValueError(f"--eos {eos!r} is not a token of {tokenizer}")
    # the same ids as encode_batch; _fast (tokenizers >= 0.20) skips the character
    # offsets, about half of encode_batch's work
    encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    after = () if eos_id is None else (eos_id,)
    dtype = token_dtype(vocab)

    def encode(docs: list[str]) -> np.ndarray:
        encodings = encode_batch(docs if eos_id is not None else [d + SEPARATOR for d in docs])
        count = sum(map(len, encodings)) + len(after) * len(encodings)
        # one pass from the lists of ids into the corpus dtype (ids < vocab fit it)
        return np.fromiter(chain.from_iterable(ids for e in encodings for ids in (e.ids, after)), dtype, count)

    return Encoder(encode, vocab, eos_id, Path(tokenizer))
