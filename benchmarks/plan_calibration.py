"""Calibrate the planner on the GPU at hand, and hold its estimates against a measured step.

    python benchmarks/plan_calibration.py --shapes coarse fine --out calibration.json

For each shape (``vs_peer.py``'s; bf16, one GPU, 8 x 2048 tokens in 2 microbatches, the
plan eager or ``--compile``): a few warm-up steps, then one step under the profiler. Each
node run of the step is a profiler range (``fmoe forward layers.3.attn mb0``...); the GPU
time of the kernels in each range, added up by node kind, against the kind's FLOPs
(``fmoe.plan.node_flops``, backward twice the forward) gives the kind's efficiency: the
calibration file's numbers (averaged over the shapes). Then the planner, with that
calibration, estimates the same step's time and peak memory, printed beside the measured
median step (step + fused AdamW) and ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import fmoe  # noqa: E402
from fmoe.plan import Calibration, CostModel, node_flops, simulate  # noqa: E402
from fmoe.plan.memory import estimate_memory  # noqa: E402
from vs_peer import SHAPES  # noqa: E402

RANGE = re.compile(r"fmoe (forward|backward|wgrad|recompute) (?:layers\.(\d+)\.)?(\w+)(?: mb\d+)?$")
KINDS = {"attn": "attn", "experts": "experts", "dense": "dense", "head": "head", "embed": "embed"}


def _device_ms(event) -> float:
    return (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)) / 1e3


def measure(name: str, args) -> dict:
    cfg = fmoe.ModelConfig(**{"aux_loss_coef": 0.0, "vocab": 32000, **SHAPES[name]()})
    plan = fmoe.Plan(model=cfg, dtype="bfloat16", device="cuda", microbatches=args.microbatches, compile=args.compile)
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=True, donate=True)
    state = opt.init(params)
    batches = [{"tokens": torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), device="cuda")}
               for _ in range(args.warmup + args.steps)]

    def step(batch):
        nonlocal params, state
        out = fmoe.step(params, batch, plan)
        params, state = opt.update(out.grads, state, params)
        return out

    torch.cuda.reset_peak_memory_stats()
    times = []
    for batch in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(batches[0])
        torch.cuda.synchronize()
    ms, flops = defaultdict(float), defaultdict(float)
    tokens_mb = args.batch * args.seq / args.microbatches
    for event in prof.key_averages():
        m = RANGE.match(event.key)
        if not m or m[3] not in KINDS:
            continue
        phase, layer, kind = m[1], None if m[2] is None else int(m[2]), m[3]
        ms[kind] += _device_ms(event)
        scale = 2.0 if phase == "backward" else 1.0
        flops[kind] += event.count * scale * node_flops(cfg, kind, layer, tokens_mb, args.seq)
    efficiency = {k: flops[k] / (ms[k] / 1e3) / (args.peak * 1e12) for k in ms if ms[k] > 0 and flops[k] > 0}
    return {"plan": plan, "median_s": statistics.median(times[args.warmup:]), "peak": peak,
            "efficiency": efficiency, "ms": dict(ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["coarse"], choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--peak", type=float, default=789.0, help="the GPU's dense bf16 TFLOP/s")
    ap.add_argument("--out", default="calibration.json")
    args = ap.parse_args()
    runs = {name: measure(name, args) for name in args.shapes}
    kinds = sorted({k for r in runs.values() for k in r["efficiency"]})
    efficiency = {k: statistics.mean(r["efficiency"][k] for r in runs.values() if k in r["efficiency"]) for k in kinds}
    source = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
              f"shapes {' '.join(args.shapes)}{', compiled' if args.compile else ''}")
    Path(args.out).write_text(json.dumps({"peak_tflops": args.peak, "efficiency": efficiency, "source": source},
                                         indent=1))
    print(f"calibration ({source}) -> {args.out}: " + ", ".join(f"{k} {v:.3f}" for k, v in efficiency.items()))
    costs = CostModel(Calibration.read(args.out))
    print("| shape | measured step ms | planner ms | planner / measured | measured peak GiB | planner GiB | "
          "planner / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        sim = simulate(r["plan"], args.batch, args.seq, costs)
        mem = estimate_memory(r["plan"], args.batch, args.seq)["total"]
        print(f"| {name} | {r['median_s'] * 1e3:.1f} | {sim.step_seconds * 1e3:.1f} | "
              f"{sim.step_seconds / r['median_s']:.2f} | {r['peak'] / 2**30:.2f} | {mem / 2**30:.2f} | "
              f"{mem / r['peak']:.2f} |")
        print(f"  node GPU ms by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in r["ms"].items()))


if __name__ == "__main__":
    main()
