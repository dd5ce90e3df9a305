"""What a resumed run takes from the run it continues: its settings.

``--resume`` (and ``--auto-resume`` when ``--out`` holds a checkpoint) reads the run's
``settings.toml`` as the base of the settings, above the defaults and below
``--config`` and the flags: a flag left out keeps the run's value, so the same
command, or ``--resume --out DIR`` alone, continues the same run. A training setting
given with another value overrides the run's (said once, ``Resumed.overrides``); a
model or data setting given with another value is refused, naming it, before any
process group, file write or step.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from ..checkpoint import read_meta
from .options import FOLDER_ACTIONS, MODEL_FIELDS, flag, read_toml

# What the data a step sees depends on: a resumed run must agree on them. The corpus is
# compared by content (``corpus_fingerprint``), so a moved corpus or another spelling of
# its path resumes; ``data`` (its path) is kept in checkpoints for people to read.
DATA_KEYS = ("seed", "batch", "seq", "corpus", "heldout_fraction")

# Model and data: what a resumed run cannot change, since the checkpoint's weights are
# that model (every ModelConfig field; ``init_from_hf``, the model a fine-tuning run
# started from, whose tokenizer may read its data) trained on those batches (DATA_KEYS).
# Every other setting is training, free to change: the length and the rates (steps, lr,
# warmup ...), the eval/log/save cadences, the machine's settings and the plan (dp, ep,
# sharding, microbatches, schedule ...), since fmoe.load reshards any plan to any plan.
# ``data`` is not here: its path may change, the checkpoint compares the corpus itself.
# The adapters' shape (``lora_*``) is fixed too: the checkpoint holds those adapters.
FIXED = (*MODEL_FIELDS, *(key for key in DATA_KEYS if key != "corpus"), "init_from_hf", "lora_rank", "lora_alpha",
         "lora_targets")

# Settings of one command, never taken from the run: what it does with the folder, the
# folder itself (found by --out, and maybe moved since), and where this command stops.
NOT_READ_BACK = ("config", "print_config", "out", "stop_after", "profile_step", *FOLDER_ACTIONS)


def resumes(settings: dict) -> bool:
    """Whether the merged ``settings`` continue the run in their ``out``."""
    checkpoint = Path(settings["out"]) / "checkpoint"
    return bool(settings["out"].strip()) and (settings["resume"] or settings["auto_resume"] and checkpoint.exists())


class Resumed(NamedTuple):
    """A resumed run's settings as it had them, and the lines saying what this command
    changes (``--lr 0.001 (the run had 0.0001)``; ``--steps`` is said with the
    learning-rate schedule, ``lr_schedule``)."""

    had: dict
    overrides: tuple


class RunFile:
    """The run's ``settings.toml``, read when the command resumes it (``read``, the
    ``base`` of ``options.resolve``); ``had`` holds what it read (empty otherwise)."""

    def __init__(self):
        self.had: dict = {}
        self.path: Path | None = None

    def read(self, settings: dict) -> dict:
        """The run's own settings when ``settings`` resume it, less those of one command
        (``NOT_READ_BACK``); ``{}`` when they do not, or the folder has no
        ``settings.toml`` (a run from before it was written: the flags and defaults)."""
        if not resumes(settings):
            return {}
        path = Path(settings["out"]) / "settings.toml"
        if not path.is_file():
            return {}
        own, _ = read_toml(str(path))
        self.path, self.had = path, {key: value for key, value in own.items() if key not in NOT_READ_BACK}
        return self.had


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def checkpoint_extra(out: str) -> dict:
    """The ``extra`` record of the checkpoint in ``out`` (read from its ``fmoe.json``
    alone, before anything starts).

    Raises:
        ValueError: naming the checkpoint, when it cannot be read.
    """
    try:
        return read_meta(Path(out) / "checkpoint")[1].get("extra", {})
    except OSError as err:
        raise ValueError(f"cannot resume: the checkpoint in {out} is unreadable ({err})") from None


def check(run_file: RunFile, settings: dict, explicit: set, extra: dict) -> Resumed:
    """Refuse model and data settings given against the run's; say the training ones.

    Arguments:
        run_file: the run's settings, as ``options.resolve`` read them.
        settings: every setting by name, as this command merged them.
        explicit: the keys given by ``--config`` or a flag.
        extra: the checkpoint's record (``checkpoint_extra``): what the data of a step
            depends on is compared with it, the rest of ``FIXED`` with ``settings.toml``.

    Returns:
        ``Resumed``: what the run had, and one line per training setting changed.

    Raises:
        ValueError: one line naming every contradicting flag and the run's value.
    """
    had = run_file.had
    refused = []
    for key in FIXED:
        if key not in explicit:
            continue
        value = settings[key]
        if key in DATA_KEYS and key in extra and extra[key] != value:
            refused.append(f"{flag(key)}={value!r}, but the checkpoint was trained with {extra[key]!r}")
        elif key not in extra and key in had and had[key] != value:
            refused.append(f"{flag(key)}={value!r} contradicts the run's {key}={had[key]!r} ({run_file.path})")
    if refused:
        raise ValueError("cannot resume: " + "; ".join(refused) + ": a resumed run keeps its model and data "
                         "settings (leave those flags out)")
    if run_file.path is None:  # nothing to compare the training settings with
        return Resumed({}, (f"warning: {settings['out']} holds no settings.toml (a run of an older fmoe?): the "
                            "resumed run has the flags given and the defaults, not necessarily its own settings",))
    overrides = tuple(f"{flag(key)} {_shown(settings[key])} (the run had {_shown(had[key])})"
                      for key in settings if key in explicit and key not in FIXED and key != "steps" and key in had
                      and had[key] != settings[key])
    return Resumed(dict(had), overrides)
