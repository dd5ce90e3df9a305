"""``python -m fmoe.plan --search``: the plans for a number of GPUs whose every rank fits a
memory budget, simulated and ranked by estimated tokens/s, each with why it ranks where
it does: its pipeline bubble, its exposed communication and its memory a GPU."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass

from tqdm import tqdm

from ..config import Plan
from .costs import CostModel, Links
from .memory import estimate_memory
from .report import GIB
from .simulate import PlanError, Simulation, simulate

STAGES = (1, 2, 4, 8, 16, 32, 64)
_FREE_LINKS = Links(nvlink_gbps=1e15, network_gbps=1e15, nvlink_us=0.0, network_us=0.0)


@dataclass(frozen=True)
class Ranked:
    """A plan that fits, as ``search`` ranks it.

    Attributes:
        tokens_per_second: the order's key (higher first; ties: less memory first).
        plan: the Plan.
        peak_gib: the most a rank of any stage holds.

    (Not the Simulation: a search keeps hundreds, and a large plan's spans run to
    hundreds of thousands; ``why`` simulates the rows it explains again.)
    """

    tokens_per_second: float
    plan: Plan
    peak_gib: float

    @property
    def key(self) -> tuple:
        return -self.tokens_per_second, self.peak_gib


@dataclass(frozen=True)
class Why:
    """Where a plan's step goes, from a second simulation with communication free:
    ``exposed_comm`` the share of the step the links add (collectives, all-to-alls and
    sends no compute hides), ``bubble`` the most any stage's compute idles without them
    (the pipeline's fill and drain, the host issuing kernels)."""

    step_ms: float
    bubble: float
    exposed_comm: float


def why(plan: Plan, rows: int, seq: int, costs: CostModel, sim: Simulation | None = None, skew: float = 1.0) -> Why:
    """The bubble and exposed communication of ``plan``'s step on ``rows`` x ``seq``
    tokens (``sim``: that step simulated already, else simulated here; ``skew``: as
    ``simulate``'s), from one more simulation with communication free."""
    sim = sim if sim is not None else simulate(plan, rows, seq, costs, skew=skew)
    free = simulate(plan, rows, seq, dataclasses.replace(costs, links=_FREE_LINKS), skew=skew)
    exposed = max(0.0, sim.step_seconds - free.step_seconds) / sim.step_seconds
    return Why(sim.step_seconds * 1e3, max(free.bubble), exposed)


def meshes(cfg, gpus: int, rows: int, seq: int, gpus_per_node: int) -> list[tuple[int, int, int, int]]:
    """``(pp, ep, tp, cp)`` of the meshes tried on ``gpus`` GPUs: ``ep`` any degree that
    divides both the experts and the GPUs, ``pp`` a power of two up to 64 (no more stages
    than layers), ``tp`` up to 8 inside a node, ``cp`` at sequences of 16k and more, and
    ``dp * ep`` row blocks the batch splits into."""
    experts = [e for e in range(1, gpus + 1) if gpus % e == 0 and cfg.experts % e == 0]
    contexts = (1, 2, 4) if seq >= 16384 else (1,)  # context parallelism pays at long sequences only
    found = []
    for pp, ep, tp, cp in itertools.product(STAGES, experts, (1, 2, 4, 8), contexts):
        model_parallel = pp * ep * tp * cp
        if (gpus % model_parallel or pp > cfg.layers or tp > gpus_per_node
                or rows % (gpus // model_parallel * ep)):
            continue
        found.append((pp, ep, tp, cp))
    return found


def _fits(plan: Plan, rows: int, seq: int, memory_gib: float, moments: str, skew: float) -> float | None:
    """The plan's peak GiB over its stages, or None once a stage does not fit (the first
    stage, which holds the most microbatches, is tried first)."""
    peak = 0.0
    for stage in range(plan.pp):
        peak = max(peak, estimate_memory(plan, rows, seq, stage, moments, skew)["total"] / GIB)
        if peak > memory_gib:
            return None
    return peak


def microbatch_counts(rows_per_block: int, pp: int) -> list[int]:
    """The microbatch counts tried, fewest first: the count that fills the pipeline (``4 pp``,
    else ``2 pp``, ``pp`` or 1, whichever splits a row block), then twice as many, and so
    on while they split it (fewer rows each: less activation memory)."""
    first = next((m for m in (4 * pp, 2 * pp, pp, 1) if rows_per_block % m == 0), 1)
    counts = [first]
    while rows_per_block % (counts[-1] * 2) == 0:
        counts.append(counts[-1] * 2)
    return counts


def _first_fit(make, counts: list[int], rows: int, seq: int, memory_gib: float, moments: str, skew: float):
    """``(plan, peak GiB)`` of the first plan that fits: no recomputation at the fewest
    microbatches that fit, else full recomputation at the fewest; None if none fits.
    Memory falls as the microbatches grow (fewer rows each) and with recomputation, so the
    plan of least memory is tried first and the fewest microbatches found by bisection."""
    peaks = {}

    def peak(remat: str, i: int):
        if (remat, i) not in peaks:
            peaks[(remat, i)] = _fits(make(remat, counts[i]), rows, seq, memory_gib, moments, skew)
        return peaks[(remat, i)]

    last = len(counts) - 1
    if peak("full", last) is None:
        return None
    for remat in ("none", "full"):  # full recomputation only where nothing else fits
        if peak(remat, last) is None:
            continue
        lo, hi = 0, last
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if peak(remat, mid) is not None else (mid + 1, hi)
        return make(remat, counts[lo]), peak(remat, lo)
    return None


def search(cfg, fields: dict, gpus: int, rows: int, seq: int, memory_gib: float, costs: CostModel,
           moments: str = "float32", skew: float = 1.0) -> list[Ranked]:
    """The plans for ``gpus`` GPUs whose every rank fits ``memory_gib``, best first (by
    ``Ranked.key``): on each of the ``meshes``, ZeRO-1 or ZeRO-3, both schedules (the
    overlap one under expert parallelism, where it has all-to-alls to hide), one or two
    interleaved stages per pipeline rank, and the first of ``_first_fit``'s recomputation
    and ``microbatch_counts`` that fits.

    Arguments:
        cfg: the ModelConfig; ``fields``: the other settings (``compile`` is kept).
        gpus, rows, seq: the GPUs and the global batch.
        memory_gib: what a rank may hold.
        costs: the CostModel; ``moments``: AdamW's moments' dtype; ``skew``: the busiest
            expert rank's routed rows over an even share (``simulate``'s).

    Returns:
        A list of Ranked.
    """
    found = []
    for pp, ep, tp, cp in tqdm(meshes(cfg, gpus, rows, seq, costs.links.gpus_per_node), desc="search",
                               unit="mesh", file=sys.stderr):
        dp = gpus // (pp * ep * tp * cp)
        counts = microbatch_counts(rows // (dp * ep), pp)
        virtuals = (1, 2) if pp > 1 and counts[0] % pp == 0 and 2 * pp <= cfg.layers else (1,)
        for sharding, schedule, virtual in itertools.product(("optim_grads_params", "optim"),
                                                             ("standard", "1f1b_overlap"), virtuals):
            if schedule == "1f1b_overlap" and ep == 1 or seq % ((2 * cp if cp > 1 else 1) * tp):
                continue

            def make(remat: str, microbatches: int) -> Plan:
                return Plan(model=cfg, dp=dp, ep=ep, tp=tp, cp=cp, pp=pp, virtual_stages=virtual,
                            sharding=sharding, schedule=schedule, remat=remat, microbatches=microbatches,
                            dtype="bfloat16", device="cuda", compile=fields.get("compile", False))
            try:
                fit = _first_fit(make, counts, rows, seq, memory_gib, moments, skew)
                if fit is not None:
                    found.append(Ranked(simulate(fit[0], rows, seq, costs, skew=skew).tokens_per_second, *fit))
            except (ValueError, PlanError):
                continue
    return sorted(found, key=lambda r: r.key)
