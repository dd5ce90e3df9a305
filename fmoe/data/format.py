"""The corpus directory, as both writers (``prepare``'s text, ``chat``'s conversations)
write it and ``tokens`` reads it: the marks in its ``meta.json``, the dtype of its ids,
and replacing one safely. The layout is described in ``fmoe.data.tokens``.

The bottom of ``fmoe.data``'s imports: it imports nothing of the package.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np

FORMAT, VERSION = "fmoe-tokens", 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_dtype(vocab: int) -> np.dtype:
    """The dtype a corpus stores the ids of a ``vocab`` in: ``uint16`` when they fit,
    else ``uint32``."""
    return np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)


def is_corpus(path: Path) -> bool:
    """Whether ``path`` holds a corpus written by fmoe (its ``meta.json`` says so)."""
    try:
        return json.loads((path / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_out(out, overwrite: bool) -> Path:
    """``out`` as a Path, if it may be written: absent, or (``overwrite``) a corpus
    (ValueError otherwise: never replace, say, a folder of input texts)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out} exists; pass --overwrite to replace it")
    if out.exists() and not is_corpus(out):
        raise ValueError(f"--out {out} exists and is not a corpus written by fmoe.data prepare; "
                         "refusing to replace it")
    return out


def temporary_sibling(out: Path) -> Path:
    """A new empty directory beside ``out``, renamed onto it when complete (so ``out``
    never holds a partial corpus)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp
