"""The tokenizer ``python -m fmoe.hf export`` ships beside the weights, so that
``transformers.AutoTokenizer.from_pretrained`` reads every export:

- ``--tokenizer FILE``: that ``tokenizer.json``;
- else the source's tokenizer files (``SOURCE_FILES``: the tokenizer, its config, chat
  templates, added tokens; never its weights), when the source has a tokenizer;
- else the ``tokenizer.json`` the checkpoint's run recorded (checked by content);
- else (a byte-level run) a ``tokenizer.json`` built with ``tokenizers`` whose id ``i``
  is byte ``i``, decoding as fmoe decodes bytes (invalid UTF-8 as U+FFFD).

A tokenizer shipped without a ``tokenizer_config.json`` gets one naming its class and
its end-of-document token (the checkpoint's ``extra["eos_id"]``), so
``AutoTokenizer(...).eos_token`` is set. Everything is checked by ``choose_tokenizer``,
before the export writes anything; ``ShippedTokenizer.write`` only writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

from ..checkpoint.files import write_atomically
from ..data import recorded_tokenizer

# Files that hold a tokenizer's vocabulary (names or patterns); a source with none of
# them has no tokenizer to ship.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model",
               "*.tiktoken")
# The whole of a Hugging Face tokenizer as a model folder holds it: the above, its config,
# special and added tokens, BPE merges, chat templates (transformers >= 5 saves them as
# ``chat_template.jinja`` and ``additional_chat_templates/``) and a remote-code tokenizer.
SOURCE_FILES = VOCAB_FILES + ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt",
                              "chat_template.jinja", "chat_template.json", "additional_chat_templates",
                              "tokenization_*.py")
# The class that reads a bare tokenizer.json whatever the model's family (a family's own
# tokenizer class may rebuild the pipeline from other files).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


class ShippedTokenizer(NamedTuple):
    """What the export writes of the tokenizer.

    Attributes:
        copies: ``{name in the export: file or folder to copy}``.
        built: a ``tokenizers.Tokenizer`` to save as ``tokenizer.json`` (byte-level runs), or None.
        config: the ``tokenizer_config.json`` to write, or None (one is copied).
    """

    copies: dict
    built: object
    config: dict | None

    def write(self, out: Path) -> None:
        """Write the tokenizer's files into the folder ``out``."""
        for name, path in self.copies.items():
            if path.is_dir():  # additional_chat_templates/: its files, as new files (modes as the umask says)
                (out / name).mkdir()
                for file in sorted(p for p in path.iterdir() if p.is_file()):
                    shutil.copyfile(file, out / name / file.name)
            else:
                shutil.copyfile(path, out / name)
        if self.built is not None:
            self.built.save(str(out / "tokenizer.json"))
        if self.config is not None:
            write_atomically(json.dumps(self.config, indent=2), out / "tokenizer_config.json")


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("the export's tokenizer needs the tokenizers package, which is missing: "
                         "pip install tokenizers (or the extra fmoe[data])") from None
    return tokenizers


def source_tokenizer_files(source: Path | None) -> dict:
    """``{name: path}`` of the source's tokenizer files; empty when it holds no vocabulary."""
    if source is None:
        return {}
    found = {p.name: p for pattern in SOURCE_FILES for p in sorted(source.glob(pattern))
             if p.is_file() or (p.is_dir() and p.name == "additional_chat_templates")}
    has_vocab = any(any(source.glob(pattern)) for pattern in VOCAB_FILES)
    return found if has_vocab else {}


def _byte_to_symbol() -> dict[int, str]:
    """The character ``tokenizers``' ByteLevel pre-tokenizer writes for each byte (GPT-2's
    table: printable Latin-1 bytes stand for themselves, the others for code points from
    256 up, in order); ``byte_level_tokenizer`` checks it against the library's alphabet."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return symbols


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` of UTF-8 bytes: id ``i`` is byte ``i`` (fmoe's byte-level
    ids), decoded as UTF-8 with U+FFFD for invalid sequences.

    Raises:
        ValueError: ``tokenizers`` is missing.
    """
    tk = _tokenizers()
    symbols = _byte_to_symbol()
    if sorted(symbols.values()) != sorted(tk.pre_tokenizers.ByteLevel.alphabet()):
        raise ValueError(f"tokenizers {tk.__version__}: its ByteLevel alphabet is not GPT-2's byte table; "
                         "the byte-level tokenizer.json cannot be built")
    # a BPE without merges: each pre-tokenized symbol is one token, the id of its byte
    tok = tk.Tokenizer(tk.models.BPE(vocab={s: b for b, s in symbols.items()}, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def _config(eos_token: str | None) -> dict:
    # spaces before punctuation are the model's text: never "cleaned up" on decoding
    config = {"tokenizer_class": TOKENIZER_CLASS, "clean_up_tokenization_spaces": False}
    return config if eos_token is None else {**config, "eos_token": eos_token}


def _eos_token(path: Path, eos_id: int | None) -> str | None:
    """The token string of ``eos_id`` in the tokenizer.json ``path`` (ValueError if it has none)."""
    if eos_id is None:
        return None
    tk = _tokenizers()
    try:
        tok = tk.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(f"{path}: not a readable tokenizer.json ({err})") from None
    token = tok.id_to_token(eos_id)
    if token is None:
        raise ValueError(f"the end-of-document id {eos_id} is no token of {path} "
                         f"(its ids: 0..{tok.get_vocab_size() - 1})")
    return token


def choose_tokenizer(checkpoint: Path, extra: dict, vocab: int, source: Path | None, tokenizer,
                     eos_id: int | None) -> ShippedTokenizer:
    """The tokenizer to ship (see the module's docstring), every check done.

    Arguments:
        checkpoint: the fmoe checkpoint.
        extra: its ``extra`` (the recorded tokenizer).
        vocab: its model's vocabulary.
        source: the Hugging Face folder the run started from, or None.
        tokenizer: a ``tokenizer.json`` given with ``--tokenizer``, or None.
        eos_id: the end-of-document id a written ``tokenizer_config.json`` names, or None.

    Returns:
        The ShippedTokenizer.

    Raises:
        ValueError: the recorded tokenizer is missing or another, ``tokenizers`` is
            missing where a file must be read or built, ``eos_id`` is no token.
    """
    if tokenizer is not None:
        path = Path(tokenizer)
        return ShippedTokenizer({"tokenizer.json": path}, None, _config(_eos_token(path, eos_id)))
    found = source_tokenizer_files(source)
    if found:
        made = None if "tokenizer_config.json" in found or "tokenizer.json" not in found else \
            _config(_eos_token(found["tokenizer.json"], eos_id))
        return ShippedTokenizer(found, None, made)
    recorded = recorded_tokenizer(checkpoint, extra, vocab)
    if recorded is not None:
        return ShippedTokenizer({"tokenizer.json": recorded}, None, _config(_eos_token(recorded, eos_id)))
    return ShippedTokenizer({}, byte_level_tokenizer(), _config(None))  # bytes have no end-of-document token
