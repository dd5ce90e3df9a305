"""Run a plan's programs without a GPU: check them together, time them with a cost model.

Every rank of a pipeline stage runs the same program (``fmoe.resolve.stage_program``) and
every group but ``pp`` lies inside one stage (``fmoe.parallel_dims``), so the ranks of a
group enter their collectives in the same order by construction; ``simulate`` checks
that, then runs one rank per stage (the stage's first) against its neighbours: each
``Send`` must meet its ``Recv`` in the order sent (point-to-point messages between two
ranks arrive in order; the stream and its gradient travel on groups of their own), every
``Recv`` must be sent, and the stages must not wait on each other in a circle (under
interleaved stages the last stage sends on to the first); each stage's program must keep
the FSDP lifecycle (``lifecycle_check``). A program that breaks this is a ``PlanError`` naming the ranks and
the actions.

Time: each stage has a compute clock and one communication stream (the step's copy of the parameters and the
optimizer's update add their memory-bound passes at the end). Compute nodes cost
their FLOPs (``costs.node_flops`` on the rank's tokens and slice; at least the host's
time issuing them, ``costs.CostModel.host_seconds``) and the tensor-,
context- and expert-tensor-parallel collectives inside them (blocking); a gather or
reduction of a unit and the expert all-to-alls run on the stream, waited for where the
program waits (a unit's ``Wait``; the node that reads an exchange's rows; a combine's
``Land``); a send arrives after its link's time. The step ends when every stage's
clock and stream are done.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field

from ..config import Plan
from ..layers.nodes import Kind, layer_kinds
from ..parallel_dims import STAGE_GROUPS, GroupName
from ..resolve import resolve_stage, stage_program
from ..schedule.actions import (Backward, Forward, Gather, Land, Recompute, Recv, Reduce, Release, Send, Wait,
                                Wgrad, label)
from ..shard.spec import ShardSpec
from .costs import CostModel, node_flops
from ..shard.ledger import LifecycleError
from .lifecycle_check import check_lifecycle


class PlanError(ValueError):
    """The plan's programs cannot run together (a deadlock, transfers out of order or never
    received, or a stage's program breaking the FSDP lifecycle)."""


@dataclass
class Span:
    """One timed piece of a stage's program: ``lane`` (``compute``, ``comm``, ``p2p``),
    ``start`` and ``end`` seconds, the ``action`` and its microbatch."""

    lane: str
    start: float
    end: float
    action: object
    mb: int = -1
    forward: bool = True

    @property
    def label(self) -> str:
        return label(self.action)


@dataclass
class StageRun:
    """One stage's simulated step (its first rank's)."""

    stage: int
    rank: int
    spans: list = field(default_factory=list)
    busy: float = 0.0
    program_end: float = 0.0
    end: float = 0.0


@dataclass
class Simulation:
    """What ``simulate`` found.

    Attributes:
        plan: the Plan; ``rows``, ``seq``: the global batch.
        stages: a StageRun per pipeline stage.
        step_seconds: the step's estimated time.
        bubble: per stage, the share of the schedule's span (the step without the
            parameter passes after it) its compute is idle.
        tokens_per_second: global tokens per step over ``step_seconds``.
        mfu: the model FLOPs (``fmoe.train_flops_per_token``) per second per GPU over the peak.
        costs: the CostModel used.
    """

    plan: Plan
    rows: int
    seq: int
    stages: list
    step_seconds: float
    bubble: list
    tokens_per_second: float
    mfu: float
    costs: CostModel


def _sizes(plan: Plan, rows: int, seq: int) -> dict:
    """A rank's token counts for one microbatch: its rows, the positions its attention
    sees (``rows x seq / cp``) and the positions its stream holds (``/ tp``)."""
    blocks = plan.dp * plan.ep
    if rows % (blocks * plan.microbatches):
        raise ValueError(f"simulate: {rows} rows do not split into dp * ep = {blocks} row blocks x "
                         f"{plan.microbatches} microbatches")
    rows_mb = rows // blocks // plan.microbatches
    seen = rows_mb * seq / plan.cp
    return {"rows": rows_mb, "seen": seen, "held": seen / plan.tp}


def _rank_elements(spec: ShardSpec, rank: int) -> int:
    """Parameter elements world rank ``rank`` holds (its shards and slices)."""
    return sum(math.prod(shape) for shape in spec.local_shapes(rank).values())


def crossing_bytes_per_token(plan: Plan) -> float:
    """Bytes an expert all-to-all moves per token: ``topk`` rows under
    ``Plan.ep_exchange='rows'``; under ``tokens`` a row, its probabilities and its int32
    expert slots for each rank its experts fall on, expected for uniform routing: ``ep *
    (1 - C(E - E/ep, k) / C(E, k))`` ranks (top-8 of 64 over 2 ranks: 2.0, over 8: 5.4)."""
    cfg = plan.model
    row = cfg.dim * plan.compute_dtype.itemsize
    if not plan.ep_exchange_mode.tokens_cross_once or plan.ep == 1:
        return float(cfg.topk * row)
    missed = math.comb(cfg.experts - cfg.experts // plan.ep, cfg.topk) / math.comb(cfg.experts, cfg.topk)
    return plan.ep * (1.0 - missed) * (row + cfg.topk * (4 + 4))


def busiest_share(plan: Plan, skew: float) -> float:
    """The routed rows the busiest expert rank computes over an even share: ``skew``
    (1: balanced routing), at most what every rank's tokens can bring it (each token's
    ``min(topk, E / ep)`` choices on it: ``ep`` when a rank holds ``topk`` experts or more);
    1 without expert parallelism, where each rank computes its own tokens' experts."""
    if plan.ep == 1:
        return 1.0
    cfg = plan.model
    return min(skew, plan.ep * min(cfg.topk, cfg.experts // plan.ep) / cfg.topk)


class _Charge:
    """What each action costs a stage's representative rank: the busiest expert rank's
    share of the routed rows under ``skew`` (``busiest_share``)."""

    def __init__(self, plan: Plan, spec: ShardSpec, rows: int, seq: int, costs: CostModel, rank: int,
                 skew: float = 1.0):
        self.plan, self.seq, self.costs, self.rank = plan, seq, costs, rank
        self.share = busiest_share(plan, skew)
        self.cfg, self.dims, self.spec = plan.model, plan.dims, spec
        self.size = _sizes(plan, rows, seq)
        self.act = self.size["held"] * self.cfg.dim * plan.compute_dtype.itemsize  # the stream, one microbatch
        # a microbatch's routed rows (tokens x topk), what dispatch, combine and its Land move
        self.rows = self.size["held"] * self.cfg.topk * self.cfg.dim * plan.compute_dtype.itemsize
        # what an expert all-to-all brings the busiest rank
        self.crossing = self.size["held"] * crossing_bytes_per_token(plan) * self.share
        self.groups = {name: next(g for g in self.dims.groups(name) if rank in g) for name in STAGE_GROUPS}

    @functools.cached_property
    def parameter_passes(self) -> float:
        """The copy of the rank's parameters into the step's shards and the optimizer's update."""
        return self.costs.parameter_pass_seconds(_rank_elements(self.spec, self.rank))

    def comm(self, kind: str, nbytes: float, group: GroupName) -> float:
        return self.costs.links.seconds(kind, nbytes, self.groups[group])

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one _Charge per simulation)
    def node(self, kind: Kind, layer, phase: str) -> tuple[float, float]:
        """``(compute seconds, blocking collective seconds)`` of a node run;
        ``phase``: ``forward``, ``backward`` (its dgrad and wgrad, or its dgrad alone
        under delayed wgrad for the experts), ``wgrad`` or ``recompute``."""
        cfg, size, tp = self.cfg, self.size, self.plan.tp
        if kind == Kind.LAYER:  # a recompute: the layer's forward again
            parts = [self.node(k, layer, "forward") for k in layer_kinds(cfg, layer)]
            return sum(p[0] for p in parts), sum(p[1] for p in parts)
        if kind in (Kind.DISPATCH, Kind.COMBINE):  # the local routing and permutation; exchanges are timed apart
            return self.costs.move_seconds(self.rows, kind.value), 0.0
        tokens = size["held"] * tp if kind != Kind.EXPERTS else size["held"]
        flops = node_flops(cfg, kind.value, layer, tokens, self.seq) / (tp if kind != Kind.EXPERTS else 1)
        if kind == Kind.EXPERTS:
            flops *= self.share
        scale = {"forward": 1.0, "recompute": 1.0, "wgrad": 1.0,
                 "backward": 1.0 if kind == Kind.EXPERTS and self.plan.delay_wgrad else 2.0}[phase]
        comm = 0.0
        if tp > 1 and kind in (Kind.ATTN, Kind.DENSE, Kind.HEAD, Kind.EMBED):
            pairs = {Kind.ATTN: 1 + bool(cfg.shared_ffn), Kind.DENSE: 2, Kind.HEAD: 0.5, Kind.EMBED: 0.5}[kind]
            comm += pairs * 2 * self.comm("all_gather", self.act * tp, GroupName.TP)
        if self.plan.cp > 1 and kind in (Kind.ATTN, Kind.DENSE):
            kv = 2 * size["seen"] * cfg.num_kv_heads * cfg.head_dim * self.plan.compute_dtype.itemsize / tp
            comm += self.comm("all_gather", kv * self.plan.cp, GroupName.CP)
        if self.plan.etp > 1 and kind == Kind.EXPERTS:
            comm += 2 * self.comm("all_to_all", self.rows * self.plan.etp, GroupName.ETP)
        if phase == "wgrad":
            comm = 0.0
        return self.costs.compute_seconds(flops * scale, kind.value), comm

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def host(self, kind: Kind, layer, phase: str) -> float:
        """The host's seconds issuing a node run (a recompute: the layer's forwards)."""
        if kind == Kind.LAYER:
            return sum(self.host(k, layer, "forward") for k in layer_kinds(self.cfg, layer))
        return self.costs.host_seconds(phase, kind.value)

    @functools.cached_property
    def land(self) -> float:
        """A combine's rows unpermuted and summed into the stream (``Land``)."""
        return self.costs.move_seconds(self.rows, "land")

    @functools.cached_property
    def exchange(self) -> float:
        """One expert all-to-all of a microbatch's rows (dispatch or combine, either way)."""
        return self.comm("all_to_all", self.crossing, GroupName.EP)

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def unit(self, name: str, gather: bool) -> float:
        """A unit's gather (compute dtype) or gradient reduction (fp32)."""
        seconds = 0.0
        for key, layout in self.spec.unit(name).groups.items():
            group = key.domain.data_group
            sharded = self.spec.sharded(key.domain)
            if gather and sharded:
                seconds += self.comm("all_gather", layout.full_size * self.spec.dtype(key).itemsize, group)
            elif not gather:
                kind = "reduce_scatter" if sharded else "all_reduce"
                seconds += self.comm(kind, layout.full_size * 4, group)
        return seconds


def simulate(plan: Plan, rows: int, seq: int, costs: CostModel | None = None, programs: dict | None = None,
             train: bool = True, skew: float = 1.0) -> Simulation:
    """Check and time ``plan``'s step on a global batch of ``rows`` sequences of ``seq``.

    Arguments:
        plan: any Plan (its world need not exist here).
        rows, seq: the global batch.
        costs: the CostModel (default: the default calibration and links).
        programs: ``{stage: actions}`` to run instead of the plan's (a test's mis-ordered one).
        train: a training step (else forward only).
        skew: the routed rows of the busiest expert rank over an even share (1: balanced
            routing; ``busiest_share``): its experts' compute and what its exchanges
            bring it scale by it, and a step waits for that rank.

    Returns:
        A Simulation.

    Raises:
        PlanError: a deadlock, a transfer out of order or never received, or a stage's
            program breaking the FSDP lifecycle, naming the ranks and the actions.
    """
    costs = CostModel() if costs is None else costs
    dims = plan.dims
    spec = resolve_stage(plan, 0).spec
    for name in STAGE_GROUPS:
        for group in dims.groups(name):  # the premise: every rank of a group runs one program
            if len({dims.stage(r) for r in group}) > 1:
                raise PlanError(f"group {name} {group} spans pipeline stages")
    programs = programs if programs is not None else \
        {s: stage_program(plan, s, train).actions for s in range(plan.pp)}
    reps = [dims.rank_of(0, 0, 0, 0, s) for s in range(plan.pp)]
    for s in range(plan.pp):
        try:
            check_lifecycle(plan, spec, stage_program(plan, s, train).with_actions(programs[s]), s)
        except LifecycleError as err:
            raise PlanError(f"rank {reps[s]} (stage {s}) breaks the FSDP lifecycle: {err}") from None
    charges = [_Charge(plan, spec, rows, seq, costs, r, skew) for r in reps]
    runs = [StageRun(s, r) for s, r in enumerate(reps)]
    _run(plan, programs, charges, runs, costs)
    step = max(r.end for r in runs)
    program = max(r.program_end for r in runs)  # the schedule's span: what its bubble is a share of
    tokens = rows * seq
    from ..params import train_flops_per_token

    model_flops = train_flops_per_token(plan.model, seq) * tokens
    return Simulation(plan, rows, seq, runs, step, [1 - r.busy / program for r in runs], tokens / step,
                      model_flops / step / dims.world / (costs.calibration.peak_tflops * 1e12), costs)


@dataclass
class _Clock:
    """A stage's GPU compute clock ``t``, communication stream ``comm`` and ``host``:
    the host issues each action after the one before, the GPU runs it once issued and
    once the GPU is free, so an eager host ahead of the GPU costs nothing and one
    behind it idles the GPU."""

    t: float = 0.0
    comm: float = 0.0
    host: float = 0.0
    ready: dict = field(default_factory=dict)  # what a later action waits for: key -> time
    reductions: list = field(default_factory=list)


_WAITS = {(Forward, Kind.EXPERTS): (Forward, Kind.DISPATCH), (Backward, Kind.EXPERTS): (Backward, Kind.COMBINE),
          (Backward, Kind.ATTN): (Backward, Kind.DISPATCH)}
"""A node run and the exchange whose rows it reads (issued by an earlier action)."""


def _run(plan: Plan, programs: dict, charges: list, runs: list, costs: CostModel) -> None:
    P, ring = plan.pp, plan.virtual_stages > 1  # interleaved: the last stage sends on to the first
    pcs, clocks = [0] * P, [_Clock() for _ in range(P)]
    # streams and their gradients travel on channels of their own (fmoe.schedule.pipeline), each in order
    channels = {(a, b, gradient): deque() for a in range(P) for b in range(P) for gradient in (False, True)}
    channel_free = dict.fromkeys(channels, 0.0)
    ep = plan.ep > 1

    def peer_of(s: int, step: int) -> int:
        return (s + step) % P if ring else s + step

    def step_one(s: int) -> bool:
        a = programs[s][pcs[s]]
        clock, charge, run = clocks[s], charges[s], runs[s]
        match a:
            case Gather(unit):
                start = max(clock.t, clock.comm, clock.host)
                clock.comm = start + charge.unit(unit, gather=True)
                clock.ready[("gather", unit)] = clock.comm
                run.spans.append(Span("comm", start, clock.comm, a))
            case Wait(unit):
                clock.t = max(clock.t, clock.ready.pop(("gather", unit), clock.t))
            case Release():
                pass
            case Reduce(unit):
                start = max(clock.t, clock.comm, clock.host)
                clock.comm = start + charge.unit(unit, gather=False)
                clock.reductions.append(clock.comm)
                run.spans.append(Span("comm", start, clock.comm, a))
            case Send(mb, boundary):
                peer = peer_of(s, -1 if boundary.gradient else 1)
                if not 0 <= peer < P:
                    raise PlanError(f"rank {run.rank} (stage {s}): {label(a)} has no stage to go to")
                link = costs.links.seconds("send", charge.act, (run.rank, runs[peer].rank))
                channels[(s, peer, boundary.gradient)].append((mb, boundary, (max(clock.t, clock.host), link),
                                                               pcs[s]))
            case Recv(mb, boundary):
                peer = peer_of(s, 1 if boundary.gradient else -1)
                if not 0 <= peer < P:
                    raise PlanError(f"rank {run.rank} (stage {s}): {label(a)} has no stage to come from")
                queue = channels[(peer, s, boundary.gradient)]
                if not queue:
                    return False  # blocked until the peer sends
                got_mb, got, (ready, link), at = queue[0]
                if (got_mb, got) != (mb, boundary):
                    raise PlanError(f"rank {run.rank} (stage {s}) receives {boundary} of microbatch {mb} from rank "
                                    f"{runs[peer].rank} (stage {peer}), which sent {got} of microbatch {got_mb} "
                                    f"first (its action {at}: {label(programs[peer][at])}): point-to-point "
                                    "messages arrive in the order sent")
                queue.popleft()
                # a transfer starts once sent, received (NCCL's send waits for its receive) and the channel's
                # transfer before it is through
                begin = max(ready, clock.host, channel_free[(peer, s, boundary.gradient)])
                arrive = channel_free[(peer, s, boundary.gradient)] = begin + link
                runs[peer].spans.append(Span("p2p", begin, arrive, programs[peer][at], mb, not boundary.gradient))
                clock.t = max(clock.t, arrive)
            case Land(node, mb):
                clock.t = max(clock.t, clock.ready.pop((Forward, Kind.COMBINE, node.layer, mb), clock.t),
                              clock.host) + charge.land
                run.busy += charge.land
            case Forward(node, mb) | Backward(node, mb) | Wgrad(node, mb) | Recompute(node, mb):
                run_type = type(a)
                phase = {Forward: "forward", Backward: "backward", Wgrad: "wgrad", Recompute: "recompute"}[run_type]
                issued, clock.host = clock.host, clock.host + charge.host(node.kind, node.layer, phase)
                if ep and node.kind in (Kind.DISPATCH, Kind.COMBINE):
                    local, _ = charge.node(node.kind, node.layer, phase)  # the rows permuted, then sent
                    clock.t = max(clock.t, issued) + local
                    run.busy += local
                    if node.kind == Kind.DISPATCH and run_type is Forward:  # the host reads the split sizes
                        clock.host = max(clock.host, clock.t)
                    start = max(clock.t, clock.comm)
                    clock.comm = start + charge.exchange
                    clock.ready[(run_type, node.kind, node.layer, mb)] = clock.comm
                    run.spans.append(Span("comm", start, clock.comm, a, mb, run_type is Forward))
                else:
                    if ep and (run_type, node.kind) in _WAITS:
                        clock.t = max(clock.t, clock.ready.pop((*_WAITS[(run_type, node.kind)], node.layer, mb),
                                                               clock.t))
                    compute, blocking = charge.node(node.kind, node.layer, phase)
                    start = max(clock.t, issued)
                    clock.t = max(start + compute + blocking, clock.host)
                    run.busy += compute
                    run.spans.append(Span("compute", start, clock.t, a, mb, run_type in (Forward, Recompute)))
        pcs[s] += 1
        return True

    while any(pcs[s] < len(programs[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while pcs[s] < len(programs[s]) and step_one(s):
                moved = True
        if not moved:
            blocked = [f"rank {runs[s].rank} (stage {s}) at action {pcs[s]}: {label(programs[s][pcs[s]])}"
                       for s in range(P) if pcs[s] < len(programs[s])]
            raise PlanError("deadlock: every stage waits for another; " + "; ".join(blocked))
    for (src, dst, _), queue in channels.items():
        if queue:
            mb, boundary, _, at = queue[0]
            raise PlanError(f"rank {runs[src].rank} (stage {src}) sends {boundary} of microbatch {mb} (its action "
                            f"{at}: {label(programs[src][at])}) that rank {runs[dst].rank} (stage {dst}) never "
                            "receives")
    for s in range(P):
        clock = clocks[s]
        runs[s].program_end = max([clock.t, clock.comm, clock.host, *clock.reductions])
        runs[s].end = runs[s].program_end + charges[s].parameter_passes
