"""Expert MLP throughput per backend: fc1 -> GLU x router prob -> fc2, forward + backward.

    python benchmarks/expert_mlp.py [--backends torch te] [--iters 20] [--permute] [--no-fused] [--graph]

The shapes of ../shared/device/ceilings.md's anchors (bf16): rows = tokens x topk.
Default: equal splits, no permute, the probability scales the GLU output (the
anchors' setting). ``--permute``: tokens ``[T, D]`` with random top-k experts
(uniform, so splits vary) go through ``make_dispatch`` + ``permute``, the experts,
then ``unpermute`` weighted by the probabilities. FLOPs are 3 x the forward's GEMMs
(dgrad + wgrad), active experts only. Backend ``te`` needs TransformerEngine
(``interop.te``). Each backend runs with fmoe's Triton kernels for the non-GEMM work
(SwiGLU x prob; with ``--permute`` also unpermute: ``fmoe/layers/triton_kernels.py``)
and again with ``FMOE_FUSED_KERNELS=0`` (the pure-torch path), side by side;
``--no-fused`` runs the torch path only. ``--graph`` also times each case replayed
from a CUDA graph: the GPU's time without the host's launch gaps (each eager call
starts on an idle GPU after a sync), as the expert path runs inside a graphed step.
Prints a table last.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os

import torch

import fmoe
from fmoe.layers import expert_mlp, fused_kernels_available, make_dispatch, permute, unpermute
from kernel_time import graph_median_ms, median_ms

SHAPES = [(65536, 2048, 1408, 16), (262144, 4096, 1536, 32)]  # rows, D, F, E
TOPK = {16: 4, 32: 8}  # issue 9's shapes: T=16384 top-4, T=32768 top-8


def _print_top_kernels(fn, title: str, top: int = 24) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name, launches = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_name[e.name[:110]] += (e.time_range.end - e.time_range.start) / 1e3
            launches[e.name[:110]] += 1
    print(f"top kernels, {title} (ms; all kernels {sum(by_name.values()):.2f}, {sum(launches.values())} launches):")
    for name, ms in by_name.most_common(top):
        print(f"  {ms:8.2f} x{launches[name]:<3d} {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["torch", "te"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--permute", action="store_true")
    ap.add_argument("--profile", action="store_true", help="top kernels of one torch-backend call per shape")
    ap.add_argument("--no-fused", action="store_true", help="only the pure-torch path (FMOE_FUSED_KERNELS=0)")
    ap.add_argument("--graph", action="store_true",
                    help="also time each case replayed from a CUDA graph (no host launch gaps)")
    args = ap.parse_args()
    os.environ.pop("FMOE_FUSED_KERNELS", None)
    fused_modes = [False] if args.no_fused or not fused_kernels_available(torch.empty(0, device="cuda")) \
        else [True, False]
    if "te" in args.backends:
        importlib.import_module("interop.te")
    results = []
    for rows, D, F, E in SHAPES:
        K = TOPK[E]
        tokens = rows // K if args.permute else rows
        cfg = fmoe.ModelConfig(dim=D, ffn=F, experts=E, topk=K if args.permute else 1, heads=16)
        g = torch.Generator(device="cuda").manual_seed(0)
        if args.permute:  # top-k of random scores: every expert about rows / E, not exactly
            experts = torch.rand(tokens, E, device="cuda", generator=g).topk(K, dim=1).indices
        else:
            experts = (torch.arange(rows, device="cuda") % E)[:, None]  # equal splits
        x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        probs = torch.rand(tokens, K if args.permute else 1, device="cuda", generator=g).to(torch.bfloat16)
        probs = (probs if args.permute else probs[:, 0]).requires_grad_()
        p = {"fc1": (torch.randn(E, D, 2 * F, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16),
             "fc2": (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).to(torch.bfloat16)}
        p = {k: v.requires_grad_() for k, v in p.items()}
        grad_y = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, generator=g)
        flops = 3 * (2 * rows * D * 2 * F + 2 * rows * F * D)
        grad_y = grad_y[:tokens]
        fixed = None if args.permute else make_dispatch(experts, E)
        # fmoe's kernels replace the torch path's SwiGLU (a registered backend such as te
        # runs its own) and, with --permute, the unpermute
        runs = [(b, f if b in ("torch", "loop") or args.permute else None)
                for b in args.backends for f in fused_modes]
        for backend, fused in dict.fromkeys(runs):
            os.environ["FMOE_FUSED_KERNELS"] = "1" if fused else "0"  # read at every call

            def fwd_bwd():
                if args.permute:  # the routing decision's permutation is part of the work
                    d = make_dispatch(experts, E)
                    y = unpermute(expert_mlp(p, permute(x, d), d, cfg, None, backend), d, probs)
                else:
                    y = expert_mlp(p, x, fixed, cfg, probs, backend)
                torch.autograd.grad(y, [x, probs, p["fc1"], p["fc2"]], grad_y)
            ms = median_ms(fwd_bwd, args.iters)
            graph_ms = graph_median_ms(fwd_bwd, args.iters) if args.graph else float("nan")
            fused_text = {True: "yes", False: "no", None: "-"}[fused]
            results.append((rows, D, F, E, backend, fused_text, ms, flops / ms / 1e9, graph_ms, flops / graph_ms / 1e9))
            if args.profile and backend == "torch":
                _print_top_kernels(fwd_bwd, f"rows={rows} D={D} F={F} E={E} torch, fused kernels {fused}")
            del fwd_bwd
        torch.cuda.empty_cache()
    os.environ.pop("FMOE_FUSED_KERNELS", None)
    what = "permute + experts + unpermute x prob, random top-k" if args.permute else \
        "swiglu x prob, equal splits, no permute"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; expert MLP fwd+bwd, bf16, {what}; "
          f"median of {args.iters}")
    head = f"{'rows':>7s} {'D':>5s} {'F':>5s} {'E':>3s} {'backend':>8s} {'fused':>5s} {'ms':>8s} {'TFLOP/s':>8s}"
    print(head + (f" {'graph ms':>9s} {'TFLOP/s':>8s}" if args.graph else ""))
    for rows, D, F, E, backend, fused, ms, tflops, graph_ms, graph_tflops in results:
        graphed = f" {graph_ms:9.2f} {graph_tflops:8.1f}" if args.graph else ""
        print(f"{rows:7d} {D:5d} {F:5d} {E:3d} {backend:>8s} {fused:>5s} {ms:8.2f} {tflops:8.1f}{graphed}")


if __name__ == "__main__":
    main()
