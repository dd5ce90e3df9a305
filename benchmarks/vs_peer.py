"""fmoe vs an independent plain-PyTorch MoE LM (``benchmarks/peer.py``), side by side
in one process: same model, batches, learning rate and precision.

    python benchmarks/vs_peer.py                                        # 1 GPU
    torchrun --nproc-per-node 2 benchmarks/vs_peer.py --meshes dp dp1ep2
    python benchmarks/vs_peer.py --device cpu                           # tiny smoke run
    torchrun --nproc-per-node 2 benchmarks/vs_peer.py --device cpu --meshes dp dp1ep2   # gloo

Model (default, issue 14): vocab 32000, D=2048, 8 layers, 16 heads, E=16 experts of
F=1408, top-4, SwiGLU; 8 x 2048 tokens per GPU per step in 1 microbatch; bf16
compute, fp32 params and AdamW state (1.37B parameters). ``--device cpu`` shrinks
the defaults to a model that runs in seconds (fp32, gloo).

First the peer: plain on one GPU, FSDP2 (``fully_shard`` per block and the root,
bf16 params / fp32 reduce) over all ranks otherwise. It is freed, then fmoe runs each
mesh of ``--meshes``: ``dp`` (``no_shard`` on one rank, ZeRO-3 ``optim_grads_params``
over all ranks otherwise) or ``dpXepY`` (X * Y ranks, ZeRO-3 with expert
parallelism). A step is forward + backward + the AdamW update on both sides; neither
clips gradients; the median over ``--steps`` timed steps after ``--warmup``. MFU
counts the active parameters' FLOPs plus attention (``fmoe.train_flops_per_token``,
the same model on both sides) against 789 TFLOP/s per GPU. Prints a markdown table
last, with each system's loss after its last step (both start from a std-0.02 init
and see the same batches, so they should be close).
"""

from __future__ import annotations

import gc
import math
import os
import re
import statistics
import time

import optree
import torch
import torch.distributed as dist

import fmoe
import peer
from fsdp_step import lm_config, lm_parser

PEAK_TFLOPS = 789.0  # dense bf16 GEMM ceiling of one H100/H200 (the other benchmarks' figure)

# Defaults that differ from lm_parser's: issue 14's model on the GPU, a toy on the CPU.
GPU_DEFAULTS = dict(layers=8, topk=4, microbatches=1, warmup=3, steps=10)
CPU_DEFAULTS = dict(vocab=512, dim=64, layers=2, heads=4, experts=8, topk=2, ffn=64, batch=2, seq=64,
                    microbatches=1, warmup=1, steps=3)


def parse():
    ap = lm_parser(microbatches=1)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a tiny smoke run on gloo")
    ap.add_argument("--meshes", nargs="+", default=["dp"], help="fmoe meshes: dp, or dpXepY (e.g. dp1ep2)")
    ap.add_argument("--lr", type=float, default=1e-4)
    known, _ = ap.parse_known_args()
    ap.set_defaults(**(CPU_DEFAULTS if known.device == "cpu" else GPU_DEFAULTS))
    return ap.parse_args()


def fmoe_optimizer(plan: fmoe.Plan, lr: float) -> fmoe.Optimizer:
    """fmoe's side of the comparison: fused AdamW over the flat buffers, no clipping.
    ``donate=True`` writes the update into the buffers passed in, as torch.optim.AdamW
    updates its params in place."""
    return fmoe.adamw(lr=lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, plan=plan, fused=True, donate=True)


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def mesh_of(name: str, world: int) -> tuple[int, int]:
    """``dp`` -> (world, 1); ``dpXepY`` -> (X, Y), which must multiply to the world size."""
    if name == "dp":
        return world, 1
    m = re.fullmatch(r"dp(\d+)ep(\d+)", name)
    if not m or int(m[1]) * int(m[2]) != world:
        raise SystemExit(f"--meshes {name!r}: want 'dp' or 'dpXepY' with X * Y = {world} ranks")
    return int(m[1]), int(m[2])


class Bench:
    """What both systems share: the ranks, the batches and the timing."""

    def __init__(self, args):
        self.args, self.device = args, args.device
        self.distributed = "RANK" in os.environ  # started by torchrun
        if self.distributed:
            dist.init_process_group("nccl" if self.device == "cuda" else "gloo")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if self.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # Batch i of this rank: the same tokens for both systems, drawn once, outside the timing.
        self.batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                                      generator=torch.Generator().manual_seed(i * self.world + self.rank)
                                      ).to(self.device)
                        for i in range(args.warmup + args.steps)]

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
        if self.distributed:
            dist.barrier()

    def fresh_memory(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else float("nan")

    def timed(self, step) -> tuple[float, torch.Tensor]:
        """Median seconds of ``step(tokens)`` over the timed steps, and the last loss."""
        times, loss = [], None
        for i, tokens in enumerate(self.batches):
            self.sync()
            t0 = time.perf_counter()
            loss = step(tokens)
            self.sync()
            if i >= self.args.warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times), loss

    def say(self, *parts):
        if self.rank == 0:
            print(*parts, flush=True)


def run_peer(bench: Bench, cfg: fmoe.ModelConfig) -> dict:
    args = bench.args
    model = peer.build(cfg, bench.device, seed=0)
    params = sum(p.numel() for p in model.parameters())
    if bench.world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        model = peer.shard(model, init_device_mesh(bench.device, (bench.world,)))
        mesh = f"dp{bench.world} FSDP2"
    else:
        mesh = "1 rank, plain"
    opt = peer.optimizer(model, args.lr)
    bench.fresh_memory()
    step_s, loss = bench.timed(lambda tokens: peer.train_step(model, opt, tokens, args.microbatches))
    if bench.distributed:  # each rank's mean -> the global batch's mean, as fmoe reports
        dist.all_reduce(loss)
        loss = loss / bench.world
    row = dict(system="plain PyTorch peer", mesh=mesh, step_s=step_s, peak=bench.peak_gib(), loss=float(loss),
               params=params)
    return row  # the model and its optimizer go with this frame; main frees the memory


def run_fmoe(bench: Bench, cfg: fmoe.ModelConfig, mesh_name: str) -> dict:
    args = bench.args
    dp, ep = mesh_of(mesh_name, bench.world)
    sharding = "no_shard" if bench.world == 1 else "optim_grads_params"
    plan = fmoe.Plan(model=cfg, dp=dp, ep=ep, sharding=sharding, microbatches=args.microbatches,
                     dtype="bfloat16" if bench.device == "cuda" else "float32", device=bench.device)
    opt = fmoe_optimizer(plan, args.lr)
    held = {"params": fmoe.init(plan, seed=0)}
    held["state"] = opt.init(held["params"])

    def step(tokens):
        out = fmoe.step(held["params"], {"tokens": tokens}, plan)
        held["params"], held["state"] = opt.update(out.grads, held["state"], held["params"])
        return out.loss

    bench.fresh_memory()
    step_s, loss = bench.timed(step)
    mesh = f"dp{dp}" + (f" x ep{ep}" if ep > 1 else "") + (" no_shard" if sharding == "no_shard" else " ZeRO-3")
    row = dict(system="fmoe", mesh=mesh, step_s=step_s,
               peak=bench.peak_gib(), loss=float(loss))
    return row


def main():
    args = parse()
    bench = Bench(args)
    cfg = lm_config(args)
    for name in args.meshes:
        mesh_of(name, bench.world)  # refuse a bad mesh before any work
    rows = [run_peer(bench, cfg)]
    bench.fresh_memory()
    bench.say(f"  done peer ({rows[0]['mesh']}): {rows[0]['step_s'] * 1e3:.1f} ms")
    for name in args.meshes:
        rows.append(run_fmoe(bench, cfg, name))
        bench.fresh_memory()
        bench.say(f"  done fmoe ({rows[-1]['mesh']}): {rows[-1]['step_s'] * 1e3:.1f} ms")

    tokens = args.batch * args.seq  # per GPU per step
    flops = fmoe.train_flops_per_token(cfg, args.seq) * tokens
    shapes = optree.tree_leaves(fmoe.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    fmoe_params = sum(math.prod(shape) for shape in shapes)
    where = (f"{torch.cuda.get_device_name()} x {bench.world}" if args.device == "cuda"
             else f"CPU, {bench.world} rank(s)" + (" on gloo" if bench.distributed else ""))
    bench.say(f"\n{where}, torch {torch.__version__}; vocab {cfg.vocab}, D={cfg.dim}, {cfg.layers} layers, "
              f"{cfg.heads} heads, E={cfg.experts} top-{cfg.topk} F={cfg.ffn} SwiGLU; "
              f"{count(rows[0]['params'])} params (fmoe: {count(fmoe_params)}, with expert_bias), "
              f"{count(fmoe.active_param_count(cfg))} active; {args.batch} x {args.seq} tokens per GPU, "
              f"{args.microbatches} microbatch(es), {'bf16' if args.device == 'cuda' else 'fp32'}; "
              f"median of {args.steps} steps after {args.warmup} warmup (step + AdamW), lr {args.lr}\n")
    bench.say("| system | mesh | step ms (median) | tokens/s/GPU | MFU | peak GiB | vs peer | loss after last step |")
    bench.say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    peer_s = rows[0]["step_s"]
    for r in rows:
        on_gpu = args.device == "cuda"  # MFU and peak memory mean nothing on the CPU
        mfu = f"{flops / r['step_s'] / (PEAK_TFLOPS * 1e12):.1%}" if on_gpu else "-"
        peak = f"{r['peak']:.2f}" if on_gpu else "-"
        bench.say(f"| {r['system']} | {r['mesh']} | {r['step_s'] * 1e3:.1f} | {tokens / r['step_s']:,.0f} | "
                  f"{mfu} | {peak} | {peer_s / r['step_s']:.2f}x | {r['loss']:.4f} |")
    if bench.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
