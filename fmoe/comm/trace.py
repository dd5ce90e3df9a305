"""The step's trace: every lifecycle transition, collective and compute node, timed.

Export it with ``export_chrome_trace`` and open the file in ``chrome://tracing`` or
https://ui.perfetto.dev: compute on one row, each unit's collectives on another.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Event:
    """One thing that happened.

    Attributes:
        kind: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``release``,
            ``all_to_all``, ``a2a_splits`` (the dropless split read), ``forward``,
            ``land`` (a combine's rows waited for, unpermuted, added), ``backward``,
            ``wgrad`` or ``recompute``.
        unit: the FSDP unit (None for compute-only or metric events).
        node: the node (``embed``, ``layers.3.attn``, ``layers.3.dispatch``, ``head``...);
            for an all-to-all, the node that issued it.
        mb: microbatch index, or -1.
        start, end: host ``time.perf_counter()`` seconds; a collective spans issue to
            wait. On CUDA these are the times work was issued and waited for on the
            host, not kernel times (use the torch profiler for those).
        nbytes: bytes sent or received by a collective.
        purpose: ``params``, ``grads`` or ``metrics`` for collectives; ``dispatch``,
            ``combine``, ``dispatch_grad`` or ``combine_grad`` for all-to-alls; ``tp``,
            ``cp`` or ``etp`` for a node's tensor-, context- or expert-tensor-parallel
            collectives (an eager step's forward ones), each on a row of its own.
    """

    kind: str
    unit: str | None
    node: str | None
    mb: int
    start: float
    end: float
    nbytes: int = 0
    purpose: str = ""


def now() -> float:
    return time.perf_counter()


def count(trace, kind: str, purpose: str | None = None) -> int:
    """How many events of ``kind`` (and ``purpose``) the trace holds."""
    return sum(1 for e in trace if e.kind == kind and (purpose is None or e.purpose == purpose))


def export_chrome_trace(trace, path, rank: int = 0) -> Path:
    """Write ``trace`` as Chrome trace-event JSON (one process per rank).

    Arguments:
        trace: the events (``out.metrics["trace"]``).
        path: the file to write.
        rank: the process id to file the events under.

    Returns:
        The path written.
    """
    if not trace:
        raise ValueError("export_chrome_trace: the trace is empty")
    t0 = min(e.start for e in trace)
    events = []
    for e in trace:
        row = "compute" if e.kind in ("forward", "land", "backward", "wgrad", "recompute") \
            else f"comm {e.unit or e.purpose}"
        name = f"{e.kind} {e.node or e.unit or e.purpose}" + (f" mb{e.mb}" if e.mb >= 0 else "")
        events.append({
            "name": name, "cat": e.kind, "ph": "X", "pid": rank, "tid": row,
            "ts": (e.start - t0) * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
            "args": {"unit": e.unit, "node": e.node, "mb": e.mb, "bytes": e.nbytes, "purpose": e.purpose},
        })
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
