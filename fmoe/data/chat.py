"""Chat JSONL -> a packed token corpus for supervised fine-tuning.

    python -m fmoe.data prepare --chat chats/ more.jsonl --tokenizer tok/tokenizer.json --seq 2048 --out data/sft

Input: one conversation per line of each ``.jsonl`` file (directories: their ``*.jsonl``,
recursively, sorted), either ``{"messages": [{"role": "system" | "user" | "assistant",
"content": "..."}, ...]}`` or ``{"prompt": "...", "completion": "..."}`` (one user turn,
then one assistant turn). Other keys are passed to the template untouched; blank lines
are skipped.

Template: when the tokenizer's folder holds a ``tokenizer_config.json`` with a
``chat_template`` (a string, or a list of ``{"name", "template"}`` of which the one named
``"default"`` is taken), conversations are rendered with it as Hugging Face's
``apply_chat_template`` does (jinja2's sandbox, ``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``tojson``; the variables ``messages``, ``bos_token``,
``eos_token`` (``--eos`` overrides the config's), ``add_generation_prompt``). Otherwise
the plain template renders each message as::

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
still holds it; at most ``_OPEN_ROWS`` rows open, the fullest one closed when a
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
- ``tokenizer.json`` (and ``tokenizer_config.json``, when there is one), copied;
- ``meta.json``: the keys of ``fmoe.data.tokens``' format, with ``documents`` the
  conversations read, plus ``"packed": {"row_tokens", "rows", "conversations",
  "trained_tokens", "split", "truncated", "template": "tokenizer" | "plain",
  "train_on", "packing_efficiency"}`` (the fraction of positions that are not padding).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from bisect import bisect_left, bisect_right, insort
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
from tqdm import tqdm

from ..checkpoint.files import swap_into_place, write_atomically
from . import prepare as _prepare
from .tokens import FORMAT, VERSION

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "all")
LONG = ("split", "truncate")
GLOBS = ("*.jsonl",)
CONFIG = "tokenizer_config.json"
PLAIN_GENERATION_PROMPT = "<|assistant|>\n"
# a token a chat template writes as literal text, such as ChatML's <|im_start|>: the
# tokenizer must hold it as one token, or every turn silently becomes ordinary text
_LITERAL_SPECIAL = re.compile(r"<\|[^|\s]+\|>")
# conversations are rendered here and encoded in threads a batch at a time (see
# prepare's _BATCH_*); at most _OPEN_ROWS rows wait for more conversations: enough for
# best-fit to leave little padding, bounded memory
_BATCH_CONVERSATIONS, _BATCH_BYTES = 2048, 1 << 20
_OPEN_ROWS = 64


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
    if "messages" not in row:
        if "prompt" not in row and "completion" not in row:
            raise ValueError(f"{where}: no 'messages' (nor 'prompt' and 'completion'); the line's keys are "
                             f"{', '.join(map(repr, row)) or 'none'}")
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{where}: '{key}' must be a string (a prompt/completion line needs both), "
                                 f"not {_kind(row.get(key))}")
        return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    messages = row["messages"]
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list of {{\"role\", \"content\"}} objects, "
                         f"not {_kind(messages)}")
    if not messages:
        raise ValueError(f"{where}: an empty conversation ('messages' is [])")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{k}] must be an object with 'role' and 'content', "
                             f"not {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{where}: messages[{k}] has role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: messages[{k}] ({role}) has 'content' of {_kind(message.get('content'))}; "
                             "it must be a string")
    return messages


def _kind(value) -> str:
    return "null (or missing)" if value is None else f"type {type(value).__name__}"


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


# ---------------------------------------------------------------------------- templates


class Template(NamedTuple):
    """How a conversation becomes text.

    Attributes:
        name: ``"tokenizer"`` (the tokenizer_config's ``chat_template``) or ``"plain"``.
        render: ``(messages, add_generation_prompt) -> text``.
        eos: the end-of-sequence token's text (``eos_token``), or None.
        direct: for the plain template, ``messages -> (text, assistant spans, message
            starts)`` in one pass: what incremental rendering finds, without re-rendering.
        source: where the template comes from, for error messages.
    """

    name: str
    render: Callable[[list[dict], bool], str]
    eos: str | None
    direct: Callable[[list[dict]], tuple[str, list[tuple[int, int]], list[int]]] | None = None
    source: str = "the plain chat template"


def plain_render(messages: list[dict], add_generation_prompt: bool, eos: str = "") -> str:
    """The plain template (see the module docstring); ``eos`` ends each assistant turn."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{eos if m['role'] == 'assistant' else ''}\n" for m in messages)
    return text + PLAIN_GENERATION_PROMPT if add_generation_prompt else text


def plain_spans(messages: list[dict], eos: str = "") -> tuple[str, list[tuple[int, int]], list[int]]:
    """``plain_render(messages)`` with, in characters, each assistant message's span
    (its content, ``eos`` and newline: what it adds after the generation prompt) and
    where each message after the first starts."""
    parts, spans, starts, at = [], [], [], 0
    for m in messages:
        if at:
            starts.append(at)
        header = f"<|{m['role']}|>\n"
        body = f"{m['content']}{eos}\n" if m["role"] == "assistant" else f"{m['content']}\n"
        if m["role"] == "assistant":
            spans.append((at + len(header), at + len(header) + len(body)))
        parts += (header, body)
        at += len(header) + len(body)
    return "".join(parts), spans, starts


def plain_template(eos: str | None) -> Template:
    """The plain template, its assistant turns ending with ``eos`` (None: bytes, none)."""
    eos_text = eos or ""
    return Template("plain", lambda messages, gen: plain_render(messages, gen, eos_text), eos,
                    lambda messages: plain_spans(messages, eos_text))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's: jinja's own tojson escapes HTML characters, which a prompt must keep
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str, variables: dict,
                          where: str) -> tuple[Callable[[list[dict], bool], str], set[str]]:
    """A Hugging Face ``chat_template`` as ``(messages, add_generation_prompt) -> text``,
    rendered as ``transformers``' ``apply_chat_template`` does; ``variables`` are the
    special tokens (``bos_token``, ``eos_token``, ...).

    Returns:
        ``(render, names)``: ``names`` are the variables the template reads.

    Raises:
        ValueError naming ``where`` if it does not parse (or jinja2 is missing).
    """
    try:
        import jinja2
        import jinja2.ext
        import jinja2.meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError(f"{where}: rendering its chat_template needs jinja2: pip install jinja2 "
                         "(or the extra fmoe[data])") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        names = jinja2.meta.find_undeclared_variables(env.parse(source))
        template = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ValueError(f"{where}: its chat_template does not parse (line {err.lineno}: {err.message})") from None

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    return render, names


def _token_text(value) -> str | None:
    """A tokenizer_config special token: a string or an ``{"content": ...}`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {_kind(config)}")
    return config


def _chat_template_source(config: dict, path: Path) -> str | None:
    """The config's ``chat_template``: a string, or the one named ``"default"`` of a list."""
    source = config.get("chat_template")
    if source is None or isinstance(source, str):
        return source or None
    if isinstance(source, list) and all(isinstance(t, dict) for t in source):
        named = {t.get("name"): t.get("template") for t in source}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{path}: 'chat_template' is a list of templates named {', '.join(map(repr, named))}; "
                         "one must be named 'default' (with a string 'template')")
    raise ValueError(f"{path}: 'chat_template' must be a string or a list of {{\"name\", \"template\"}}, "
                     f"not {_kind(source)}")


def _single_token(tok, text: str) -> int | None:
    """The id ``text`` encodes to when it is one token of ``tok`` (encoded as the
    rendered conversations are: no special tokens added), else None."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return ids[0] if len(ids) == 1 else None


def _require_tokens(tok, tokenizer: Path, needed: dict[str, str]) -> None:
    """ValueError naming the first of ``needed`` (``{token: what needs it}``) that is not
    one token of ``tok``."""
    for text, why in needed.items():
        if _single_token(tok, text) is None:
            raise ValueError(f"{tokenizer}: a tokenizer without the special tokens the template needs: {text!r} "
                             f"({why}) is not a token of it; add it to the tokenizer, or pick another template")


def load_template(tokenizer: Path | None, tok, eos: str | None) -> Template:
    """The template for ``tokenizer`` (see the module docstring), its special tokens
    checked against ``tok``.

    Arguments:
        tokenizer: the ``tokenizer.json`` (its folder may hold ``tokenizer_config.json``),
            or None for UTF-8 bytes.
        tok: the ``tokenizers.Tokenizer`` read from it (None for bytes).
        eos: ``--eos``: overrides the config's ``eos_token`` (``""``: none).
    """
    if tokenizer is None:
        if eos:
            raise ValueError(f"--eos {eos!r} names a token of a tokenizer; byte-level data has none")
        return plain_template(None)
    config_path = Path(tokenizer).parent / CONFIG
    config = _read_config(config_path) if config_path.is_file() else {}
    eos_text = (eos or None) if eos is not None else _token_text(config.get("eos_token"))
    source = _chat_template_source(config, config_path)
    if source is None:
        if eos_text is None:
            have = [c for c in _prepare.EOS_CANDIDATES if tok.token_to_id(c) is not None]
            hint = f" (this tokenizer has {have[0]!r})" if have else ""
            raise ValueError(f"{tokenizer}: a tokenizer without the special tokens the template needs: the plain "
                             "chat template ends each assistant turn with an end-of-sequence token, and none is set; "
                             f"pass --eos TOKEN{hint}, or give {config_path} an 'eos_token' or a 'chat_template'")
        _require_tokens(tok, tokenizer, {eos_text: "the end of each assistant turn"})
        return plain_template(eos_text)
    variables = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    variables["eos_token"] = eos_text
    render, used = compile_chat_template(source, {k: v for k, v in variables.items() if v is not None},
                                         str(config_path))
    needed = {}
    for name in ("bos_token", "eos_token"):
        if name in used:
            if variables[name] is None:
                flag = " (or pass --eos TOKEN)" if name == "eos_token" else ""
                raise ValueError(f"{tokenizer}: a tokenizer without the special tokens the template needs: the "
                                 f"chat_template of {config_path} writes {name}, which it does not set{flag}")
            needed[variables[name]] = f"{name} of {config_path}"
    for text in sorted(set(_LITERAL_SPECIAL.findall(source))):
        needed.setdefault(text, f"written by the chat_template of {config_path}")
    _require_tokens(tok, tokenizer, needed)
    return Template("tokenizer", render, eos_text, None, f"the chat_template of {config_path}")


def _render(template: Template, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return template.render(messages, add_generation_prompt)
    except Exception as err:  # the template's raise_exception, or any error inside it
        raise ValueError(f"{where}: {template.source} fails on this conversation "
                         f"({type(err).__name__}: {err})") from None


def _prefix(template: Template, messages: list[dict], count: int, add_generation_prompt: bool, whole: str,
            where: str) -> int:
    """The length of ``render(messages[:count])``, checked to be a prefix of ``whole``
    (the render of more of the conversation)."""
    if count == 0 and not add_generation_prompt:
        return 0  # nothing rendered yet; some templates fail on no messages
    text = _render(template, messages[:count], add_generation_prompt, where)
    if not whole.startswith(text):
        prompt = " with the generation prompt" if add_generation_prompt else ""
        raise ValueError(f"{where}: {template.source} renders the first {count} message(s){prompt} as text that "
                         f"is not a prefix of its rendering of the conversation, so the assistant's turns (and the "
                         f"message boundaries) cannot be found by rendering it incrementally; use --train-on all "
                         f"--long truncate, or another template")
    return len(text)


def assistant_spans(template: Template, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
    """Each assistant message's ``(start, end)`` in ``text`` (the whole conversation's
    render): ``render(messages[:i], add_generation_prompt=True)`` to
    ``render(messages[:i + 1])``."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            end = _prefix(template, messages, i + 1, False, text, where) if i + 1 < len(messages) else len(text)
            done = text[:end]
            spans.append((_prefix(template, messages, i, True, done, where), end))
    return spans


def message_starts(template: Template, messages: list[dict], text: str, where: str) -> list[int]:
    """Where each message after the first starts in ``text``, in characters: where a
    long conversation may be split."""
    if template.direct is not None:
        return template.direct(messages)[2]
    return [_prefix(template, messages, i, False, text, where) for i in range(1, len(messages))]


def render_conversation(template: Template, messages: list[dict], train_on: str,
                        where: str) -> tuple[str, list[tuple[int, int]]]:
    """``(text, trained character spans)`` of one conversation."""
    if template.direct is not None:
        text, spans, _ = template.direct(messages)
    else:
        text = _render(template, messages, False, where)
        spans = assistant_spans(template, messages, text, where) if train_on == "assistant" else []
    if not text:
        raise ValueError(f"{where}: {template.source} renders this conversation as no text")
    return text, [(0, len(text))] if train_on == "all" else spans


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


# ---------------------------------------------------------------------------- packing


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

    def __init__(self, row_tokens: int, pad_id: int, dtype: np.dtype, emit: Callable, open_rows: int = _OPEN_ROWS):
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
    ``prepare._IN_FLIGHT`` earlier ones are encoded in threads, and packed in order. The
    progress bar advances by each packed batch's input bytes."""
    totals = _Counts(0, 0, 0)
    in_flight = _prepare._IN_FLIGHT
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
                 open_rows: int = _OPEN_ROWS) -> dict:
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
    out = _prepare.check_out(out, overwrite)
    files = _prepare.find_inputs(inputs, globs)
    if tokenizer is None:
        tok, vocab = None, 256
    else:
        tokenizer = Path(tokenizer)
        tok, vocab = _prepare.open_tokenizer(tokenizer)
    template = load_template(tokenizer, tok, eos)
    eos_id = None if tok is None or template.eos is None else _single_token(tok, template.eos)
    dtype = _prepare._dtype(vocab)
    encode = bytes_encoder if tok is None else tokenizer_encoder(tok, dtype)
    row_tokens = seq + 1
    tmp = _prepare.temporary_sibling(out)
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
            if (tokenizer.parent / CONFIG).is_file():
                shutil.copyfile(tokenizer.parent / CONFIG, tmp / CONFIG)
        positions = packer.closed * row_tokens
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": vocab, "tokens": positions,
                "max_id": packer.max_id, "documents": counts.conversations,
                "tokenizer": "tokenizer.json" if tokenizer is not None else None, "eos_id": eos_id,
                "sources": [str(Path(p).resolve()) for p in inputs], "files": len(files),
                "packed": {"row_tokens": row_tokens, "rows": packer.closed, "conversations": counts.conversations,
                           "trained_tokens": packer.trained, "split": counts.split, "truncated": counts.truncated,
                           "template": template.name, "train_on": train_on,
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
    return (f"fmoe.data: {packed['conversations']} conversations ({packed['split']} split, {packed['truncated']} "
            f"truncated), {content:,} tokens in {packed['rows']} rows of {packed['row_tokens']}, "
            f"{trained:.1%} trained on, packing {packed['packing_efficiency']:.1%} -> {out}")
