"""The main job's state across the lives of its processes: what a run starts from
(fresh weights, a Hugging Face checkpoint's, or its own checkpoint, resumed), what a
checkpoint records beside the weights and the optimizer state so that a resumed run
can be refused when it would not continue the same one, and the run folder made
ready."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from .. import hf, lora
from ..checkpoint import Checkpoint, load, save
from ..checkpoint.files import replace_file
from ..data import tokenizer_record
from ..initialize import draw_threads, init
from . import lr_schedule
from .resilience import CheckpointDir, is_staging, remove, run_contents
from .resuming import DATA_KEYS
from .setup import Run
# Settings whose being on or off shapes the optimizer state: a resumed run must agree.
STATE_SWITCHES = ("clip", "max_skips")


def threads(run: Run) -> int | None:
    """The CPU threads a step's kernels use, which decide its rounding; None on GPUs."""
    return torch.get_num_threads() if torch.device(run.plan.device).type == "cpu" else None


class Checkpoints:
    """The run's checkpoints as the loop sees them: the state it starts from, and
    saving one (``checkpoint-<step>``, then the ``checkpoint`` link, ``CheckpointDir``)
    with what a resumed run must agree on, and the learning-rate schedule
    (``lr_schedule``: its record, settled by ``resumed``)."""

    def __init__(self, run: Run):
        self.run = run
        self.dir = CheckpointDir(run.out, run.settings.keep)
        self.data = {key: getattr(run.settings, key) for key in DATA_KEYS if key != "corpus"}
        self.data["corpus"] = run.fingerprint
        self.tokenizer = tokenizer_record(run.corpus)  # the run folder's tokenizer.json, by content
        self.lr_schedule = lr_schedule.fresh(run.settings)
        self.drawn: str | None = None

    def resumed(self) -> Checkpoint | None:
        """The run's checkpoint, loaded and checked, when the run resumes (else None);
        the learning-rate schedule continued from its record (said when ``--steps``
        changed, after what this command changes of the run's settings).

        Raises:
            SystemExit: naming what keeps the checkpoint from being resumed.
        """
        run = self.run
        if not run.settings.resume:
            return None
        ck = load(run.out / "checkpoint", run.plan)
        self._check_resumable(ck)
        run.say(f"resumed from {run.out / 'checkpoint'} at step {ck.step}")
        had = run.resumed.had if run.resumed else {}
        for line in run.resumed.overrides if run.resumed else ():
            run.say(line)
        self.lr_schedule, line = lr_schedule.continued(run.settings, ck.extra, ck.step, had.get("steps"))
        if line:
            run.say(line)
        return ck

    def start(self, opt, ck) -> tuple:
        """``(params, opt_state, first step, base)``: resumed from ``ck`` (``resumed``'s), or
        fresh (``drawn``: the line saying how long the draw took), or from a Hugging Face
        checkpoint. Under ``--lora-rank`` the params are the adapters (fresh or resumed)
        and ``base`` the frozen Hugging Face weights; otherwise ``base`` is None."""
        run = self.run
        s = run.settings
        if run.plan.lora is not None:
            base = hf.load(s.init_from_hf, run.plan)
            run.say(f"the frozen base from the Hugging Face checkpoint {s.init_from_hf}")
            if ck is not None:
                return ck.params, ck.opt_state, ck.step + 1, base
            adapters = lora.init(run.plan, seed=s.seed)
            return adapters, opt.init(adapters), 1, base
        if ck is not None:
            return ck.params, ck.opt_state, ck.step + 1, None
        if s.init_from_hf:
            params = hf.load(s.init_from_hf, run.plan)
            run.say(f"initialised from the Hugging Face checkpoint {s.init_from_hf}")
        else:
            started = time.perf_counter()
            params = init(run.plan, seed=s.seed)
            self.drawn = (f"initial parameters drawn in {time.perf_counter() - started:.1f}s (seed {s.seed}, "
                          f"{draw_threads()} CPU thread(s) a rank)")
        return params, opt.init(params), 1, None

    def _check_resumable(self, ck) -> None:
        """The checkpoint ``ck`` was trained on this run's data and optimizer switches and
        is short of its last step; a warning when its CPU threads differ."""
        run, data = self.run, self.data
        s = run.settings
        if "corpus" not in ck.extra and "data" in ck.extra and ck.extra["data"] != run.corpus.source:
            raise SystemExit(f"fmoe.train: cannot resume: --data={run.corpus.source!r}, but the checkpoint (saved by "
                             f"an older fmoe, which kept only the path) was trained with {ck.extra['data']!r}")
        for key in DATA_KEYS:
            if key in ck.extra and ck.extra[key] != data[key]:
                what = "--data gives a corpus of " if key == "corpus" else f"--{key.replace('_', '-')}="
                raise SystemExit(f"fmoe.train: cannot resume: {what}{data[key]!r}, but the checkpoint was trained "
                                 f"with {ck.extra[key]!r}")
        for key, was_on in ck.extra.get("state_switches", {}).items():
            if bool(getattr(s, key)) != was_on:
                raise SystemExit(f"fmoe.train: cannot resume: --{key.replace('_', '-')}={getattr(s, key)!r} turns "
                                 f"{'off' if was_on else 'on'} what the checkpoint's optimizer state was built "
                                 f"{'with' if was_on else 'without'}")
        if ck.step >= s.steps:
            raise SystemExit(f"fmoe.train: the checkpoint is at step {ck.step} already; raise --steps to go on")
        if s.stop_after and ck.step >= s.stop_after:
            raise SystemExit(f"fmoe.train: the checkpoint is at step {ck.step} already; raise --stop-after "
                             "(or leave it out) to go on")
        if ck.extra.get("threads") not in (None, threads(run)):
            run.say(f"warning: resuming with {threads(run)} CPU thread(s) per process where the run used "
                    f"{ck.extra['threads']} (--threads): CPU kernels split their sums by thread, so from here on "
                    "the run is not bit for bit what an uninterrupted one gives")

    def save(self, step_num: int, params, opt_state) -> Path:
        """Save step ``step_num`` (a collective: every rank calls it); the main rank then
        points ``checkpoint`` at it. Returns the ``checkpoint`` link."""
        run = self.run
        s = run.settings
        extra = dict(self.data, data=run.corpus.source, tokenizer=self.tokenizer, threads=threads(run))
        extra["state_switches"] = {key: bool(getattr(s, key)) for key in STATE_SWITCHES}
        extra[lr_schedule.RECORD] = self.lr_schedule
        extra.update(samples_seen=step_num * s.batch, eos_id=run.corpus.eos_id)
        save(self.dir.path_for(step_num), run.plan, params, opt_state=opt_state, step=step_num, extra=extra)
        if run.world.is_main:
            self.dir.publish(step_num)
        return self.dir.latest

    def nonfinite_stop(self, in_a_row: int, step_num: int, first: int, loss: float) -> str:
        """The message of the non-finite stop: the real last good checkpoint (or that there
        is none) and the likely cause."""
        if self.dir.latest.exists():
            where = f"The last good checkpoint is {self.dir.latest.resolve()}: --resume from it"
        else:
            where = "No checkpoint was saved before them"
        if step_num - in_a_row + 1 <= first:  # non-finite from this run's first step on
            cause = ("they began at the run's first step, so a setting is the likely cause (the model config, "
                     "--init-from-hf weights or the data), not the learning rate")
        else:
            cause = "after finite steps, so the likely cause is divergence: try a lower --lr or --clip"
        return (f"fmoe.train: {in_a_row} steps in a row (to step {step_num}) had non-finite gradients (loss {loss}); "
                f"stopping without applying them. {where}; {cause}")


def prepare_out(run: Run) -> None:
    """The run folder, once every check has passed (main rank): with ``--overwrite`` the
    old run removed, a killed save's staging removed, then the settings (and the
    corpus's tokenizer, for ``fmoe.generate``) written."""
    if run.settings.overwrite and (old := run_contents(run.out)):
        remove(old)
        run.say(f"--overwrite: removed {', '.join(p.name for p in old)} from {run.out}")
    elif stale := [p for p in run_contents(run.out) if is_staging(p)]:
        remove(stale)
        run.say(f"removed {len(stale)} staging folder(s) left in {run.out} by an interrupted save")
    run.out.mkdir(parents=True, exist_ok=True)
    replace_file(run.out / "settings.toml", run.settings_toml)  # a resumed run reads it back
    if run.corpus.tokenizer is not None:
        shutil.copyfile(run.corpus.tokenizer, run.out / "tokenizer.json")
