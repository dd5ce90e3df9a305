"""A training loop that calls fmoe.step and fmoe.adamw directly.

    python examples/train_loop.py --steps 200

Everything is a value: params, optimizer state, the batch. Nothing is hidden in a
module or a hook, so each line below is the whole story of one training step.
"""

import argparse

import torch

import fmoe
from fmoe.data import corpus_bytes, random_windows, train_heldout_split

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--device", default="cpu")
args = ap.parse_args()

cfg = fmoe.ModelConfig(vocab=256, dim=128, layers=2, heads=4, experts=8, topk=2, ffn=256)
plan = fmoe.Plan(model=cfg, microbatches=2, dtype="float32", device=args.device)

params = fmoe.init(plan, seed=0)
opt = fmoe.adamw(lr=fmoe.warmup_cosine(3e-3, warmup=20, total=args.steps), weight_decay=0.1, max_grad_norm=1.0)
opt_state = opt.init(params)

train_ids, _ = train_heldout_split(corpus_bytes())
rng = torch.Generator().manual_seed(0)
for i in range(args.steps):
    batch = random_windows(train_ids, batch=16, seq=128, generator=rng)   # {"tokens": [16, 129]}
    out = fmoe.step(params, batch, plan)                                   # loss, grads, metrics
    params, opt_state = opt.update(out.grads, opt_state, params)
    params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], cfg.expert_bias_rate)
    if i % 20 == 0 or i == args.steps - 1:
        load = out.metrics["expert_counts"].float()
        print(f"step {i:4d}  loss {out.loss.item():.3f}  "
              f"max/mean expert load {(load.max(-1).values / load.mean(-1)).max().item():.2f}")
