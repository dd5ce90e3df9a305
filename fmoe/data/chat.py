"""Chat JSONL -> a packed token corpus for supervised fine-tuning.

    python -m fmoe.data prepare --chat chats/ more.jsonl --tokenizer tok/tokenizer.json --seq 2048 --out data/sft

Input: one conversation per line of each ``.jsonl`` file (directories: their ``*.jsonl``,
recursively, sorted), either ``{"messages": [{"role": "system" | "user" | "assistant",
"content": "..."}, ...]}`` or ``{"prompt": "...", "completion": "..."}`` (one user turn,
then one assistant turn); a line with both ``messages`` and ``prompt``/``completion`` is
refused. Other keys are passed to the template untouched; blank lines are skipped.

Template: when the tokenizer's folder holds a ``chat_template.jinja`` (as transformers
>= 4.50 saves it; it wins over the config's, as in transformers), or a
``tokenizer_config.json`` with a ``chat_template`` (a string, or a list of ``{"name",
"template"}`` of which the one named ``"default"`` is taken), conversations are
rendered with it as Hugging Face's ``apply_chat_template`` does (jinja2's sandbox,
``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``; the variables
``messages``, ``bos_token``, ``eos_token`` (``--eos`` overrides the config's),
``add_generation_prompt``). Otherwise the plain template renders each message as::

    <|{role}|>\\n{content}\\n                  (system and user)
    <|assistant|>\\n{content}{EOS}\\n           (assistant)

and its generation prompt is ``<|assistant|>\\n``. The headers are ordinary text; ``EOS``
is ``--eos``, else the config's ``eos_token``, and a tokenizer with neither is refused.
Without ``--tokenizer`` (UTF-8 bytes, vocab 256) there are no special tokens: ``EOS`` is
empty, so an assistant turn ends with the ``\\n`` after its content, and a reply ends
where the model writes the next header's ``<|``. Every special token a template writes
(its ``eos_token``/``bos_token``, and any ``<|name|>`` in a ``chat_template``) must
encode to one token of the tokenizer, or the tokenizer is refused naming the token.

Loss mask (``--train-on assistant``, the default): what each assistant message adds to
the text, ``render(messages[:i+1])`` minus ``render(messages[:i],
add_generation_prompt=True)`` (its content and its end of turn, not its header), is
trained on; a template whose prefixes do not render as prefixes of the whole is refused.
A token is trained when its characters (the tokenizer's offsets) lie inside such a span.
``--train-on all`` trains every token. The first token of each document is never a
target (nothing in its document precedes it).

Packing: conversations are packed whole, best-fit (the open row with the least room that
still holds it; at most ``packing.OPEN_ROWS`` rows open, the fullest one closed when a
conversation fits none), into rows of exactly ``seq + 1`` tokens. Each conversation in a
row is a document, numbered 0, 1, 2, ... along the row; the rest of the row is padding
(the EOS id, or 0 without one; never trained) with the next number. A conversation longer
than a row is, with ``--long split`` (the default), cut at message boundaries into pieces
that fit, each its own document, as long as they may be, cut before a user or system
message when one fits (so that a piece opens with a prompt); a single message longer than
a row keeps its first ``seq + 1`` tokens. With ``--long truncate`` it keeps its first
``seq + 1`` tokens.

Output directory (written beside ``--out`` and renamed into place when complete):

- ``tokens.bin``: ``rows * (seq + 1)`` ids, row after row, ``uint16`` when the vocab
  fits, else ``uint32``;
- ``loss_mask.bin``: ``uint8``, one per id: 1 where that token is a trained target, so
  target ``j`` of a row (the token at ``j + 1``) counts iff ``loss_mask[j + 1] == 1``;
- ``segments.bin``: ``uint32``, one per id: its document's number within its row,
  non-decreasing along a row;
- ``tokenizer.json`` (and ``tokenizer_config.json`` and ``chat_template.jinja``, when
  there are), copied;
- ``meta.json``: the keys of ``fmoe.data.tokens``' format, with ``documents`` the
  conversations read, plus ``"packed": {"row_tokens", "rows", "conversations",
  "trained_tokens", "split", "truncated", "template": "tokenizer" | "plain",
  "template_file" (the file the template was read from, or null), "train_on",
  "packing_efficiency"}`` (the fraction of positions that are not padding).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
from tqdm import tqdm

from ..checkpoint.files import swap_into_place, write_atomically
from .chat_template import CONFIG, JINJA, Template, describe_kind, load_template, message_starts, \
    render_conversation, single_token
from .encoding import IN_FLIGHT, find_inputs, open_tokenizer
from .format import FORMAT, VERSION, check_out, temporary_sibling, token_dtype
from .packing import OPEN_ROWS, Packer, split_points
from .tokenizer_match import tokenized_with

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "all")
LONG = ("split", "truncate")
GLOBS = ("*.jsonl",)
# conversations are rendered here and encoded in threads a batch at a time (see
# prepare's _BATCH_*)
_BATCH_CONVERSATIONS, _BATCH_BYTES = 2048, 1 << 20


# ---------------------------------------------------------------------------- input


def parse_conversation(line: str, where: str) -> list[dict]:
    """One JSONL line as its list of messages (``{"role", "content"}`` dicts, other keys
    kept); ValueError naming ``where`` (``file:line``), the field and what is allowed."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a chat line must be a JSON object with 'messages' (or 'prompt' and "
                         f"'completion'), not a {type(row).__name__}")
    both = [key for key in ("prompt", "completion") if key in row]
    if "messages" in row and both:
        raise ValueError(f"{where}: the line has both 'messages' and {'/'.join(map(repr, both))}; a chat line holds "
                         "either 'messages' or 'prompt' and 'completion', not both")
    if "messages" not in row:
        if "prompt" not in row and "completion" not in row:
            raise ValueError(f"{where}: no 'messages' (nor 'prompt' and 'completion'); the line's keys are "
                             f"{', '.join(map(repr, row)) or 'none'}")
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{where}: '{key}' must be a string (a prompt/completion line needs both), "
                                 f"not {describe_kind(row.get(key))}")
        return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    messages = row["messages"]
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list of {{\"role\", \"content\"}} objects, "
                         f"not {describe_kind(messages)}")
    if not messages:
        raise ValueError(f"{where}: an empty conversation ('messages' is [])")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{k}] must be an object with 'role' and 'content', "
                             f"not {describe_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{where}: messages[{k}] has role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: messages[{k}] ({role}) has 'content' of {describe_kind(message.get('content'))}; "
                             "it must be a string")
    return messages


def read_conversations(path: Path) -> Iterator[tuple[list[dict] | None, int, str]]:
    """A chat file's conversations, each as ``(messages, bytes, "file:line")``; a blank
    line gives ``(None, bytes, ...)``, so that the bytes add up to the file's size."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.isspace():
                yield None, len(raw), ""
                continue
            where = f"{path}:{number}"
            yield parse_conversation(raw.decode("utf-8", errors="replace"), where), len(raw), where


# ---------------------------------------------------------------------------- tokens


class Encoded(NamedTuple):
    """A batch of conversations as tokens, one after another.

    Attributes:
        ids: ``[T]`` token ids.
        trained: ``[T]`` uint8, 1 where a token lies inside a trained span.
        ends: ``[C + 1]`` int64: conversation ``c`` is ``ids[ends[c]:ends[c + 1]]``.
        starts: ``[T]`` int64: each token's first character in its conversation's text.
    """

    ids: np.ndarray
    trained: np.ndarray
    ends: np.ndarray
    starts: np.ndarray


def trained_flags(starts_T: np.ndarray, ends_T: np.ndarray, counts_C: np.ndarray, lengths_C: list[int],
                  spans_C: list[list[tuple[int, int]]]) -> np.ndarray:
    """``[T]`` uint8: 1 where a token's characters ``[start, end)`` (within its
    conversation's text) lie inside one of its conversation's ``spans``.

    The batch is done at once: each conversation's characters are shifted to a place of
    their own on one line (one character apart, so that no span reaches into the next
    conversation) and each token is looked up in the sorted spans."""
    base_C = np.zeros(len(lengths_C), np.int64)
    np.cumsum(np.asarray(lengths_C, np.int64)[:-1] + 1, out=base_C[1:])
    spans = [(b + s, b + e) for b, conversation in zip(base_C.tolist(), spans_C) for s, e in conversation]
    if not spans:
        return np.zeros(len(starts_T), np.uint8)
    first_S, last_S = np.asarray(spans, np.int64).T
    shift_T = np.repeat(base_C, counts_C)
    start_T, end_T = starts_T + shift_T, ends_T + shift_T
    span_T = np.searchsorted(first_S, start_T, side="right") - 1  # the last span starting at or before the token
    inside_T = (span_T >= 0) & (end_T <= last_S[np.maximum(span_T, 0)])
    return inside_T.view(np.uint8)


def tokenizer_encoder(tok, dtype: np.dtype) -> Callable[[list[str], list], Encoded]:
    """``(texts, spans) -> Encoded`` with a ``tokenizers.Tokenizer``: the whole text of
    each conversation encoded at once (as at inference), no special tokens added (the
    template writes them), the tokens' character offsets mapped onto the spans."""

    def encode(texts: list[str], spans_C: list) -> Encoded:
        encodings = tok.encode_batch(texts, add_special_tokens=False)
        counts_C = np.fromiter(map(len, encodings), np.int64, len(encodings))
        total = int(counts_C.sum())
        ids_T = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype, total)
        offsets_T2 = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in encodings)), np.int64,
                                 2 * total).reshape(total, 2)
        trained_T = trained_flags(offsets_T2[:, 0], offsets_T2[:, 1], counts_C, list(map(len, texts)), spans_C)
        return Encoded(ids_T, trained_T, np.concatenate([[0], np.cumsum(counts_C)]), offsets_T2[:, 0].copy())

    return encode


def bytes_encoder(texts: list[str], spans_C: list) -> Encoded:
    """``Encoded`` of UTF-8 bytes: every byte a token, each belonging to the character
    it encodes."""
    blobs = [t.encode("utf-8") for t in texts]
    counts_C = np.fromiter(map(len, blobs), np.int64, len(blobs))
    data_T = np.frombuffer(b"".join(blobs), np.uint8)
    ends_C1 = np.concatenate([[0], np.cumsum(counts_C)])
    # the character of each byte: count the bytes that start one (not 0b10xxxxxx)
    chars_T = np.cumsum((data_T & 0xC0) != 0x80) - 1
    chars_before_C = np.concatenate([[0], np.cumsum([len(t) for t in texts])])[:-1]
    starts_T = chars_T - np.repeat(chars_before_C, counts_C)
    trained_T = trained_flags(starts_T, starts_T + 1, counts_C, list(map(len, texts)), spans_C)
    return Encoded(data_T.astype(np.uint16), trained_T, ends_C1, starts_T)


# ---------------------------------------------------------------------------- the pipeline


class _Batch(NamedTuple):
    texts: list[str]
    spans: list[list[tuple[int, int]]]
    messages: list[list[dict]]
    wheres: list[str]
    nbytes: int


def _batches(files: list[Path], template: Template, train_on: str) -> Iterator[_Batch]:
    """The conversations of ``files``, parsed, checked and rendered, in batches (with the
    bytes they took, blank lines included)."""
    batch = _Batch([], [], [], [], 0)
    nbytes = 0
    for path in files:
        for messages, n, where in read_conversations(path):
            nbytes += n
            if messages is None:
                continue
            text, spans = render_conversation(template, messages, train_on, where)
            batch.texts.append(text)
            batch.spans.append(spans)
            batch.messages.append(messages)
            batch.wheres.append(where)
            if len(batch.texts) >= _BATCH_CONVERSATIONS or nbytes >= _BATCH_BYTES:
                yield batch._replace(nbytes=nbytes)
                batch, nbytes = _Batch([], [], [], [], 0), 0
    if batch.texts or nbytes:
        yield batch._replace(nbytes=nbytes)


def _encode_batch(encode: Callable, batch: _Batch) -> Encoded:
    """``encode`` of a batch; a text that is not Unicode (a lone surrogate, as JSON's
    ``"\\ud800"`` escape gives) is named by its file and line."""
    try:
        return encode(batch.texts, batch.spans)
    except Exception:
        for text, where in zip(batch.texts, batch.wheres):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"{where}: {err.object[err.start:err.end]!r} is not a character (a lone surrogate "
                                 "escape, such as \\ud800, in the JSON); it cannot be tokenized") from None
        raise


class _Counts(NamedTuple):
    conversations: int
    split: int
    truncated: int


def _pack_batch(batch: _Batch, encoded: Encoded, template: Template, packer: Packer, long: str) -> _Counts:
    """Hand a batch's conversations to ``packer``, split or truncated to fit a row."""
    row_tokens = packer.row_tokens
    ends = encoded.ends.tolist()
    split = truncated = 0
    for c in range(len(batch.texts)):
        start, end = ends[c], ends[c + 1]
        if end - start <= row_tokens:
            pieces = [(start, end)] if end > start else []
        elif long == "truncate":
            pieces, truncated = [(start, start + row_tokens)], truncated + 1
        else:
            messages = batch.messages[c]
            chars = message_starts(template, messages, batch.texts[c], batch.wheres[c])
            cuts = np.searchsorted(encoded.starts[start:end], chars, side="left").tolist()
            prompts = [cut for cut, m in zip(cuts, messages[1:]) if m["role"] != "assistant"]
            local, cut_short = split_points(end - start, cuts, row_tokens, prompts)
            pieces = [(start + a, start + b) for a, b in local]
            split, truncated = split + (len(pieces) > 1), truncated + cut_short
        for a, b in pieces:
            packer.add(encoded.ids[a:b], encoded.trained[a:b])
    return _Counts(len(batch.texts), split, truncated)


def _write_packed(files: list[Path], template: Template, encode: Callable, packer: Packer, long: str,
                  train_on: str, quiet: bool) -> _Counts:
    """Stream ``files`` into ``packer``: batches are read and rendered here while up to
    ``encoding.IN_FLIGHT`` earlier ones are encoded in threads, and packed in order. The
    progress bar advances by each packed batch's input bytes."""
    totals = _Counts(0, 0, 0)
    in_flight = IN_FLIGHT
    with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="chat",
              disable=quiet, file=sys.stderr) as bar, \
            ThreadPoolExecutor(in_flight, thread_name_prefix="fmoe-chat") as pool:
        queue: deque = deque()

        def pack_oldest():
            nonlocal totals
            batch, future = queue.popleft()
            if future is not None:
                counts = _pack_batch(batch, future.result(), template, packer, long)
                totals = _Counts(*(a + b for a, b in zip(totals, counts)))
            bar.update(batch.nbytes)

        try:
            for batch in _batches(files, template, train_on):
                queue.append((batch, pool.submit(_encode_batch, encode, batch) if batch.texts else None))
                if len(queue) >= in_flight:
                    pack_oldest()
            while queue:
                pack_oldest()
            packer.finish()
        except BaseException:
            for _, future in queue:  # a bad line midway: do not encode what is queued
                if future is not None:
                    future.cancel()
            raise
    return totals


def prepare_chat(inputs, out, seq: int | None, tokenizer=None, eos: str | None = None, train_on: str = "assistant",
                 long: str = "split", overwrite: bool = False, quiet: bool = False, globs=GLOBS,
                 open_rows: int = OPEN_ROWS) -> dict:
    """Render, tokenize, mask and pack chat JSONL ``inputs`` into the corpus directory
    ``out`` (the format is in the module docstring).

    Arguments:
        inputs: ``.jsonl`` files, and directories (their ``globs``, recursively).
        out: the directory to write (refused if it exists, unless ``overwrite``; nothing
            appears there unless every line is good).
        seq: the tokens a row trains on: rows hold ``seq + 1``.
        tokenizer: a ``tokenizer.json`` path (its folder's ``tokenizer_config.json``
            gives the chat template and EOS), or None for UTF-8 bytes.
        eos: the end-of-sequence token (None: the config's ``eos_token``; ``""``: none).
        train_on: ``"assistant"`` (the assistant's turns) or ``"all"`` (every token).
        long: a conversation longer than a row: ``"split"`` at message boundaries, or
            ``"truncate"`` to its first ``seq + 1`` tokens.
        overwrite: replace an existing corpus at ``out`` (atomically).
        quiet: no progress bar.
        globs: the file patterns taken from directories.
        open_rows: the rows kept open for packing at once.

    Returns:
        The written ``meta.json`` as a dict.
    """
    if seq is None:
        raise ValueError("--chat needs --seq N: rows of N + 1 tokens are packed")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"--seq {seq!r} is invalid: must be an int >= 1 (a row holds seq + 1 tokens)")
    if train_on not in TRAIN_ON:
        raise ValueError(f"--train-on {train_on!r} is invalid; allowed: {', '.join(TRAIN_ON)}")
    if long not in LONG:
        raise ValueError(f"--long {long!r} is invalid; allowed: {', '.join(LONG)}")
    out = check_out(out, overwrite)
    files = find_inputs(inputs, globs)
    if tokenizer is None:
        tok, vocab = None, 256
    else:
        tokenizer = Path(tokenizer)
        tok, vocab = open_tokenizer(tokenizer)
    template = load_template(tokenizer, tok, eos)
    eos_id = None if tok is None or template.eos is None else single_token(tok, template.eos)
    dtype = token_dtype(vocab)
    encode = bytes_encoder if tok is None else tokenizer_encoder(tok, dtype)
    row_tokens = seq + 1
    tmp = temporary_sibling(out)
    try:
        with open(tmp / "tokens.bin", "wb") as ids_f, open(tmp / "loss_mask.bin", "wb") as flags_f, \
                open(tmp / "segments.bin", "wb") as segments_f:
            def emit(ids_R, flags_R, segments_R):
                ids_f.write(memoryview(ids_R).cast("B"))
                flags_f.write(memoryview(flags_R).cast("B"))
                segments_f.write(memoryview(segments_R).cast("B"))

            packer = Packer(row_tokens, eos_id or 0, dtype, emit, open_rows)
            counts = _write_packed(files, template, encode, packer, long, train_on, quiet)
            for f in (ids_f, flags_f, segments_f):
                f.flush()
                os.fsync(f.fileno())
        if counts.conversations == 0:
            raise ValueError(f"the inputs hold no conversations ({len(files)} file(s) under "
                             f"{', '.join(map(str, inputs))})")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
            for name in (CONFIG, JINJA):
                if (tokenizer.parent / name).is_file():
                    shutil.copyfile(tokenizer.parent / name, tmp / name)
        positions = packer.closed * row_tokens
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": vocab, "tokens": positions,
                "max_id": packer.max_id, "documents": counts.conversations,
                "tokenizer": "tokenizer.json" if tokenizer is not None else None,
                "tokenized_with": tokenized_with(tokenizer), "eos_id": eos_id,
                "sources": [str(Path(p).resolve()) for p in inputs], "files": len(files),
                "packed": {"row_tokens": row_tokens, "rows": packer.closed, "conversations": counts.conversations,
                           "trained_tokens": packer.trained, "split": counts.split, "truncated": counts.truncated,
                           "template": template.name, "template_file": template.file, "train_on": train_on,
                           "packing_efficiency": packer.content / positions}}
        write_atomically(json.dumps(meta, indent=1), tmp / "meta.json")
        swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def summary(meta: dict, out) -> str:
    """The one line ``python -m fmoe.data prepare --chat`` prints when done."""
    packed = meta["packed"]
    content = round(packed["packing_efficiency"] * meta["tokens"])
    trained = packed["trained_tokens"] / content if content else 0.0
    template = f"template {packed['template_file']}" if packed.get("template_file") else "the plain template"
    return (f"fmoe.data: {packed['conversations']} conversations ({packed['split']} split, {packed['truncated']} "
            f"truncated), {content:,} tokens in {packed['rows']} rows of {packed['row_tokens']}, "
            f"{trained:.1%} trained on, packing {packed['packing_efficiency']:.1%}, {template} -> {out}")
