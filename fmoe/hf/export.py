"""``python -m fmoe.hf export``: an fmoe checkpoint as a Hugging Face model directory.

    python -m fmoe.hf export runs/mine/checkpoint --out hf/mine             # bf16 safetensors
    python -m fmoe.hf export runs/ft/checkpoint --out hf/ft --source ~/models/Qwen3-30B-A3B

Writes ``config.json`` and safetensors (``fmoe.hf.save``), the tokenizer and a
``generation_config.json``, so ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read the folder. The source Hugging Face directory
(``--source``; by default the ``init_from_hf`` of the run's ``settings.toml``) gives
the keys of its ``config.json`` that fmoe did not change, its tokenizer files and its
generation config; a model trained from scratch gets the ``tokenizer.json`` its run
recorded (if its corpus had one; checked by content, never a file that merely lies
beside the checkpoint) and the end-of-text id its checkpoint names.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tomllib
from pathlib import Path

from ..checkpoint import load, read_config
from ..checkpoint.files import write_atomically
from ..config import Plan
from ..data import recorded_tokenizer
from .api import save

# Files of a Hugging Face tokenizer, copied from the source when it has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def run_source(checkpoint: Path) -> Path | None:
    """The ``init_from_hf`` directory in the ``settings.toml`` of the checkpoint's run, if any."""
    settings = checkpoint.resolve().parent / "settings.toml"
    if not settings.is_file():
        return None
    source = tomllib.loads(settings.read_text()).get("init_from_hf") or None
    return Path(source) if source else None


def export(checkpoint, out, source=None, tokenizer=None, dtype: str = "bfloat16") -> Path:
    """Write the fmoe checkpoint ``checkpoint`` as a Hugging Face directory ``out``.

    Arguments:
        checkpoint: an fmoe checkpoint (``runs/x/checkpoint``).
        out: the output directory (created, or replaced if it holds a ``config.json``).
        source: the Hugging Face directory the run started from; None: the run's
            ``init_from_hf`` if its ``settings.toml`` names one.
        tokenizer: a ``tokenizer.json`` to include; None: the source's tokenizer files,
            else the one the checkpoint's run recorded, if any.
        dtype: the weights' dtype in the files, ``bfloat16 | float16 | float32``.

    Returns:
        ``out`` as a Path.

    Raises:
        ValueError: naming what cannot be exported (a missing file, a model no
            Hugging Face family holds, a trained expert bias).
    """
    checkpoint, out = Path(checkpoint), Path(out)
    source = Path(source) if source else run_source(checkpoint)
    if source is not None and not (source / "config.json").is_file():
        raise ValueError(f"--source {source}: no config.json (a Hugging Face model directory has one)")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no such file")
    cfg = read_config(checkpoint)
    plan = Plan(model=cfg)
    ck = load(checkpoint, plan)
    tokenizer_files = _tokenizer_files(checkpoint, ck.extra, cfg.vocab, source, tokenizer)  # refused before writing
    save(out, ck.params, plan, dtype=dtype, source=source)
    hf_config = json.loads((out / "config.json").read_text())
    if ck.extra.get("eos_id") is not None and "eos_token_id" not in hf_config:
        hf_config["eos_token_id"] = ck.extra["eos_id"]  # the corpus's end-of-document id
        write_atomically(json.dumps(hf_config, indent=2), out / "config.json")
    for name, path in tokenizer_files.items():
        shutil.copyfile(path, out / name)
    _write_generation_config(out, source, hf_config)
    return out


def _tokenizer_files(checkpoint: Path, extra: dict, vocab: int, source: Path | None, tokenizer) -> dict[str, Path]:
    """The tokenizer to ship, ``{name in out: file}``: ``--tokenizer``, else the
    source's files, else the one the run recorded (checked by content; none for bytes)."""
    if tokenizer is not None:
        return {"tokenizer.json": Path(tokenizer)}
    found = {name: source / name for name in TOKENIZER_FILES if source is not None and (source / name).is_file()}
    if not found and (recorded := recorded_tokenizer(checkpoint, extra, vocab)):
        found = {"tokenizer.json": recorded}
    return found


def _write_generation_config(out: Path, source: Path | None, hf_config: dict) -> None:
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
        return
    ids = {key: hf_config[key] for key in _TOKEN_IDS if hf_config.get(key) is not None}
    write_atomically(json.dumps({"_from_model_config": True, **ids}, indent=2), out / "generation_config.json")


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m fmoe.hf", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="an fmoe checkpoint -> a Hugging Face model directory", allow_abbrev=False)
    ex.add_argument("checkpoint", help="an fmoe checkpoint, e.g. runs/mine/checkpoint")
    ex.add_argument("--out", required=True, help="the Hugging Face directory to write")
    ex.add_argument("--source", default=None, help="the Hugging Face directory the run started from "
                                                   "(default: the run's --init-from-hf, if any)")
    ex.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the source's, else the run's)")
    ex.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = ap.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.source, args.tokenizer, args.dtype)
    except (ValueError, OSError) as err:
        raise SystemExit(f"fmoe.hf export: {err}") from None
    print(f"fmoe.hf export: wrote {out} (" + ", ".join(sorted(p.name for p in out.iterdir())) + ")")
    return out
