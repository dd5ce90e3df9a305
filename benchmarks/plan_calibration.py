"""Calibrate the planner on the GPU at hand, and hold its estimates against a measured step.

    python benchmarks/plan_calibration.py --shapes coarse fine --out calibration.json

For each shape (``vs_peer.py``'s; bf16, one GPU, 8 x 2048 tokens in 2 microbatches, the
plan eager or ``--compile``): a few warm-up steps, then one step under the profiler. Each
node run of the step is a profiler range (``fmoe forward layers.3.attn mb0``...); the GPU
time of the kernels launched inside each range, added up by node kind, against the kind's
FLOPs (``fmoe.plan.node_flops``, backward twice the forward) gives the kind's efficiency,
and against the bytes of the rows they permute (``tokens x topk x dim``) the speed of
``dispatch`` and ``combine``; a few fused AdamW updates timed alone give the speed of the
passes over the parameters; the step's trace on a tiny batch gives the host's time in
each node run (what a node costs when the GPU waits for the host: eager, small
microbatches, a pipeline stage waiting on a receive). The calibration file holds these (averaged over the shapes).
Then the planner, with that calibration, estimates the same step's time and peak memory,
printed beside the measured median step (step + fused AdamW), the GPU's busy time in the
profiled step and ``torch.cuda.max_memory_allocated``.

Under torchrun (several GPUs), with the calibration file one GPU wrote, it holds the
planner against a plan of several ranks instead (rank 0 prints the table):

    torchrun --nproc-per-node 2 benchmarks/plan_calibration.py --shapes coarse \
        --calibration calibration.json --pp 2 --microbatches 8

``--device cpu`` runs each shape's toy on gloo (a smoke run of this script; its
numbers mean nothing).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import optree
import torch

sys.path.insert(0, str(Path(__file__).parent))

import fmoe  # noqa: E402
from fmoe.plan import Calibration, CostModel, node_flops, simulate  # noqa: E402
from fmoe.plan.memory import estimate_memory  # noqa: E402
from kernel_time import union  # noqa: E402
from vs_peer import CPU_SHAPES, SHAPES, TOY  # noqa: E402

RANGE = re.compile(r"fmoe (forward|backward|wgrad|recompute|land) (?:layers\.(\d+)\.)?(\w+)(?: mb\d+)?$")
KINDS = ("attn", "experts", "dense", "head", "embed")  # charged by FLOPs
MOVES = ("dispatch", "combine", "land")  # charged by the bytes of the rows they permute (land: combine's unpermute)


def _device_ms(event) -> float:
    return (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)) / 1e3


def _plan(name: str, args) -> fmoe.Plan:
    toy = args.device == "cpu"
    fields = {**SHAPES[name](), **TOY, **CPU_SHAPES[name]} if toy else SHAPES[name]()
    cfg = fmoe.ModelConfig(**{"aux_loss_coef": 0.0, "vocab": 32000, **fields})
    return fmoe.Plan(model=cfg, dtype="float32" if toy else "bfloat16", device=args.device,
                     microbatches=args.microbatches, compile=args.compile, pp=args.pp, dp=args.dp, ep=args.ep,
                     virtual_stages=args.virtual_stages,
                     sharding=args.sharding, schedule=args.schedule)


def measure(name: str, args, rank: int = 0, profiled: bool = True) -> dict:
    """The shape's median step time and peak memory on this rank (and, ``profiled``, its
    node kinds' GPU time and efficiency from one step under the profiler)."""
    plan = _plan(name, args)
    cfg = plan.model
    train = training(plan, args, rank)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed(train)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    run = {"plan": plan, "median_s": statistics.median(times[args.warmup:]), "peak": peak}
    if not profiled:
        return run
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train.step(train.batches[0])
        train.sync()
    (ms, outside), work = node_gpu_ms(prof), defaultdict(float)
    tokens_mb = args.batch * args.seq / args.microbatches
    rows_bytes = tokens_mb * cfg.topk * cfg.dim * plan.compute_dtype.itemsize  # what dispatch and combine move
    for phase, layer, kind in ms:  # each ran once per microbatch
        if kind in MOVES:
            work[kind] += args.microbatches * rows_bytes
        elif kind in KINDS:
            work[kind] += args.microbatches * (2.0 if phase == "backward" else 1.0) * \
                node_flops(cfg, kind, layer, tokens_mb, args.seq)
    by_kind = defaultdict(float)
    for (_, _, kind), v in ms.items():
        by_kind[kind] += v
    efficiency = {k: work[k] / (by_kind[k] / 1e3) / (args.peak * 1e12) for k in KINDS
                  if by_kind[k] > 0 and work[k] > 0}
    # a move that launched no kernels of its own (dispatch without expert parallelism) costs nothing
    move_gbps = {k: work[k] / (by_kind[k] / 1e3) / 1e9 if by_kind[k] > 0 else 1e9 for k in MOVES}
    busy = sum(e - s for s, e in union((k.time_range.start, k.time_range.end) for k in prof.events() if on_gpu(k))) / 1e3
    return {**run, "efficiency": efficiency, "move_gbps": move_gbps, "ms": dict(by_kind), "gpu_busy_ms": busy,
            "outside_ms": outside,
            "hbm_gbps": _optimizer_gbps(train.opt, train.params, train.state,
                                        fmoe.step(train.params, train.batches[0], plan).grads, train.sync)}


@dataclass
class Training:
    """A training run's carried state: the params and optimizer state (fused AdamW on
    CUDA), this rank's part of the global batches every rank draws alike (on the
    device), and the device's synchronize."""

    plan: fmoe.Plan
    opt: object
    params: dict
    state: object
    batches: list
    sync: object

    def step(self, batch) -> fmoe.StepOutput:
        out = fmoe.step(self.params, batch, self.plan)
        self.params, self.state = self.opt.update(out.grads, self.state, self.params)
        return out


def training(plan: fmoe.Plan, args, rank: int = 0) -> Training:
    """A Training of ``plan`` over ``args.warmup + args.steps`` batches."""
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=args.device == "cuda",
                     donate=args.device == "cuda")
    generator = torch.Generator().manual_seed(0)  # every rank draws the same global batches
    batches = [fmoe.local_batch({"tokens": torch.randint(0, plan.model.vocab, (args.batch, args.seq + 1),
                                                         generator=generator)}, plan, rank)
               for _ in range(args.warmup + args.steps)]
    batches = [{k: v.to(args.device) for k, v in b.items()} for b in batches]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    return Training(plan, opt, params, opt.init(params), batches, sync)


def timed(run: Training) -> list[float]:
    """Seconds of a step on each of the run's batches, the ranks lined up by a barrier
    before each."""
    times = []
    for batch in run.batches:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        run.sync()
        t0 = time.perf_counter()
        run.step(batch)
        run.sync()
        times.append(time.perf_counter() - t0)
    return times


def host_us(name: str, args, steps: int = 4) -> dict:
    """Microseconds the host spends in each node run (``"forward attn"``...), from the
    step's trace on a batch so small (one row of 128 tokens per microbatch) that the
    GPU never holds the host up: the launch cost a node pays however little it computes."""
    plan = _plan(name, args)
    params = fmoe.init(plan, seed=0)
    batch = {"tokens": torch.randint(0, plan.model.vocab, (args.microbatches, 129),
                                     generator=torch.Generator().manual_seed(0)).to(args.device)}
    times = defaultdict(list)
    for i in range(3 + steps):
        trace = fmoe.step(params, batch, plan).metrics["trace"]
        if i < 3:
            continue
        for e in trace:
            if e.kind in ("forward", "backward", "wgrad") and e.node:
                times[f"{e.kind} {e.node.split('.')[-1]}"].append((e.end - e.start) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def on_gpu(event) -> bool:
    """A kernel, copy or fill on the GPU; not a range's own span on the GPU's timeline
    (``record_function`` draws one from its first kernel to its last, gaps included)."""
    return event.device_type.name == "CUDA" and not event.name.startswith("fmoe ")


def node_gpu_ms(prof) -> tuple[dict, list]:
    """GPU milliseconds of the kernels launched inside each node run's range, by
    ``(phase, layer, kind)``, and the GPU time outside every range by kernel name (the
    most first). A kernel counts for the range whose host interval holds its
    launch: autograd launches a backward's kernels from its own thread while the range,
    on the main thread, waits for it, so the ranges' own kernel totals would miss them."""
    events = prof.events()
    outside = Counter()
    for e in events:
        if on_gpu(e):
            outside[e.name] += e.time_range.elapsed_us() / 1e3
    ranges = sorted((e.time_range.start, e.time_range.end, m) for e in events
                    if e.device_type.name == "CPU" and (m := RANGE.match(e.name)))
    starts = [r[0] for r in ranges]
    out = defaultdict(float)
    for e in events:
        if e.device_type.name != "CPU" or not e.kernels:
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.start <= ranges[i][1]:
            m = ranges[i][2]
            kind = "land" if m[1] == "land" else m[3]  # a Land names its combine node
            out[(m[1], None if m[2] is None else int(m[2]), kind)] += sum(k.duration for k in e.kernels) / 1e3
            for k in e.kernels:
                outside[k.name] -= k.duration / 1e3
    return out, [(name, ms) for name, ms in outside.most_common() if ms > 0.05]


def _optimizer_gbps(opt, params, state, grads, sync, repeats: int = 5) -> float:
    """GB/s of the fused AdamW update over the fp32 parameters (28 bytes an element: the
    parameter, its gradient and both moments read, the parameter and moments written)."""
    elements = sum(leaf.numel() for leaf in optree.tree_leaves(params))
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        params, state = opt.update(grads, state, params)
    sync()
    return elements * 28 * repeats / (time.perf_counter() - t0) / 1e9


def compare(runs: dict, costs, args) -> None:
    """The planner's step time and peak memory beside the measured ones, one row per shape;
    ``costs``: a CostModel, or ``{shape: CostModel}`` (each shape's own calibration)."""
    own = isinstance(costs, dict)
    print("planner's calibration: " + ("each shape's own" if own else costs.calibration.source))
    print("| shape | plan | measured step ms | GPU busy ms | planner ms | planner / measured | measured peak GiB | "
          "planner GiB | planner / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        plan = r["plan"]
        sim = simulate(plan, args.batch, args.seq, costs[name] if own else costs)
        mem = max(estimate_memory(plan, args.batch, args.seq, s)["total"] for s in range(plan.pp))
        shown = " x ".join(f"{k}{getattr(plan, k)}" for k in ("pp", "dp", "ep") if getattr(plan, k) > 1) or "1 GPU"
        shown += f" ({plan.virtual_stages} virtual)" if plan.virtual_stages > 1 else ""
        shown += f", {plan.microbatches} mb, {plan.schedule}"
        ratio = f"{mem / r['peak']:.2f}" if r["peak"] else "-"
        busy = f"{r['gpu_busy_ms']:.1f}" if "gpu_busy_ms" in r else "-"
        print(f"| {name} | {shown} | {r['median_s'] * 1e3:.1f} | {busy} | {sim.step_seconds * 1e3:.1f} | "
              f"{sim.step_seconds / r['median_s']:.2f} | {r['peak'] / 2**30:.2f} | {mem / 2**30:.2f} | {ratio} |")
        if "ms" in r:
            print("  node GPU ms by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in r["ms"].items()))
            outside = r["outside_ms"]
            print(f"  GPU ms outside node ranges: {sum(v for _, v in outside):.1f}; most: "
                  + "; ".join(f"{name[:70]} {v:.1f}" for name, v in outside[:10]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["coarse"], choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8, help="rows of the global batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sharding", default="no_shard")
    ap.add_argument("--schedule", default="standard")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--peak", type=float, default=789.0, help="the GPU's dense bf16 TFLOP/s")
    ap.add_argument("--calibration", help="read this calibration instead of measuring one (several ranks); "
                    "with {shape} in the path, each shape's own (cal_{shape}.json)")
    ap.add_argument("--out", default="calibration.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    if args.device == "cpu":
        args.batch, args.seq = min(args.batch, 4), min(args.seq, 64)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        if not args.calibration:
            raise SystemExit("several ranks hold the planner against a calibration: give --calibration FILE "
                             "(one GPU writes it: run this script without torchrun)")
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        rank = torch.distributed.get_rank()
        runs = {name: measure(name, args, rank, profiled=False) for name in args.shapes}
        peaks = torch.tensor([float(r["peak"]) for r in runs.values()], device=args.device)
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)  # the fullest rank's peak
        for r, peak in zip(runs.values(), peaks.tolist()):
            r["peak"] = peak
        if rank == 0:
            compare(runs, _read(args.calibration, args.shapes), args)
        torch.distributed.destroy_process_group()
        return
    runs = {name: measure(name, args, profiled=not args.calibration) for name in args.shapes}
    if args.calibration:
        return compare(runs, _read(args.calibration, args.shapes), args)
    hosts = {name: host_us(name, args) for name in args.shapes}
    cal = _calibration(runs.values(), hosts.values(), args)
    Path(args.out).write_text(json.dumps(cal, indent=1))
    print(f"calibration ({cal['source']}) -> {args.out}: " + ", ".join(f"{k} {v:.3f}" for k, v in cal["efficiency"].items())
          + "; " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in cal["move_gbps"].items())
          + f"; AdamW {cal['hbm_gbps']:.0f} GB/s; host " + ", ".join(f"{k} {v:.0f} us" for k, v in cal["host_us"].items()))
    for name in args.shapes:  # and each shape's own: what a user calibrating the model they plan gets
        Path(_own(args.out, name)).write_text(json.dumps(_calibration([runs[name]], [hosts[name]], args, name), indent=1))
    compare(runs, CostModel(Calibration.read(args.out)), args)
    compare(runs, _read(_own(args.out, "{shape}"), args.shapes), args)


def _own(path: str, shape: str) -> str:
    """Where shape ``shape``'s own calibration goes beside ``path`` (``cal.json`` -> ``cal_coarse.json``)."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}_{shape}{p.suffix}"))


def _read(path: str, shapes) -> CostModel | dict:
    """The calibration at ``path``; with ``{shape}`` in it, each shape's own."""
    if "{shape}" in path:
        return {name: CostModel(Calibration.read(path.replace("{shape}", name))) for name in shapes}
    return CostModel(Calibration.read(path))


def _calibration(runs, hosts, args, shapes: str | None = None) -> dict:
    """A calibration file's contents: the runs' and host traces' numbers averaged."""
    runs, hosts = list(runs), list(hosts)

    def mean(field):
        return {k: statistics.mean(r[field][k] for r in runs if k in r[field])
                for k in sorted({k for r in runs for k in r[field]})}

    host = {k: statistics.mean(h[k] for h in hosts if k in h) for k in sorted({k for h in hosts for k in h})}
    source = (f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}, shapes {shapes or ' '.join(args.shapes)}"
              f"{', compiled' if args.compile else ''}")
    return {"peak_tflops": args.peak, "efficiency": mean("efficiency"), "move_gbps": mean("move_gbps"),
            "hbm_gbps": statistics.mean(r["hbm_gbps"] for r in runs), "host_us": host, "source": source}

if __name__ == "__main__":
    main()
