"""``Plan.fp8``'s recipes (``rowwise``, ``tensorwise``) against fmoe's own bf16 step,
side by side in one process.

    python benchmarks/fp8_step.py --shapes coarse fine            # compiled and eager
    python benchmarks/fp8_step.py --shapes coarse --fmoe-compile off --profile
    python benchmarks/fp8_step.py --shapes fine --modes graph --recipes none tensorwise none

For each shape of ``vs_peer.py`` (coarse: D=2048, E=16 top-4 F=1408; fine: E=64 top-8
F=704; 8 layers, vocab 32000, 8 x 2048 tokens per step) fmoe runs its step + fused
AdamW in bf16 and in each FP8 recipe, eager, with ``compile=True`` and (unless ``--fmoe-graph
off``) compiled with the whole step replayed as one CUDA graph (``capture_step``),
on one GPU, ``no_shard``, the same batches and init. Prints tokens/s, MFU (active
parameters + attention against 789 TFLOP/s, the bf16 ceiling: FP8 is counted at the
same FLOPs), peak memory, the loss after the last step, and FP8's speed-up over bf16
in the same mode (its first bf16 run). ``--modes`` and ``--recipes`` pick the runs, in
the order given for each mode (a recipe named twice runs twice: alternated runs show
the spread between runs of one process). With ``--profile``, the GPU time of one step by kernel family
(GEMMs bf16 / FP8, attention, elementwise: inductor's fusions with the FP8 casts among
them, fmoe's Triton kernels, torch's own with the fused AdamW; the rest) for each
system, and the top kernels of the FP8 ones.
"""

from __future__ import annotations

import collections
import re

import torch

from step_profile import kernel_times, profiled_step
from vs_peer import PEAK_TFLOPS, Bench, fmoe_graphs, fmoe_has_compile, freed, parse, run_fmoe, shape_config

import fmoe
from fmoe.config import FP8S


# Markers of the FP8 GEMM kernels in their (mangled) names, as torch 2.11 launches them
# on an H200: CUTLASS's grouped and rowwise kernels carry e4m3 types or torch's sm9x
# wrapper, cuBLASLt's FP8 kernels an ``ovscale`` (outer-vector scaling) suffix or, tensor
# scaled, the operands' types after the arch (``nvjet_sm90_qrtst``: q E4M3, r E5M2;
# bf16's are ``nvjet_sm90_tst``).
FP8_GEMM_MARKS = ("e4m3", "f8", "ovscale", "enable_3x_kernel_for_sm9x")
NVJET_FP8 = re.compile(r"nvjet_sm\d+_[qr]{2}")


def kernel_family(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "comm"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if n.startswith("triton") or "_kernel" in n and "gemm" not in n and "cutlass" not in n:
        return "elementwise"  # inductor's and fmoe's Triton kernels, torch's own (AdamW's included)
    if any(mark in n for mark in FP8_GEMM_MARKS) or NVJET_FP8.search(n):
        return "fp8 GEMM"
    if "gemm" in n or "xmma" in n or "cutlass" in n or "nvjet" in n:
        return "bf16 GEMM"
    return "other"


def profile_families(cfg, compile: bool, fp8: str) -> tuple[dict, list]:
    """GPU milliseconds by kernel family over one step + update (``step_profile``'s),
    and the ten kernels that took longest."""
    _, ms, _ = kernel_times(profiled_step(cfg, compile, fp8)[0])
    families = collections.Counter()
    for name, took in ms.items():
        families[kernel_family(name)] += took
    return dict(families), [(name[:90], took) for name, took in ms.most_common(10)]


MODES = {"eager": (False, False), "compiled": (True, False), "graph": (True, True)}  # (compile, graph)


def own_flags(ap) -> None:
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES),
                    help="eager, compile=True, compiled with the step as one CUDA graph")
    ap.add_argument("--recipes", nargs="+", choices=FP8S, default=list(FP8S),
                    help="Plan.fp8 values, run in this order in each mode (repeats run again)")


def main():
    args = parse(own_flags)
    if args.device != "cuda":
        raise SystemExit("fp8_step.py: Plan.fp8 needs a CUDA GPU with FP8 GEMMs; there is no CPU run")
    if "none" not in args.recipes:
        raise SystemExit("fp8_step.py: --recipes must include 'none', the bf16 step the others are measured against")
    families, args.profile = args.profile, False  # vs_peer's own --profile (NCCL time) means nothing here
    bench = Bench(args)
    kinds = [MODES[m] for m in args.modes
             if (not MODES[m][0] or fmoe_has_compile(args)) and (not MODES[m][1] or fmoe_graphs(args, bench))]
    for name in args.shapes:
        cfg = shape_config(name, args, toy=False, aux_loss=args.aux_loss)
        bench.draw(cfg.vocab)
        rows = [((c, g, f), freed(bench, run_fmoe(bench, cfg, "dp", c, g, **({"fp8": f} if f != "none" else {}))))
                for c, g in kinds for f in args.recipes]
        bf16 = {}  # (compile, graph): the mode's first bf16 run
        for (c, g, f), r in rows:
            if f == "none":
                bf16.setdefault((c, g), r)
        tokens = args.batch * args.seq
        flops = fmoe.train_flops_per_token(cfg, args.seq) * tokens
        bench.say(f"\n## {name}: D={cfg.dim}, {cfg.layers} layers, E={cfg.experts} top-{cfg.topk} F={cfg.ffn}, "
                  f"vocab {cfg.vocab}; {args.batch} x {args.seq} tokens, {torch.cuda.get_device_name()}, "
                  f"torch {torch.__version__}; median of {args.steps} steps after {args.warmup}\n")
        bench.say("| system | step ms | tokens/s | MFU | peak GiB | loss after last step | FP8 / bf16 |")
        bench.say("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for (c, g, f), r in rows:
            ratio = f"{bf16[(c, g)]['step_s'] / r['step_s']:.3f}x"
            bench.say(f"| {r['system']} | {r['step_s'] * 1e3:.1f} | {tokens / r['step_s']:,.0f} | "
                      f"{flops / r['step_s'] / (PEAK_TFLOPS * 1e12):.1%} | {r['peak']:.2f} | {r['loss']:.4f} | "
                      f"{ratio if f == 'none' else f'**{ratio}**'} |")
        if families:
            bench.say("\nGPU ms of one step + update by kernel family:\n")
            systems = {key: r["system"] for key, r in rows if not key[1]}
            found = {key: profile_families(cfg, key[0], key[2]) for key in systems}
            torch._dynamo.reset()
            names = sorted({k for fams, _ in found.values() for k in fams})
            bench.say("| system | " + " | ".join(names) + " | total |")
            bench.say("| --- |" + " ---: |" * (len(names) + 1))
            for key, (fams, _) in found.items():
                bench.say(f"| {systems[key]} | " + " | ".join(f"{fams.get(n, 0):.1f}" for n in names)
                          + f" | {sum(fams.values()):.1f} |")
            for key, (_, top) in found.items():
                if key[2] != "none":
                    bench.say(f"\ntop kernels, {systems[key]}:")
                    for kernel, took in top:
                        bench.say(f"  {took:7.2f} ms  {kernel}")


if __name__ == "__main__":
    main()
