"""Kernel intervals from a CUDA profile: how much communication ran with no compute beside it;
``median_ms``, a call's GPU time by CUDA events, and ``graph_median_ms``, the same replayed
from a CUDA graph."""

from __future__ import annotations

import statistics


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` between two CUDA events, each call after the last
    one finished (``warmup`` calls first)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_median_ms(fn, iters: int) -> float:
    """``median_ms`` of ``fn`` captured once (after warm-up on a side stream) and replayed:
    the GPU's time alone, without the host's launch gaps, as inside a graphed step."""
    import torch

    from interop.graph_capture import warm_up

    warm_up(fn, 3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    ms = median_ms(graph.replay, iters)
    del graph
    return ms


def union(intervals):
    """Sorted, merged ``[start, end]`` intervals."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def covered(interval, merged) -> float:
    """Length of ``interval`` inside the merged intervals."""
    s, e = interval
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in merged)


def kernels(prof, is_comm):
    """``(comm, compute, other)`` kernel intervals (us) of a profile; ``is_comm(name)``
    picks the communication kernels to measure among NCCL's."""
    comm, compute, other = [], [], []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name.lower()
        span = (e.time_range.start, e.time_range.end)
        if "nccl" in name:
            (comm if is_comm(name) else other).append(span)
        elif "memset" not in name:
            compute.append(span)
    return comm, compute, other


def exposure(prof, is_comm=lambda name: True) -> dict:
    """Milliseconds: ``comm`` kernel time, the ``exposed`` part of it (no compute kernel
    on any stream), summed ``compute`` kernel time and ``busy`` (any kernel running)."""
    comm, compute, other = kernels(prof, is_comm)
    merged = union(compute)
    total = sum(e - s for s, e in comm)
    hidden = sum(covered(span, merged) for span in comm)
    busy = sum(e - s for s, e in union(comm + compute + other))
    return {"comm": total / 1e3, "exposed": (total - hidden) / 1e3,
            "compute": sum(e - s for s, e in compute) / 1e3, "busy": busy / 1e3}
