"""List the host syncs of one training step (each one drains the GPU queue).

    torchrun --nproc-per-node 2 benchmarks/host_syncs.py [--capacity 1.25] [--schedule 1f1b_overlap]

Runs a small dp=1 x ep=world step under ``torch.cuda.set_sync_debug_mode("warn")``
and prints how often each source line synchronised. Dropless routing must show
exactly one line (the split sizes in ``plan_exchange``, once per layer and
microbatch) plus the step's metrics; static capacity only the metrics.
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch
import torch.distributed as dist

import fmoe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=float, default=0.0)
    ap.add_argument("--schedule", default="standard")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    cfg = fmoe.ModelConfig(vocab=1024, dim=256, layers=2, heads=4, experts=8, topk=2, ffn=256,
                           capacity_factor=args.capacity)
    plan = fmoe.Plan(model=cfg, dp=1, ep=world, sharding="no_shard", microbatches=2, dtype="bfloat16",
                     device="cuda", schedule=args.schedule, delay_wgrad=True)
    params = fmoe.init(plan, seed=0)
    batch = {"tokens": torch.randint(0, cfg.vocab, (4, 257), generator=torch.Generator().manual_seed(rank))}
    fmoe.step(params, batch, plan)
    torch.cuda.synchronize()
    sites = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        fmoe.step(params, batch, plan)
        torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{'/'.join(w.filename.split('/')[-3:])}:{w.lineno}"] += 1
    if rank == 0:
        print(f"host syncs in one step ({args.schedule}, capacity={args.capacity}):")
        for site, n in sites.most_common():
            print(f"{n:6d}  {site}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
