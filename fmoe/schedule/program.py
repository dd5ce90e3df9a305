"""A step as a program: the ordered actions (``fmoe.schedule.actions``) of a plan.

The program is a pure function of the plan, built once (``fmoe.resolve``) before
anything runs, so the checks that guard execution can run on it ahead of time, and a
test can hand the executor a deliberately wrong one. The builders take ``Scheduling``,
what a program depends on of its plan, read from the plan once by ``fmoe.resolve``.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, NamedTuple

from ..config import ModelConfig
from ..config_fields import Schedule
from ..layers.nodes import Kind, layer_kinds
from ..shard.spec import ShardSpec
from .actions import (STREAM, STREAM_GRADIENT, Action, Backward, Forward, Gather, Land, Node, Recompute, Recv, Reduce,
                      Release, Send, Wait, Wgrad)

EMBED, HEAD = Node(Kind.EMBED), Node(Kind.HEAD)


class Scheduling(NamedTuple):
    """What a step's program depends on of its plan (``fmoe.resolve.scheduling`` reads it).

    Attributes:
        model: the ModelConfig.
        microbatches: ``Plan.microbatches``.
        schedule: ``Plan.schedule`` (the Schedule a training step's order is, with more than
            one microbatch).
        delay_wgrad: ``Plan.delay_wgrad``.
        remat_layers: ``Plan.remat='full'``: each layer recomputed before its backward.
        pp: the pipeline ranks (``Plan.pp``).
        stages: the members of each of the ``pp * virtual_stages`` stages in forward order;
            stage ``k`` runs on pipeline rank ``k % pp``.
        prefetch: ``Plan.prefetch``: units gathered ahead under ZeRO-3.
        two_slots: ``Plan.gather_buffers='double'``.
    """

    model: ModelConfig
    microbatches: int
    schedule: Schedule
    delay_wgrad: bool
    remat_layers: bool
    pp: int
    stages: tuple
    prefetch: int
    two_slots: bool

    def chunks(self, stage: int) -> tuple:
        """The members of each chunk pipeline rank ``stage`` holds (one per virtual stage)."""
        return self.stages[stage::self.pp]

    @property
    def order(self) -> "Order":
        """The training step's order (one microbatch has one: ``standard``'s)."""
        return ORDERS[self.schedule if self.microbatches > 1 else Schedule.STANDARD]

    @property
    def backward(self) -> tuple:
        return _backward(self.model, self.delay_wgrad, self.remat_layers)


def layer_nodes(cfg: ModelConfig, layer: int) -> tuple[Node, ...]:
    """A layer's nodes in forward order: ``attn``, ``dispatch``, ``experts``,
    ``combine``, or a dense layer's ``dense``."""
    return tuple(Node(kind, layer) for kind in layer_kinds(cfg, layer))


class Use(NamedTuple):
    """One node run (or pipeline transfer) in a schedule's order: its action type, node
    (a transfer's Boundary), microbatch and unit."""

    mb: int
    run: type
    node: Node
    unit: str | None

    def action(self) -> Action:
        if self.run in (Send, Recv):
            return self.run(self.mb, self.node)
        return self.run(self.node, self.mb, self.unit) if self.run is not Land else Land(self.node, self.mb)


def _layer_backward(cfg: ModelConfig, i: int, delay_wgrad: bool, remat: bool) -> list:
    ops = [(Recompute, Node(Kind.LAYER, i))] if remat else []
    if cfg.is_dense(i):
        return ops + [(Backward, Node(Kind.DENSE, i))]
    attn, dispatch, experts, combine = layer_nodes(cfg, i)
    ops += [(Backward, combine), (Backward, experts), (Backward, dispatch)]
    if delay_wgrad:  # under the dispatch's backward all-to-all
        ops.append((Wgrad, experts))
    return ops + [(Backward, attn)]


@functools.lru_cache(maxsize=64)  # every stage of every plan the planner weighs reads these
def _forward(cfg: ModelConfig) -> tuple:
    layers = tuple((Forward, n) for i in range(cfg.layers) for n in layer_nodes(cfg, i))
    return ((Forward, EMBED), *layers, (Forward, HEAD))


@functools.lru_cache(maxsize=64)
def _backward(cfg: ModelConfig, delay_wgrad: bool, remat: bool) -> tuple:
    ops = tuple(op for i in reversed(range(cfg.layers)) for op in _layer_backward(cfg, i, delay_wgrad, remat))
    return ((Backward, HEAD), *ops, (Backward, EMBED))


class _Chunk(NamedTuple):
    """One chunk of a pipeline rank (one of its virtual stages): its forward and backward
    node runs, its layers, and whether it is the model's first or last stage."""

    forward: list
    backward: list
    layers: list
    first: bool
    last: bool


def _chunks(how: Scheduling, stage: int) -> list[_Chunk]:
    forward, P = _forward(how.model), how.pp
    out = []
    for v, members in enumerate(how.chunks(stage)):
        k, held = v * P + stage, set(members)
        out.append(_Chunk([(run, n) for run, n in forward if n.member in held],
                          [(run, n) for run, n in how.backward if n.member in held],
                          [int(m.split(".")[1]) for m in members if m.startswith("layers.")],
                          k == 0, k == len(how.stages) - 1))
    return out


def _pipeline(how: Scheduling, train: bool, stage: int) -> list[tuple[int, type, Node]]:
    """Stage ``stage``'s part of a pipeline-parallel step (``Plan.pp > 1``), 1F1B: its
    nodes of each microbatch, the stream received from the stage before and sent to the
    one after (its gradient the other way). ``P - stage - 1`` warm-up forwards, then one
    forward and one backward in turn (under ``1f1b_overlap`` woven into each other:
    ``_woven``), then the remaining backwards.

    Under ``Plan.virtual_stages = V > 1`` the rank holds ``V`` chunks and runs
    interleaved 1F1B (Megatron's order): forwards of microbatch groups of ``P``, each
    group through chunk 0, then chunk 1, ...; backwards the same with the chunks
    reversed; ``2 (P - stage - 1) + (V - 1) P`` warm-up forwards. Each chunk runs its
    microbatches in order, so the arithmetic is the single process's either way. Under
    ``Plan.delay_wgrad`` a backward sends its gradient before its experts' weight GEMMs."""
    M, P = how.microbatches, how.pp
    chunks = _chunks(how, stage)
    V = len(chunks)

    def fwd(mb, v):
        c = chunks[v]
        return ([] if c.first else [(mb, Recv, STREAM)]) + [(mb, run, n) for run, n in c.forward] + \
            ([] if c.last else [(mb, Send, STREAM)])

    def bwd(mb, v):
        c = chunks[v]
        ops = [(mb, run, n) for run, n in c.backward]
        # zero-bubble style: the delayed weight GEMMs after the gradient is on its way to the stage before,
        # which starts its backward that much sooner; they fill this stage's wait for its next gradient
        late = [op for op in ops if op[1] is Wgrad] if not c.first else []
        return ([] if c.last else [(mb, Recv, STREAM_GRADIENT)]) + [op for op in ops if op not in late] + \
            ([] if c.first else [(mb, Send, STREAM_GRADIENT)]) + late

    # the k-th forward and backward of the rank: (microbatch, chunk)
    forwards = [((k // (P * V)) * P + k % P, (k // P) % V) for k in range(M * V)] if V > 1 else \
        [(mb, 0) for mb in range(M)]
    backwards = [(mb, V - 1 - v) for mb, v in forwards]
    if not train:
        return [op for mb, v in forwards for op in fwd(mb, v)]
    return how.order.pipeline(how, stage, chunks, forwards, backwards, fwd, bwd)


def _one_f_one_b_pipeline(how: Scheduling, stage: int, chunks: list, forwards: list, backwards: list, fwd, bwd) -> list:
    """Stage ``stage``'s part under ``standard``: ``P - stage - 1`` warm-up forwards
    (interleaved: ``2 (P - stage - 1) + (V - 1) P``), then one forward and one backward
    in turn, then the remaining backwards."""
    P, V = how.pp, len(chunks)
    warm = min(P - stage - 1 if V == 1 else 2 * (P - stage - 1) + (V - 1) * P, len(forwards))
    ops = [op for mb, v in forwards[:warm] for op in fwd(mb, v)]
    for i in range(len(forwards) - warm):
        ops += fwd(*forwards[warm + i]) + bwd(*backwards[i])
    return ops + [op for mb, v in backwards[len(forwards) - warm:] for op in bwd(mb, v)]


def _overlapped_pipeline(how: Scheduling, stage: int, chunks: list, forwards: list, backwards: list, fwd, bwd) -> list:
    """Stage ``stage``'s part under ``1f1b_overlap``: forwards and backwards woven in pairs
    (``_woven``). A pair needs its backward's gradient when it starts, so stage ``s``
    pairs the forward of microbatch ``f`` with the backward of ``f - (2 (P - s) - 1)``,
    whose gradient the next stage sent a pair earlier: the pairs of neighbouring stages
    then do not wait on each other, at the price of ``2 (P - s) - 1`` microbatches in
    flight on stage ``s`` (``P - s`` under plain 1F1B). The last stage pairs ``f`` with
    ``f - 1``, as ``1f1b_overlap`` does without stages. Interleaved (``V`` chunks), the
    same with ``(V - 1) P`` more warm-up forwards, counted in chunk runs."""
    P, V = how.pp, len(chunks)
    warm = min(P - stage + (V - 1) * P, len(forwards))
    lag = P - 1 - stage  # pairs that hold a forward alone while the backwards are on their way
    ops = [op for mb, v in forwards[:warm] for op in fwd(mb, v)]
    done = 0  # backwards run
    for i in range(len(forwards) - warm):
        if i < lag:
            ops += fwd(*forwards[warm + i])
        else:
            (f, vf), (b, vb) = forwards[warm + i], backwards[done]
            ops += _woven(how, f, chunks[vf], b, chunks[vb])
            done += 1
    return ops + [op for mb, v in backwards[done:] for op in bwd(mb, v)]


def _woven(how: Scheduling, f: int, forward: _Chunk, b: int, backward: _Chunk) -> list[tuple[int, type, Node]]:
    """Under ``1f1b_overlap``, a stage's steady-state pair: the forward of microbatch
    ``f`` through chunk ``forward`` woven into the backward of ``b`` through chunk
    ``backward`` layer by layer (``_overlapped_layers``: each all-to-all under the other
    microbatch's compute), as ``1f1b_overlap`` weaves them without stages; a chunk with
    more layers than the other runs its extra layers alone. ``f``'s stream is received
    before and sent after, ``b``'s gradient the same."""
    cfg, delay, remat = how.model, how.delay_wgrad, how.remat_layers
    ops = ([] if forward.first else [(f, Recv, STREAM)]) + ([] if backward.last else [(b, Recv, STREAM_GRADIENT)])
    ops += ([(f, Forward, EMBED)] if forward.first else []) + ([(b, Backward, HEAD)] if backward.last else [])
    fl, bl = forward.layers, backward.layers[::-1]
    for j in range(min(len(fl), len(bl))):
        ops += [(f if who == "f" else b, run, node)
                for who, run, node in _overlapped_layers(cfg, fl[j], bl[j], delay, remat)]
    ops += [(f, Forward, node) for i in fl[len(bl):] for node in layer_nodes(cfg, i)]
    ops += [(b, run, node) for i in bl[len(fl):] for run, node in _layer_backward(cfg, i, delay, remat)]
    ops += ([(f, Forward, HEAD)] if forward.last else []) + ([(b, Backward, EMBED)] if backward.first else [])
    sends = ([] if forward.last else [(f, Send, STREAM)]) + ([] if backward.first else [(b, Send, STREAM_GRADIENT)])
    return ops + sends


def _overlapped_layers(cfg: ModelConfig, fwd_layer: int, bwd_layer: int, delay_wgrad: bool, remat: bool) -> list:
    """Forward of one layer (microbatch f) woven into the backward of another (b):
    each all-to-all is issued right before compute of the other microbatch."""
    if cfg.is_dense(fwd_layer) or cfg.is_dense(bwd_layer):
        return _overlapped_with_dense(cfg, fwd_layer, bwd_layer, delay_wgrad, remat)
    f_attn, f_dispatch, f_experts, f_combine = layer_nodes(cfg, fwd_layer)
    b_attn, b_dispatch, b_experts, b_combine = layer_nodes(cfg, bwd_layer)
    if remat:  # f's attention first, as without remat, so units are held and gathered alike
        ops = [("f", Forward, f_attn),
               ("f", Forward, f_dispatch),                      # runs under ...
               ("b", Recompute, Node(Kind.LAYER, bwd_layer)),   # ... b's layer recomputed
               ("b", Backward, b_combine),                      # runs under ...
               ("f", Forward, f_experts),                       # ... the experts of f
               ("b", Backward, b_experts),
               ("b", Backward, b_dispatch)]                     # runs under b's wgrad, if delayed
    else:
        ops = [("b", Backward, b_combine),    # its all-to-all runs under ...
               ("f", Forward, f_attn),        # ... attention of f
               ("f", Forward, f_dispatch),    # runs under ...
               ("b", Backward, b_experts),    # ... the experts' dgrad of b
               ("b", Backward, b_dispatch),   # runs under ...
               ("f", Forward, f_experts)]     # ... the experts of f (and b's wgrad)
    if delay_wgrad:
        ops.append(("b", Wgrad, b_experts))
    return ops + [("f", Forward, f_combine),   # runs under ...
                  ("b", Backward, b_attn)]     # ... attention's backward of b


def _overlapped_with_dense(cfg: ModelConfig, fwd_layer: int, bwd_layer: int, delay_wgrad: bool,
                           remat: bool) -> list:
    """``_overlapped_layers`` where one layer (or both) is dense: a dense layer has no
    exchange, so its whole node runs under the other layer's first all-to-all."""
    forward = [("f", Forward, node) for node in layer_nodes(cfg, fwd_layer)]
    backward = [("b", run, node) for run, node in _layer_backward(cfg, bwd_layer, delay_wgrad, remat)]
    if cfg.is_dense(fwd_layer):  # under b's combine backward (after its recompute)
        split = 2 if remat and not cfg.is_dense(bwd_layer) else 1
        return backward[:split] + forward + backward[split:]
    return forward[:2] + backward + forward[2:]  # b's dense layer under f's dispatch


def _with_landings(ops: list) -> list:
    """``ops`` with each forward ``combine``'s ``Land`` right before the node that reads
    its output (the next layer's ``attn``, or the ``head``, of that microbatch, or the
    send of the stream to the next pipeline stage): what the schedule runs between the
    two overlaps the combine's all-to-all."""
    out, pending = [], {}
    for mb, run, node in ops:
        reads = (run is Forward and node.kind in (Kind.ATTN, Kind.DENSE, Kind.HEAD)) or (run is Send and node == STREAM)
        if reads and mb in pending:
            out.append((mb, Land, pending.pop(mb)))
        out.append((mb, run, node))
        if run is Forward and node.kind == Kind.COMBINE:
            pending[mb] = node
    return out


def schedule_ops(how: Scheduling, train: bool = True, stage: int = 0) -> list[tuple[int, type, Node]]:
    """``(mb, action type, node)`` in the order the plan's schedule runs them.

    ``standard``: each microbatch's forward, then its backward. ``1f1b_overlap``:
    after microbatch 0's forward, the forward of microbatch ``f`` is interleaved with
    the backward of ``f - 1`` layer by layer (forward layer j with backward layer
    L-1-j), then the last backward runs alone. Each forward ``combine`` lands right
    before the next node of its microbatch reads its output. ``delay_wgrad`` adds a
    ``Wgrad`` per layer after its dispatch's backward; ``remat='full'`` a
    ``Recompute`` of each layer before its backward. Under pipeline parallelism, stage
    ``stage``'s part (``_pipeline``).
    """
    return _with_landings(_pipeline(how, train, stage) if how.pp > 1 else _schedule(how, train))


def _schedule(how: Scheduling, train: bool) -> list[tuple[int, type, Node]]:
    if not train:
        return [(mb, run, node) for mb in range(how.microbatches) for run, node in _forward(how.model)]
    return how.order.single(how)


def _standard(how: Scheduling) -> list[tuple[int, type, Node]]:
    """Each microbatch's forward, then its backward."""
    return [(mb, run, node) for mb in range(how.microbatches) for run, node in _forward(how.model) + how.backward]


def _overlapped(how: Scheduling) -> list[tuple[int, type, Node]]:
    """Microbatch 0's forward; then the forward of each next microbatch woven into the
    backward of the one before, layer by layer (``_overlapped_layers``); then the last
    backward alone."""
    cfg, M, delay, remat = how.model, how.microbatches, how.delay_wgrad, how.remat_layers
    L = cfg.layers
    ops = [(0, run, node) for run, node in _forward(cfg)]
    for f in range(1, M):
        b = f - 1
        ops += [(f, Forward, EMBED), (b, Backward, HEAD)]
        for j in range(L):
            ops += [(f if who == "f" else b, run, node)
                    for who, run, node in _overlapped_layers(cfg, j, L - 1 - j, delay, remat)]
        ops += [(f, Forward, HEAD), (b, Backward, EMBED)]
    return ops + [(M - 1, run, node) for run, node in how.backward]


class Order(NamedTuple):
    """How a schedule orders a training step's node runs: with no pipeline stages
    (``single(scheduling)``), and a pipeline stage's part (``pipeline(scheduling, stage, chunks,
    forwards, backwards, fwd, bwd)``: its chunk runs in the rank's order and how to run
    one forward or backward, ``_pipeline``'s)."""

    single: Callable
    pipeline: Callable


# A schedule is a Schedule value and its entry here; the executor, the planner's checks and
# its simulation run any program these give.
ORDERS = {Schedule.STANDARD: Order(_standard, _one_f_one_b_pipeline),
          Schedule.OVERLAP: Order(_overlapped, _overlapped_pipeline)}


def node_uses(how: Scheduling, spec: ShardSpec, train: bool = True, stage: int = 0) -> list[Use]:
    """The schedule's node runs (of pipeline stage ``stage``) with each node's FSDP unit
    (None for exchanges and transfers)."""
    return [Use(mb, run, node, None if run in (Send, Recv) or node.is_comm else spec.unit_of_member(node.member).name)
            for mb, run, node in schedule_ops(how, train, stage)]


def max_live_units(how: Scheduling, spec: ShardSpec, uses: list[Use]) -> int:
    """ZeRO-3 holds the units in use plus ``prefetch`` more; the others hold all units
    for the step. In use at once: one unit, two while ``1f1b_overlap`` weaves two
    microbatches, one more where a unit's use spans the others' (tied embeddings put
    ``embed`` and ``head``, the first and last compute, in one unit)."""
    if not spec.sharding.regathers:
        return len(spec.units)
    edges = sorted(e for first, last, _ in _spans(uses) for e in ((first, 1), (last + 1, -1)))
    most = open_now = 0
    for _, change in edges:  # at one position, closings (-1) sort before openings
        open_now += change
        most = max(most, open_now)
    return how.prefetch + most


def _spans(uses: list[Use]) -> list[tuple[int, int, str]]:
    """``(first, last, unit)`` index ranges a unit must stay gathered under ZeRO-3.

    A span covers one (unit, microbatch, direction); spans of a unit that overlap or
    follow each other with no other unit's compute in between are merged.
    """
    compute = [i for i, u in enumerate(uses) if u.unit is not None]
    rank = {i: k for k, i in enumerate(compute)}
    ranges: dict = {}
    for i in compute:
        u = uses[i]
        key = (u.unit, u.mb, u.run is Forward)
        ranges[key] = (ranges.get(key, (i, i))[0], i)
    merged: list = []
    for unit in dict.fromkeys(k[0] for k in ranges):
        for first, last in sorted(r for k, r in ranges.items() if k[0] == unit):
            if merged and merged[-1][2] == unit and rank[first] <= rank[merged[-1][1]] + 1:
                merged[-1] = (merged[-1][0], max(last, merged[-1][1]), unit)
            else:
                merged.append((first, last, unit))
    return sorted(merged)


def build_program(how: Scheduling, spec: ShardSpec, uses: list[Use]) -> tuple[Action, ...]:
    """The plan's node runs (``node_uses``) with every lifecycle transition.

    ``optim_grads_params`` gathers a unit before its span of use (``prefetch`` spans
    ahead) and releases it after; the other strategies gather every unit once, keep
    it for the step and release it at the end. Gradients are reduced after a unit's
    last backward (or delayed wgrad) of a microbatch: every microbatch under
    ZeRO-2/3, only the last under DDP and ZeRO-1.
    """
    last_mb = how.microbatches - 1
    last_bwd = {}
    for i, u in enumerate(uses):
        if u.run is not Forward and u.unit is not None:
            last_bwd[(u.mb, u.unit)] = i
    reduce_at = {i: key for key, i in last_bwd.items()
                 if spec.sharding.reduces_every_microbatch or key[0] == last_mb}
    spans = _spans(uses) if spec.sharding.regathers else []
    program, live, waited = [], [], set()

    def gather(unit):
        if unit not in live:
            program.append(Gather(unit))
            live.append(unit)

    if not spec.sharding.regathers:
        for u in uses:
            if u.unit is not None:
                gather(u.unit)
    starting = {first: k for k, (first, _, _) in enumerate(spans)}
    ending: dict = {}
    for _, last, unit in spans:
        ending.setdefault(last, []).append(unit)
    for i, u in enumerate(uses):
        if i in starting:
            for *_, unit in spans[starting[i]:starting[i] + 1 + how.prefetch]:
                gather(unit)
        if u.unit is not None and u.unit not in waited:
            program.append(Wait(u.unit))
            waited.add(u.unit)
        program.append(u.action())
        for unit in ending.get(i, ()):
            program.append(Release(unit))
            live.remove(unit)
            waited.discard(unit)
        if i in reduce_at:
            mb, unit = reduce_at[i]
            program.append(Reduce(unit, mb, mb == last_mb))
    for unit in live:
        program.append(Release(unit))
    return tuple(program)


def with_live_units(program) -> Iterator[tuple[Action, frozenset]]:
    """Each action of ``program`` with the units live when it starts: a unit is live from
    its ``Gather`` to its ``Release`` (gathering or gathered, the ledger's phases other
    than SHARDED). The slot assignment and the planner's memory walk read it."""
    live: frozenset = frozenset()
    for a in program:
        yield a, live
        match a:
            case Gather(unit):
                live = live | {unit}
            case Release(unit):
                live = live - {unit}


def double_buffer_slots(how: Scheduling, spec: ShardSpec, program) -> dict | None:
    """Under ``gather_buffers='double'``, a fixed slot (0 or 1) per unit.

    Slots alternate in order of first gather; ValueError (before anything runs) if
    the program would ever need both live units in one slot.
    """
    if not how.two_slots or not any(size > 1 for size in spec.sizes.values()):
        return None
    slots: dict = {}
    for a, live in with_live_units(program):
        if isinstance(a, Gather):
            slot = slots.setdefault(a.unit, len(slots) % 2)
            busy = [u for u in live if slots[u] == slot]
            if busy:
                raise ValueError(
                    f"Plan.gather_buffers='double' cannot hold this schedule: unit {a.unit} and {busy[0]} "
                    "share a slot while both are live (allowed: gather_buffers 'dynamic' or 'persistent', "
                    "or units that alternate)")
    return slots
