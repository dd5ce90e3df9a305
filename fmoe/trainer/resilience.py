"""Surviving a long run: preemption signals, kept checkpoints, failed collectives.

- ``StopSignals``: SIGTERM (a scheduler preempting the job) and SIGINT (Ctrl-C) ask
  the loop to stop after the step in flight (one process), or after the next logged
  step (several: the ranks agree on it with one small all-reduce on each logged step,
  so all of them save the same step and exit together).
- ``CheckpointDir``: each checkpoint is ``checkpoint-<step>`` under the run folder and
  ``checkpoint`` is a symlink to the newest complete one, switched atomically after
  it is written; only then are checkpoints beyond the newest ``keep`` removed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import read_meta

_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")
# What a killed save leaves: a collective save's staging folder (checkpoint/files.py)
# and the link being switched (CheckpointDir.publish).
_STAGING = re.compile(r"^\.(checkpoint-\d+\.tmp-[0-9a-f]+|checkpoint-link-\d+)$")
# What a run writes into its folder besides checkpoints.
RUN_FILES = ("settings.toml", "metrics.jsonl", "tokenizer.json", "tensorboard", "checkpoint")


def run_contents(out: Path) -> list[Path]:
    """The files and folders of a run in ``out`` (settings, metrics, events, checkpoints),
    staging left by a killed save included; [] for a folder holding none."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.name in RUN_FILES or _STEP_DIR.match(p.name) or _STAGING.match(p.name))


def is_staging(path: Path) -> bool:
    return bool(_STAGING.match(path.name))


def remove(paths: list[Path]) -> None:
    """Delete files, links and folders (a link is removed, never followed)."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


class StopSignals:
    """Catches SIGTERM and SIGINT (the first of each; a second SIGINT interrupts at once)."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._catch)

    def _catch(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def agreed(self, device) -> bool:
        """Whether any rank received a signal: a collective and a host read on several
        ranks (so the loop asks on the steps it reads metrics anyway); on one, neither."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.received is not None
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class CheckpointDir:
    """The run's checkpoints: ``checkpoint-<step>`` folders and the ``checkpoint`` link."""

    def __init__(self, out: Path, keep: int):
        self.out, self.keep = out, keep

    @property
    def latest(self) -> Path:
        return self.out / "checkpoint"

    def path_for(self, step: int) -> Path:
        return self.out / f"checkpoint-{step:08d}"

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.out.iterdir() if (m := _STEP_DIR.match(p.name)))

    def publish(self, step: int) -> None:
        """Point ``checkpoint`` at the complete ``checkpoint-<step>`` (atomic), then
        remove the oldest beyond ``keep``. Main rank only, after the save returned."""
        if self.latest.exists() and not self.latest.is_symlink():  # a checkpoint folder of an older fmoe
            os.rename(self.latest, self.path_for(read_meta(self.latest)[1]["step"]))
        tmp = self.out / f".checkpoint-link-{os.getpid()}"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(self.path_for(step).name)
        os.replace(tmp, self.latest)
        for old in self.steps()[:-self.keep]:
            if old != step:
                shutil.rmtree(self.path_for(old), ignore_errors=True)
