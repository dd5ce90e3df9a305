"""A step as a program: the ordered list of lifecycle transitions and compute nodes.

The program is a pure function of the plan, built before anything runs, so the
same checks that guard execution can be run on it ahead of time, and a test can
hand the executor a deliberately wrong one.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..config import Plan
from ..shard.spec import shard_spec
from .nodes import EMBED, HEAD, Node, layer_nodes


class Action(NamedTuple):
    """``op`` is ``gather | wait | release | reduce`` (on ``unit``),
    ``forward | backward | wgrad`` (of ``node`` for microbatch ``mb``; ``unit`` is
    the node's FSDP unit, None for the communication nodes), ``land`` (a ``combine``
    node's rows are back: wait for its all-to-all, unpermute, add the residual), or
    ``recompute`` (``Plan.remat='full'``: re-run the layer ``node``,
    ``Node("layer", i)``, before its backward)."""

    op: str
    unit: str | None = None
    node: Node | None = None
    mb: int = -1


class Use(NamedTuple):
    """One node run in a schedule's order: ``op`` is ``forward``, ``land``, ``backward``,
    ``wgrad`` or ``recompute`` (whose node is a layer)."""

    mb: int
    op: str
    node: Node
    unit: str | None


def _layer_backward(i: int, delay_wgrad: bool, remat: bool) -> list:
    attn, _, experts, _ = layer_nodes(i)
    ops = [("recompute", Node("layer", i))] if remat else []
    ops += [("backward", Node("combine", i)), ("backward", experts), ("backward", Node("dispatch", i))]
    if delay_wgrad:  # under the dispatch's backward all-to-all
        ops.append(("wgrad", experts))
    return ops + [("backward", attn)]


def _forward(cfg) -> list:
    layers = [("forward", n) for i in range(cfg.layers) for n in layer_nodes(i)]
    return [("forward", EMBED)] + layers + [("forward", HEAD)]


def _backward(cfg, delay_wgrad: bool, remat: bool) -> list:
    layers = [op for i in reversed(range(cfg.layers)) for op in _layer_backward(i, delay_wgrad, remat)]
    return [("backward", HEAD)] + layers + [("backward", EMBED)]


def _overlapped_layers(fwd_layer: int, bwd_layer: int, delay_wgrad: bool, remat: bool) -> list:
    """Forward of one layer (microbatch f) woven into the backward of another (b):
    each all-to-all is issued right before compute of the other microbatch."""
    F = {n.kind: n for n in layer_nodes(fwd_layer)}
    B = {n.kind: n for n in layer_nodes(bwd_layer)}
    if remat:  # f's attention first, as without remat, so units are held and gathered alike
        ops = [("f", "forward", F["attn"]),
               ("f", "forward", F["dispatch"]),           # runs under ...
               ("b", "recompute", Node("layer", bwd_layer)),  # ... b's layer recomputed
               ("b", "backward", B["combine"]),           # runs under ...
               ("f", "forward", F["experts"]),            # ... the experts of f
               ("b", "backward", B["experts"]),
               ("b", "backward", B["dispatch"])]          # runs under b's wgrad, if delayed
    else:
        ops = [("b", "backward", B["combine"]),    # its all-to-all runs under ...
               ("f", "forward", F["attn"]),        # ... attention of f
               ("f", "forward", F["dispatch"]),    # runs under ...
               ("b", "backward", B["experts"]),    # ... the experts' dgrad of b
               ("b", "backward", B["dispatch"]),   # runs under ...
               ("f", "forward", F["experts"])]     # ... the experts of f (and b's wgrad)
    if delay_wgrad:
        ops.append(("b", "wgrad", B["experts"]))
    return ops + [("f", "forward", F["combine"]),   # runs under ...
                  ("b", "backward", B["attn"])]     # ... attention's backward of b


def _with_landings(ops: list) -> list:
    """``ops`` with each forward ``combine``'s ``land`` right before the node that reads
    its output (the next layer's ``attn``, or the ``head``, of that microbatch): what
    the schedule runs between the two overlaps the combine's all-to-all."""
    out, pending = [], {}
    for mb, op, node in ops:
        if op == "forward" and node.kind in ("attn", "head") and mb in pending:
            out.append((mb, "land", pending.pop(mb)))
        out.append((mb, op, node))
        if op == "forward" and node.kind == "combine":
            pending[mb] = node
    return out


def schedule_ops(plan: Plan, train: bool = True) -> list[tuple[int, str, Node]]:
    """``(mb, op, node)`` in the order the plan's schedule runs them.

    ``standard``: each microbatch's forward, then its backward. ``1f1b_overlap``:
    after microbatch 0's forward, the forward of microbatch ``f`` is interleaved with
    the backward of ``f - 1`` layer by layer (forward layer j with backward layer
    L-1-j), then the last backward runs alone. Each forward ``combine`` lands right
    before the next node of its microbatch reads its output. ``delay_wgrad`` adds a
    ``wgrad`` op per layer after its dispatch's backward; ``remat='full'`` a
    ``recompute`` of each layer before its backward.
    """
    return _with_landings(_schedule(plan, train))


def _schedule(plan: Plan, train: bool) -> list[tuple[int, str, Node]]:
    cfg, M, delay, remat = plan.model, plan.microbatches, plan.delay_wgrad, plan.remat == "full"
    if not train:
        return [(mb, op, node) for mb in range(M) for op, node in _forward(cfg)]
    if plan.schedule == "standard" or M == 1:
        return [(mb, op, node) for mb in range(M) for op, node in _forward(cfg) + _backward(cfg, delay, remat)]
    ops = [(0, op, node) for op, node in _forward(cfg)]
    for f in range(1, M):
        b = f - 1
        ops += [(f, "forward", EMBED), (b, "backward", HEAD)]
        for j in range(cfg.layers):
            ops += [(f if who == "f" else b, op, node)
                    for who, op, node in _overlapped_layers(j, cfg.layers - 1 - j, delay, remat)]
        ops += [(f, "forward", HEAD), (b, "backward", EMBED)]
    return ops + [(M - 1, op, node) for op, node in _backward(cfg, delay, remat)]


def node_uses(plan: Plan, train: bool = True) -> list[Use]:
    """The schedule's ops with each node's FSDP unit (None for communication nodes)."""
    spec = shard_spec(plan)
    return [Use(mb, op, node, None if node.is_comm else spec.unit_of_member(node.member).name)
            for mb, op, node in schedule_ops(plan, train)]


def max_live_units(plan: Plan) -> int:
    """ZeRO-3 holds the units in use plus ``prefetch`` more; the others hold all units
    for the step. In use at once: one unit, two while ``1f1b_overlap`` weaves two
    microbatches, one more where a unit's use spans the others' (tied embeddings put
    ``embed`` and ``head``, the first and last compute, in one unit)."""
    if plan.sharding == "optim_grads_params":
        return plan.prefetch + _most_spans_at_once(plan)
    return len(shard_spec(plan).units)


@functools.lru_cache(maxsize=64)
def _most_spans_at_once(plan: Plan) -> int:
    """The most ZeRO-3 spans open at one program position (a sweep over their ends)."""
    edges = sorted(e for first, last, _ in _spans(node_uses(plan)) for e in ((first, 1), (last + 1, -1)))
    most = open_now = 0
    for _, change in edges:  # at one position, closings (-1) sort before openings
        open_now += change
        most = max(most, open_now)
    return most


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
        key = (u.unit, u.mb, u.op == "forward")
        ranges[key] = (ranges.get(key, (i, i))[0], i)
    merged: list = []
    for unit in dict.fromkeys(k[0] for k in ranges):
        for first, last in sorted(r for k, r in ranges.items() if k[0] == unit):
            if merged and merged[-1][2] == unit and rank[first] <= rank[merged[-1][1]] + 1:
                merged[-1] = (merged[-1][0], max(last, merged[-1][1]), unit)
            else:
                merged.append((first, last, unit))
    return sorted(merged)


def build_program(plan: Plan, train: bool = True) -> list[Action]:
    """The plan's schedule (see ``schedule_ops``) with every lifecycle transition.

    ``optim_grads_params`` gathers a unit before its span of use (``prefetch`` spans
    ahead) and releases it after; the other strategies gather every unit once, keep
    it for the step and release it at the end. Gradients are reduced after a unit's
    last backward (or delayed wgrad) of a microbatch: every microbatch under
    ZeRO-2/3, only the last under DDP and ZeRO-1.
    """
    uses = node_uses(plan, train)
    per_mb = plan.sharding in ("optim_grads", "optim_grads_params")
    zero3 = plan.sharding == "optim_grads_params"
    last_bwd = {}
    for i, u in enumerate(uses):
        if u.op != "forward" and u.unit is not None:
            last_bwd[(u.mb, u.unit)] = i
    reduce_at = {i: key for key, i in last_bwd.items() if per_mb or key[0] == plan.microbatches - 1}
    spans = _spans(uses) if zero3 else []
    program, live, waited = [], [], set()

    def gather(unit):
        if unit not in live:
            program.append(Action("gather", unit))
            live.append(unit)

    if not zero3:
        for u in uses:
            if u.unit is not None:
                gather(u.unit)
    starting = {first: k for k, (first, _, _) in enumerate(spans)}
    ending: dict = {}
    for _, last, unit in spans:
        ending.setdefault(last, []).append(unit)
    for i, u in enumerate(uses):
        if i in starting:
            for *_, unit in spans[starting[i]:starting[i] + 1 + plan.prefetch]:
                gather(unit)
        if u.unit is not None and u.unit not in waited:
            program.append(Action("wait", u.unit))
            waited.add(u.unit)
        program.append(Action(u.op, u.unit, u.node, u.mb))
        for unit in ending.get(i, ()):
            program.append(Action("release", unit))
            live.remove(unit)
            waited.discard(unit)
        if i in reduce_at:
            mb, unit = reduce_at[i]
            program.append(Action("reduce", unit, None, mb))
    for unit in live:
        program.append(Action("release", unit))
    return program


@functools.lru_cache(maxsize=64)
def program_for(plan: Plan, train: bool = True) -> tuple[Action, ...]:
    """``build_program`` once per plan: a pure function of it, asked for every step."""
    return tuple(build_program(plan, train))


def double_buffer_slots(plan: Plan, program: list[Action]) -> dict | None:
    """Under ``gather_buffers='double'``, a fixed slot (0 or 1) per unit.

    Slots alternate in order of first gather; ValueError (before anything runs) if
    the program would ever need both live units in one slot.
    """
    if plan.gather_buffers != "double" or not any(size > 1 for size in shard_spec(plan).sizes.values()):
        return None
    slots, live = {}, set()
    for a in program:
        if a.op == "gather":
            slot = slots.setdefault(a.unit, len(slots) % 2)
            busy = [u for u in live if slots[u] == slot]
            if busy:
                raise ValueError(
                    f"Plan.gather_buffers='double' cannot hold this schedule: unit {a.unit} and {busy[0]} "
                    "share a slot while both are live (allowed: gather_buffers 'dynamic' or 'persistent', "
                    "or units that alternate)")
            live.add(a.unit)
        elif a.op == "release":
            live.discard(a.unit)
    return slots
