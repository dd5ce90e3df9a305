"""Tokens per GPU that fit, per recomputation policy, for the main job's GPU presets.

    python benchmarks/fit_tokens.py                          # every GPU preset, one GPU
    python benchmarks/fit_tokens.py qwen3-moe-small --policies none full:2048

Each preset is run as the main job would (its model and plan, ``adamw(fused=True,
donate=True)``) at its sequence length and a 32000-token vocabulary, on one GPU,
with ``Plan.remat`` (and ``Plan.loss_chunk``) per policy ``REMAT[:CHUNK]``. The
largest batch (rows of ``seq`` tokens) is found from the peak memory of two small
batches (peak is affine in the tokens: what is held whatever the batch, plus
activations per token), then confirmed by running it and bisected to within ~6% (a
``+`` marks a prediction that fitted with 5% more, left unsearched). "Fits" means within the GPU's memory less
``--headroom`` GiB for the allocator's fragmentation and the CUDA context.

Eager (``compile=False``): torch.compile would recompile for every batch tried.
Compiled, ``none`` holds less than eager (BENCHMARKS.md, issue 24), so this is the
conservative side.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fmoe.trainer import options
from memory import GIB, run_steps

POLICIES = ["none", "none:2048", "selective:2048", "full:2048"]


def preset_plan(name: str, policy: str):
    remat, _, chunk = policy.partition(":")
    settings, _ = options.resolve(["--config", name, "--vocab", "32000"])
    cfg = options.model_config(settings)
    plan = options.plan_for(settings, cfg, remat=remat, loss_chunk=int(chunk or 0), compile=False, device="cuda")
    return plan, settings["seq"]


def largest_batch(plan, seq: int, budget_gib: float, probe_rows=(2, 6)) -> tuple[int, dict | None]:
    """The most rows of ``seq`` tokens whose steps peak within ``budget_gib``: predicted
    from two probes, then bisected between what fits and what does not."""
    def fits(rows):
        got = run_steps(plan, rows, seq, warm=1, steps=1)
        return got if got is not None and got["peak"] <= budget_gib else None

    a, b = probe_rows
    small, big = fits(a), fits(b)
    if small is None:
        return 0, None
    if big is None:
        good, got, bad = a, small, b
    else:
        per_row = max((big["peak"] - small["peak"]) / (b - a), 1e-3)
        guess = max(b + 1, int(b + (budget_gib - big["peak"]) / per_row))
        at_guess = fits(guess)
        if at_guess is None:
            good, got, bad = b, big, guess
        else:
            good, got, bad = guess, at_guess, int(guess * 1.05) + 1
            if fits(bad) is not None:  # the prediction was short: say so rather than search on
                return good, dict(got, short=True)
    while bad - good > max(1, good // 16):  # to within ~6%
        mid = (good + bad) // 2
        at_mid = fits(mid)
        if at_mid is None:
            bad = mid
        else:
            good, got = mid, at_mid
    return good, got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="*", default=[p for p in options.presets() if p != "cpu"])
    ap.add_argument("--policies", nargs="+", default=POLICIES, help="REMAT[:LOSS_CHUNK] each")
    ap.add_argument("--headroom", type=float, default=4.0, help="GiB left free")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    budget = torch.cuda.mem_get_info()[1] / GIB - args.headroom
    print(f"\n## {torch.cuda.get_device_name()}, torch {torch.__version__}: tokens per GPU within "
          f"{budget:.1f} GiB (eager, vocab 32000, one GPU)\n")
    print("| preset | seq | params | " + " | ".join(args.policies) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(args.policies))
    for name in args.presets:
        cells, t0, params = [], time.perf_counter(), None
        for policy in args.policies:
            plan, seq = preset_plan(name, policy)
            rows, got = largest_batch(plan, seq, budget)
            if got is None:
                cells.append("does not fit")
                continue
            params = got["params"]
            more = "+" if got.get("short") else ""
            cells.append(f"{rows * seq:,}{more} ({got['peak']:.0f} GiB, {got['tok_s'] / 1e3:.0f}k tok/s)")
            print(f"  {name} {policy}: {cells[-1]} after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        size = f"{params / 1e9:.2f}B" if params else "-"
        print(f"| {name} | {seq} | {size} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - t0:.0f} s -->",
              flush=True)


if __name__ == "__main__":
    main()
