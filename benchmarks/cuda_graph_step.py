"""Step time of a small, launch-bound MoE: eager ``fmoe.step`` vs CUDA graphs.

    python benchmarks/cuda_graph_step.py [--layers 4] [--dim 256] [--steps 20] [--repeats 7]

Modes, measured side by side in one process on the same params and batch:
eager; scope graphs (``attn``, ``router``, ``experts`` per layer and microbatch,
``interop.cuda_graph.capture_scopes``); the whole step as one graph
(``capture_step``). Each is timed alone (step only) and followed by an eager AdamW
update (what a training loop does). Prints medians over repeats of ``--steps``
steps, and the speedup over eager, as a table last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fmoe
from interop.cuda_graph import capture_scopes, capture_step


def _per_step_ms(run, steps: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--capacity", type=float, default=1.25)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    cfg = fmoe.ModelConfig(vocab=1024, dim=args.dim, layers=args.layers, heads=4, experts=args.experts, topk=2,
                           ffn=args.dim, capacity_factor=args.capacity)
    plan = fmoe.Plan(model=cfg, microbatches=args.microbatches, dtype="bfloat16", device="cuda")
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-3, plan=plan)
    batch = {"tokens": torch.randint(0, cfg.vocab, (args.batch, args.seq + 1),
                                     generator=torch.Generator().manual_seed(0)).cuda()}
    whole = capture_step(params, batch, plan)
    kernels = capture_scopes(params, batch, plan, ("attn", "router", "experts"))
    modes = {"eager": lambda p: fmoe.step(p, batch, plan),
             "scope graphs": lambda p: fmoe.step(p, batch, plan, kernels),
             "whole-step graph": lambda p: whole(p, batch)}
    eager_loss = fmoe.step(params, batch, plan).loss
    rows = []
    for name, run in modes.items():
        same = torch.equal(run(params).loss, eager_loss)
        step_ms = _per_step_ms(lambda: run(params), args.steps, args.repeats)
        state = {"params": params, "opt": opt.init(params)}

        def train_step():
            out = run(state["params"])
            state["params"], state["opt"] = opt.update(out.grads, state["opt"], state["params"])

        train_ms = _per_step_ms(train_step, args.steps, args.repeats)
        rows.append((name, step_ms, train_ms, same))
    tokens = args.batch * args.seq
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} layers, D={args.dim}, "
          f"E={args.experts} top-2, capacity {args.capacity}, {tokens} tokens/step, {args.microbatches} mb, bf16; "
          f"median of {args.repeats} x {args.steps} steps")
    print(f"{'mode':18s} {'step ms':>9s} {'speedup':>8s} {'+adamw ms':>10s} {'speedup':>8s}  loss == eager")
    for name, step_ms, train_ms, same in rows:
        print(f"{name:18s} {step_ms:9.3f} {rows[0][1] / step_ms:7.2f}x {train_ms:10.3f} "
              f"{rows[0][2] / train_ms:7.2f}x  {same}")


if __name__ == "__main__":
    main()
