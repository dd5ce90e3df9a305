"""A LoRA training step against a full fine-tuning step on the same plan (issue 65's numbers).

    python benchmarks/lora_step.py [--shape fine] [--rank 16] [--targets q,k,v,out,experts] [--compile]
    python benchmarks/lora_step.py --model qwen3-30b-a3b --seq 4096 --remat full --loss-chunk 4096 --compile
    python benchmarks/lora_step.py --device cpu            # the shape's CPU toy, to check the script

Both sides run the same model, plan and batches (8 x 2048 tokens on the GPU, bf16 compute), one
process: full fine-tuning is ``fmoe.step`` on fp32 params + fused AdamW on every parameter; LoRA
is ``fmoe.step(adapters, batch, plan, base=frozen)`` + fused AdamW on the adapters, the base drawn
in the compute dtype and laid out once (``fmoe.lora.freeze``). Each side is built and warmed up
alone (``--warmup`` steps: its peak memory above what the other side holds), then the two are
timed side by side, a step of one beside a step of the other (median of ``--steps`` each), and
each side's static state is counted (what lives between steps: params, their gradients, AdamW's
moments; for LoRA the frozen base's shards, the adapters, their gradients and moments). ``--model`` takes a released model's shape
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


def allocated(device) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def peak_since(device, before: int) -> float:
    """GiB at the most since the peak was reset, above ``before`` bytes held by the other side."""
    return (torch.cuda.max_memory_allocated() - before) / 2**30 if device.startswith("cuda") else math.nan


class Side:
    """One side's training step (``step(batch)``) and what it holds between steps."""

    def __init__(self, name: str, step, static: int, adapted: int = 0):
        self.name, self.step, self.static, self.adapted = name, step, static, adapted
        self.times: list = []
        self.first = self.peak = math.nan

    def warm(self, batches, warmup: int, device: str, before: int) -> None:
        """``warmup`` steps alone (compiles, allocator); the peak memory since the side was
        built, above ``before`` bytes (what was held then: the other side's state)."""
        for i in range(warmup):
            t0 = time.perf_counter()
            self.step(batches[i % len(batches)])
            sync(device)
            if i == 0:
                self.first = time.perf_counter() - t0
        self.peak = peak_since(device, before)

    def timed(self, batch, device: str) -> None:
        sync(device)
        t0 = time.perf_counter()
        self.step(batch)
        sync(device)
        self.times.append(time.perf_counter() - t0)

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def full_fine_tuning(plan) -> Side:
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(1e-5, weight_decay=0.0, plan=plan, fused=True, donate=True)
    state = {"params": params, "opt": opt.init(params)}

    def step(batch):
        out = fmoe.step(state["params"], batch, plan)
        state["params"], state["opt"] = opt.update(out.grads, state["opt"], state["params"])
    static = tree_bytes(state["params"], state["opt"]) + tree_bytes(state["params"])  # + the grads of a step
    return Side("full fine-tuning", step, static)


def lora_fine_tuning(plan) -> Side:
    t0 = time.perf_counter()
    base = fmoe.lora.freeze(fmoe.init(plan, seed=0, dtype=plan.compute_dtype), plan)
    print(f"  the frozen base drawn and laid out in {time.perf_counter() - t0:.0f} s", flush=True)
    adapters = fmoe.lora.init(plan, seed=0)
    opt = fmoe.adamw(1e-4, weight_decay=0.0, plan=plan, fused=True, donate=True)
    state = {"adapters": adapters, "opt": opt.init(adapters)}

    def step(batch):
        out = fmoe.step(state["adapters"], batch, plan, base=base)
        state["adapters"], state["opt"] = opt.update(out.grads, state["opt"], state["adapters"])
    static = tree_bytes(base.shards.flat, state["adapters"], state["opt"]) + tree_bytes(state["adapters"])
    adapted = tree_bytes(state["adapters"]) // 4
    return Side(f"LoRA ({adapted / 1e6:,.1f}M adapter params)", step, static, adapted)


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
    sides = []
    for make, on in ((lora_fine_tuning, plan.replace(lora=lora)), (full_fine_tuning, plan))[:1 if args.model else 2]:
        gc.collect()
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        before = allocated(plan.device)  # the other side's state, held while this one runs
        sides.append(make(on))
        sides[-1].warm(batches, args.warmup, plan.device, before)
    for i in range(steps):  # side by side: each step of one side beside one of the other
        for side in sides:
            side.timed(batches[i % len(batches)], plan.device)
    for side in sides:
        print(f"  {side.name}: {side.seconds * 1e3:.1f} ms a step (median of {steps}; the first took "
              f"{side.first:.1f} s)", flush=True)
    adapted = sides[0]
    if args.model:
        mfu = 6 * fmoe.active_param_count(cfg) * tokens / adapted.seconds / 789e12
        print(f"\n| step | tokens/s | peak GiB | static state GiB |\n| --- | ---: | ---: | ---: |\n"
              f"| {adapted.name} | {tokens / adapted.seconds:,.0f} | {adapted.peak:.2f} | "
              f"{adapted.static / 2**30:.2f} |\n\n{args.model} LoRA on one GPU: {adapted.seconds * 1e3:.0f} ms a step of "
              f"{batch} x {seq} tokens; 6 x active params x tokens / time = {mfu:.1%} of 789 TFLOP/s (a LoRA step "
              "computes about 2/3 of that)")
        return
    full = sides[1]
    speed = full.seconds / adapted.seconds
    memory = full.static / adapted.static
    print("\n| step | tokens/s | peak GiB | static state GiB |\n| --- | ---: | ---: | ---: |")
    for side in (full, adapted):
        print(f"| {side.name} | {tokens / side.seconds:,.0f} | {side.peak:.2f} | {side.static / 2**30:.3f} |")
    print(f"\nLoRA / full tokens/s: {speed:.3f}x (target >= {TARGETS_SPEED}x: "
          f"{'met' if speed >= TARGETS_SPEED else 'not met'}); static state {memory:.2f}x below "
          f"(target >= {TARGETS_MEMORY}x: {'met' if memory >= TARGETS_MEMORY else 'not met'})")


if __name__ == "__main__":
    main()
