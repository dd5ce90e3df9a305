"""The optimizer's share of a step: AdamW with fp32 against bf16 moments (issue 42, item 2).

    python benchmarks/optim_moments.py --shape coarse          (one GPU)
    python benchmarks/optim_moments.py --device cpu            (a toy: checks the script runs)

Times fmoe's fused AdamW update (weight decay and global-norm clipping on, as the main job
runs it) over all the shape's parameters: fp32 moments with torch's fused kernel and with
fmoe's per-leaf kernel, and bf16 moments (fmoe's kernel), beside the step it
follows (``compile=True``, replayed from a CUDA graph on the GPU); the gradients are a real
step's. Prints, per moment dtype: the update's median milliseconds, the bytes it must move
(params read and written, gradients read twice: the norm and the update, both moments read
and written) per second against the HBM copy ceiling, and its share of step + update.
"""

import argparse
import os
import statistics
import time

import optree
import torch

import fmoe
from vs_peer import SHAPES

HBM_COPY_GBS = 4205.0  # ../shared/device/ceilings.md: HBM copy (read + write), H200


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="coarse", choices=tuple(SHAPES))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.device == "cpu":
        args.batch, args.seq, args.warmup, args.steps = 2, 64, 1, 3
    return args


def median_s(fn, warmup: int, steps: int, device: str) -> float:
    times = []
    for _ in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def main():
    args = parse()
    gpu = args.device == "cuda"
    fields = SHAPES[args.shape]() if gpu else dict(vocab=512, dim=64, layers=2, heads=4, experts=8, topk=2, ffn=64)
    plan = fmoe.Plan(model=fmoe.ModelConfig(**{"aux_loss_coef": 0.0, **fields}), device=args.device,
                     dtype="bfloat16" if gpu else "float32", compile=gpu)
    params = fmoe.init(plan, seed=0)
    batch = {"tokens": torch.randint(0, plan.model.vocab, (args.batch, args.seq + 1),
                                     generator=torch.Generator().manual_seed(0)).to(args.device)}
    if gpu:
        from interop.cuda_graph import capture_step

        step = capture_step(params, batch, plan)
    else:
        def step(p, b):
            return fmoe.step(p, b, plan)
    grads = optree.tree_map(torch.clone, step(params, batch).grads)
    step_s = median_s(lambda: step(params, batch), args.warmup, args.steps, args.device)
    n = sum(t.numel() for t in optree.tree_leaves(params))
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"{args.shape}: {n / 1e9:.2f}B params, step ({args.batch} x {args.seq} tokens, "
          f"{'compiled, graphed' if gpu else 'eager'}) {step_s * 1e3:.1f} ms, {device}")
    print("| moments | kernel | update ms | bytes / element | GB/s | of HBM copy ceiling | share of step + update |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    # (moments, kernel): "torch" is torch's fused AdamW, what fused=True ran on CUDA before
    # fmoe's kernel took fp32 moments (FMOE_FUSED_KERNELS=0 around the update only: the step
    # above ran with the kernels)
    for moments, kernel in (("float32", "torch"), ("float32", "fmoe"), ("bfloat16", "fmoe")):
        os.environ["FMOE_FUSED_KERNELS"] = "0" if kernel == "torch" else "1"
        opt = fmoe.adamw(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0, plan=plan,
                         fused=True, donate=True, moments=moments)
        held = {"params": optree.tree_map(torch.clone, params)}
        held["state"] = opt.init(held["params"])

        def update():
            held["params"], held["state"] = opt.update(grads, held["state"], held["params"])

        update_s = median_s(update, args.warmup, args.steps, args.device)
        per_element = 4 * 2 + 4 * 2 + (4 if moments == "float32" else 2) * 2 * 2
        gbs = n * per_element / update_s / 1e9
        print(f"| {moments} | {kernel} | {update_s * 1e3:.2f} | {per_element} | {gbs:.0f} | {gbs / HBM_COPY_GBS:.0%} | "
              f"{update_s / (step_s + update_s):.1%} |", flush=True)
        del held


if __name__ == "__main__":
    main()
