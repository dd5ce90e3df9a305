"""``python -m fmoe.plan``: check, time and size a plan's step without a GPU, or rank the
plans that fit; either way, print the ``fmoe.train`` command that runs the plan.

    python -m fmoe.plan --model qwen3-235b --gpus 64 --pp 4 --ep 8 --microbatches 16 --batch 256 --seq 4096
    python -m fmoe.plan --model deepseek-v3 --gpus 256 --search --memory 80 --batch 1024 --seq 4096
    python -m fmoe.plan --config qwen3-moe-medium --gpus 2 --pp 2 --microbatches 8 --trace step.json

The model and plan come from the main job's flags (``--config`` and any model or plan
field; ``dp`` from ``--gpus`` when left out, ``dtype`` bfloat16, ``device`` cuda), or
``--model``, a released model (``fmoe.plan.models``), whose fields the flags given
override; ``--batch`` and ``--seq`` are the global batch, ``--moments`` the AdamW moments'
dtype its memory counts (the planner reads no other run flag); ``--routing-skew`` the
busiest expert rank's routed rows over an even share (1, balanced, unless given). Prints
the plan, what was checked, the estimated step time, tokens/s and MFU, each stage's
bubble and memory, whether it fits the memory budget, and a timeline of one rank per
stage; ``--trace`` writes it as a Chrome trace. ``--search`` ranks the plans for ``--gpus`` whose every rank
fits the budget by estimated tokens/s. The budget: ``--memory`` GiB, else the memory of
the calibration's GPU, else this machine's GPU's, else an H100's 80 GiB, of which a plan
leaves ``--reserve`` (10%) free. Costs:
``--calibration`` (a file of ``benchmarks/plan_calibration.py``; default: assumed
efficiencies) and the links (``--gpus-per-node``, ``--nvlink-gbps``, ``--network-gbps``;
defaults: H100 / H200 nodes of 8 on NVLink, 400G InfiniBand).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from ..checks import check, check_finite, check_int, is_number
from ..config import Plan
from ..trainer import options
from .budget import RESERVE, budget, over_budget
from .command import run_line
from .costs import Calibration, CostModel, Links
from .memory import estimate_memory
from .models import MODELS, model
from .report import GIB, chrome_trace, check_trace_path, describe, summary, timeline
from .search import meshes, search, why
from .simulate import PlanError, busiest_share, simulate

PROG = "python -m fmoe.plan"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (and the pointer to ``--help``), not the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _planner_flags(group) -> None:
    group.add_argument("--model", choices=MODELS, metavar="NAME", help="a released model to plan for (its "
                       "config.json's shapes; the model flags given override its fields). One of: "
                       + ", ".join(MODELS) + ".")
    group.add_argument("--gpus", type=int, metavar="N",
                       help="the GPUs the plan runs on, >= 1 (default: the plan's world)")
    group.add_argument("--search", action="store_true", help="rank the plans for --gpus that fit the memory budget")
    group.add_argument("--memory", type=float, metavar="GIB", help="GiB each GPU can hold, > 0 (default: the "
                       "calibration's GPU's, else this machine's GPU's, else 80)")
    group.add_argument("--reserve", type=float, default=RESERVE, metavar="F",
                       help="the share of --memory a plan's estimate leaves free, in [0, 1): the CUDA context, NCCL's "
                            "buffers, fragmentation and the estimate's error (default: %(default)g)")
    group.add_argument("--top", type=int, default=10, metavar="N", help="plans --search prints, >= 1 (default: 10)")
    group.add_argument("--trace", metavar="PATH", help="write the simulated step as a Chrome trace here")
    group.add_argument("--calibration", metavar="PATH",
                       help="a calibration file (benchmarks/plan_calibration.py writes one)")
    group.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node, metavar="N",
                       help=f"GPUs a node holds on NVLink, >= 1 (default: {Links.gpus_per_node})")
    group.add_argument("--nvlink-gbps", type=float, default=Links.nvlink_gbps, metavar="GBPS",
                       help=f"GB/s a GPU moves in NCCL collectives inside a node (default: {Links.nvlink_gbps:g})")
    group.add_argument("--network-gbps", type=float, default=Links.network_gbps, metavar="GBPS",
                       help=f"GB/s a GPU moves between nodes (default: {Links.network_gbps:g})")
    group.add_argument("--routing-skew", type=float, default=1.0, metavar="F",
                       help="the routed rows of the busiest expert rank over an even share, >= 1: its experts' "
                            "memory, compute and exchanges scale by it (capped at what every rank's tokens can "
                            "bring it: ep when a rank holds topk experts or more). Learned routing starts "
                            "far from balance (default: 1, balanced)")


def _own_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    _planner_flags(ap)
    return ap


def help_parser() -> argparse.ArgumentParser:
    """Every flag the planner takes: its own, then the main job's (``fmoe.trainer.options``)."""
    main_job = options.parser(PROG)
    ap = argparse.ArgumentParser(prog=PROG, parents=[main_job], add_help=False, description=__doc__,
                                 usage=f"{PROG} [the planner's flags (listed last)] [the main job's flags]",
                                 epilog=main_job.epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    _planner_flags(ap.add_argument_group("planner (python -m fmoe.plan's own)"))
    return ap


def _check_flags(own) -> None:
    """The planner's own flags in range, before anything is read or simulated."""
    if own.gpus is not None:
        check_int("--gpus", own.gpus, 1)
    if own.memory is not None:
        check_finite("--memory", own.memory, True, " (GiB a GPU)")
    check_int("--top", own.top, 1)
    check_int("--gpus-per-node", own.gpus_per_node, 1)
    check_finite("--nvlink-gbps", own.nvlink_gbps, True)
    check_finite("--network-gbps", own.network_gbps, True)
    check(
        "--routing-skew", own.routing_skew, is_number(own.routing_skew) and math.isfinite(own.routing_skew)
        and own.routing_skew >= 1, "must be a finite number >= 1 (1: balanced routing)")
    check("--reserve", own.reserve, is_number(own.reserve) and 0 <= own.reserve < 1,
          "must be a share of --memory in [0, 1) (0: plans may fill it)")
    if own.search and not own.gpus:
        raise ValueError("--search needs --gpus")
    if own.trace:
        check_trace_path(own.trace)


def _calibration(path: str | None) -> Calibration:
    if not path:
        return Calibration()
    return Calibration.read(path, where=f"--calibration {path}")


def _model_and_fields(rest: list, name: str | None):
    merged, explicit = options.resolve(rest, PROG)
    run, fields = options.split(merged)
    if name is not None:  # the released model's fields, but those given as flags (not by --config)
        released, flags = model(name), set(vars(options.parser(PROG).parse_args(rest)))
        fields.update({f: getattr(released, f) for f in options.MODEL_FIELDS if f not in flags})
        explicit |= set(options.MODEL_FIELDS)
    vocab_from_data = "vocab" not in explicit
    if vocab_from_data:  # the main job takes the vocabulary from its data
        fields["vocab"] = 32000
    return options.model_config(fields), fields, explicit, run, vocab_from_data


def _plan(fields: dict, cfg, explicit: set, gpus: int | None) -> Plan:
    fields = dict(fields)
    for name, planned in (("dtype", "bfloat16"), ("device", "cuda")):  # the main job's defaults are the CPU's
        if name not in explicit:
            fields[name] = planned
    others = fields["pp"] * fields["ep"] * fields["cp"] * fields["tp"]
    if "dp" not in explicit and gpus:
        if gpus % others:
            raise ValueError(f"--gpus={gpus} is not a multiple of pp * ep * cp * tp = {others}")
        fields["dp"] = gpus // others
    plan = options.plan_for(fields, cfg)
    if gpus and plan.world != gpus:
        raise ValueError(f"--gpus={gpus} is not the plan's world: pp * dp * ep * cp * tp = {plan.world}")
    return plan


def _run_keys(run) -> dict:
    return {"batch": run.batch, "seq": run.seq, "moments": run.moments}


def _print_search(own, cfg, fields, run, costs, limit, vocab_from_data) -> int:
    t0 = time.perf_counter()
    ranked = search(cfg, fields, own.gpus, run.batch, run.seq, limit.usable, costs, run.moments, own.routing_skew)
    print(f"{len(ranked)} plan(s) for {own.gpus} GPUs fit {limit} (batch {run.batch} x {run.seq}; "
          f"{time.perf_counter() - t0:.1f} s); ranked by estimated tokens/s, higher first (ties: less memory first)")
    if not ranked:
        print("no plan fits: try more --gpus, --moments bfloat16, a larger --memory or a smaller --reserve")
        return 1
    print("  tokens/s (key)   step ms   bubble   exposed comm   GiB a GPU   plan")
    for row in ranked[:own.top]:
        w = why(row.plan, run.batch, run.seq, costs, skew=own.routing_skew)
        print(f"  {row.tokens_per_second:>14,.0f}  {w.step_ms:>8,.1f}   {w.bubble:>6.3f}   {w.exposed_comm:>12.1%}"
              f"   {row.peak_gib:>9.1f}   {describe(row.plan)}")
    print("  (bubble: the most idle share of a stage's compute with communication free; exposed comm: the share "
          "of the step the links add)")
    best = ranked[0]
    for note in (_expert_parallel_note(cfg, own.gpus, ranked, run, costs, own.routing_skew),
                 _collapsed_routing_note(best.plan, run, limit, own.routing_skew)):
        if note:
            print(note)
    print(f"best: {describe(best.plan)}")
    print(run_line(best.plan, _run_keys(run), own.gpus_per_node, vocab_from_data, run.config))
    return 0


def _expert_parallel_note(cfg, gpus: int, ranked: list, run, costs, skew: float) -> str | None:
    """Why the best plan has no expert parallelism, in one line (None when it has)."""
    if ranked[0].plan.ep > 1 or cfg.experts == 1:
        return None
    degrees = [e for e in range(2, gpus + 1) if gpus % e == 0 and cfg.experts % e == 0]
    if not degrees:
        return f"ep: not tried: no degree > 1 divides both the {cfg.experts} experts and the {gpus} GPUs"
    if all(ep == 1 for _, ep, _, _ in meshes(cfg, gpus, run.batch, run.seq, costs.links.gpus_per_node)):
        return (f"ep: not tried: the batch of {run.batch} rows does not split into the dp * ep row blocks of ep in "
                f"{degrees}")
    with_ep = [r for r in ranked if r.plan.ep > 1]
    if not with_ep:
        return f"ep: no plan with ep in {degrees} fits the memory budget"
    best, top = with_ep[0], ranked[0]
    gap = 1 - best.tokens_per_second / top.tokens_per_second
    w_ep, w_top = (why(r.plan, run.batch, run.seq, costs, skew=skew) for r in (best, top))
    return (f"ep: the best plan with ep > 1 ({describe(best.plan)}) estimates {best.tokens_per_second:,.0f} tokens/s, "
            f"{gap:.1%} fewer: its exposed communication is {w_ep.exposed_comm:.1%} of its step against "
            f"{w_top.exposed_comm:.1%}, its bubble {w_ep.bubble:.3f} against {w_top.bubble:.3f}")


def _collapsed_routing_note(plan: Plan, run, limit, skew: float) -> str | None:
    """One line when ``plan`` has expert parallelism and fits only while routing is
    balanced: learned routing starts collapsed (every token's choices on the same few
    experts), and the busiest expert rank then holds the rows of all. None otherwise."""
    worst = busiest_share(plan, math.inf)
    if plan.ep == 1 or skew >= worst:
        return None
    need = max(estimate_memory(plan, run.batch, run.seq, s, run.moments, worst)["total"] for s in range(plan.pp)) / GIB
    if need <= limit.usable:
        return None
    return (f"routing: with routing collapsed (--routing-skew {worst:g}: what learned routing starts at, every "
            f"token's choices on the same few experts) this plan needs {need:,.1f} GiB a GPU, over {limit}; "
            f"--routing-skew {worst:g} ranks the plans that fit it")


def _print_plan(own, cfg, fields, explicit, run, costs, limit, vocab_from_data) -> int:
    t0 = time.perf_counter()
    plan = _plan(fields, cfg, explicit, own.gpus)
    sim = simulate(plan, run.batch, run.seq, costs, skew=own.routing_skew)
    memory = [estimate_memory(plan, run.batch, run.seq, s, run.moments, own.routing_skew) for s in range(plan.pp)]
    for line in summary(sim, memory):
        print(line)
    w = why(plan, run.batch, run.seq, costs, sim, own.routing_skew)
    print(f"where the step goes: bubble {w.bubble:.3f} (the most idle share of a stage's compute with communication "
          f"free), exposed communication {w.exposed_comm:.1%} of the step (what the links add)")
    over = over_budget(plan, memory, limit, run.moments, run.batch)
    need = max(m["total"] for m in memory) / GIB
    print(over if over else f"memory: needs {need:,.1f} GiB a GPU, fits {limit}")
    collapsed = None if over else _collapsed_routing_note(plan, run, limit, own.routing_skew)
    if collapsed:
        print(collapsed)
    print("timeline, one rank per stage (digits: a microbatch's forward, letters: its backward, a = 0; '.': idle):")
    for line in timeline(sim):
        print(line)
    if own.trace:
        print(f"trace: {chrome_trace(sim, own.trace)}")
    print(run_line(plan, _run_keys(run), own.gpus_per_node, vocab_from_data, run.config))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


def main(argv=None) -> int:
    """Run the planner on ``argv`` (default: the command line).

    Returns:
        0; 1 where the plan cannot run or --search finds none that fits; 2 for a bad flag.
    """
    own, rest = _own_parser().parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        help_parser().print_help()
        return 0
    try:
        _check_flags(own)
        cfg, fields, explicit, run, vocab_from_data = _model_and_fields(rest, own.model)
        calibration = _calibration(own.calibration)
        costs = CostModel(calibration, Links(own.gpus_per_node, own.nvlink_gbps, own.network_gbps))
        limit = budget(own.memory, calibration.source, own.reserve)
        if own.search:
            return _print_search(own, cfg, fields, run, costs, limit, vocab_from_data)
        return _print_plan(own, cfg, fields, explicit, run, costs, limit, vocab_from_data)
    except PlanError as err:
        print(f"fmoe.plan: the plan cannot run: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"fmoe.plan: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
