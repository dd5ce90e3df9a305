"""FSDP step time and peak memory per sharding strategy, and how much communication
prefetch hides. One command on a machine with 2 GPUs:

    torchrun --nproc-per-node 2 benchmarks/fsdp_step.py [--layers 6 --dim 2048 ...]

Model (default): D=2048, 6 layers, 16 heads, E=16 experts of F=1408, top-2,
vocab 32000: 1.06B total parameters, 0.29B active per token. bf16 compute, fp32
params/grads/AdamW state; each GPU runs its own 16k tokens per step in 2
microbatches. Prints a table on rank 0 (median of the timed steps) and writes it as
JSON next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import optree
import torch
import torch.distributed as dist

import fmoe
from fmoe.resolve import resolve
from fmoe.schedule import Gather, Reduce
from fmoe.comm import count


def lm_parser(microbatches: int = 2) -> argparse.ArgumentParser:
    """Flags of the ~1B MoE LM the step benchmarks share (D=2048, 6 layers, 16 heads,
    16 experts of F=1408, top-2, vocab 32000) and of its batch (8 x 2048 per GPU)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="key/value heads; 0 = --heads (fewer: GQA)")
    ap.add_argument("--head-size", type=int, default=0, help="features per head; 0 = dim / heads")
    ap.add_argument("--qk-norm", default="none", choices=("none", "head", "full"), help="RMSNorm of q and k")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=microbatches)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    return ap


def lm_config(args) -> fmoe.ModelConfig:
    return fmoe.ModelConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                            kv_heads=args.kv_heads, head_size=args.head_size, qk_norm=args.qk_norm,
                            experts=args.experts, topk=args.topk, ffn=args.ffn)


def parse():
    ap = lm_parser()
    ap.add_argument("--out", default="fsdp_step.json")
    return ap.parse_args()


def memory_formula(plan) -> float:
    """Bytes per rank of params, grads and AdamW moments (fp32; divided over the ranks
    where the strategy shards them) plus the gathered compute-dtype weights: every
    unit for DDP/ZeRO-1/ZeRO-2, the live units for ZeRO-3. Activations, per-step
    flat copies and gradient accumulation buffers are what the measured peak adds."""
    setup = resolve(plan)
    spec = setup.spec
    full = [sum(layout.full_size for layout in u.groups.values()) for u in spec.units]
    n, world = sum(full), plan.world
    per = {"no_shard": (4, 4, 8), "optim": (4 / world, 4, 8 / world),
           "optim_grads": (4 / world, 4 / world, 8 / world),
           "optim_grads_params": (4 / world, 4 / world, 8 / world)}[plan.sharding]
    itemsize = torch.empty((), dtype=plan.compute_dtype).element_size()
    gathered = setup.train.max_live * max(full) if plan.sharding == "optim_grads_params" else n
    return n * sum(per) + itemsize * gathered


def run_case(name, plan, tokens, args):
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, max_grad_norm=1.0, plan=plan)
    state = opt.init(params)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, out = [], None
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        out = fmoe.step(params, {"tokens": tokens}, plan)
        params, state = opt.update(out.grads, state, params)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    trace = out.metrics["trace"]
    resting = sum(t.numel() * t.element_size() for t in optree.tree_leaves((params, state)))
    row = {
        "case": name, "sharding": plan.sharding, "prefetch": plan.prefetch,
        "step_s": statistics.median(times), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "formula_gib": memory_formula(plan) / 2**30,
        "resting_gib": resting / 2**30, "loss": float(out.loss),
        "all_gathers": count(trace, "all_gather", "params"),
        "reduce_scatters": count(trace, "reduce_scatter", "grads"),
        "all_reduces": count(trace, "all_reduce", "grads"),
    }
    del params, state, out
    torch.cuda.empty_cache()
    return row


def comm_only(plan):
    """Seconds for this plan's parameter gathers and gradient reduce-scatters of one
    step, issued back to back with nothing to hide behind."""
    setup = resolve(plan)
    spec, program = setup.spec, setup.train.actions
    work = []
    for u in spec.units:
        gathers = sum(1 for a in program if isinstance(a, Gather) and a.unit == u.name)
        reduces = sum(1 for a in program if isinstance(a, Reduce) and a.unit == u.name)
        for g, layout in u.groups.items():
            work.append((gathers, reduces,
                         torch.empty(layout.shard_size, dtype=spec.dtype(g), device="cuda"),
                         torch.empty(layout.full_size, dtype=spec.dtype(g), device="cuda"),
                         torch.empty(layout.full_size, dtype=torch.float32, device="cuda"),
                         torch.empty(layout.shard_size, dtype=torch.float32, device="cuda")))
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for gathers, reduces, shard, full, gfull, gshard in work:
            for _ in range(gathers):
                dist.all_gather_into_tensor(full, shard)
            for _ in range(reduces):
                dist.reduce_scatter_tensor(gshard, gfull)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    cfg = lm_config(args)
    total_params = fmoe.params.param_count(cfg)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g)
    base = dict(model=cfg, dp=world, microbatches=args.microbatches, dtype="bfloat16", device="cuda")
    cases = [(s, fmoe.Plan(sharding=s, **base)) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")]
    cases.append(("optim_grads_params, no prefetch", fmoe.Plan(sharding="optim_grads_params", prefetch=0, **base)))
    rows = []
    for name, plan in cases:
        rows.append(run_case(name, plan, tokens, args))
        if rank == 0:
            print(f"  done {name}: {rows[-1]['step_s'] * 1e3:.0f} ms", flush=True)
    comm = comm_only(cases[3][1])
    tokens_per_step = args.batch * args.seq * world
    flops = fmoe.train_flops_per_token(cfg, args.seq) * tokens_per_step
    if rank == 0:
        print(f"\nmodel: {total_params / 1e9:.2f}B params, {world} GPUs, {tokens_per_step} tokens/step, "
              f"bf16 compute, microbatches {args.microbatches}")
        print(f"{'case':34s} {'step ms':>8s} {'tok/s':>9s} {'MFU':>6s} {'peak GiB':>9s} {'formula':>8s} "
              f"{'rest GiB':>9s} {'AG':>4s} {'RS':>4s} {'AR':>4s}")
        for r in rows:
            mfu = flops / r["step_s"] / world / 789e12
            r["tokens_per_s"] = tokens_per_step / r["step_s"]
            r["mfu"] = mfu
            print(f"{r['case']:34s} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:9.0f} {mfu:6.1%} "
                  f"{r['peak_gib']:9.2f} {r['formula_gib']:8.2f} {r['resting_gib']:9.2f} {r['all_gathers']:4d} "
                  f"{r['reduce_scatters']:4d} {r['all_reduces']:4d}")
        z3, z3_off = rows[3]["step_s"], rows[4]["step_s"]
        hidden = (z3_off - z3) / comm if comm > 0 else float("nan")
        print(f"\nZeRO-3 gathers + reduce-scatters alone: {comm * 1e3:.1f} ms/step; prefetch on {z3 * 1e3:.1f} ms, "
              f"off {z3_off * 1e3:.1f} ms: prefetch hides {hidden:.0%} of the communication time")
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "comm_only_s": comm, "total_params": total_params, "world": world,
                       "tokens_per_step": tokens_per_step}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
