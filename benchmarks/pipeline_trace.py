"""Where a pipeline step's time goes, plain and interleaved 1F1B side by side: per rank,
the median step, the GPU's busy time and idle gaps (torch profiler), the host's time in
each kind of action (fmoe's own trace) and the host syncs one step makes.

    torchrun --nproc-per-node 2 benchmarks/pipeline_trace.py --shapes coarse --virtual-stages 1 2 \
        --out traces/

Each rank writes ``trace_<shape>_v<V>_rank<R>.json.gz`` (a Chrome trace of one step) under
``--out``. ``--device cpu`` runs the toy shapes on gloo (a smoke run; numbers mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import os
import shutil
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from kernel_time import union  # noqa: E402
from plan_calibration import _plan, on_gpu, timed, training  # noqa: E402
from vs_peer import SHAPES  # noqa: E402


def one(name: str, args, rank: int) -> dict:
    plan = _plan(name, args)
    train = training(plan, args, rank)
    times = timed(train)
    from torch.profiler import ProfilerActivity, profile

    torch.distributed.barrier()
    train.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as prof:
        warnings.simplefilter("always")
        if args.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        out = train.step(train.batches[0])
        train.sync()
        wall = time.perf_counter() - t0
        if args.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:80] for w in caught if "synchroniz" in str(w.message)]
    host = defaultdict(float)
    for e in out.metrics["trace"]:
        host[e.kind] += (e.end - e.start) * 1e3
    spans = sorted((k.time_range.start, k.time_range.end) for k in prof.events() if on_gpu(k))
    busy = sum(e - s for s, e in union(spans)) / 1e3
    merged = union(spans)
    gaps = sorted(((b[0] - a[1]) / 1e3 for a, b in zip(merged, merged[1:])), reverse=True)
    path = Path(args.out) / f"trace_{name}_v{args.virtual_stages}_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return {"median_ms": statistics.median(times[args.warmup:]) * 1e3, "profiled_ms": wall * 1e3, "busy_ms": busy,
            "gaps": gaps[:5], "gaps_over_1ms": sum(g for g in gaps if g > 1.0), "host": dict(host),
            "syncs": syncs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["coarse"], choices=sorted(SHAPES))
    ap.add_argument("--virtual-stages", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="standard")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="traces")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    if args.device == "cpu":
        args.batch, args.seq, args.microbatches = 4, 64, 4
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.shapes:
        for v in args.virtual_stages:
            run = copy.copy(args)
            run.virtual_stages, run.pp, run.dp, run.ep, run.compile, run.sharding = v, world, 1, 1, False, "no_shard"
            got = [None] * world
            torch.distributed.all_gather_object(got, one(name, run, rank))
            rows += [(name, v, r, g) for r, g in enumerate(got)]
    if rank == 0:
        print("| shape | virtual | rank | step ms | profiled ms | GPU busy ms | idle gaps > 1 ms | largest gaps ms |"
              " host ms by action | host syncs |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, v, r, g in rows:
            host = ", ".join(f"{k} {ms:.0f}" for k, ms in sorted(g["host"].items(), key=lambda kv: -kv[1]))
            print(f"| {name} | {v} | {r} | {g['median_ms']:.1f} | {g['profiled_ms']:.1f} | {g['busy_ms']:.1f} | "
                  f"{g['gaps_over_1ms']:.1f} | {' '.join(f'{x:.1f}' for x in g['gaps'])} | {host} | "
                  f"{len(g['syncs'])}: {'; '.join(sorted(set(g['syncs'])))[:200]} |")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
