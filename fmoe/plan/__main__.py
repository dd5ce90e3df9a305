"""``python -m fmoe.plan``: check, time and size a plan's step without a GPU, or rank the
plans that fit.

    python -m fmoe.plan --model qwen3-235b --gpus 64 --pp 4 --ep 8 --microbatches 16 --batch 256 --seq 4096
    python -m fmoe.plan --model deepseek-v3 --gpus 256 --search --memory 80 --batch 1024 --seq 4096
    python -m fmoe.plan --config qwen3-moe-medium --gpus 2 --pp 2 --microbatches 8 --trace step.json

The model and plan come from the main job's flags (``--config`` and any model or plan
field; ``dp`` from ``--gpus`` when left out, ``dtype`` bfloat16) or ``--model`` (a full-size model of
``fmoe.plan.models``); ``--batch`` and ``--seq`` are the global batch, ``--moments`` the
AdamW moments' dtype its memory counts. Prints the plan,
what was checked, the estimated step time, tokens/s and MFU, each stage's bubble and
memory, and a timeline of one rank per stage; ``--trace`` writes it as a Chrome trace.
``--search`` ranks the plans for ``--gpus`` whose every rank fits ``--memory`` GiB by
estimated tokens/s. Costs: ``--calibration`` (a file of ``benchmarks/plan_calibration.py``;
default: assumed efficiencies) and the links (``--gpus-per-node``, ``--nvlink-gbps``,
``--network-gbps``; defaults: H100 / H200 nodes of 8 on NVLink, 400G InfiniBand).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from tqdm import tqdm

from ..config import Plan
from ..trainer import options
from .costs import Calibration, CostModel, Links
from .memory import estimate_memory
from .models import MODELS
from .report import GIB, chrome_trace, describe, summary, timeline
from .simulate import PlanError, simulate


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fmoe.plan", add_help=False,
                                 description="Check, time and size a plan's step without a GPU.")
    ap.add_argument("--model", choices=sorted(MODELS), help="a full-size model to plan for")
    ap.add_argument("--gpus", type=int, help="the GPUs the plan runs on (default: the plan's world)")
    ap.add_argument("--search", action="store_true", help="rank the plans for --gpus that fit --memory")
    ap.add_argument("--memory", type=float, default=80.0, help="GiB each GPU can hold (--search)")
    ap.add_argument("--top", type=int, default=10, help="plans --search prints")
    ap.add_argument("--trace", help="write the simulated step as a Chrome trace here")
    ap.add_argument("--calibration", help="a calibration file (benchmarks/plan_calibration.py)")
    ap.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
    ap.add_argument("--nvlink-gbps", type=float, default=Links.nvlink_gbps)
    ap.add_argument("--network-gbps", type=float, default=Links.network_gbps)
    return ap


def _model_and_fields(rest: list, model: str | None):
    merged, explicit = options.resolve(rest, "python -m fmoe.plan")
    run, fields = options.split(merged)
    if model is not None:
        fields.update(MODELS[model])
        explicit |= set(MODELS[model])
    if "vocab" not in explicit:  # the main job takes the vocabulary from its data
        fields["vocab"] = 32000
    return options.model_config(fields), fields, explicit, run


def _plan(fields: dict, cfg, explicit: set, gpus: int | None, **changes) -> Plan:
    fields = {**fields, **changes}
    if "dtype" not in explicit:  # the main job's default is for the CPU; a planned run computes in bf16
        fields["dtype"] = "bfloat16"
    if "dp" not in explicit and "dp" not in changes and gpus:
        others = fields["pp"] * fields["ep"] * fields["cp"] * fields["tp"]
        if gpus % others:
            raise ValueError(f"--gpus={gpus} is not a multiple of pp * ep * cp * tp = {others}")
        fields["dp"] = gpus // others
    return options.plan_for(fields, cfg, device="cuda")


def search(cfg, fields: dict, gpus: int, rows: int, seq: int, memory_gib: float, costs: CostModel,
           moments: str = "float32") -> list:
    """``[(tokens/s, Plan, peak GiB)]`` of the plans for ``gpus`` GPUs whose every rank fits
    ``memory_gib``, best first: pipeline, expert and tensor parallel degrees (tensor
    parallelism inside a node), context parallelism at sequences of 16k and more,
    ZeRO-1 or ZeRO-3, both schedules, one or two interleaved stages per pipeline rank, no
    recomputation or, where that does not fit, full, and the microbatch count that fills
    the pipeline (``4 pp`` where the rows allow)."""
    found = []
    degrees = [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= gpus]
    contexts = (1, 2, 4) if seq >= 16384 else (1,)  # context parallelism pays at long sequences only
    meshes = [(pp, ep, tp, cp) for pp, ep, tp, cp in itertools.product(degrees, degrees, (1, 2, 4, 8), contexts)
              if not (gpus % (pp * ep * tp * cp) or cfg.experts % ep or pp > cfg.layers or tp > costs.links.gpus_per_node
                      or rows % (gpus // (pp * ep * tp * cp) * ep))]
    for pp, ep, tp, cp in tqdm(meshes, desc="search", unit="mesh", file=sys.stderr):
        dp = gpus // (pp * ep * tp * cp)
        per_block = rows // (dp * ep)
        microbatches = next((m for m in (4 * pp, 2 * pp, pp, 1) if per_block % m == 0), 1)
        virtuals = (1, 2) if pp > 1 and microbatches % pp == 0 and 2 * pp <= cfg.layers else (1,)
        for sharding, schedule, virtual in itertools.product(("optim_grads_params", "optim"),
                                                             ("standard", "1f1b_overlap"), virtuals):
            if schedule == "1f1b_overlap" and ep == 1 or seq % ((2 * cp if cp > 1 else 1) * tp):
                continue
            for remat in ("none", "full"):  # full recomputation only where nothing else fits
                try:
                    plan = Plan(model=cfg, dp=dp, ep=ep, tp=tp, cp=cp, pp=pp, virtual_stages=virtual,
                                sharding=sharding, schedule=schedule, remat=remat, microbatches=microbatches,
                                dtype="bfloat16", device="cuda", compile=fields.get("compile", False))
                    peak = _fits(plan, rows, seq, memory_gib, moments)
                    if peak is None:
                        continue
                    found.append((simulate(plan, rows, seq, costs).tokens_per_second, plan, peak))
                except (ValueError, PlanError):
                    continue
                break
    return sorted(found, key=lambda f: -f[0])


def _fits(plan: Plan, rows: int, seq: int, memory_gib: float, moments: str) -> float | None:
    """The plan's peak GiB over its stages, or None once a stage does not fit (the first
    stage, which holds the most microbatches, is tried first)."""
    peak = 0.0
    for stage in range(plan.pp):
        peak = max(peak, estimate_memory(plan, rows, seq, stage, moments)["total"] / GIB)
        if peak > memory_gib:
            return None
    return peak


def main(argv=None) -> int:
    planner, rest = _parser().parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return 0
    try:
        cfg, fields, explicit, run = _model_and_fields(rest, planner.model)
        calibration = Calibration.read(planner.calibration) if planner.calibration else Calibration()
        costs = CostModel(calibration, Links(planner.gpus_per_node, planner.nvlink_gbps, planner.network_gbps))
        t0 = time.perf_counter()
        if planner.search:
            if not planner.gpus:
                raise ValueError("--search needs --gpus")
            ranked = search(cfg, fields, planner.gpus, run.batch, run.seq, planner.memory, costs, run.moments)
            print(f"{len(ranked)} plan(s) for {planner.gpus} GPUs fit {planner.memory:g} GiB each "
                  f"(batch {run.batch} x {run.seq}; {time.perf_counter() - t0:.1f} s); best first:")
            for tokens, plan, peak in ranked[:planner.top]:
                print(f"  {tokens:>12,.0f} tokens/s  peak {peak:6.1f} GiB  {describe(plan)}")
            return 0
        plan = _plan(fields, cfg, explicit, planner.gpus)
        sim = simulate(plan, run.batch, run.seq, costs)
        memory = [estimate_memory(plan, run.batch, run.seq, s, run.moments) for s in range(plan.pp)]
        legend = "timeline, one rank per stage (digits: a microbatch's forward, letters: its backward, a = 0; '.': idle):"
        for line in summary(sim, memory) + [legend] + timeline(sim):
            print(line)
        if planner.trace:
            print(f"trace: {chrome_trace(sim, planner.trace)}")
        print(f"({time.perf_counter() - t0:.1f} s)")
    except PlanError as err:
        print(f"fmoe.plan: the plan cannot run: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"fmoe.plan: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
