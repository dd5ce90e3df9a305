"""The main job's settings: one flag per ModelConfig and Plan field and per run option,
merged from defaults, the ``cpu`` preset, a TOML file and the command line.

Every setting has one name: ``--shared-ffn`` on the command line is ``shared_ffn`` in
a TOML file. Precedence, lowest first: the fields' defaults, the ``cpu`` preset (the
defaults of the main job), a resumed run's own ``settings.toml`` (``resuming``),
``--config`` (a TOML file, or the name of a shipped preset), then the flags given.
Everything is checked before any process group or tensor exists: an unknown key or a
value of the wrong type here (``resolve``), a run setting out of range when its
``RunSettings`` is built (``split``), a value a ModelConfig or Plan refuses when
``fmoe.trainer.setup`` builds them; each is a ValueError naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import tomllib
from pathlib import Path
from typing import Callable

from ..config import ModelConfig, Plan, choices, field_docs
from .run_settings import RUN_DEFAULTS, RUN_FIELDS, RUN_HELP, TYPES, RunSettings, check_type

PRESETS_DIR = Path(__file__).parent / "presets"

# What a run is asked to do with its folder, not how it trains: never written to a
# settings file (reusing one for a new --out must not resume or remove anything). These,
# like every switch a --config can set (--fused-optimizer), have a --no- form to undo it.
FOLDER_ACTIONS = ("resume", "auto_resume", "overwrite")
UNSET_PATHS = ("data", "init_from_hf")  # "" by default, meaning the embedded corpus / random weights
LAYER_LISTS = ("dense_layers", "window_layers")  # ModelConfig's tuples of layer indices, "0,1" as settings


MEMBER_GROUPS = ("units", "pp_layout")  # Plan's tuples of member groups, "embed+head,layers.0" as settings


def _field_type(field) -> type:
    if field.name in MEMBER_GROUPS:
        return str  # "embed+head,layers.0+layers.1": groups separated by commas, members by +
    if field.name in LAYER_LISTS:
        return str  # "0,1": layer indices separated by commas
    return TYPES[str(field.type)]


MODEL_FIELDS = {f.name: _field_type(f) for f in dataclasses.fields(ModelConfig)}
# Plan fields the main job does not set (yet): the model has its own, the adapters none
NOT_SETTINGS = ("model", "lora")
PLAN_FIELDS = {f.name: _field_type(f) for f in dataclasses.fields(Plan) if f.name not in NOT_SETTINGS}
KNOWN = {**RUN_FIELDS, **MODEL_FIELDS, **PLAN_FIELDS}


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def flag(name: str) -> str:
    """The flag of the setting ``name``: ``shared_ffn`` -> ``--shared-ffn``."""
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
    from ..params import active_param_count, param_count

    own = read_toml(name)[0]
    settings = {**_defaults(), **own}
    cfg = model_config(settings, **({} if "vocab" in own or name == "cpu" else {"vocab": 32000}))
    total = param_count(cfg)
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
    groups = (("run", RUN_FIELDS, RUN_HELP),
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
            if kind is bool and title == "run" and (name.startswith("no_") or name == "print_config"):
                # already a "no" or a one-off action: nothing for a --no- form to undo
                group.add_argument(flag(name), action="store_true", help=help_)
            elif kind is bool:
                group.add_argument(flag(name), action=argparse.BooleanOptionalAction, help=help_)
            else:
                group.add_argument(flag(name), type=kind, help=help_, metavar=kind.__name__.upper())
    return ap


def _check_value(name: str, value, where: str):
    if name not in KNOWN:
        close = difflib.get_close_matches(name, list(KNOWN), n=1)
        raise ValueError(f"{where}: unknown key {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return check_type(name, KNOWN[name], value, where)


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
                **{f.name: f.default for f in dataclasses.fields(Plan) if f.name not in NOT_SETTINGS}, **RUN_DEFAULTS}
    settings.update(dict.fromkeys(MEMBER_GROUPS, ""))
    settings.update(dict.fromkeys(LAYER_LISTS, ""))
    settings.update(read_toml("cpu")[0])
    return settings


def resolve(argv=None, prog: str = "python -m fmoe.train",
            base: Callable[[dict], dict] | None = None, notes: list | None = None) -> tuple[dict, set]:
    """The merged settings and the keys set explicitly (by ``--config`` or a flag).

    Arguments:
        base: given the settings merged without it, the settings to put between the
            defaults and ``--config`` (a resumed run's own, ``resuming.RunFile.read``);
            they are not explicit.
        notes: where the line saying a warm-up was cut is appended (the run says it).

    Returns:
        ``(settings, explicit)``: every key of ``KNOWN`` with its value. A warm-up longer
        than ``steps`` is cut to ``steps`` unless the ``--warmup`` flag gave it (then
        ``RunSettings`` refuses it): a preset's, a file's or the run's own was meant for
        a longer run.
    """
    flags = vars(parser(prog).parse_args(argv))
    settings = _defaults()
    given = {**(read_toml(flags["config"])[0] if flags.get("config") else {}), **flags}
    own = base({**settings, **given}) if base is not None else {}
    settings.update(own)
    settings.update(given)
    if "warmup" not in flags and settings["warmup"] > settings["steps"]:
        if notes is not None:
            notes.append(f"warm-up {settings['warmup']} steps ({_warmup_source(given, own)}) is longer than --steps "
                         f"{settings['steps']}: the rate warms up over all {settings['steps']} and reaches --lr at the "
                         "last (--warmup to choose)")
        settings["warmup"] = max(settings["steps"], 0)  # one meant for a longer run: warm up over all of this one
    return settings, set(given)


def _warmup_source(given: dict, own: dict) -> str:
    if "warmup" in given:
        return "from --config"
    return "the resumed run's" if "warmup" in own else "the default"


def split(settings: dict) -> tuple[RunSettings, dict]:
    """``resolve``'s settings as the run's own, typed and checked, and the ModelConfig
    and Plan fields as given (ModelConfig and Plan check those when a run builds them).

    Returns:
        ``(run, fields)``: a ``RunSettings``, and the other keys with their values.

    Raises:
        ValueError: naming the flag of a run setting out of range.
    """
    run = RunSettings(**{name: settings[name] for name in RUN_FIELDS})
    return run, {name: value for name, value in settings.items() if name not in RUN_FIELDS}


def joined(run: RunSettings, fields: dict) -> dict:
    """``split`` undone: every setting by name, as ``to_toml`` takes them."""
    return {**fields, **dataclasses.asdict(run)}


def parse_units(text: str):
    """``"embed+head,layers.0+layers.1"`` -> ``(("embed", "head"), ("layers.0", "layers.1"))``; "" -> None."""
    if not text:
        return None
    return tuple(tuple(m for m in unit.split("+") if m) for unit in text.split(","))


def parse_layers(text: str, name: str = "dense_layers") -> tuple:
    """``"0,1"`` -> ``(0, 1)``; "" -> ``()``. ValueError naming the setting ``name`` otherwise."""
    try:
        return tuple(int(i) for i in text.split(",")) if text.strip() else ()
    except ValueError:
        raise ValueError(f"{name}={text!r} is invalid: must be layer indices separated by commas, "
                         "such as '0,1'") from None


def model_config(settings: dict, **overrides) -> ModelConfig:
    fields = {k: settings[k] for k in MODEL_FIELDS}
    for name in LAYER_LISTS:
        if isinstance(fields[name], str):
            fields[name] = parse_layers(fields[name], name)
    return ModelConfig(**{**fields, **overrides})


def plan_for(settings: dict, cfg: ModelConfig, **overrides) -> Plan:
    fields = {k: settings[k] for k in PLAN_FIELDS}
    for name in MEMBER_GROUPS:
        fields[name] = parse_units(fields[name])
    return Plan(model=cfg, **{**fields, **overrides})


def resolved(settings: dict, plan: Plan) -> dict:
    """The settings with the model and plan a run built: the vocabulary read from the
    data, the model of ``--init-from-hf``, ``dp`` from the world (``settings.toml``)."""
    out = dict(settings, **{name: getattr(plan.model, name) for name in MODEL_FIELDS})
    out.update({name: ",".join(map(str, getattr(plan.model, name))) for name in LAYER_LISTS})
    out.update({name: getattr(plan, name) for name in PLAN_FIELDS if name not in (*MEMBER_GROUPS, "device")})
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
    run_keys = [n for n in RUN_FIELDS if n not in ("config", "print_config", *FOLDER_ACTIONS)]
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
