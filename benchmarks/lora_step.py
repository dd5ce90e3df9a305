"""A LoRA training step against a full fine-tuning step on the same plan (issue 65's numbers).

    python benchmarks/lora_step.py [--shape fine] [--rank 16] [--targets q,k,v,out,experts] [--compile]
    python benchmarks/lora_step.py --model qwen3-30b-a3b --seq 4096 --remat full --loss-chunk 4096 --compile
    python benchmarks/lora_step.py --device cpu            # the shape's CPU toy, to check the script

Both sides run the same model, plan and batches (8 x 2048 tokens on the GPU, bf16 compute), one
process: full fine-tuning is ``fmoe.step`` on fp32 params + fused AdamW on every parameter; LoRA
is ``fmoe.step(adapters, batch, plan, base=frozen)`` + fused AdamW on the adapters, the base drawn
in the compute dtype and laid out once (``fmoe.lora.freeze``). Each side is timed alone (median
of ``--steps`` steps after ``--warmup``), its peak memory read, and its static state counted
(what lives between steps: params, their gradients, AdamW's moments; for LoRA the frozen base's
shards, the adapters, their gradients and moments). ``--model`` takes a released model's shape
(``fmoe.plan.models``) and runs LoRA alone: its full fine-tuning does not fit one GPU. Prints a
table last, each target marked met or not.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time

import optree
import torch

import fmoe
from fmoe.plan.models import MODELS
from fmoe.plan.models import model as released
from vs_peer import MODEL_FLAGS, shape_config

TARGETS_SPEED, TARGETS_MEMORY = 1.25, 4.0  # LoRA over full fine-tuning: tokens/s, and static state below


def tree_bytes(*trees) -> int:
    return sum(t.numel() * t.element_size() for tree in trees for t in optree.tree_leaves(tree)
               if isinstance(t, torch.Tensor))


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(step, batches, warmup, device) -> tuple[float, float]:
    """Median seconds of ``step(batch)`` after ``warmup`` steps, and the first step's seconds."""
    times = []
    for batch in batches:
        sync(device)
        t0 = time.perf_counter()
        step(batch)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:]), times[0]


def fresh(device):
    gc.collect()
    torch._dynamo.reset()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else math.nan


def full_fine_tuning(plan, batches, args) -> dict:
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(1e-5, weight_decay=0.0, plan=plan, fused=True, donate=True)
    state = {"params": params, "opt": opt.init(params)}

    def step(batch):
        out = fmoe.step(state["params"], batch, plan)
        state["params"], state["opt"] = opt.update(out.grads, state["opt"], state["params"])
        return out
    seconds, first = timed(step, batches, args.warmup, plan.device)
    static = tree_bytes(state["params"], state["opt"]) + tree_bytes(state["params"])  # + the grads of a step
    return {"seconds": seconds, "first": first, "static": static, "peak": peak_gib(plan.device)}


def lora_fine_tuning(plan, batches, args) -> dict:
    t0 = time.perf_counter()
    base = fmoe.lora.freeze(fmoe.init(plan, seed=0, dtype=plan.compute_dtype), plan)
    print(f"  the frozen base drawn and laid out in {time.perf_counter() - t0:.0f} s", flush=True)
    adapters = fmoe.lora.init(plan, seed=0)
    opt = fmoe.adamw(1e-4, weight_decay=0.0, plan=plan, fused=True, donate=True)
    state = {"adapters": adapters, "opt": opt.init(adapters)}

    def step(batch):
        out = fmoe.step(state["adapters"], batch, plan, base=base)
        state["adapters"], state["opt"] = opt.update(out.grads, state["opt"], state["adapters"])
        return out
    seconds, first = timed(step, batches, args.warmup, plan.device)
    static = tree_bytes(base.shards.flat, state["adapters"], state["opt"]) + tree_bytes(state["adapters"])
    return {"seconds": seconds, "first": first, "static": static, "peak": peak_gib(plan.device),
            "adapted": tree_bytes(state["adapters"]) // 4}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="fine", choices=("coarse", "fine", "qwen3-moe-medium"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="q,k,v,out,experts")
    ap.add_argument("--model", default=None, choices=MODELS, help="a released model's shape: LoRA alone")
    ap.add_argument("--compile", action="store_true", help="Plan.compile on both sides")
    ap.add_argument("--remat", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--loss-chunk", type=int, default=0)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--batch", type=int, default=None, help="sequences a step (8 on the GPU, 2 on the CPU)")
    ap.add_argument("--seq", type=int, default=None, help="tokens a sequence (2048 on the GPU, 64 on the CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps with the warm-up (13 GPU, 4 CPU)")
    ap.add_argument("--warmup", type=int, default=None)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    batch, seq = args.batch or (8 if gpu else 2), args.seq or (2048 if gpu else 64)
    steps, args.warmup = args.steps or (13 if gpu else 4), args.warmup or (3 if gpu else 1)
    if args.model:
        cfg = released(args.model)
        args.shape = args.model
    else:
        cfg = shape_config(args.shape, argparse.Namespace(**dict.fromkeys(MODEL_FLAGS)), toy=not gpu)
    compute = dict(dtype="bfloat16", device="cuda") if gpu else dict(device="cpu")
    plan = fmoe.Plan(model=cfg, compile=args.compile, remat=args.remat, loss_chunk=args.loss_chunk,
                     microbatches=args.microbatches, **compute)
    lora = fmoe.LoRA(rank=args.rank, alpha=args.alpha, targets=tuple(args.targets.split(",")))
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g).to(plan.device)}
               for _ in range(steps)]
    where = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"{where}, torch {torch.__version__}; {args.shape}{'' if gpu else ' (CPU toy)'}: "
          f"{fmoe.active_param_count(cfg) / 1e6:.1f}M active params, {batch} x {seq} tokens a step, "
          f"compile={args.compile}, remat={args.remat}, microbatches={args.microbatches}; LoRA rank {args.rank}, "
          f"alpha {args.alpha:g}, targets {args.targets}", flush=True)
    tokens = batch * seq
    if args.model:
        fresh(plan.device)
        adapted = lora_fine_tuning(plan.replace(lora=lora), batches, args)
        mfu = 6 * fmoe.active_param_count(cfg) * tokens / adapted["seconds"] / 789e12
        print(f"\n| step | tokens/s | peak GiB | static state GiB |\n| --- | ---: | ---: | ---: |\n"
              f"| LoRA ({adapted['adapted'] / 1e6:.0f}M adapter params) | {tokens / adapted['seconds']:,.0f} | "
              f"{adapted['peak']:.2f} | {adapted['static'] / 2**30:.2f} |\n\n{args.model} LoRA on one GPU: "
              f"{adapted['seconds'] * 1e3:.0f} ms a step of {batch} x {seq} tokens; 6 x active params x tokens "
              f"/ time = {mfu:.1%} of 789 TFLOP/s (a LoRA step computes about 2/3 of that)")
        return
    fresh(plan.device)
    full = full_fine_tuning(plan, batches, args)
    print(f"  full fine-tuning: {full['seconds'] * 1e3:.1f} ms a step (first {full['first']:.1f} s)", flush=True)
    fresh(plan.device)
    adapted = lora_fine_tuning(plan.replace(lora=lora), batches, args)
    print(f"  LoRA: {adapted['seconds'] * 1e3:.1f} ms a step (first {adapted['first']:.1f} s)", flush=True)
    speed = full["seconds"] / adapted["seconds"]
    memory = full["static"] / adapted["static"]
    print("\n| step | tokens/s | peak GiB | static state GiB |\n| --- | ---: | ---: | ---: |")
    for name, r in (("full fine-tuning", full), (f"LoRA ({adapted['adapted'] / 1e6:.2f}M adapter params)", adapted)):
        print(f"| {name} | {tokens / r['seconds']:,.0f} | {r['peak']:.2f} | {r['static'] / 2**30:.3f} |")
    print(f"\nLoRA / full tokens/s: {speed:.3f}x (target >= {TARGETS_SPEED}x: "
          f"{'met' if speed >= TARGETS_SPEED else 'not met'}); static state {memory:.2f}x below "
          f"(target >= {TARGETS_MEMORY}x: {'met' if memory >= TARGETS_MEMORY else 'not met'})")


if __name__ == "__main__":
    main()
