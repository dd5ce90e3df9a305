"""``python -m fmoe.hf export``: an fmoe checkpoint as a Hugging Face model directory.

    python -m fmoe.hf export runs/mine/checkpoint --out hf/mine             # bf16 safetensors
    python -m fmoe.hf export runs/ft/checkpoint --out hf/ft --source ~/models/Qwen3-30B-A3B
    python -m fmoe.hf export runs/mine/checkpoint --out hf/mine --overwrite # replace an earlier export
    python -m fmoe.hf export runs/lora/checkpoint --out hf/lora --adapter   # a PEFT adapter (--lora-rank runs)

Writes ``config.json`` and safetensors (``fmoe.hf.save``), the tokenizer and a
``generation_config.json``, so ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read the folder. The source Hugging Face directory
(``--source``; by default the ``init_from_hf`` of the run's ``settings.toml``) gives
the keys of its ``config.json`` that fmoe did not change, its tokenizer files (chat
template included) and its generation config; it must describe the checkpoint's model
(same family, same shapes). A model trained from scratch gets the ``tokenizer.json``
its run recorded (checked by content, never a file that merely lies beside the
checkpoint) and the end-of-text id its checkpoint names, or, trained on UTF-8 bytes, a
byte-level ``tokenizer.json`` (``fmoe.hf.export_tokenizer``).

An existing non-empty ``--out`` is refused unless ``--overwrite`` (and then only a
Hugging Face model folder); the source folder and the checkpoint never. The folder is
written beside ``--out`` and renamed into place when complete, so a failure or Ctrl-C
(exit 130) leaves ``--out`` as it was (``fmoe.hf.export_folder``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tomllib
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint import load, read_config, read_lora
from ..checkpoint.files import write_atomically
from ..config import ModelConfig, Plan
from ..lora import merge
from .adapter import CONFIG_FILE as ADAPTER_CONFIG, save_adapter
from .api import _architecture_diff, _read_config_json, config, save
from .api import load as load_hf
from .export_folder import check_out, staged_folder
from .export_tokenizer import choose_tokenizer
from .families import family_of

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def run_source(checkpoint: Path) -> Path | None:
    """The ``init_from_hf`` directory in the ``settings.toml`` of the checkpoint's run, if any."""
    settings = checkpoint.resolve().parent / "settings.toml"
    if not settings.is_file():
        return None
    source = tomllib.loads(settings.read_text()).get("init_from_hf") or None
    return Path(source) if source else None


def export(checkpoint, out, source=None, tokenizer=None, dtype: str = "bfloat16", overwrite: bool = False,
           adapter: bool = False) -> Path:
    """Write the fmoe checkpoint ``checkpoint`` as a Hugging Face directory ``out``,
    all at once: nothing of it appears in ``out`` until it is complete.

    A checkpoint of adapters (a ``--lora-rank`` run's) is written as its base model (the
    ``source``) with the adapters merged, or with ``adapter`` as a PEFT adapter folder
    (``fmoe.hf.save_adapter``) that ``peft.PeftModel.from_pretrained`` loads onto the
    source model.

    Arguments:
        checkpoint: an fmoe checkpoint (``runs/x/checkpoint``).
        out: the output directory: absent or empty, or (``overwrite``) a Hugging Face
            model folder to replace; never the source nor the checkpoint.
        source: the Hugging Face directory the run started from; None: the run's
            ``init_from_hf`` if its ``settings.toml`` names one.
        tokenizer: a ``tokenizer.json`` to include; None: the source's tokenizer files,
            else the one the checkpoint's run recorded, else a byte-level one.
        dtype: the weights' dtype in the files, ``bfloat16 | float16 | float32``.
        overwrite: replace an existing non-empty ``out`` (only once the new folder is complete).
        adapter: write a checkpoint of adapters as a PEFT adapter folder.

    Returns:
        ``out`` as a Path.

    Raises:
        ValueError: naming what cannot be exported (``--out`` taken, a missing file, a
            source of another model, a model no Hugging Face family holds, a trained
            expert bias), before anything is written.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    named = source is not None
    source = Path(source) if named else run_source(checkpoint)
    where = f"--source {source}" + ("" if named else " (the run's init_from_hf)")
    if source is not None and not (source / "config.json").is_file():
        raise ValueError(f"{where}: no config.json (a Hugging Face model directory has one)")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no such file")
    started_from = run_source(checkpoint)  # protected even when --source names another folder
    adapters = read_lora(checkpoint)
    if adapter and adapters is None:
        raise ValueError(f"--adapter: {checkpoint} holds a whole model, not adapters (a --lora-rank run's "
                         "checkpoint has them): leave --adapter out")
    if adapters is not None and source is None:
        raise ValueError(f"{checkpoint} holds adapters, whose base model the run's settings.toml does not name: "
                         "pass --source, the Hugging Face folder the run started from")
    target = check_out(out, overwrite, {f"the folder the run started from ({started_from})": started_from,
                                        f"--source ({source})": source, "the checkpoint": checkpoint},
                       marker=ADAPTER_CONFIG if adapter else "config.json")
    cfg = read_config(checkpoint)
    if source is not None:
        check_source(source, cfg, where)
    plan = Plan(model=cfg, lora=adapters)
    ck = _load(checkpoint, plan)
    if adapter:
        with staged_folder(target) as stage:
            save_adapter(stage, ck.params, plan, source=source)
        return out
    if adapters is not None:  # the base with the adapters merged: a plain model from here on
        ck = ck._replace(params=merge(load_hf(source, plan), ck.params, plan))
        plan = plan.replace(lora=None)
    shipped = choose_tokenizer(checkpoint, ck.extra, cfg.vocab, source, tokenizer, _eos_id(ck.extra, source))
    with staged_folder(target) as stage:
        save(stage, ck.params, plan, dtype=dtype, source=source)
        hf_config = json.loads((stage / "config.json").read_text())
        if ck.extra.get("eos_id") is not None and "eos_token_id" not in hf_config:
            hf_config["eos_token_id"] = ck.extra["eos_id"]  # the corpus's end-of-document id
            write_atomically(json.dumps(hf_config, indent=2), stage / "config.json")
        shipped.write(stage)
        _write_generation_config(stage, source, hf_config)
    return out


def _load(checkpoint: Path, plan: Plan):
    """``fmoe.load``; a Ctrl-C that torch's checkpoint reader wrapped (as the failure of
    its step) raised as itself."""
    try:
        return load(checkpoint, plan)
    except CheckpointException as err:
        failures = [f[0] if isinstance(f, tuple) else f for f in (getattr(err, "failures", None) or {}).values()]
        if any(isinstance(f, KeyboardInterrupt) for f in failures):
            raise KeyboardInterrupt from None
        raise


def check_source(source: Path, cfg: ModelConfig, where: str) -> None:
    """Refuse a source folder that describes another model than ``cfg`` (its keys would be
    written over the checkpoint's): another family, or other shapes or features.

    Raises:
        ValueError: naming ``where`` (the ``--source``) and the first difference, both values.
    """
    family = family_of(cfg)
    theirs = _read_config_json(source).get("model_type")
    if theirs != family:
        raise ValueError(f"{where}: its config.json has model_type={theirs!r}, but this checkpoint is written as "
                         f"{family!r}: pass the --source the run started from, or none")
    try:
        diff = _architecture_diff(config(source), cfg)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if diff:
        raise ValueError(f"{where} describes another model than the checkpoint: its {diff[0]}; pass the --source "
                         "the run started from, or none")


def _eos_id(extra: dict, source: Path | None) -> int | None:
    """The end-of-document id: the checkpoint's corpus's, else the source config's."""
    if extra.get("eos_id") is not None:
        return extra["eos_id"]
    if source is None:
        return None
    eos = _read_config_json(source).get("eos_token_id")
    return eos if isinstance(eos, int) else None


def _write_generation_config(out: Path, source: Path | None, hf_config: dict) -> None:
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
        return
    ids = {key: hf_config[key] for key in _TOKEN_IDS if hf_config.get(key) is not None}
    write_atomically(json.dumps({"_from_model_config": True, **ids}, indent=2), out / "generation_config.json")


def main(argv=None) -> Path:
    """``python -m fmoe.hf export ...``: errors exit non-zero with one line on stderr,
    Ctrl-C with 130 and one line."""
    ap = argparse.ArgumentParser(prog="python -m fmoe.hf", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="an fmoe checkpoint -> a Hugging Face model directory", allow_abbrev=False,
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ex.add_argument("checkpoint", help="an fmoe checkpoint, e.g. runs/mine/checkpoint")
    ex.add_argument("--out", required=True, help="the Hugging Face directory to write (absent or empty, unless "
                                                 "--overwrite)")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing --out that is a Hugging Face model "
                                                             "folder, once the new one is complete")
    ex.add_argument("--source", default=None, help="the Hugging Face directory the run started from "
                                                   "(default: the run's --init-from-hf, if any)")
    ex.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the source's, else the run's, "
                                                      "else UTF-8 bytes)")
    ex.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ex.add_argument("--adapter", action="store_true", help="a checkpoint of adapters (--lora-rank) as a PEFT "
                                                           "adapter folder instead of the merged model")
    args = ap.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.source, args.tokenizer, args.dtype, args.overwrite,
                     args.adapter)
    except (ValueError, OSError) as err:
        raise SystemExit(f"fmoe.hf export: {err}") from None
    except KeyboardInterrupt:  # staged_folder has removed what was written
        kept = "is as it was" if Path(args.out).exists() else "was not created"
        print(f"fmoe.hf export: interrupted (Ctrl-C); nothing was written (--out {args.out} {kept})", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"fmoe.hf export: wrote {out} (" + ", ".join(sorted(p.name for p in out.iterdir())) + ")")
    return out
