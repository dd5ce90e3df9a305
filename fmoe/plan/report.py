"""A Simulation in words: the summary, a timeline per stage, a Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.files import replace_file
from .memory import PARTS, estimate_memory
from .simulate import Simulation

GIB = 2**30


def describe(plan) -> str:
    dims = plan.dims
    virtual = f" virtual_stages={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return (f"pp={dims.pp}{virtual} dp={dims.dp} ep={dims.ep} tp={dims.tp} cp={dims.cp} etp={dims.etp} "
            f"sharding={plan.sharding} schedule={plan.schedule} microbatches={plan.microbatches} "
            f"remat={plan.remat}{' delay_wgrad' if plan.delay_wgrad else ''} ({dims.world} GPUs)")


def timeline(sim: Simulation, width: int = 100) -> list[str]:
    """One line per stage: each column a slice of the step, the microbatch whose compute
    runs there (a digit for a forward, a letter for a backward: a = 0), ``.`` idle."""
    scale = width / sim.step_seconds if sim.step_seconds else 0.0
    lines = []
    for run in sim.stages:
        row = ["."] * width
        for span in run.spans:
            if span.lane != "compute" or span.mb < 0:
                continue
            mark = str(span.mb % 10) if span.forward else chr(ord("a") + span.mb % 26)
            for col in range(int(span.start * scale), max(int(span.end * scale), int(span.start * scale) + 1)):
                if col < width:
                    row[col] = mark
        lines.append(f"stage {run.stage:>2} (rank {run.rank:>4}) |{''.join(row)}|")
    return lines


def summary(sim: Simulation, memory: list[dict] | None = None) -> list[str]:
    plan = sim.plan
    memory = memory if memory is not None else [estimate_memory(plan, sim.rows, sim.seq, s) for s in range(plan.pp)]
    bubble = " ".join(f"{b:.3f}" for b in sim.bubble)
    out = [f"plan: {describe(plan)}",
           f"batch: {sim.rows} x {sim.seq} tokens; calibration: {sim.costs.calibration.source}",
           f"checked: every rank's program (one per stage, {plan.pp} stage(s)) runs together: every send "
           "received in order, no stage waiting on another in a circle, the FSDP lifecycle kept",
           f"step: {sim.step_seconds * 1e3:,.1f} ms estimated, {sim.tokens_per_second:,.0f} tokens/s, "
           f"MFU {sim.mfu:.1%}",
           f"bubble per stage (idle share of its compute over the schedule): {bubble}",
           "memory per rank at its peak (GiB): stage | " + " | ".join(PARTS) + " | total"]
    for s, parts in enumerate(memory):
        out.append(f"  {s:>5} | " + " | ".join(f"{parts[p] / GIB:.2f}" for p in PARTS) + f" | {parts['total'] / GIB:.2f}")
    return out


def check_trace_path(path) -> None:
    """Refuse a ``--trace`` path the trace could not be written to, before anything runs."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--trace {path}: is a directory; give a file name (step.json)")
    if not path.parent.is_dir():
        raise ValueError(f"--trace {path}: no directory {path.parent}")


def chrome_trace(sim: Simulation, path) -> Path:
    """The simulated step as Chrome trace events: a process per stage (its first rank),
    a row per lane (compute, comm, p2p); written whole or not at all (a temporary file
    renamed into place)."""
    events = [{"name": span.label, "ph": "X", "pid": run.rank, "tid": span.lane, "ts": span.start * 1e6,
               "dur": (span.end - span.start) * 1e6, "args": {"stage": run.stage, "mb": span.mb}}
              for run in sim.stages for span in run.spans]
    path = Path(path)
    replace_file(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
