"""The main job: train a small byte-level MoE LM on the embedded corpus.

    python -m fmoe.train                       # CPU, a few minutes
    python -m fmoe.train --device cuda --dtype bfloat16 --dim 512 --steps 2000

Prints the unigram baseline and the held-out loss, writes ``metrics.jsonl`` and
checkpoints (``fmoe.save``: every ``--save-every`` steps and at the end) under
``--out``; ``--resume`` continues from the checkpoint there, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import optree
import torch
from tqdm import tqdm

import fmoe
from fmoe.data import corpus_bytes, random_windows, tiled_windows, train_heldout_split, unigram_cross_entropy


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fmoe.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--dim", type=int, default=128)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--experts", type=int, default=8)
    m.add_argument("--topk", type=int, default=2)
    m.add_argument("--ffn", type=int, default=256)
    m.add_argument("--shared-ffn", type=int, default=0)
    m.add_argument("--activation", default="swiglu")
    m.add_argument("--score-func", default="softmax")
    r = ap.add_argument_group("run")
    r.add_argument("--steps", type=int, default=1000)
    r.add_argument("--batch", type=int, default=16, help="sequences per step")
    r.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    r.add_argument("--microbatches", type=int, default=1)
    r.add_argument("--lr", type=float, default=3e-3)
    r.add_argument("--warmup", type=int, default=30)
    r.add_argument("--weight-decay", type=float, default=0.1)
    r.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--device", default="cpu")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--eval-every", type=int, default=200)
    r.add_argument("--eval-batches", type=int, default=8)
    r.add_argument("--out", default="runs/fmoe-lm", help="folder for metrics.jsonl and the checkpoint")
    r.add_argument("--save-every", type=int, default=250, help="checkpoint every N steps (0: only at the end)")
    r.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    r.add_argument("--stop-after", type=int, default=0,
                   help="end this run after that step, with a checkpoint (for time-limited jobs; 0: run to --steps)")
    r.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def build_plan(args) -> fmoe.Plan:
    cfg = fmoe.ModelConfig(
        vocab=256, dim=args.dim, layers=args.layers, heads=args.heads, experts=args.experts,
        topk=args.topk, ffn=args.ffn, shared_ffn=args.shared_ffn, activation=args.activation,
        score_func=args.score_func,
    )
    return fmoe.Plan(model=cfg, microbatches=args.microbatches, dtype=args.dtype, device=args.device)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        plan = build_plan(args)  # bad flags fail here, before any data or tensor work
    except ValueError as err:
        raise SystemExit(f"fmoe.train: {err}") from None
    if args.steps < 1 or args.eval_every < 1:
        raise SystemExit("fmoe.train: --steps and --eval-every must be >= 1")
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint"
    if args.resume and not ckpt_path.exists():
        raise SystemExit(f"fmoe.train: --resume, but there is no checkpoint at {ckpt_path}")

    train_ids, heldout_ids = train_heldout_split(corpus_bytes())
    heldout = tiled_windows(heldout_ids, args.batch, args.seq, args.eval_batches)
    baseline = unigram_cross_entropy(train_ids, heldout_ids)
    sampler = torch.Generator().manual_seed(args.seed)

    opt = fmoe.adamw(fmoe.warmup_cosine(args.lr, args.warmup, args.steps), weight_decay=args.weight_decay,
                     max_grad_norm=args.clip or None)
    first_step = 1
    if args.resume:
        try:
            ck = fmoe.load(ckpt_path, plan)
        except ValueError as err:
            raise SystemExit(f"fmoe.train: cannot resume: {err}") from None
        params, opt_state, first_step = ck.params, ck.opt_state, ck.step + 1
        sampler.set_state(ck.rng)
        if first_step > args.steps:
            raise SystemExit(f"fmoe.train: the checkpoint is at step {ck.step} already; raise --steps to go on")
        print(f"resumed from {ckpt_path} at step {ck.step}")
    else:
        params = fmoe.init(plan, seed=args.seed)
        opt_state = opt.init(params)
    n_params = sum(p.numel() for p in optree.tree_leaves(params))
    print(f"fmoe.train: {n_params / 1e6:.2f}M params, {len(train_ids)} train / {len(heldout_ids)} held-out bytes, "
          f"plan dtype={plan.dtype} device={plan.device}")
    print(f"unigram baseline (held-out): {baseline:.4f} nats/byte")

    def evaluate():
        losses = [float(fmoe.eval_loss(params, b, plan)) for b in heldout]
        return sum(losses) / len(losses)

    def checkpoint(step_num):
        return fmoe.save(ckpt_path, plan, params, opt_state=opt_state, step=step_num, rng=sampler.get_state(),
                         extra={"seed": args.seed, "samples_seen": step_num * args.batch})

    log = open(out_dir / "metrics.jsonl", "a" if args.resume else "w")
    start = time.perf_counter()
    last_step = min(args.steps, args.stop_after) if args.stop_after else args.steps
    bar = tqdm(range(first_step, last_step + 1), desc="train", disable=args.no_progress, dynamic_ncols=True)
    train_loss = heldout_loss = float("nan")
    for step_num in bar:
        batch = random_windows(train_ids, args.batch, args.seq, sampler)
        out = fmoe.step(params, batch, plan)
        grad_norm = float(fmoe.global_norm(out.grads))
        params, opt_state = opt.update(out.grads, opt_state, params)
        params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], plan.model.expert_bias_rate)
        counts = out.metrics["expert_counts"].float()
        train_loss = float(out.loss)
        record = {
            "step": step_num, "loss": train_loss, "grad_norm": grad_norm,
            "aux_loss": float(out.metrics["aux_loss"]),
            "max_load": float((counts.max(-1).values / counts.mean(-1)).max()),
            "elapsed_s": time.perf_counter() - start,
        }
        if step_num % args.eval_every == 0 or step_num == last_step:
            heldout_loss = evaluate()
            record["heldout_loss"] = heldout_loss
            bar.write(f"step {step_num:5d}  train {train_loss:.4f}  held-out {heldout_loss:.4f}  "
                      f"(unigram {baseline:.4f})")
        log.write(json.dumps(record) + "\n")
        log.flush()
        bar.set_postfix(loss=f"{train_loss:.3f}")
        if args.save_every and step_num % args.save_every == 0 and step_num < last_step:
            checkpoint(step_num)
    bar.close()
    log.close()
    wall = time.perf_counter() - start
    ckpt = checkpoint(last_step)
    summary = {"unigram": baseline, "train_loss": train_loss, "heldout_loss": heldout_loss,
               "wall_s": wall, "steps": last_step, "checkpoint": str(ckpt)}
    print(f"done in {wall:.1f}s: train {train_loss:.4f}, held-out {heldout_loss:.4f} nats/byte "
          f"vs unigram {baseline:.4f} ({heldout_loss / baseline:.0%} of baseline); checkpoint {ckpt}")
    return summary


if __name__ == "__main__":
    main()
