"""Weak scaling of a training step over DP x EP meshes: tokens/s, MFU, exposed communication.

    torchrun --nproc-per-node N benchmarks/scaling.py --out scaling.jsonl   (N = 1, 2, 4, 8)

Model (the FSDP benchmark's): D=2048, 6 layers, 16 heads, 16 experts of F=1408, top-2,
vocab 32000 (1.06B total, 0.29B active parameters). Every GPU runs 8 x 2048 tokens per
step in 4 microbatches (weak scaling), ZeRO-3 with the 1F1B overlap schedule and
delayed wgrad, bf16; a step is ``fmoe.step`` + ``opt.update``. Meshes: dp=N and, from
2 GPUs, dp=N/2 x ep=2. Median of the timed steps; one more step runs under the CUDA
profiler for the communication kernels' time and the part of it with no compute
kernel beside it. Rows are appended to ``--out``; rank 0 prints every row in the file,
with the weak-scaling efficiency against the 1-GPU row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import fmoe
from kernel_time import exposure

PEAK_TFLOPS = 789.0  # dense bf16 GEMM ceiling of one H200 (ceilings.md)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="scaling.jsonl")
    return ap.parse_args()


def run(plan, tokens, steps):
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, max_grad_norm=1.0, plan=plan)
    state = opt.init(params)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(2 + steps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fmoe.step(params, {"tokens": tokens}, plan)
        params, state = opt.update(out.grads, state, params)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        out = fmoe.step(params, {"tokens": tokens}, plan)
        params, state = opt.update(out.grads, state, params)
        torch.cuda.synchronize()
        profiled = (time.perf_counter() - t0) * 1e3
    ms = exposure(prof)
    return statistics.median(times), ms, profiled, torch.cuda.max_memory_allocated() / 2**30


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    cfg = fmoe.ModelConfig(vocab=32000, dim=2048, layers=args.layers, heads=16, experts=16, topk=2, ffn=1408)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    meshes = [(world, 1)] + ([(world // 2, 2)] if world >= 2 and world % 2 == 0 else [])
    rows = []
    for dp, ep in meshes:
        plan = fmoe.Plan(model=cfg, dp=dp, ep=ep, sharding="optim_grads_params", schedule="1f1b_overlap",
                         delay_wgrad=True, microbatches=args.microbatches, dtype="bfloat16", device="cuda")
        step_s, ms, profiled, peak = run(plan, tokens, args.steps)
        per_gpu = args.batch * args.seq / step_s
        rows.append({"gpus": world, "dp": dp, "ep": ep, "step_ms": step_s * 1e3, "tokens_s": per_gpu * world,
                     "tokens_s_gpu": per_gpu,
                     "mfu": per_gpu * fmoe.train_flops_per_token(cfg, args.seq) / (PEAK_TFLOPS * 1e12),
                     "comm_ms": ms["comm"], "exposed_share": ms["exposed"] / profiled, "peak_gib": peak})
        if rank == 0:
            print(f"done dp={dp} ep={ep}: {step_s * 1e3:.1f} ms", flush=True)
        torch.cuda.empty_cache()
    if rank == 0:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        with open(args.out) as f:
            table = [json.loads(line) for line in f if line.strip()]
        base = next((r["tokens_s_gpu"] for r in table if r["gpus"] == 1), None)
        print(f"\nWeak scaling, {args.batch} x {args.seq} tokens per GPU per step, ZeRO-3 + 1f1b_overlap + "
              f"delay_wgrad, bf16; median of {args.steps} steps")
        print(f"{'GPUs':>4s} {'mesh':>10s} {'step ms':>8s} {'tokens/s':>9s} {'tok/s/GPU':>9s} {'MFU':>6s} "
              f"{'weak eff':>8s} {'comm ms':>8s} {'exposed comm':>12s} {'peak GiB':>8s}")
        for r in table:
            eff = f"{r['tokens_s_gpu'] / base:8.1%}" if base else f"{'-':>8s}"
            print(f"{r['gpus']:4d} {'dp%dxep%d' % (r['dp'], r['ep']):>10s} {r['step_ms']:8.1f} {r['tokens_s']:9.0f} "
                  f"{r['tokens_s_gpu']:9.0f} {r['mfu']:6.1%} {eff} {r['comm_ms']:8.1f} "
                  f"{r['exposed_share']:12.1%} {r['peak_gib']:8.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
