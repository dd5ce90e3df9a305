"""Where one fmoe step's GPU time goes: the kernels of one step + update, per shape.

    python benchmarks/step_profile.py                              # coarse fine qwen3-moe-medium, compiled
    python benchmarks/step_profile.py --shapes fine --no-compile   # eager

The shapes are ``vs_peer.py``'s (8 x 2048 tokens, bf16, one GPU, ``no_shard``,
``adamw(fused=True, donate=True)``). After 3 warm-up steps, one step and its update
run under ``torch.profiler``: wall time (the profiler adds host overhead), the union
of kernel intervals (GPU busy), the kernel count and the top kernels by total time.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fmoe
from kernel_time import union
from vs_peer import SHAPES


def profile_step(cfg: fmoe.ModelConfig, compiled: bool, top: int) -> None:
    plan = fmoe.Plan(model=cfg, dtype="bfloat16", device="cuda", compile=compiled)
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
    spans, ms, calls = [], collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            spans.append((e.time_range.start, e.time_range.end))
            ms[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1e3
            calls[e.name[:90]] += 1
    busy = sum(e - s for s, e in union(spans)) / 1e3
    print(f"wall {wall:.1f} ms, GPU busy {busy:.1f} ms, {len(spans)} kernels; top kernels:")
    for name, t in ms.most_common(top):
        print(f"  {t:7.2f} ms  x{calls[name]:4d}  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=tuple(SHAPES))
    ap.add_argument("--no-compile", action="store_true", help="profile the eager step")
    ap.add_argument("--top", type=int, default=28)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    for name in args.shapes:
        print(f"\n## {name} ({'eager' if args.no_compile else 'compile=True'}), "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        profile_step(fmoe.ModelConfig(**SHAPES[name]()), not args.no_compile, args.top)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
