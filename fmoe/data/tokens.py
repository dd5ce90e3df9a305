"""A tokenized corpus on disk: its format, opening it, and its unigram baseline.

A corpus directory (written by ``python -m fmoe.data prepare``) holds

- ``tokens.bin``: every token id as one flat little-endian array, ``uint16`` when the
  vocabulary fits, else ``uint32`` (as nanoGPT and Megatron store theirs), read
  through ``numpy.memmap`` and never loaded whole;
- ``meta.json``: ``{"format": "fmoe-tokens", "version": 1, "dtype", "vocab", "tokens",
  "max_id", "documents", "tokenizer", "tokenized_with", "eos_id", "sources"}``
  (``tokenized_with``: the tokenizer that made the ids, by path and content digest, or
  ``"bytes"``; see ``fmoe.data.tokenizer_match``; older corpora lack it);
- ``tokenizer.json`` when a Hugging Face tokenizer made the ids (byte-level otherwise).

A packed corpus (``python -m fmoe.data prepare --chat``: conversations packed into rows
for fine-tuning) also holds ``loss_mask.bin`` (``uint8``, per position: 1 where that
token is a trained target) and ``segments.bin`` (``uint32``, per position: its document
within the row), and ``meta.json``'s ``"packed": {"row_tokens": S + 1, "rows", ...}``.
Its batches are whole rows with ``loss_mask`` and ``segments`` (``fmoe.batch``).

The batches the main job draws from a corpus are ``fmoe.data.batches``'.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .encoding import load_encoder
from .format import DTYPES, FORMAT, VERSION

EMBEDDED = "embedded:pydoc_data.topics"


class PackedRows(NamedTuple):
    """A packed corpus's per-position data beside its ids, split as the ids are.

    Attributes:
        row: positions per row (``S + 1``).
        train_mask, heldout_mask: 1-D ``uint8``: 1 where that position's token is a trained target.
        train_segments, heldout_segments: 1-D ``uint32``: the position's document within its row.
    """

    row: int
    train_mask: np.ndarray
    heldout_mask: np.ndarray
    train_segments: np.ndarray
    heldout_segments: np.ndarray


class TokenCorpus(NamedTuple):
    """Token ids split into a training part and a held-out tail.

    Attributes:
        train, heldout: 1-D integer arrays (memory-mapped for corpus directories).
        vocab: the tokenizer's vocabulary size (256 byte-level).
        tokenizer: the ``tokenizer.json`` that made the ids, or None (UTF-8 bytes).
        eos_id: the end-of-document id between documents, if any.
        source: the corpus directory, or ``embedded:pydoc_data.topics``.
        packed: a packed corpus's rows (split at a row), or None for a plain stream of ids.
    """

    train: np.ndarray
    heldout: np.ndarray
    vocab: int
    tokenizer: Path | None
    eos_id: int | None
    source: str
    packed: PackedRows | None = None


def check_corpus(corpus: TokenCorpus) -> str:
    """Read every id of ``corpus`` once, in chunks: each must be below its vocabulary.

    A corpus whose ``meta.json`` under-reports its ids would otherwise train until the
    batch that holds a bad id; this finds it before the first step. The same read gives
    the corpus's fingerprint (``corpus_fingerprint``), which a resumed run compares.

    Returns:
        ``corpus_fingerprint(corpus)``.

    Raises:
        ValueError: naming the corpus, the first id out of range and where it is.
    """
    return _scan(corpus, check=True)


def corpus_fingerprint(corpus: TokenCorpus) -> str:
    """What identifies a corpus by content, wherever it lives: its token count, vocabulary
    and a BLAKE2b digest of every id (train and held-out, in order). A resumed run
    compares this, not the path it was given by."""
    return _scan(corpus, check=False)


_CHUNK = 1 << 24  # ids read at a time: a memory-mapped corpus stays on disk


def _scan(corpus: TokenCorpus, check: bool) -> str:
    digest = hashlib.blake2b(digest_size=16)
    at = 0
    for part in (corpus.train, corpus.heldout):
        flat = np.ascontiguousarray(part).reshape(-1)
        for start in range(0, len(flat), _CHUNK):
            chunk = flat[start:start + _CHUNK]
            if check and len(chunk) and int(chunk.max()) >= corpus.vocab:
                first = int(np.argmax(chunk >= corpus.vocab))
                where = f"{corpus.source}/tokens.bin" if Path(corpus.source).is_dir() else corpus.source
                raise ValueError(f"{where}: id {int(chunk[first])} at position {at + start + first} is not below "
                                 f"the corpus's vocab ({corpus.vocab}); its meta.json does not describe its tokens "
                                 "(prepare it again with `python -m fmoe.data prepare`)")
            digest.update(chunk.astype("<i8", copy=False).tobytes())
        at += len(flat)
    if corpus.packed is not None:  # which targets count, and where documents end, are data too
        p = corpus.packed
        for part in (p.train_mask, p.heldout_mask, p.train_segments, p.heldout_segments):
            for start in range(0, len(part), _CHUNK):
                digest.update(np.asarray(part[start:start + _CHUNK]).astype("<u4", copy=False).tobytes())
        return f"{at} tokens in rows of {p.row}, vocab {corpus.vocab}, blake2b {digest.hexdigest()}"
    return f"{at} tokens, vocab {corpus.vocab}, blake2b {digest.hexdigest()}"


def _check_fraction(heldout_fraction: float) -> None:
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction!r} is invalid: must be in (0, 1)")


def _split(ids: np.ndarray, heldout_fraction: float, where: str) -> tuple[np.ndarray, np.ndarray]:
    _check_fraction(heldout_fraction)
    cut = int(len(ids) * (1 - heldout_fraction))
    if cut < 2 or len(ids) - cut < 2:
        raise ValueError(f"{where}: {len(ids)} tokens are too few to hold out {heldout_fraction:.0%} of them")
    return ids[:cut], ids[cut:]


def embedded_corpus(heldout_fraction: float = 0.05, tokenizer=None) -> TokenCorpus:
    """Python's bundled documentation: UTF-8 bytes (the zero-setup default), or, with
    ``tokenizer`` (a ``tokenizer.json``), each pydoc topic a document tokenized with it
    and followed by its end-of-document token (as ``python -m fmoe.data prepare`` would)."""
    if tokenizer is None:
        from .embedded import corpus_bytes

        ids = np.frombuffer(corpus_bytes(), dtype=np.uint8)
        train, heldout = _split(ids, heldout_fraction, EMBEDDED)
        return TokenCorpus(train, heldout, 256, None, None, EMBEDDED)
    from pydoc_data.topics import topics

    enc = load_encoder(tokenizer)
    source = f"{EMBEDDED} tokenized with {tokenizer}"
    train, heldout = _split(enc.encode([topics[name] for name in sorted(topics)]), heldout_fraction, source)
    return TokenCorpus(train, heldout, enc.vocab, Path(tokenizer), enc.eos_id, source)


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def tokenizer_record(corpus: TokenCorpus) -> dict | None:
    """What a run records of the tokenizer that made its ids (a checkpoint's
    ``extra["tokenizer"]``): None for UTF-8 bytes, else the file name the run folder
    keeps it under and its BLAKE2b, so that a tool reading the checkpoint later uses this
    tokenizer and no other."""
    if corpus.tokenizer is None:
        return None
    return {"file": "tokenizer.json", "blake2b": _file_digest(corpus.tokenizer)}


def recorded_tokenizer(checkpoint, extra: dict, vocab: int) -> Path | None:
    """The tokenizer a checkpoint's run recorded (``tokenizer_record``): its file in the
    run folder (the checkpoint's parent), checked by content; None for UTF-8 bytes. A
    ``tokenizer.json`` that merely lies nearby is never taken.

    A checkpoint that records none (``fmoe.save`` by hand, or an older fmoe) holds bytes
    when its vocabulary is 256 or less.

    Raises:
        ValueError: the recorded file is missing or differs, or nothing is recorded and
            the vocabulary is larger than bytes; pass a tokenizer explicitly then.
    """
    checkpoint = Path(checkpoint)
    if "tokenizer" not in extra:
        if vocab <= 256:
            return None
        raise ValueError(f"{checkpoint} records no tokenizer (saved by fmoe.save or an older fmoe) and its vocab "
                         f"is {vocab}, so its ids are not bytes: name the tokenizer.json it was trained with")
    record = extra["tokenizer"]
    if record is None:
        return None
    if not (isinstance(record, dict) and isinstance(record.get("file"), str) and isinstance(record.get("blake2b"), str)
            and Path(record["file"]).name == record["file"] not in ("", ".", "..")):
        raise ValueError(f"{checkpoint}: its extra['tokenizer']={record!r} is not a tokenizer record (null, or the "
                         "file name in the run folder and its BLAKE2b)")
    path = checkpoint.resolve().parent / record["file"]
    if not path.is_file() or _file_digest(path) != record["blake2b"]:
        state = "is missing" if not path.is_file() else "is another tokenizer (its BLAKE2b differs)"
        raise ValueError(f"{checkpoint} was trained with the tokenizer its run kept as {path}, which {state}: "
                         f"name that tokenizer.json explicitly (BLAKE2b {record['blake2b']})")
    return path


def read_meta(directory: Path) -> dict:
    """The validated ``meta.json`` of a corpus directory (ValueError naming the key)."""
    path = directory / "meta.json"
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such corpus directory (write one with `python -m fmoe.data prepare`)")
    if not path.is_file():
        raise ValueError(f"{directory}: no meta.json; not a corpus written by `python -m fmoe.data prepare`")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: key 'format' must be {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: key 'version'={meta.get('version')!r}; this fmoe reads {VERSION}")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: key 'dtype'={meta.get('dtype')!r}; allowed: {', '.join(DTYPES)}")
    for key in ("vocab", "tokens", "max_id"):
        if isinstance(meta.get(key), bool) or not isinstance(meta.get(key), int) or meta[key] < 0:
            raise ValueError(f"{path}: key {key!r}={meta.get(key)!r} must be an int >= 0")
    if meta["max_id"] >= meta["vocab"]:
        raise ValueError(f"{path}: key 'max_id'={meta['max_id']} must be < 'vocab'={meta['vocab']}")
    eos = meta.get("eos_id")
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < meta["vocab"]):
        raise ValueError(f"{path}: key 'eos_id'={eos!r} must be null or an id < 'vocab'={meta['vocab']}")
    name = meta.get("tokenizer")
    # a bare file name: the directory is self-contained, and meta.json cannot point outside it
    if name is not None and (not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")):
        raise ValueError(f"{path}: key 'tokenizer'={name!r} must be null or a file name inside the directory")
    return meta


def open_corpus(path, heldout_fraction: float = 0.05) -> TokenCorpus:
    """A prepared corpus directory, memory-mapped (never read whole) and validated.

    Arguments:
        path: a directory written by ``python -m fmoe.data prepare``.
        heldout_fraction: the tail of the tokens held out, in (0, 1).

    Returns:
        A ``TokenCorpus`` whose ``train``/``heldout`` are views of one ``numpy.memmap``.

    Raises:
        ValueError naming the file and key: missing directory or files, a ``meta.json``
        of another format, version or dtype, a size that disagrees with ``tokens``,
        ``max_id >= vocab``, or too few tokens to hold some out.
    """
    directory = Path(path)
    meta = read_meta(directory)
    data = directory / "tokens.bin"
    dtype = np.dtype(DTYPES[meta["dtype"]])
    if not data.is_file():
        raise ValueError(f"{directory}: tokens.bin is missing")
    if data.stat().st_size != meta["tokens"] * dtype.itemsize:
        raise ValueError(f"{data}: {data.stat().st_size} bytes, but meta.json's 'tokens'={meta['tokens']} "
                         f"of {meta['dtype']} need {meta['tokens'] * dtype.itemsize}")
    ids = np.memmap(data, dtype=dtype, mode="r") if meta["tokens"] else np.zeros(0, dtype)
    tokenizer = directory / meta["tokenizer"] if meta.get("tokenizer") is not None else None
    if tokenizer is not None and not tokenizer.is_file():
        raise ValueError(f"{directory}: meta.json's key 'tokenizer' names {meta['tokenizer']!r}, which is missing")
    if "packed" in meta:
        return _open_packed(directory, meta, ids, heldout_fraction, tokenizer)
    train, heldout = _split(ids, heldout_fraction, str(directory))
    return TokenCorpus(train, heldout, meta["vocab"], tokenizer, meta.get("eos_id"), str(directory))


_PACKED_FILES = {"loss_mask.bin": np.uint8, "segments.bin": np.uint32}


def _open_packed(directory: Path, meta: dict, ids: np.ndarray, heldout_fraction: float,
                 tokenizer: Path | None) -> TokenCorpus:
    """A packed corpus: its rows split at a row, the held-out rows the tail."""
    packed, where = meta["packed"], directory / "meta.json"
    row = packed.get("row_tokens") if isinstance(packed, dict) else None
    if isinstance(row, bool) or not isinstance(row, int) or row < 2 or len(ids) % row:
        raise ValueError(f"{where}: key 'packed.row_tokens'={row!r} must be an int >= 2 dividing 'tokens'="
                         f"{len(ids)}")
    arrays = []
    for name, dtype in _PACKED_FILES.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != len(ids) * np.dtype(dtype).itemsize:
            state = "is missing" if not path.is_file() else f"has {path.stat().st_size} bytes"
            raise ValueError(f"{path} {state}; a packed corpus of {len(ids)} tokens needs "
                             f"{len(ids) * np.dtype(dtype).itemsize} ({np.dtype(dtype).name} per token)")
        arrays.append(np.memmap(path, dtype=dtype, mode="r") if len(ids) else np.zeros(0, dtype))
    _check_fraction(heldout_fraction)
    rows = len(ids) // row
    held = max(1, round(rows * heldout_fraction))
    if rows - held < 1:
        raise ValueError(f"{directory}: {rows} packed row(s) are too few to hold out {heldout_fraction:.0%} of them")
    cut = (rows - held) * row
    mask, segments = arrays
    split = PackedRows(row, mask[:cut], mask[cut:], segments[:cut], segments[cut:])
    return TokenCorpus(ids[:cut], ids[cut:], meta["vocab"], tokenizer, meta.get("eos_id"), str(directory), split)


def check_vocab(corpus: TokenCorpus, vocab: int) -> None:
    """ValueError unless a model of ``vocab`` tokens can read every id of ``corpus``."""
    if corpus.vocab > vocab:
        raise ValueError(f"{corpus.source}: its tokenizer has {corpus.vocab} tokens, but the model's vocab is "
                         f"{vocab} (use --vocab >= {corpus.vocab})")


def corpus_unigram(corpus: TokenCorpus, vocab: int) -> float:
    """``unigram_cross_entropy`` of the corpus; of a packed one over its trained targets."""
    if corpus.packed is None:
        return unigram_cross_entropy(corpus.train, corpus.heldout, vocab)
    p = corpus.packed

    def trained(ids, mask):
        n = min(len(ids), 10_000_000)
        return np.asarray(ids[:n])[np.asarray(mask[:n]).astype(bool)]

    return unigram_cross_entropy(trained(corpus.train, p.train_mask), trained(corpus.heldout, p.heldout_mask), vocab)


def unigram_cross_entropy(train, heldout, vocab: int = 256, max_tokens: int = 10_000_000) -> float:
    """Nats per token of ``heldout`` under ``train``'s token frequencies (add-one smoothed).

    The baseline a language model must beat: it knows which tokens are common but nothing
    about context. A large corpus is counted on a bounded sample: the first
    ``max_tokens`` of each split (all of both for the embedded corpus).

    Arguments:
        train, heldout: 1-D ids (tensors, numpy arrays or memmaps), each < ``vocab``.
    """
    def as_long(ids):
        ids = ids[:max_tokens]
        return ids.long() if isinstance(ids, torch.Tensor) else torch.from_numpy(np.asarray(ids, dtype=np.int64))

    counts = torch.bincount(as_long(train), minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[as_long(heldout)].mean())
