"""All-to-all bandwidth inside an expert-parallel training step vs NCCL's ceiling.

    torchrun --nproc-per-node 2 benchmarks/ep_a2a.py

Layer config where the exchange matters: D=2048, E=16 experts of F=1408, top-4,
4 layers, 8192 tokens per GPU per microbatch, bf16, dp=1 x ep=2 (`no_shard`, so
the only large collectives are the dispatch/combine all-to-alls). A step runs under
the CUDA profiler; the all-to-all kernels' time and the bytes fmoe counted give the
achieved bus bandwidth, compared with a standalone all_to_all of the same size.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import fmoe
from ep_args import ep_layer_parser


def parse():
    return ep_layer_parser(steps=3).parse_args()


def a2a_kernel_seconds(prof) -> float:
    """Summed device time of NCCL send/recv (all-to-all) kernels."""
    total = 0.0
    for e in prof.events():
        name = e.name.lower()
        if "nccl" in name and ("sendrecv" in name or "alltoall" in name) and e.device_type.name == "CUDA":
            total += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return total * 1e-6


def standalone_busbw(nbytes: int, world: int) -> float:
    """Bus bandwidth of a lone all_to_all_single of ``nbytes`` per rank (median of 5)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes * (world - 1) / world / statistics.median(times[2:])


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    cfg = fmoe.ModelConfig(vocab=32000, dim=args.dim, layers=args.layers, heads=16, experts=args.experts,
                           topk=args.topk, ffn=args.ffn)
    plan = fmoe.Plan(model=cfg, dp=1, ep=world, sharding="no_shard", microbatches=1, dtype="bfloat16",
                     device="cuda")
    params = fmoe.init(plan, seed=0)
    rows = args.tokens // args.seq
    g = torch.Generator().manual_seed(rank)
    batch = {"tokens": torch.randint(0, cfg.vocab, (rows, args.seq + 1), generator=g)}
    for _ in range(2):
        out = fmoe.step(params, batch, plan)
    torch.cuda.synchronize()
    step_times, kernel_s, sent = [], [], []
    for _ in range(args.steps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fmoe.step(params, batch, plan)
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        kernel_s.append(a2a_kernel_seconds(prof))
        sent.append(2 * int(out.metrics["a2a_bytes"]) // world)  # forward + backward, this rank
    per_layer = sent[0] // (4 * cfg.layers)
    ceiling = standalone_busbw(per_layer, world)
    busbw = statistics.median([b * (world - 1) / world / k for b, k in zip(sent, kernel_s)])
    if rank == 0:
        step = statistics.median(step_times)
        share = statistics.median(kernel_s) / step
        print(f"\nEP all-to-all, dp=1 x ep={world}, D={cfg.dim} E={cfg.experts} top-{cfg.topk} F={cfg.ffn}, "
              f"{cfg.layers} layers, {args.tokens} tokens/GPU, bf16")
        print(f"{'bytes/rank/step':>16s} {'per a2a MiB':>12s} {'a2a kernel ms':>14s} {'step ms':>8s} "
              f"{'a2a share':>10s} {'in-step busbw':>14s} {'standalone busbw':>17s}")
        print(f"{sent[0]:16d} {per_layer / 2**20:12.1f} {statistics.median(kernel_s) * 1e3:14.1f} "
              f"{step * 1e3:8.1f} {share:10.1%} {busbw / 1e9:11.1f} GB/s {ceiling / 1e9:14.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
