"""Step time of the standard schedule vs 1F1B all-to-all overlap (with and without
delayed wgrad), and how much all-to-all time each leaves exposed.

    torchrun --nproc-per-node 2 benchmarks/schedule_overlap.py

Layer config where the exchange is a real share of the step: D=2048, E=16 experts
of F=1408, top-4, 4 layers, 8192 tokens per GPU per microbatch, 8 microbatches,
bf16, dp=1 x ep=2, ``no_shard`` (the only large collectives are the all-to-alls).
Each variant: warm-up, then the median of timed steps; one more step runs under the
CUDA profiler, where every all-to-all kernel interval is intersected with the union
of compute-kernel intervals: the rest of its time is exposed. ``compute ms`` sums
compute kernels (they slow down while NCCL kernels share the SMs); ``GPU idle ms`` is
the profiled step's wall time during which no kernel ran (host-side waits). Routing is dropless
(one host read of split sizes per layer and microbatch) and, with --capacity, also
static capacity (no host sync).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import fmoe
from ep_args import ep_layer_parser
from kernel_time import exposure

VARIANTS = [("standard", False), ("standard", True), ("1f1b_overlap", False), ("1f1b_overlap", True)]


def parse():
    ap = ep_layer_parser(steps=5)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--sharding", default="no_shard")
    ap.add_argument("--capacity", type=float, default=0.0, help="also run static capacity with this factor")
    return ap.parse_args()


def measure(plan, params, batch, steps):
    for _ in range(2):
        fmoe.step(params, batch, plan)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fmoe.step(params, batch, plan)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        out = fmoe.step(params, batch, plan)
        torch.cuda.synchronize()
        profiled_ms = (time.perf_counter() - t0) * 1e3
    ms = exposure(prof, lambda name: "sendrecv" in name or "alltoall" in name)
    return (statistics.median(times), ms["comm"], ms["exposed"], ms["compute"], profiled_ms - ms["busy"],
            out.loss.item())


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    rows = args.tokens // args.seq
    g = torch.Generator().manual_seed(rank)
    results = []
    for capacity in [0.0] + ([args.capacity] if args.capacity else []):
        cfg = fmoe.ModelConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=16, experts=args.experts,
                               topk=args.topk, ffn=args.ffn, capacity_factor=capacity)
        batch = {"tokens": torch.randint(0, cfg.vocab, (rows * args.microbatches, args.seq + 1), generator=g)}
        params = None
        for schedule, delay in VARIANTS:
            plan = fmoe.Plan(model=cfg, dp=1, ep=world, sharding=args.sharding, microbatches=args.microbatches,
                             dtype="bfloat16", device="cuda", schedule=schedule, delay_wgrad=delay)
            params = params if params is not None else fmoe.init(plan, seed=0)
            step_s, a2a_ms, exposed_ms, compute_ms, idle_ms, loss = measure(plan, params, batch, args.steps)
            results.append((capacity, schedule, delay, step_s, a2a_ms, exposed_ms, compute_ms, idle_ms, loss))
            if rank == 0:
                print(f"done {schedule} delay_wgrad={delay} capacity={capacity}: {step_s * 1e3:.1f} ms "
                      f"loss {loss:.4f}", flush=True)
        del params
        torch.cuda.empty_cache()
    if rank == 0:
        tokens = args.tokens * args.microbatches * world
        print(f"\nSchedules, dp=1 x ep={world}, D={args.dim} E={args.experts} top-{args.topk} F={args.ffn}, "
              f"{args.layers} layers, {args.tokens} tokens/GPU/microbatch x {args.microbatches}, bf16, "
              f"{args.sharding}; median of {args.steps} steps, profile of one more")
        print(f"{'routing':>12s} {'schedule':>13s} {'delay_wgrad':>11s} {'step ms':>8s} {'tok/s':>9s} "
              f"{'vs standard':>11s} {'a2a ms':>7s} {'exposed ms':>10s} {'hidden':>7s} {'compute ms':>10s} "
              f"{'GPU idle ms':>11s}")
        for capacity, schedule, delay, step_s, a2a_ms, exposed_ms, compute_ms, idle_ms, _ in results:
            base = next(r[3] for r in results if r[0] == capacity and r[1] == "standard" and not r[2])
            routing = f"capacity {capacity:g}" if capacity else "dropless"
            print(f"{routing:>12s} {schedule:>13s} {str(delay):>11s} {step_s * 1e3:8.1f} {tokens / step_s:9.0f} "
                  f"{base / step_s:10.2f}x {a2a_ms:7.1f} {exposed_ms:10.1f} {1 - exposed_ms / a2a_ms:7.1%} "
                  f"{compute_ms:10.1f} {idle_ms:11.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
