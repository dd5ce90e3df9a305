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
document is followed by a blank line, ``"\\n\\n"``, encoded with it. ``meta.json``'s
``"tokenized_with"`` records the tokenizer by path and content digest (or ``"bytes"``):
``python -m fmoe.train --init-from-hf DIR`` refuses a corpus of another tokenizer than
``DIR/tokenizer.json``.

The corpus is streamed: documents are encoded in batches of a few MB (several at once,
each spread over the tokenizer's threads, while the next is read) and appended to
``tokens.bin`` in a temporary sibling directory, renamed into place when complete. The
progress bar counts the input's bytes, batch by batch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from ..checkpoint.files import swap_into_place, write_atomically
from .chat import GLOBS as CHAT_GLOBS, prepare_chat, summary
from .encoding import GLOBS, IN_FLIGHT, SEPARATOR, Encoder, find_inputs, load_encoder
from .format import FORMAT, VERSION, check_out, temporary_sibling
from .tokenizer_match import tokenized_with

# a batch is encoded when it holds this many documents or bytes: enough work for
# encode_batch to spread over its threads, bounded memory, and a progress bar that moves;
# _IN_FLIGHT batches are encoded at once (encoding.IN_FLIGHT)
_BATCH_DOCS, _BATCH_BYTES, _IN_FLIGHT = 4096, 2 << 20, IN_FLIGHT


def documents(path: Path) -> Iterator[tuple[str, int]]:
    """A file's documents, each with the bytes it took: the whole file, or each
    ``.jsonl`` line's ``"text"`` (ValueError naming the file and line; a blank line is
    an empty document, so that the bytes add up to the file's size)."""
    if path.suffix != ".jsonl":
        raw = path.read_bytes()
        yield raw.decode("utf-8", errors="replace"), len(raw)
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                yield "", len(raw)
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{number}: a jsonl line needs a string field 'text'")
            yield row["text"], len(raw)


def _batches(files: list[Path]) -> Iterator[tuple[list[str], int]]:
    """The documents of ``files`` that are not blank, in batches, each with the bytes it
    took (blank documents included: the batches' bytes add up to the files' sizes)."""
    docs: list[str] = []
    nbytes = 0
    for f in files:
        for doc, n in documents(f):
            nbytes += n
            if doc and not doc.isspace():  # not blank: a blank document would add only a separator
                docs.append(doc)
                if len(docs) >= _BATCH_DOCS or nbytes >= _BATCH_BYTES:
                    yield docs, nbytes
                    docs, nbytes = [], 0
    if docs or nbytes:
        yield docs, nbytes


def _write_tokens(files: list[Path], enc: Encoder, path: Path, quiet: bool) -> tuple[int, int, int]:
    """Stream the documents of ``files`` through ``enc`` into ``path``: batches are read
    here while up to ``_IN_FLIGHT`` earlier ones are encoded in threads, and written in
    order. The progress bar advances by each written batch's input bytes.

    Returns:
        ``(tokens, documents, max_id)``.
    """
    count = n_docs = max_id = 0
    total = sum(f.stat().st_size for f in files)
    with open(path, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True, desc="tokenize",
                                        disable=quiet, file=sys.stderr) as bar, \
            ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="fmoe-prepare") as pool:
        queue: deque = deque()

        def write_oldest():
            nonlocal count, n_docs, max_id
            future, n, nbytes = queue.popleft()
            if future is not None:
                ids = future.result()
                max_id = max(max_id, int(ids.max(initial=0)))
                sink.write(memoryview(ids).cast("B"))
                count += len(ids)
            n_docs += n
            bar.update(nbytes)

        try:
            for docs, nbytes in _batches(files):
                queue.append((pool.submit(enc.encode, docs) if docs else None, len(docs), nbytes))
                if len(queue) >= _IN_FLIGHT:
                    write_oldest()
            while queue:
                write_oldest()
        except BaseException:
            for future, _, _ in queue:  # a bad input midway: do not encode what is queued
                if future is not None:
                    future.cancel()
            raise
        sink.flush()
        os.fsync(sink.fileno())
    return count, n_docs, max_id


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
    out = check_out(out, overwrite)
    files = find_inputs(inputs, globs)
    enc = load_encoder(tokenizer, eos)
    dtype = enc.dtype
    tmp = temporary_sibling(out)
    try:
        count, n_docs, max_id = _write_tokens(files, enc, tmp / "tokens.bin", quiet)
        if count == 0:
            raise ValueError(f"the inputs hold no text ({len(files)} file(s) under {', '.join(map(str, inputs))})")
        if enc.tokenizer is not None:
            shutil.copyfile(enc.tokenizer, tmp / "tokenizer.json")
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": enc.vocab, "tokens": count,
                "max_id": max_id, "documents": n_docs,
                "tokenizer": "tokenizer.json" if enc.tokenizer is not None else None,
                "tokenized_with": tokenized_with(enc.tokenizer), "eos_id": enc.eos_id,
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
    chat = p.add_argument_group("chat data for fine-tuning (the format: pydoc fmoe.data.chat)")
    chat.add_argument("--chat", action="store_true",
                      help="the inputs are chat JSONL (directories: their *.jsonl): rendered, masked and packed "
                           "into rows of --seq + 1 tokens")
    chat.add_argument("--seq", type=int, default=None, help="with --chat: the tokens a row trains on (required)")
    chat.add_argument("--train-on", default=None, metavar="{assistant,all}",
                      help="with --chat: the tokens trained on (default: assistant)")
    chat.add_argument("--long", default=None, metavar="{split,truncate}",
                      help="with --chat: a conversation longer than a row is split at message boundaries "
                           "(default) or truncated")
    args = ap.parse_args(argv)
    chat_only = [flag for flag, value in (("--seq", args.seq), ("--train-on", args.train_on),
                                          ("--long", args.long)) if value is not None]
    if chat_only and not args.chat:
        raise SystemExit(f"fmoe.data: {' and '.join(chat_only)} only go with --chat (chat JSONL for fine-tuning)")
    try:
        if args.chat:
            meta = prepare_chat(args.inputs, args.out, args.seq, args.tokenizer, args.eos,
                                args.train_on or "assistant", args.long or "split", args.overwrite, args.quiet,
                                args.globs or CHAT_GLOBS)
        else:
            meta = prepare(args.inputs, args.out, args.tokenizer, args.eos, args.overwrite, args.quiet,
                           args.globs or GLOBS)
    except (ValueError, OSError) as err:
        raise SystemExit(f"fmoe.data: {err}") from None
    except KeyboardInterrupt:  # the partial corpus is removed by prepare's cleanup
        kept = "the corpus there is unchanged" if Path(args.out).exists() else "nothing was written there"
        print(f"fmoe.data: interrupted; --out {args.out}: {kept}", file=sys.stderr)
        raise SystemExit(130) from None
    if args.chat:
        print(summary(meta, args.out))
        return
    print(f"fmoe.data: {meta['documents']} documents, {meta['tokens']} tokens ({meta['dtype']}, vocab "
          f"{meta['vocab']}) -> {args.out}")
