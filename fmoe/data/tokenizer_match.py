"""Whether two ``tokenizer.json`` files are the same tokenizer, and the checks built on it.

The same tokenizer means the same content: a BLAKE2b digest of the file's JSON in a
canonical form (keys sorted, no whitespace, BPE merges as ``[left, right]`` pairs, which
tokenizers >= 0.20 writes where older versions wrote ``"left right"``). Re-indenting the
file, reordering its keys or re-saving it with another ``tokenizers`` changes nothing; any
other change (a merge, a vocabulary entry, an added token, a normalizer) makes it another
tokenizer.

A prepared corpus records the tokenizer that made its ids in ``meta.json``'s
``"tokenized_with"``: ``{"path": the tokenizer.json it was prepared with, "blake2b": its
digest}``, or ``"bytes"`` for UTF-8 bytes. ``check_model_tokenizer`` holds a corpus
against a Hugging Face model folder's own ``tokenizer.json`` before a fine-tune starts.

Imports nothing of fmoe but ``fmoe.data.tokens``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from .tokens import TokenCorpus, read_meta

BYTES = "bytes"
_HEX = re.compile(r"[0-9a-f]{32}")


def tokenizer_digest(path) -> str:
    """The content digest of a ``tokenizer.json``: BLAKE2b (16 bytes, hex) of its
    canonical JSON (see the module docstring).

    Raises:
        ValueError: naming the file when it cannot be read as JSON.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable tokenizer.json ({err})") from None
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, dict) and isinstance(model.get("merges"), list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).hexdigest()


def same_tokenizer(a, b) -> bool:
    """Whether ``a`` and ``b`` (``tokenizer.json`` paths, or None for UTF-8 bytes) turn
    text into the same ids."""
    if a is None or b is None:
        return a is None and b is None
    return tokenizer_digest(a) == tokenizer_digest(b)


def describe(path, digest: str) -> str:
    """How a message names a tokenizer: its path and a short digest."""
    return f"{path} (blake2b {digest[:12]})"


def tokenized_with(tokenizer) -> dict | str:
    """``meta.json``'s ``"tokenized_with"`` for a corpus made with ``tokenizer`` (a
    ``tokenizer.json`` path, or None for UTF-8 bytes)."""
    if tokenizer is None:
        return BYTES
    return {"path": str(Path(tokenizer).resolve()), "blake2b": tokenizer_digest(tokenizer)}


class CorpusTokenizer(NamedTuple):
    """What made a corpus directory's ids.

    Attributes:
        kind: ``"tokenizer"``, ``"bytes"``, or ``"unknown"`` (no record and a vocabulary
            larger than bytes: a corpus fmoe did not write).
        digest: the digest of the corpus's ``tokenizer.json`` (kind ``"tokenizer"``).
        text: how a message names it.
    """

    kind: str
    digest: str | None
    text: str


def corpus_tokenizer(directory) -> CorpusTokenizer:
    """The tokenizer a corpus directory's ids were made with: its copy of the
    ``tokenizer.json`` (checked against the digest ``meta.json`` recorded), or bytes.

    A corpus written before ``"tokenized_with"`` was recorded is judged by its copy (or,
    with none, as bytes when its vocabulary is 256 or less).

    Raises:
        ValueError: naming the key when ``"tokenized_with"`` is malformed, contradicts
            ``"tokenizer"``, or does not match the copy's content.
    """
    directory = Path(directory)
    meta = read_meta(directory)
    record, where = meta.get("tokenized_with"), directory / "meta.json"
    valid = record is None or record == BYTES or (
        isinstance(record, dict) and isinstance(record.get("path"), str)
        and isinstance(record.get("blake2b"), str) and _HEX.fullmatch(record["blake2b"]) is not None)
    if not valid:
        raise ValueError(f"{where}: key 'tokenized_with'={record!r} must be \"bytes\" or "
                         "{\"path\": the tokenizer.json, \"blake2b\": 32 hex digits}")
    if meta.get("tokenizer") is None:
        if isinstance(record, dict):
            raise ValueError(f"{where}: key 'tokenized_with' names {record['path']}, but key 'tokenizer' is null")
        if record == BYTES or meta["vocab"] <= 256:
            return CorpusTokenizer(BYTES, None, "UTF-8 bytes (prepared without --tokenizer)")
        return CorpusTokenizer("unknown", None, f"ids of a vocab of {meta['vocab']} and no tokenizer on record")
    if record == BYTES:
        raise ValueError(f"{where}: key 'tokenized_with' is \"bytes\", but key 'tokenizer' names "
                         f"{meta['tokenizer']!r}")
    copy = directory / meta["tokenizer"]
    digest = tokenizer_digest(copy)
    if record is None:
        return CorpusTokenizer("tokenizer", digest, describe(f"{copy} (prepared by an older fmoe)", digest))
    if record["blake2b"] != digest:
        raise ValueError(f"{copy} is not the tokenizer {where} records (key 'tokenized_with': blake2b "
                         f"{record['blake2b'][:12]}, the copy's is {digest[:12]}): the corpus was altered; prepare "
                         "it again")
    return CorpusTokenizer("tokenizer", digest, describe(record["path"], digest))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def check_model_tokenizer(corpus: TokenCorpus, model_dir, model_vocab: int,
                          warn: Callable[[str], None] = _stderr) -> None:
    """Refuse to fine-tune the Hugging Face model in ``model_dir`` on ``corpus`` when its
    ids come from another tokenizer than the model's ``tokenizer.json`` (or are bytes).

    Without a ``tokenizer.json`` in ``model_dir`` nothing can be compared: a model of
    vocab 256 or less reads bytes (a corpus of a tokenizer is refused); a larger one
    (its tokenizer in another format, say) gets a one-line warning through ``warn``, as
    does a corpus with no tokenizer on record and a vocabulary larger than bytes. The
    embedded corpus under ``--init-from-hf`` is tokenized with the model's own, so it
    passes.

    Arguments:
        corpus: the run's ``--data`` (``open_corpus``), or the embedded corpus.
        model_dir: ``--init-from-hf``'s folder.
        model_vocab: that model's vocabulary.
        warn: takes the warning line (default: printed on stderr).

    Raises:
        ValueError: naming ``--data``, both tokenizers and the ``prepare`` command that
            makes a corpus for this model.
    """
    if not Path(corpus.source).is_dir():
        return
    data, model_dir = corpus.source, Path(model_dir)
    mine = corpus_tokenizer(data)
    theirs = model_dir / "tokenizer.json"
    chat = " --chat" if corpus.packed is not None else ""
    redo = f"prepare it with `python -m fmoe.data prepare{chat} ... --tokenizer {theirs}`"
    if not theirs.is_file():
        if model_vocab <= 256:
            if mine.kind == "tokenizer":
                raise ValueError(f"--data {data} was tokenized with {mine.text}, but --init-from-hf {model_dir} "
                                 f"has no tokenizer.json and a vocab of {model_vocab}: its ids are UTF-8 bytes; "
                                 f"prepare the corpus without --tokenizer")
            return
        warn(f"warning: --init-from-hf {model_dir} has no tokenizer.json, so --data {data} ({mine.text}) cannot "
             "be checked against the model's tokenizer; make sure it was prepared with it")
        return
    digest = tokenizer_digest(theirs)
    if mine.kind == "unknown":
        warn(f"warning: --data {data} holds {mine.text}, so it cannot be checked against --init-from-hf "
             f"{model_dir}'s tokenizer.json (blake2b {digest[:12]}); if it is not that tokenizer's, {redo}")
    elif mine.digest != digest:
        what = "holds" if mine.kind == BYTES else "was tokenized with"
        raise ValueError(f"--data {data} {what} {mine.text}, but --init-from-hf {model_dir}'s tokenizer.json is "
                         f"blake2b {digest[:12]}; {redo}")
