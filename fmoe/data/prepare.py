"""Tokenize text files into a corpus directory (see ``fmoe.data.tokens`` for the format).

    python -m fmoe.data prepare docs/ notes.txt --out data/mycorpus --tokenizer tokenizer.json

Inputs are files and directories. Directories are walked recursively in sorted order
for the files matching ``--glob`` (default: ``*.txt *.md *.rst *.py *.jsonl``), skipping
names that start with a dot (``.git``, ``.venv``); a file named on the command line is
read whatever its name. A ``.jsonl`` file holds one document per line (a JSON object's
``"text"``; blank lines skipped); any other file is one document, read as UTF-8
(invalid bytes become U+FFFD). Blank documents (empty or whitespace only) are skipped.

With ``--tokenizer`` (a Hugging Face ``tokenizer.json``; needs the ``tokenizers``
package) every document is followed by the end-of-document token: ``--eos TOKEN``, by
default the tokenizer's ``<|endoftext|>``, ``</s>`` or ``<|im_end|>``. Without one
(byte-level, the default: ids are UTF-8 bytes, vocab 256; or ``--eos ''``) every
document is followed by a blank line, ``"\\n\\n"``, encoded with it.

The corpus is streamed: documents are encoded in batches and appended to
``tokens.bin`` in a temporary sibling directory, renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
from tqdm import tqdm

from ..checkpoint.files import swap_into_place, write_atomically
from .tokens import FORMAT, VERSION

GLOBS = ("*.txt", "*.md", "*.rst", "*.py", "*.jsonl")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>")
SEPARATOR = "\n\n"  # after each document when there is no end-of-document token
# a batch is encoded when it holds this many documents or bytes: bounded memory, and
# encode_batch has enough work to spread over its threads
_BATCH_DOCS, _BATCH_BYTES = 1024, 16 << 20


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


def documents(path: Path) -> Iterator[tuple[str, int]]:
    """A file's documents, each with the bytes it took: the whole file, or each
    ``.jsonl`` line's ``"text"`` (ValueError naming the file and line)."""
    if path.suffix != ".jsonl":
        raw = path.read_bytes()
        yield raw.decode("utf-8", errors="replace"), len(raw)
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{number}: a jsonl line needs a string field 'text'")
            yield row["text"], len(raw)


class Encoder(NamedTuple):
    """Documents -> ids, each document's ids ending with its separator."""

    encode: Callable[[list[str]], list[np.ndarray]]
    vocab: int
    eos_id: int | None
    tokenizer: Path | None  # the tokenizer.json, or None for UTF-8 bytes


def load_encoder(tokenizer=None, eos: str | None = None) -> Encoder:
    """The encoder of a ``tokenizer.json`` (``eos`` None: found; ``""``: none), or
    byte-level when ``tokenizer`` is None."""
    if tokenizer is None:
        if eos:
            raise ValueError(f"--eos {eos!r} names a token of a tokenizer; byte-level data has none")
        return Encoder(lambda docs: [np.frombuffer((d + SEPARATOR).encode("utf-8"), dtype=np.uint8) for d in docs],
                       256, None, None)
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
    names = [eos] if eos is not None else [c for c in EOS_CANDIDATES if tok.token_to_id(c) is not None][:1]
    eos_id = tok.token_to_id(names[0]) if names and names[0] else None
    if eos and eos_id is None:
        raise ValueError(f"--eos {eos!r} is not a token of {tokenizer}")

    def encode(docs: list[str]) -> list[np.ndarray]:
        if eos_id is None:
            return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch([d + SEPARATOR for d in docs])]
        return [np.asarray(e.ids + [eos_id], dtype=np.int64) for e in tok.encode_batch(docs)]

    return Encoder(encode, vocab, eos_id, Path(tokenizer))


def _write_tokens(files: list[Path], enc: Encoder, dtype, path: Path, quiet: bool) -> tuple[int, int, int]:
    """Stream the documents of ``files`` through ``enc`` into ``path``.

    Returns:
        ``(tokens, documents, max_id)``.
    """
    count = n_docs = max_id = 0
    pending: list[str] = []
    pending_bytes = 0
    with open(path, "wb") as sink, tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                                        desc="tokenize", disable=quiet, file=sys.stderr) as bar:
        def flush():
            nonlocal count, n_docs, max_id, pending_bytes
            for ids in enc.encode(pending):
                max_id = max(max_id, int(ids.max(initial=0)))
                ids.astype(dtype).tofile(sink)
                count += len(ids)
            n_docs += len(pending)
            bar.update(pending_bytes)
            pending.clear()
            pending_bytes = 0

        for f in files:
            for doc, nbytes in documents(f):
                pending_bytes += nbytes
                if doc.strip():  # a blank document would add only a separator
                    pending.append(doc)
                if len(pending) >= _BATCH_DOCS or pending_bytes >= _BATCH_BYTES:
                    flush()
        flush()
        sink.flush()
        os.fsync(sink.fileno())
    return count, n_docs, max_id


def _is_corpus(path: Path) -> bool:
    try:
        return json.loads((path / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def prepare(inputs, out, tokenizer=None, eos: str | None = None, overwrite: bool = False, quiet: bool = False,
            globs=GLOBS) -> dict:
    """Tokenize ``inputs`` into the corpus directory ``out``.

    Arguments:
        inputs: files and directories.
        out: the directory to write (refused if it exists, unless ``overwrite``).
        tokenizer: a ``tokenizer.json`` path, or None for UTF-8 bytes.
        eos: the end-of-document token (None: the tokenizer's, if any; ``""``: none).
        overwrite: replace an existing ``out``, when it is a corpus (atomically: the old
            one stays whole until the new one is complete).
        quiet: no progress bar.
        globs: the file patterns taken from directories.

    Returns:
        The written ``meta.json`` as a dict.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out} exists; pass --overwrite to replace it")
    if out.exists() and not _is_corpus(out):
        raise ValueError(f"--out {out} exists and is not a corpus written by fmoe.data prepare; "
                         "refusing to replace it")
    files = find_inputs(inputs, globs)
    enc = load_encoder(tokenizer, eos)
    dtype = np.dtype(np.uint16 if enc.vocab <= 2**16 else np.uint32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        count, n_docs, max_id = _write_tokens(files, enc, dtype, tmp / "tokens.bin", quiet)
        if count == 0:
            raise ValueError(f"the inputs hold no text ({len(files)} file(s) under {', '.join(map(str, inputs))})")
        if enc.tokenizer is not None:
            shutil.copyfile(enc.tokenizer, tmp / "tokenizer.json")
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": enc.vocab, "tokens": count,
                "max_id": max_id, "documents": n_docs,
                "tokenizer": "tokenizer.json" if enc.tokenizer is not None else None, "eos_id": enc.eos_id,
                "separator": None if enc.eos_id is not None else SEPARATOR,
                "sources": [str(Path(p).resolve()) for p in inputs], "files": len(files), "globs": list(globs)}
        write_atomically(json.dumps(meta, indent=1), tmp / "meta.json")
        swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def main(argv=None) -> None:
    """``python -m fmoe.data prepare ...``: errors exit non-zero with one line on stderr."""
    ap = argparse.ArgumentParser(prog="python -m fmoe.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into a corpus directory", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="files and directories")
    p.add_argument("--out", required=True, help="the corpus directory to write")
    p.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: UTF-8 bytes)")
    p.add_argument("--eos", default=None,
                   help="the end-of-document token (default: the tokenizer's, if any; '' for none)")
    p.add_argument("--glob", action="append", default=None, dest="globs", metavar="PATTERN",
                   help=f"files to take from directories, repeatable (default: {' '.join(GLOBS)})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        meta = prepare(args.inputs, args.out, args.tokenizer, args.eos, args.overwrite, args.quiet,
                       args.globs or GLOBS)
    except (ValueError, OSError) as err:
        raise SystemExit(f"fmoe.data: {err}") from None
    print(f"fmoe.data: {meta['documents']} documents, {meta['tokens']} tokens ({meta['dtype']}, vocab "
          f"{meta['vocab']}) -> {args.out}")
