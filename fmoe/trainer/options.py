"""The main job's settings: one flag per ModelConfig and Plan field and per run option,
merged from defaults, the ``cpu`` preset, a TOML file and the command line.

Every setting has one name: ``--shared-ffn`` on the command line is ``shared_ffn`` in
a TOML file. Precedence, lowest first: the fields' defaults, the ``cpu`` preset (the
defaults of the main job), ``--config`` (a TOML file, or the name of a shipped
preset), then the flags given. Everything is checked here, before any process group
or tensor exists: an unknown key, a value of the wrong type or a value a ModelConfig
or Plan refuses is a ValueError naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import tomllib
from pathlib import Path

from ..config import ModelConfig, Plan, choices, field_docs

PRESETS_DIR = Path(__file__).parent / "presets"

# (name, type, default, help). bool options are switches: present means true.
RUN_OPTIONS = (
    ("config", str, "", "a TOML file of settings, or a shipped preset's name (see --print-config)"),
    ("print_config", bool, False, "print the merged settings as TOML and exit"),
    ("steps", int, 1000, "optimizer steps"),
    ("batch", int, 16, "sequences per step, over all ranks"),
    ("seq", int, 128, "tokens per sequence"),
    ("lr", float, 3e-3, "peak learning rate (linear warm-up, cosine decay)"),
    ("warmup", int, 30, "warm-up steps"),
    ("min_lr_ratio", float, 0.1, "the cosine decay ends at this fraction of --lr"),
    ("weight_decay", float, 0.1, "decoupled weight decay of the matrices"),
    ("clip", float, 1.0, "global grad-norm clip (0: off)"),
    ("fused_optimizer", bool, False, "torch's fused AdamW kernel, updating params and moments in place (same state and update up to rounding)"),
    ("max_skips", int, 5, "skip updates whose gradients hold NaN/inf; stop after this many in a row (0: off)"),
    ("seed", int, 0, "init and data sampling seed"),
    ("data", str, "", "a directory written by `python -m fmoe.data prepare` (default: the embedded corpus)"),
    ("heldout_fraction", float, 0.05, "the tail of the tokens held out for evaluation"),
    ("init_from_hf", str, "", "start from this Hugging Face checkpoint directory (fine-tuning)"),
    ("log_every", int, 1, "read the step's metrics to the host and log them every N steps (and at evaluations, "
                          "checkpoints and the last step); the steps between queue on the device without a sync"),
    ("eval_every", int, 200, "evaluate the held-out loss every N steps"),
    ("eval_batches", int, 8, "held-out batches per evaluation"),
    ("out", str, "runs/fmoe-lm", "folder for metrics.jsonl, TensorBoard events and the checkpoint"),
    ("save_every", int, 250, "checkpoint every N steps (0: only at the end)"),
    ("keep", int, 1, "checkpoints to keep (the newest; one is removed only after a newer one is complete)"),
    ("resume", bool, False, "continue from the checkpoint in --out (--no-resume: not, whatever --config says)"),
    ("overwrite", bool, False, "start afresh in an --out that holds a run: its settings, metrics, events and "
                               "checkpoints are removed (and listed) first"),
    ("auto_resume", bool, False, "continue from the checkpoint in --out if there is one, else start "
                                 "(for torchrun --max-restarts)"),
    ("stop_after", int, 0, "end this run after that step, with a checkpoint (0: run to --steps)"),
    ("timeout", float, 1800.0, "seconds a collective waits for the other ranks before the job fails"),
    ("cuda_graph", str, "", "CUDA-graph scopes, comma-separated from attn, router, experts; or 'step' "
                            "(python -m interop.train)"),
    ("peak_tflops", float, 0.0, "the device's peak for MFU (0: known GPUs only)"),
    ("sample_tokens", int, 64, "tokens to generate from a held-out prompt at the end (0: none)"),
    ("threads", int, 0, "CPU threads per process (0: torch's default)"),
    ("no_progress", bool, False, "no progress bar"),
    ("no_tensorboard", bool, False, "no TensorBoard events even when tensorboard is installed"),
)
RUN_DEFAULTS = {name: default for name, _, default, _ in RUN_OPTIONS}
# What a run is asked to do with its folder, not how it trains: never written to a
# settings file (reusing one for a new --out must not resume or remove anything), and
# each has a --no- form to undo a --config that sets it.
FOLDER_ACTIONS = ("resume", "auto_resume", "overwrite")
UNSET_PATHS = ("data", "init_from_hf")  # "" by default, meaning the embedded corpus / random weights
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _field_type(field) -> type:
    if field.name == "units":
        return str  # "embed+head,layers.0+layers.1": units separated by commas, members by +
    return _TYPES[str(field.type)]


MODEL_FIELDS = {f.name: _field_type(f) for f in dataclasses.fields(ModelConfig)}
PLAN_FIELDS = {f.name: _field_type(f) for f in dataclasses.fields(Plan) if f.name != "model"}
KNOWN = {**{n: t for n, t, _, _ in RUN_OPTIONS}, **MODEL_FIELDS, **PLAN_FIELDS}


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistyped flag gets one line with the nearest flags, not the usage."""

    def error(self, message: str):
        unknown = [a.split("=", 1)[0] for a in message.split(": ", 1)[-1].split() if a.startswith("--")]
        hints = []
        for flag in unknown if message.startswith("unrecognized arguments") else []:
            close = difflib.get_close_matches(flag, [o for o in self._option_string_actions if o.startswith("--")],
                                              n=3, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {' or '.join(close)}?")
        self.exit(2, f"{self.prog}: error: {message}" + "".join(f"\n  {h}" for h in hints)
                  + f"\n(see {self.prog} --help)\n")


@functools.cache  # the parser of every run lists them; the shipped files do not change
def preset_summary(name: str) -> str:
    """One line of ``--help``: the preset's size (computed from its model, at a 32k
    vocabulary where the preset leaves the vocabulary to the data), shape and device."""
    from ..params import active_param_count, flat_shapes

    own = read_toml(name)[0]
    settings = {**_defaults(), **own}
    cfg = model_config(settings, **({} if "vocab" in own or name == "cpu" else {"vocab": 32000}))
    total = sum(math.prod(shape) for shape in flat_shapes(cfg).values())
    return (f"  {name}: {total / 1e6:,.1f}M params, {active_param_count(cfg) / 1e6:,.1f}M active at vocab "
            f"{cfg.vocab}; D={cfg.dim}, {cfg.layers} layers, E={cfg.experts} top-{cfg.topk} F={cfg.ffn}; "
            f"{settings['device']}, {settings['dtype']}")


def _shown(value) -> str:
    return "unset" if value == "" else repr(value)


def parser(prog: str = "python -m fmoe.train") -> argparse.ArgumentParser:
    """Every setting as a flag, each with its meaning (the dataclass docstrings for
    ModelConfig and Plan fields), its allowed values and the main job's default;
    nothing has a default in the namespace, so it holds exactly the flags given
    (merging happens in ``resolve``). No abbreviations: ``--sample`` is an error."""
    ap = _Parser(prog=prog, argument_default=argparse.SUPPRESS, allow_abbrev=False,
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Presets (--config NAME; the cpu preset holds the defaults shown above):\n"
                        + "\n".join(preset_summary(p) for p in presets()))
    defaults = _defaults()
    groups = (("run", {n: t for n, t, _, _ in RUN_OPTIONS}, {n: h for n, _, _, h in RUN_OPTIONS}),
              ("model (fmoe.ModelConfig fields)", MODEL_FIELDS, field_docs(ModelConfig)),
              ("plan (fmoe.Plan fields)", PLAN_FIELDS, field_docs(Plan)))
    for title, fields, helps in groups:
        group = ap.add_argument_group(title)
        for name, kind in fields.items():
            help_ = helps.get(name, "")
            allowed = choices(name)
            if allowed is not None:
                help_ += " One of: " + ", ".join(map(str, allowed)) + "."
            if name not in ("config", "print_config"):
                help_ += f" (default: {_shown(defaults[name])})"
            help_ = help_.replace("%", "%%")
            if kind is bool and title == "run" and name not in FOLDER_ACTIONS:
                group.add_argument(_flag(name), action="store_true", help=help_)
            elif kind is bool:
                group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, help=help_)
            else:
                group.add_argument(_flag(name), type=kind, help=help_, metavar=kind.__name__.upper())
    return ap


def _check_value(name: str, value, where: str):
    if name not in KNOWN:
        close = difflib.get_close_matches(name, list(KNOWN), n=1)
        raise ValueError(f"{where}: unknown key {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    kind = KNOWN[name]
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ValueError(f"{where}: key {name!r} must be {'a' if kind is not int else 'an'} {kind.__name__}, "
                         f"got {value!r}")
    return value


def read_toml(source: str) -> tuple[dict, str]:
    """``(settings, where)`` of a TOML file or a shipped preset's name."""
    path = Path(source)
    if not path.is_file():
        if (PRESETS_DIR / f"{source}.toml").is_file():
            path = PRESETS_DIR / f"{source}.toml"
        else:
            raise ValueError(f"--config {source!r}: no such file, nor a preset (presets: {', '.join(presets())})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {path}: not valid TOML ({err})") from None
    where = f"config file {path}"
    for key, value in data.items():
        if isinstance(value, dict):
            raise ValueError(f"{where}: key {key!r} is a table; settings are top-level keys")
        if key == "config":
            raise ValueError(f"{where}: key 'config' cannot name another file")
    return {k: _check_value(k, v, where) for k, v in data.items()}, where


def _defaults() -> dict:
    """Every setting's value before ``--config`` and the flags: the fields' defaults,
    then the ``cpu`` preset."""
    settings = {**{f.name: f.default for f in dataclasses.fields(ModelConfig)},
                **{f.name: f.default for f in dataclasses.fields(Plan) if f.name != "model"}, **RUN_DEFAULTS}
    settings["units"] = ""
    settings.update(read_toml("cpu")[0])
    return settings


def resolve(argv=None, prog: str = "python -m fmoe.train") -> tuple[dict, set]:
    """The merged settings and the keys set explicitly (by ``--config`` or a flag).

    Returns:
        ``(settings, explicit)``: every key of ``KNOWN`` with its value.
    """
    flags = vars(parser(prog).parse_args(argv))
    settings = _defaults()
    explicit = set()
    if flags.get("config"):
        from_file, _ = read_toml(flags["config"])
        settings.update(from_file)
        explicit |= set(from_file)
    settings.update(flags)
    explicit |= set(flags)
    return settings, explicit


def parse_units(text: str):
    """``"embed+head,layers.0+layers.1"`` -> ``(("embed", "head"), ("layers.0", "layers.1"))``; "" -> None."""
    if not text:
        return None
    return tuple(tuple(m for m in unit.split("+") if m) for unit in text.split(","))


def model_config(settings: dict, **overrides) -> ModelConfig:
    return ModelConfig(**{**{k: settings[k] for k in MODEL_FIELDS}, **overrides})


def plan_for(settings: dict, cfg: ModelConfig, **overrides) -> Plan:
    fields = {k: settings[k] for k in PLAN_FIELDS}
    fields["units"] = parse_units(fields["units"])
    return Plan(model=cfg, **{**fields, **overrides})


def resolved(settings: dict, plan: Plan) -> dict:
    """The settings with the model and plan a run built: the vocabulary read from the
    data, the model of ``--init-from-hf``, ``dp`` from the world (``settings.toml``)."""
    out = dict(settings, **{name: getattr(plan.model, name) for name in MODEL_FIELDS})
    out.update({name: getattr(plan, name) for name in PLAN_FIELDS if name not in ("units", "device")})
    return out


def to_toml(settings: dict, derived: dict | None = None) -> str:
    """The settings as a flat TOML document (what ``--print-config`` shows and
    ``settings.toml`` holds), usable as a ``--config``: paths left unset (``data``,
    ``init_from_hf``) are comments, since an empty path is refused; the folder actions
    (``resume``, ``auto_resume``, ``overwrite``) are left out, so reusing a file never
    resumes or removes a run; ``derived`` (name -> why) are comments too, values the
    run worked out rather than was given (``dp`` from the number of processes), so the
    file runs on another world as well."""
    derived = derived or {}
    lines = []
    run_keys = [n for n, _, _, _ in RUN_OPTIONS if n not in ("config", "print_config", *FOLDER_ACTIONS)]
    for title, names in (("run", run_keys), ("model", list(MODEL_FIELDS)), ("plan", list(PLAN_FIELDS))):
        lines.append(f"# {title}")
        for name in names:
            value = settings[name]
            line = f"{name} = {json.dumps(value) if not isinstance(value, float) else repr(value)}"
            if name in UNSET_PATHS and not value:
                line = f"# {line}  (unset)"
            elif name in derived:
                line = f"# {line}  ({derived[name]})"
            lines.append(line)
    return "\n".join(lines) + "\n"
