"""A full training step on one GPU: tokens/s, MFU and where the time goes.

    python benchmarks/full_step.py                      # the ~1B MoE LM, several modes + profile
    python benchmarks/full_step.py --sweep-experts 8 16 32 64 128 --dim 1024 --ffn 704 --layers 4

Model (default): D=2048, 6 layers, 16 heads, 16 experts of F=1408, top-2, vocab
32000 (1.06B total, 0.29B active parameters); 8 x 2048 tokens per step, bf16, one
GPU, no sharding. A step is ``fmoe.step`` + ``fmoe.adamw``'s update; MFU counts the
active parameters' FLOPs plus attention against 789 TFLOP/s.

Modes: eager with the torch expert backend and the optax-style AdamW chain; the same
with ``adamw(fused=True)``, pure and with ``donate=True``; with ``te`` experts (when
TransformerEngine imports); and the whole step captured as a CUDA graph
(``interop.cuda_graph``). One more step of the donated eager modes runs under the profiler: kernel time by kind (matmul, attention,
other), GPU idle time, and the top kernels.

``--sweep-experts``: the eager torch step for each expert count at fixed top-k and F
(fixed active FLOPs; total parameters grow with E).
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fmoe
from fsdp_step import lm_config, lm_parser
from interop.cuda_graph import capture_step
from kernel_time import union

PEAK_TFLOPS = 789.0


def parse():
    ap = lm_parser(microbatches=1)
    ap.add_argument("--sweep-experts", type=int, nargs="*", default=None)
    return ap.parse_args()


def model(args, experts: int) -> fmoe.ModelConfig:
    return lm_config(args).replace(experts=experts)


def timed_steps(run, params, opt, args) -> tuple[float, float]:
    """Median seconds of ``run(params)`` + the optimizer update, and of ``run`` alone."""
    state = opt.init(params)
    times, alone = [], []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run(params)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        params, state = opt.update(out.grads, state, params)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            alone.append(t1 - t0)
    return statistics.median(times), statistics.median(alone)


KINDS = (("matmul", ("gemm", "cutlass", "nvjet", "xmma", "grouped_mm", "sm90")),
         ("attention", ("flash", "fmha", "attention", "sdpa")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def profile_step(run, params, opt):
    """Kernel milliseconds by kind, GPU idle ms, wall ms, top kernels of one step + update."""
    state = opt.init(params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = run(params)
        opt.update(out.grads, state, params)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    spans, by_kind, by_name = [], collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        ms = (e.time_range.end - e.time_range.start) / 1e3
        spans.append((e.time_range.start, e.time_range.end))
        by_kind[kind_of(e.name)] += ms
        by_name[e.name[:70]] += ms
    busy = sum(e - s for s, e in union(spans)) / 1e3
    return by_kind, busy, wall, by_name.most_common(12)


def main():
    args = parse()
    torch.cuda.set_device(0)
    tokens = args.batch * args.seq
    rows = []
    te = importlib.util.find_spec("transformer_engine") is not None
    if te:
        importlib.import_module("interop.te")
    configs = args.sweep_experts or [args.experts]
    for experts in configs:
        cfg = model(args, experts)
        flops_per_token = fmoe.train_flops_per_token(cfg, args.seq)
        plan = fmoe.Plan(model=cfg, microbatches=args.microbatches, dtype="bfloat16", device="cuda")
        params = fmoe.init(plan, seed=0)
        chain = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan)
        fused = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=True)
        donating = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=True, donate=True)
        batch = {"tokens": torch.randint(0, cfg.vocab, (args.batch, args.seq + 1),
                                         generator=torch.Generator().manual_seed(0)).cuda()}
        eager = lambda p: fmoe.step(p, batch, plan)  # noqa: E731
        modes = {"eager torch, donated": (eager, donating)}
        if not args.sweep_experts:
            modes = {"eager torch, AdamW chain": (eager, chain), "eager torch, fused AdamW": (eager, fused), **modes}
            if te:
                te_plan = plan.replace(expert_backend="te")
                modes["eager te, donated"] = (lambda p: fmoe.step(p, batch, te_plan), donating)
            graphed = capture_step(params, batch, plan)
            modes["whole-step graph, fused"] = (lambda p: graphed(p, batch), fused)
        for name, (run, opt) in modes.items():
            torch.cuda.reset_peak_memory_stats()
            step_s, alone_s = timed_steps(run, params, opt, args)
            rows.append((experts, name, step_s, alone_s, tokens / step_s,
                         flops_per_token * tokens / step_s / PEAK_TFLOPS / 1e12, torch.cuda.max_memory_allocated() / 2**30))
            print(f"  done E={experts} {name}: {step_s * 1e3:.1f} ms", flush=True)
        if not args.sweep_experts:
            profiles = {name: profile_step(run, params, opt) for name, (run, opt) in modes.items()
                        if name.startswith("eager") and "donated" in name}
        del params, modes, chain, fused, donating
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; D={args.dim}, {args.layers} layers, "
          f"top-{args.topk} of E, F={args.ffn}, vocab {args.vocab}; {tokens} tokens/step in {args.microbatches} "
          f"microbatch(es), bf16, 1 GPU; median of {args.steps} steps (step + AdamW)")
    print(f"{'E':>4s} {'params':>7s} {'mode':24s} {'step ms':>8s} {'no-opt ms':>9s} {'tokens/s':>9s} {'MFU':>6s} "
          f"{'peak GiB':>9s}")
    for experts, name, step_s, alone_s, tps, mfu, peak in rows:
        total = fmoe.params.param_count(model(args, experts))
        print(f"{experts:4d} {total / 1e9:6.2f}B {name:24s} {step_s * 1e3:8.1f} {alone_s * 1e3:9.1f} {tps:9.0f} "
              f"{mfu:6.1%} {peak:9.2f}")
    for mode, (by_kind, busy, wall, top) in ({} if args.sweep_experts else profiles).items():
        print(f"\nprofile of one step + update, {mode}: wall {wall:.1f} ms, GPU busy {busy:.1f} ms, "
              f"idle {wall - busy:.1f} ms; kernel ms by kind: "
              + ", ".join(f"{k} {v:.1f}" for k, v in by_kind.most_common()))
        print("top kernels (ms):")
        for name, ms in top:
            print(f"  {ms:8.2f}  {name}")


if __name__ == "__main__":
    main()
