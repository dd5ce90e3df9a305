"""The main job's learning rate across the lives of a run: linear warm-up to ``--lr``,
then cosine decay to ``--min-lr-ratio * --lr`` at the last step (``fmoe.warmup_cosine``).

A resumed run may change ``--steps``. Its rate then goes on without a jump: the decay
restarts from the rate the run had at the checkpoint's step and reaches the floor at
the new last step (``fmoe.optim.transforms.cosine_from``); still in the warm-up, only
the decay's end moves. Each checkpoint records the schedule (``RECORD`` in its extra:
the steps it was first built for and every restart), so one resumed again rebuilds the
same rates; one saved before the record existed was trained over the run's
``settings.toml`` steps. The rate of update ``n`` (step ``n + 1``) is the schedule at
``n``.
"""

from __future__ import annotations

from ..optim.transforms import Schedule, cosine_from, warmup_cosine
from .run_settings import RunSettings

RECORD = "lr_schedule"  # the key of a checkpoint's extra that holds it


def fresh(s: RunSettings) -> dict:
    """The record of a run's schedule from its first step: ``--steps`` long."""
    return {"steps": s.steps, "restarts": []}


def build(record: dict, s: RunSettings) -> Schedule:
    """The schedule ``record`` describes, at ``s``'s rates: ``warmup_cosine`` over the
    first steps, then each restart ``[at, steps]`` in turn."""
    schedule = warmup_cosine(s.lr, s.warmup, record["steps"], floor=s.min_lr_ratio)
    for at, steps in record["restarts"]:
        schedule = cosine_from(schedule, at, steps, s.min_lr_ratio * s.lr)
    return schedule


def _last_step(record: dict) -> int:
    return record["restarts"][-1][1] if record["restarts"] else record["steps"]


def continued(s: RunSettings, extra: dict, at: int, had_steps: int | None) -> tuple[dict, str | None]:
    """The schedule of a run resumed at step ``at`` from a checkpoint whose record is
    ``extra``, and the line saying how it goes on when ``--steps`` changed (else None).

    Arguments:
        s: the resumed run's settings (``s.steps > at``: a checkpoint at or past the last
            step is refused before).
        extra: the checkpoint's extra; without ``RECORD`` (an older checkpoint) the run
            was trained over ``had_steps`` (its settings.toml's), else over ``s.steps``.

    Returns:
        ``(record, line)``: the record to build the schedule from and to save with
        the next checkpoints, and the line to say, or None.
    """
    record = extra.get(RECORD) or {"steps": had_steps or s.steps, "restarts": []}
    was = _last_step(record)
    if was == s.steps:
        return record, None
    change = f"--steps {s.steps} (the run had {was})"
    if not record["restarts"] and at <= s.warmup:  # the decay has not begun: only its end moves
        return ({"steps": s.steps, "restarts": []},
                f"{change}: the warm-up goes on to step {s.warmup}, then the cosine decay ends at step {s.steps}")
    record = {"steps": record["steps"], "restarts": [*record["restarts"], [at, s.steps]]}
    start = float(build(record, s)(at))
    return record, (f"{change}: the cosine decay continues from lr {start:.3g} at step {at + 1} to "
                    f"{s.min_lr_ratio * s.lr:.3g} at step {s.steps}")
