"""Where one fmoe step's GPU time goes: the kernels of one step + update, per shape.

    python benchmarks/step_profile.py                              # coarse fine qwen3-moe-medium, compiled
    python benchmarks/step_profile.py --shapes fine --no-compile   # eager
    python benchmarks/step_profile.py --shapes coarse --fp8 rowwise
    python benchmarks/step_profile.py --trace /tmp/traces          # + a Chrome trace per shape
    python benchmarks/trace_gaps.py /tmp/traces/coarse.json        # where the GPU waits for the host

The shapes are ``vs_peer.py``'s (8 x 2048 tokens, bf16, one GPU, ``no_shard``,
``adamw(fused=True, donate=True)``). After 3 warm-up steps, one step and its update
run under ``torch.profiler``: wall time (the profiler adds host overhead), the union
of kernel intervals (GPU busy), the kernel count and the top kernels by total time.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fmoe
from fmoe.config import FP8S
from kernel_time import union
from vs_peer import SHAPES


def profiled_step(cfg: fmoe.ModelConfig, compiled: bool, fp8: str = "none"):
    """``(profile, wall ms)`` of one step + update after 3 warm-up steps (8 x 2048
    tokens, one GPU, ``no_shard``, the donating fused AdamW)."""
    plan = fmoe.Plan(model=cfg, dtype="bfloat16", device="cuda", compile=compiled, fp8=fp8)
    batch = {"tokens": torch.randint(0, cfg.vocab, (8, 2049), generator=torch.Generator().manual_seed(0)).cuda()}
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=True, donate=True)
    state = opt.init(params)
    for _ in range(3):
        out = fmoe.step(params, batch, plan)
        params, state = opt.update(out.grads, state, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = fmoe.step(params, batch, plan)
        params, state = opt.update(out.grads, state, params)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    return prof, wall


def kernel_times(prof) -> tuple[list, collections.Counter, collections.Counter]:
    """``(spans, ms, calls)`` of a profile's GPU kernels: their ``(start, end)``
    intervals (us), and milliseconds and launches per kernel name."""
    spans, ms, calls = [], collections.Counter(), collections.Counter()
    for e in prof.events():
        # kernels only: the program's named ranges show up on the GPU too, spanning its gaps
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False) \
                and not e.name.startswith("fmoe "):
            spans.append((e.time_range.start, e.time_range.end))
            ms[e.name] += (e.time_range.end - e.time_range.start) / 1e3
            calls[e.name] += 1
    return spans, ms, calls


def profile_step(cfg: fmoe.ModelConfig, compiled: bool, top: int, trace: str | None = None,
                 fp8: str = "none") -> None:
    prof, wall = profiled_step(cfg, compiled, fp8)
    spans, ms, calls = kernel_times(prof)
    busy = sum(e - s for s, e in union(spans)) / 1e3
    if trace:  # the program's actions are named ranges ("fmoe forward layers.0.attn mb0")
        prof.export_chrome_trace(trace)
        print(f"trace: {trace}")
    print(f"wall {wall:.1f} ms, GPU busy {busy:.1f} ms, {len(spans)} kernels; top kernels:")
    for name, t in ms.most_common(top):
        print(f"  {t:7.2f} ms  x{calls[name]:4d}  {name[:90]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=tuple(SHAPES))
    ap.add_argument("--no-compile", action="store_true", help="profile the eager step")
    ap.add_argument("--top", type=int, default=28)
    ap.add_argument("--fp8", default="none", choices=FP8S, help="Plan.fp8")
    ap.add_argument("--trace", metavar="DIR", help="write each shape's Chrome trace to DIR/<shape>.json")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    for name in args.shapes:
        print(f"\n## {name} ({'eager' if args.no_compile else 'compile=True'}, fp8={args.fp8}), "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        trace = None
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            trace = os.path.join(args.trace, f"{name}.json")
        profile_step(fmoe.ModelConfig(**SHAPES[name]()), not args.no_compile, args.top, trace, args.fp8)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
