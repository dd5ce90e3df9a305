"""Activation memory per recomputation policy and loss chunking, one GPU.

    python benchmarks/memory.py                       # the coarse model, issue 24's runs
    python benchmarks/memory.py --runs none:8x2048 full:32x2048 --compile

Each run is ``POLICY:BxS[:CHUNK]`` (``Plan.remat``, batch rows x sequence length,
``Plan.loss_chunk``; default 0). For each, on a fresh allocator: params from
``fmoe.init``, ``adamw(fused=True, donate=True)``, 2 warm-up steps, then the peak
allocated memory over 5 more (median step time). "Activations" is the peak minus
what the step holds whatever the policy: params, AdamW moments and the fp32 grads
(3 + 1 fp32 copies of the parameters, ``16 bytes x params``) and the bf16 compute
copy of the params (``2 bytes x params``). ``--head-only`` measures the loss alone
instead: final hidden states ``[T, D]`` -> logits over a large vocabulary -> summed
cross-entropy, forward + backward, whole vs in pieces (the loss's extra peak over its
inputs and gradients).

The coarse model: vocab 32000, D=2048, 8 layers, 16 heads, E=16 top-4 F=1408 (issue
21's), bf16 compute, no sharding.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import optree
import torch

import fmoe
from fmoe.layers.loss import linear_cross_entropy_sum

COARSE = dict(vocab=32000, dim=2048, layers=8, heads=16, experts=16, topk=4, ffn=1408, aux_loss_coef=0.0)
DEFAULT_RUNS = ["none:8x2048", "selective:8x2048", "full:8x2048", "none:8x2048:2048", "selective:8x2048:2048",
                "full:8x2048:2048", "selective:12x2048:2048", "full:32x2048:2048", "full:8x8192:2048"]
GIB = 2**30


def parse_run(text: str) -> tuple[str, int, int, int]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or "x" not in parts[1]:
        raise SystemExit(f"--runs {text!r}: want POLICY:BxS[:CHUNK], e.g. full:32x2048:2048")
    rows, seq = (int(n) for n in parts[1].split("x"))
    return parts[0], rows, seq, int(parts[2]) if len(parts) == 3 else 0


def fresh():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_steps(plan: fmoe.Plan, rows: int, seq: int, warm: int = 2, steps: int = 5) -> dict | None:
    """``warm + steps`` training steps (``fmoe.step`` + ``adamw(fused=True, donate=True)``)
    on a fresh allocator; the peak over the last ``steps`` and their median time. None
    when they do not fit."""
    cfg = plan.model
    fresh()
    params = opt = state = out = None
    times = []
    try:
        params = fmoe.init(plan, seed=0)
        opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=True, donate=True)
        state = opt.init(params)
        n_params = sum(t.numel() for t in optree.tree_leaves(params))
        tokens = torch.randint(0, cfg.vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
        batch = {"tokens": tokens.cuda()}
        for i in range(warm + steps):
            if i == warm:
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fmoe.step(params, batch, plan)
            params, state = opt.update(out.grads, state, params)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / GIB
        held = n_params * (16 + 2) / GIB
        return dict(peak=peak, activations=peak - held, tok_s=rows * seq / statistics.median(times[warm:]),
                    loss=float(out.loss), params=n_params)
    except torch.OutOfMemoryError:
        return None
    finally:  # nothing of this run outlives it, even when it ran out of memory
        del params, opt, state, out
        fresh()


def measure(cfg: fmoe.ModelConfig, remat: str, rows: int, seq: int, chunk: int, compile: bool, steps: int = 5):
    plan = fmoe.Plan(model=cfg, dtype="bfloat16", device="cuda", remat=remat, loss_chunk=chunk, compile=compile)
    return run_steps(plan, rows, seq, steps=steps)


def head_only(tokens: int, dim: int, vocab: int, chunks: list[int]):
    """The loss's own extra peak: whole logits vs pieces."""
    print(f"\n## the loss alone: {tokens} tokens, D={dim}, vocab {vocab}, bf16\n")
    print("| loss_chunk | extra peak GiB (over inputs and their grads) | fwd+bwd ms |")
    print("| ---: | ---: | ---: |")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for chunk in chunks:
        fresh()
        x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        w = (torch.randn(dim, vocab, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).requires_grad_()
        t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        for _ in range(2):  # warm-up, and grads allocated
            linear_cross_entropy_sum(x, w, t, chunk).backward()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        linear_cross_entropy_sum(x, w, t, chunk).backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        print(f"| {chunk or 'whole'} | {(torch.cuda.max_memory_allocated() - base) / GIB:.2f} | {ms:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="POLICY:BxS[:CHUNK] each")
    ap.add_argument("--compile", action="store_true", help="Plan(compile=True)")
    ap.add_argument("--head-only", action="store_true", help="the loss alone at --tokens / --vocab")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 4096, 2048, 1024])
    args = ap.parse_args()
    torch.cuda.set_device(0)
    if args.head_only:
        head_only(args.tokens, COARSE["dim"], args.vocab, args.chunks)
        return
    cfg = fmoe.ModelConfig(**COARSE)
    print(f"\n## {torch.cuda.get_device_name()}, torch {torch.__version__}; coarse model, bf16, "
          f"{'compiled' if args.compile else 'eager'}; params + AdamW + grads + bf16 copy held by every run\n")
    print("| remat | tokens per step | loss_chunk | peak GiB | activations GiB | tokens/s | loss |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for text in args.runs:
        remat, rows, seq, chunk = parse_run(text)
        r = measure(cfg, remat, rows, seq, chunk, args.compile)
        what = f"| {remat} | {rows} x {seq} | {chunk or '-'} |"
        if r is None:
            print(f"{what} out of memory | | | |", flush=True)
        else:
            print(f"{what} {r['peak']:.2f} | {r['activations']:.2f} | {r['tok_s']:,.0f} | {r['loss']:.4f} |",
                  flush=True)


if __name__ == "__main__":
    main()
