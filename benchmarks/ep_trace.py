"""Where a dp1 x epN step's GPU idles, per way of crossing ranks (``Plan.ep_exchange``).

    torchrun --nproc-per-node 2 benchmarks/ep_trace.py --shape fine --modes rows tokens --out DIR
    torchrun --nproc-per-node 2 benchmarks/ep_trace.py --device cpu --batch 1 --seq 64   # gloo smoke run

For each mode: ``vs_peer.py``'s shape (8 x 2048 tokens a rank, bf16, one microbatch)
under ``Plan(dp=1, ep=world, sharding="optim_grads_params", compile=True)`` with the
fused AdamW, ``--warmup`` steps, then one step under ``torch.profiler`` (CPU and CUDA) on
every rank. Each rank writes ``DIR/<mode>-rank<r>.json`` and prints ``trace_gaps.py``'s
table for it: the GPU's idle gaps charged to the program action that launched the kernel
after each gap, and the host's time per action. Ranks print one after the other.
``--device cpu`` (gloo, fp32, the shape's CPU toy) writes the traces without the table.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import fmoe
from trace_gaps import analyse
from vs_peer import MODEL_FLAGS, fmoe_optimizer, shape_config


def traced_step(cfg: fmoe.ModelConfig, mode: str, args, rank: int, world: int) -> str:
    on_gpu = args.device == "cuda"
    plan = fmoe.Plan(model=cfg, dp=1, ep=world, sharding="optim_grads_params", dtype="bfloat16" if on_gpu else
                     "float32", device=args.device, compile=on_gpu, ep_exchange=mode)
    params = fmoe.init(plan, seed=0)
    opt = fmoe_optimizer(plan, 1e-4)
    state = opt.init(params)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g).to(args.device)

    def step():
        nonlocal params, state
        out = fmoe.step(params, {"tokens": tokens}, plan)
        params, state = opt.update(out.grads, state, params)

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    path = os.path.join(args.out, f"{mode}-rank{rank}.json")
    prof.export_chrome_trace(path)
    print(f"rank {rank}, ep_exchange={mode}: profiled step {wall * 1e3:.1f} ms", flush=True)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="fine", choices=("coarse", "fine"))
    ap.add_argument("--modes", nargs="+", default=["rows", "tokens"], choices=fmoe.config.EP_EXCHANGES)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", default="ep_traces")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    os.makedirs(args.out, exist_ok=True)
    cfg = shape_config(args.shape, argparse.Namespace(**dict.fromkeys(MODEL_FLAGS)), toy=args.device == "cpu")
    for mode in args.modes:
        path = traced_step(cfg, mode, args, rank, world)
        torch._dynamo.reset()
        for r in range(world):
            dist.barrier()
            if r == rank and args.device == "cuda":
                analyse(path, args.top)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
