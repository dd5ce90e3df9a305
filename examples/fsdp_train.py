"""Data-parallel training with FSDP (ZeRO-3 by default), one process per rank.

    torchrun --nproc-per-node 2 examples/fsdp_train.py                # CPU, gloo
    torchrun --nproc-per-node 2 examples/fsdp_train.py --device cuda  # GPUs, NCCL
    torchrun --nproc-per-node 2 examples/fsdp_train.py --ep 2 --schedule 1f1b_overlap --delay-wgrad

Each rank holds 1/world of every parameter, gradient and AdamW moment; fmoe.step
gathers each layer's weights just before it runs and frees them after, as the
plan's program says. Every rank feeds its own rows and sees the global loss.
"""

import argparse
import os

import torch
import torch.distributed as dist

import fmoe
from fmoe.data import corpus_bytes, random_windows, train_heldout_split

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--sharding", default="optim_grads_params")
ap.add_argument("--device", default="cpu")
ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (dp = world / ep)")
ap.add_argument("--schedule", default="standard", help="standard | 1f1b_overlap")
ap.add_argument("--delay-wgrad", action="store_true", help="run the experts' weight gradients later")
ap.add_argument("--trace", default="", help="write rank 0's last step as a Chrome trace here")
args = ap.parse_args()

if args.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

cfg = fmoe.ModelConfig(vocab=256, dim=128, layers=2, heads=4, experts=8, topk=2, ffn=256)
plan = fmoe.Plan(model=cfg, dp=world // args.ep, ep=args.ep, sharding=args.sharding, schedule=args.schedule,
                 delay_wgrad=args.delay_wgrad, microbatches=2, device=args.device)
params = fmoe.init(plan, seed=0)                     # this rank's shards
opt = fmoe.adamw(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, plan=plan)
state = opt.init(params)

train_ids, _ = train_heldout_split(corpus_bytes())
rng = torch.Generator().manual_seed(0)                # same global batch on every rank...
for i in range(args.steps):
    batch = random_windows(train_ids, batch=8 * world, seq=128, generator=rng)["tokens"]
    mine = batch[rank * 8:(rank + 1) * 8]             # ...of which each rank takes its rows
    out = fmoe.step(params, {"tokens": mine}, plan)
    params, state = opt.update(out.grads, state, params)
    params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], cfg.expert_bias_rate)
    if rank == 0 and (i % 10 == 0 or i == args.steps - 1):
        print(f"step {i:3d}  loss {out.loss.item():.3f}")

if args.trace and rank == 0:
    print("trace:", fmoe.export_chrome_trace(out.metrics["trace"], args.trace))
full = fmoe.gather_full(params, plan)                 # collective: every rank calls it
if rank == 0:
    print("full embed:", tuple(full["embed"].shape), "this rank's rows:", tuple(params["embed"].shape))
dist.destroy_process_group()
