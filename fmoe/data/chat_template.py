"""How a conversation becomes text and which of it is trained on: the tokenizer's
``chat_template`` (rendered with jinja2 as Hugging Face's ``apply_chat_template`` does)
or the plain template, and the assistant spans found by rendering incrementally (the
rules: ``fmoe.data.chat``)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Callable, NamedTuple

from .encoding import EOS_CANDIDATES

CONFIG = "tokenizer_config.json"
# where transformers >= 4.50 saves a tokenizer's (default) chat template, beside
# tokenizer.json; it wins over the config's "chat_template", as in transformers
JINJA = "chat_template.jinja"
PLAIN_GENERATION_PROMPT = "<|assistant|>\n"
# a token a chat template writes as literal text, such as ChatML's <|im_start|>: the
# tokenizer must hold it as one token, or every turn silently becomes ordinary text
_LITERAL_SPECIAL = re.compile(r"<\|[^|\s]+\|>")


def describe_kind(value) -> str:
    """What an error says a JSON value is."""
    return "null (or missing)" if value is None else f"type {type(value).__name__}"


class Template(NamedTuple):
    """How a conversation becomes text.

    Attributes:
        name: ``"tokenizer"`` (the tokenizer_config's ``chat_template``) or ``"plain"``.
        render: ``(messages, add_generation_prompt) -> text``.
        eos: the end-of-sequence token's text (``eos_token``), or None.
        direct: for the plain template, ``messages -> (text, assistant spans, message
            starts)`` in one pass: what incremental rendering finds, without re-rendering.
        source: where the template comes from, for error messages.
        file: the file it was read from (``chat_template.jinja`` or
            ``tokenizer_config.json``), or None for the plain template.
    """

    name: str
    render: Callable[[list[dict], bool], str]
    eos: str | None
    direct: Callable[[list[dict]], tuple[str, list[tuple[int, int]], list[int]]] | None = None
    source: str = "the plain chat template"
    file: str | None = None


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
        raise ValueError(f"{path}: must hold a JSON object, not {describe_kind(config)}")
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
                     f"not {describe_kind(source)}")


def single_token(tok, text: str) -> int | None:
    """The id ``text`` encodes to when it is one token of ``tok`` (encoded as the
    rendered conversations are: no special tokens added), else None."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return ids[0] if len(ids) == 1 else None


def _require_tokens(tok, tokenizer: Path, needed: dict[str, str]) -> None:
    """ValueError naming the first of ``needed`` (``{token: what needs it}``) that is not
    one token of ``tok``."""
    for text, why in needed.items():
        if single_token(tok, text) is None:
            raise ValueError(f"{tokenizer}: a tokenizer without the special tokens the template needs: {text!r} "
                             f"({why}) is not a token of it; add it to the tokenizer, or pick another template")


def load_template(tokenizer: Path | None, tok, eos: str | None) -> Template:
    """The template for ``tokenizer`` (see the module docstring), its special tokens
    checked against ``tok``.

    Arguments:
        tokenizer: the ``tokenizer.json`` (its folder may hold ``tokenizer_config.json``
            and ``chat_template.jinja``, which wins over the config's ``chat_template``),
            or None for UTF-8 bytes.
        tok: the ``tokenizers.Tokenizer`` read from it (None for bytes).
        eos: ``--eos``: overrides the config's ``eos_token`` (``""``: none).
    """
    if tokenizer is None:
        if eos:
            raise ValueError(f"--eos {eos!r} names a token of a tokenizer; byte-level data has none")
        return plain_template(None)
    config_path, jinja = Path(tokenizer).parent / CONFIG, Path(tokenizer).parent / JINJA
    config = _read_config(config_path) if config_path.is_file() else {}
    eos_text = (eos or None) if eos is not None else _token_text(config.get("eos_token"))
    source, origin = (_read_jinja(jinja), jinja) if jinja.is_file() else \
        (_chat_template_source(config, config_path), config_path)
    if source is None:
        if eos_text is None:
            have = [c for c in EOS_CANDIDATES if tok.token_to_id(c) is not None]
            hint = f" (this tokenizer has {have[0]!r})" if have else ""
            raise ValueError(f"{tokenizer}: a tokenizer without the special tokens the template needs: the plain "
                             "chat template ends each assistant turn with an end-of-sequence token, and none is set; "
                             f"pass --eos TOKEN{hint}, or give {config_path} an 'eos_token' or a 'chat_template'")
        _require_tokens(tok, tokenizer, {eos_text: "the end of each assistant turn"})
        return plain_template(eos_text)
    variables = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    variables["eos_token"] = eos_text
    render, used = compile_chat_template(source, {k: v for k, v in variables.items() if v is not None},
                                         str(origin))
    needed = {}
    for name in ("bos_token", "eos_token"):
        if name in used:
            if variables[name] is None:
                flag = " (or pass --eos TOKEN)" if name == "eos_token" else ""
                raise ValueError(f"{tokenizer}: a tokenizer without the special tokens the template needs: the "
                                 f"chat_template of {origin} writes {name}, which {config_path} does not set{flag}")
            needed[variables[name]] = f"{name} of {config_path}"
    for text in sorted(set(_LITERAL_SPECIAL.findall(source))):
        needed.setdefault(text, f"written by the chat_template of {origin}")
    _require_tokens(tok, tokenizer, needed)
    return Template("tokenizer", render, eos_text, None, f"the chat_template of {origin}", str(origin.resolve()))


def _read_jinja(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None


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
