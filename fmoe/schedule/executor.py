"""Run a program: thread the lifecycle state through gathers, nodes and reductions.

Each compute node runs under plain autograd on its own: its inputs are detached
boundary tensors and its weights are leaves viewing the unit's gathered buffer. Its
backward is ``torch.autograd.grad`` from the saved outputs, so the executor, not a
hook, decides when weights are gathered, released and reduced, and every node first
asks the lifecycle for its unit (which raises if the unit is not gathered).

The all-to-all nodes issue an exchange and return at once. A forward ``combine``'s
rows are waited for where the program lists its ``land`` action (right before the
next node of that microbatch reads them); the other exchanges where their result is
first needed (the next compute node of that microbatch, forward or backward).
Whatever the program runs in between, typically another microbatch's compute,
overlaps the exchange: on CUDA the collective runs on NCCL's stream, ordered against
the compute stream by events; on CPU on gloo's threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import optree
import torch

from ..batch import Batch
from ..config import Plan
from ..layers.attention import documents
from ..layers.expert_parallel import ExpertParallel, Transfer, from_experts, to_experts
from ..layers.experts import DeferredWgrad
from ..layers.fp8 import Fp8Weight
from ..layers.model import stack_stats
from ..layers.moe import Routed
from ..params import param_table
from ..shard import lifecycle as lc
from ..shard.mesh import Mesh
from ..shard.spec import local_leaves, shard_rank, shard_spec
from ..shard.trace import Event, now
from .compiled import kernels_for
from .nodes import (Attended, Kernels, Node, all_nodes, attn_node, combine_output, embed_node, experts_node,
                    head_node, layer_nodes)
from .program import Action, double_buffer_slots, max_live_units


class Executed(NamedTuple):
    """What a program produced on this rank.

    Attributes:
        ce_sum: this rank's summed cross-entropy (fp32 scalar, detached).
        objective: this rank's share of the differentiated objective (detached).
        grads: ``{path: this rank's fp32 grad leaf}`` (empty without backward nodes).
        stats: one MoEStats per microbatch, stacked over layers (in microbatch order).
        state: the final Lifecycle (its trace included).
    """

    ce_sum: torch.Tensor
    objective: torch.Tensor
    grads: dict
    stats: list
    state: lc.Lifecycle


def check_program(plan: Plan, program: list[Action]) -> dict | None:
    """Everything about running ``program`` that can fail before a collective:
    double-buffer slots, and room for persistent buffers. Returns the slots."""
    slots = double_buffer_slots(plan, program)
    device = torch.device(plan.device)
    spec = shard_spec(plan)
    if plan.gather_buffers == "persistent" and device.type == "cuda":
        need = sum(layout.full_size * torch.empty((), dtype=u.dtype(key, plan)).element_size()
                   for u in spec.units for key, layout in u.groups.items() if spec.sharded(key[0]))
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            raise ValueError(f"Plan.gather_buffers='persistent' keeps every unit gathered: {need / 2**30:.1f} GiB, "
                             f"but {device} has {free / 2**30:.1f} GiB free (allowed: 'dynamic' or 'double')")
    return slots


class _Computed(NamedTuple):
    """A node's record for its later actions: detached ``inputs`` (by name),
    differentiable ``outputs`` (by name), weight leaves and an optional scalar
    objective, for its backward; ``routed``: an ``attn`` record's routing, which its
    layer's ``combine`` and ``dispatch`` backwards read to send gradients across ranks;
    ``wgrad``: an ``experts`` record's held-back weight GEMMs (``Plan.delay_wgrad``) and
    ``{id(weight): path}``, which stay recorded after the backward until the ``wgrad``
    action runs them."""

    inputs: dict
    outputs: dict
    weights: dict
    objective: torch.Tensor | None = None
    routed: Routed | None = None
    wgrad: tuple | None = None


def _leaf(x, train: bool):
    if x is None:
        return None
    return x.detach().requires_grad_(train and x.is_floating_point())


def _weight_leaf(w, train: bool):
    """A gathered weight as a leaf of the node's graph; an ``Fp8Weight``'s gradient
    goes to its ``grad_leaf``."""
    if isinstance(w, Fp8Weight):
        return w._replace(grad_leaf=w.grad_leaf.detach().requires_grad_(train))
    return w.detach().requires_grad_(train)


def _grad_target(w) -> torch.Tensor:
    return w.grad_leaf if isinstance(w, Fp8Weight) else w


def _backprop(rec: _Computed, grads_out: dict):
    """Gradients of a node's inputs and weights from its outputs' gradients (and its objective)."""
    outs, seeds = [], []
    for name, grad in grads_out.items():
        if grad is not None and rec.outputs.get(name) is not None:
            outs.append(rec.outputs[name])
            seeds.append(grad)
    if rec.objective is not None:
        outs.append(rec.objective)
        seeds.append(None)
    names = [n for n, x in rec.inputs.items() if x is not None and x.requires_grad]
    targets = [rec.inputs[n] for n in names] + [_grad_target(w) for w in rec.weights.values()]
    if not outs or not targets:
        return dict.fromkeys(names), {}
    got = torch.autograd.grad(outs, targets, seeds, allow_unused=True)
    return dict(zip(names, got)), dict(zip(rec.weights, got[len(names):]))


class _Flow:
    """What moves between actions during one step: three tables keyed by
    ``(microbatch, node)``, each entry written by one action and taken by a later one.

    ``values``: a node's forward outputs by name (tensors, or Transfers in flight), for
    the next forward of its microbatch; a ``combine``'s until its ``land`` are the rows
    in flight with what landing them needs. Under ``Plan.remat='full'`` the whole
    layer's node (``Node("layer", i)``) holds what its ``recompute`` needs: the layer's
    input ``h`` and routing, and the rows that crossed ranks. ``grads``: gradients
    w.r.t. those outputs, possibly in flight, for the node's backward. ``records``:
    autograd records (``_Computed``) waiting for their backward (and an ``experts``
    record for its ``wgrad``). ``events``: exchanges that landed, for the trace.
    """

    def __init__(self, plan: Plan, mesh: Mesh, batch: Batch, total_targets, kernels: Kernels):
        self.plan, self.mesh, self.total_targets, self.kernels = plan, mesh, total_targets, kernels
        self.batch_mb = batch.microbatches(plan.microbatches)
        # packed documents: worked out once per microbatch, read by every layer
        self.docs_mb = [None if b.documents is None else documents(b.documents) for b in self.batch_mb]
        self.train = torch.is_grad_enabled()
        self.ep_events: list = []
        self.ep = ExpertParallel(mesh.ep, plan.model.experts // plan.ep, self.ep_events) if plan.ep > 1 else None
        self.values: dict = {}
        self.grads: dict = {}
        self.records: dict = {}
        # Plan.remat='full': layer forwards keep only what their layer's recompute
        # needs (in ``values``, under the layer's node); their autograd graphs are dropped at once
        self.remat = self.train and plan.remat == "full"
        self.events: list = []
        # the node whose output "h" each embed/attn/head node reads
        order = [n for n in all_nodes(plan.model) if n.kind in ("embed", "attn", "head")]
        self.previous = {after: before.sibling("combine") if before.kind == "attn" else before
                         for before, after in zip(order, order[1:])}
        self.table = param_table(plan.model)

    def send(self, transfer: Transfer, node: Node, mb: int) -> Transfer:
        """Tag an exchange just issued by ``node`` for the trace."""
        transfer.node, transfer.mb = str(node), mb
        return transfer

    def resolve(self, value):
        """A value or gradient, waiting for it if it is in flight."""
        if isinstance(value, Transfer):
            first = value.landed is None
            out = value.wait()
            if first:
                self.events.append(value.event())
            return out
        return value

    def take(self, table: dict, mb: int, node, what: str) -> dict:
        try:
            return table.pop((mb, node))
        except KeyError:
            raise lc.LifecycleError(f"{what}: {node} (microbatch {mb}) has not produced it yet; "
                                    "the program runs nodes out of order") from None

    def save(self, mb: int, node: Node, record: _Computed) -> None:
        if self.train:
            self.records[(mb, node)] = record

    def grads_for(self, mb: int, node: Node) -> dict:
        return self.grads.setdefault((mb, node), {})

    def routing(self, mb: int, node: Node) -> Routed:
        """The routing of ``node``'s layer, from its ``attn`` record (kept until the
        ``attn`` backward, the layer's last)."""
        rec = self.records.get((mb, node.sibling("attn")))
        if rec is None:
            raise lc.LifecycleError(f"backward {node} (microbatch {mb}): its layer's attn has no record; "
                                    "the program runs nodes out of order")
        return rec.routed


def _weights(state, unit: str, node: Node, flow: _Flow, what: str) -> dict:
    """Leaves viewing the gathered weights ``node`` computes with (raises unless gathered)."""
    views = lc.require_gathered(state, unit, what)
    cfg = flow.plan.model
    return {p: _weight_leaf(v, flow.train) for p, v in views.items() if node.uses(flow.table[p], cfg)}


def _detached(tree):
    """``tree`` with every tensor detached. A forward whose layer is recomputed runs
    under autograd like any other (the same kernels: a compiled region's inference
    graph would round differently) and keeps none of it: once its outputs are
    detached, nothing holds the graph and what it saved."""
    return optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True)


def _input_h(flow: _Flow, mb: int, node: Node) -> torch.Tensor:
    """The hidden states ``node`` reads (the previous layer's landed combine, or the
    embedding), as a leaf of its own graph."""
    prev = flow.take(flow.values, mb, flow.previous[node], f"forward {node}")
    if "h" not in prev:
        raise lc.LifecycleError(f"forward {node} (microbatch {mb}): {flow.previous[node]} has not landed; "
                                "the program needs a land action before it")
    return _leaf(prev["h"], flow.train)


def _forward_embed(flow: _Flow, mb: int, node: Node, weights: dict):
    h = embed_node(weights, flow.batch_mb[mb].inputs)
    flow.values[(mb, node)] = {"h": h}
    flow.save(mb, node, _Computed({}, {"h": h}, weights))


def _forward_head(flow: _Flow, mb: int, node: Node, weights: dict):
    plan, h = flow.plan, _input_h(flow, mb, node)
    objective, ce_sum = head_node(weights, h, flow.batch_mb[mb].targets, flow.total_targets, plan.model.norm_eps,
                                  mb, flow.kernels, plan.loss_chunk)
    flow.save(mb, node, _Computed({"h": h}, {}, weights, objective))
    return objective.detach(), ce_sum


def _forward_attn(flow: _Flow, mb: int, node: Node, weights: dict) -> Attended:
    h = _input_h(flow, mb, node)
    result = attn_node(weights, h, flow.plan, node.layer, flow.mesh.world.size, flow.ep, mb, flow.kernels,
                       docs=flow.docs_mb[mb])
    if flow.remat:  # kept: the input and the routing; the rows go on as an output and
        # a recompute makes them again
        result = _detached(result)
        flow.values[(mb, node.whole_layer)] = {"h": h.detach(), "routed": result.routed._replace(rows_RD=None)}
    else:
        flow.save(mb, node, _Computed({"h": h}, result.outputs, weights, result.objective, result.routed))
    flow.values[(mb, node)] = dict(result.outputs, routed=result.routed)
    return result


def _forward_dispatch(flow: _Flow, mb: int, node: Node, weights: dict):
    """Issue the all-to-all of the rows (and their probabilities) to their experts' ranks."""
    attn = flow.values[(mb, node.sibling("attn"))]
    rows, probs, routed = attn["rows"], attn["row_probs"], attn["routed"]
    if routed.exchange is not None:
        cap = routed.dispatch.capacity
        rows = flow.send(to_experts(rows, routed.exchange, flow.ep, cap), node, mb)
        probs = None if probs is None else flow.send(to_experts(probs, routed.exchange, flow.ep, cap), node, mb)
    flow.values[(mb, node)] = {"rows": rows, "row_probs": probs}


def _forward_experts(flow: _Flow, mb: int, node: Node, weights: dict):
    sent = flow.take(flow.values, mb, node.sibling("dispatch"), f"forward {node}")
    routed = flow.values[(mb, node.sibling("attn"))]["routed"]
    rows = _leaf(flow.resolve(sent["rows"]), flow.train)
    probs = _leaf(flow.resolve(sent["row_probs"]), flow.train)
    if flow.remat:
        y = experts_node(weights, rows, probs, routed, flow.plan, node.layer, None, mb, flow.kernels)
        flow.values[(mb, node)] = {"y": y.detach()}
        if routed.exchange is not None:  # these rows crossed ranks: kept, never exchanged again
            flow.values[(mb, node.whole_layer)].update(rows=rows.detach(), row_probs=probs)
    else:
        flow.values[(mb, node)] = {"y": _run_experts(flow, mb, node, weights, rows, probs, routed)}


def _forward_combine(flow: _Flow, mb: int, node: Node, weights: dict):
    """Issue the all-to-all bringing the rows back; unpermute and the residual add run
    at the node's ``land`` action (``_land``)."""
    y = flow.take(flow.values, mb, node.sibling("experts"), f"forward {node}")["y"]
    attn = flow.values.pop((mb, node.sibling("attn")))
    routed = attn["routed"]
    if routed.exchange is not None:
        y = flow.send(from_experts(y, routed.exchange, flow.ep, routed.dispatch.capacity), node, mb)
    flow.values[(mb, node)] = {"y": y, "attn": attn}


FORWARD = {"embed": _forward_embed, "attn": _forward_attn, "dispatch": _forward_dispatch,
           "experts": _forward_experts, "combine": _forward_combine, "head": _forward_head}
"""Each node kind's forward: ``(flow, mb, node, weights) -> Attended | (objective, ce_sum) | None``."""


def _forward(state, a: Action, flow: _Flow):
    """Run one node's forward; returns ``(state, Attended | head result | None)``."""
    node = a.node
    weights = {} if a.unit is None else _weights(state, a.unit, node, flow, f"forward {node} (microbatch {a.mb})")
    return state, FORWARD[node.kind](flow, a.mb, node, weights)


def _run_experts(flow: _Flow, mb: int, node: Node, weights: dict, rows, probs, routed) -> torch.Tensor:
    """The experts' forward under autograd, its record kept for the backward."""
    plan = flow.plan
    deferred = DeferredWgrad() if flow.train and plan.delay_wgrad else None
    y = experts_node(weights, rows, probs, routed, plan, node.layer, deferred, mb, flow.kernels)
    wgrad = None if deferred is None else (deferred, {id(w): p for p, w in weights.items()})
    flow.save(mb, node, _Computed({"rows": rows, "row_probs": probs}, {"y": y}, weights, wgrad=wgrad))
    return y


def _land(state, a: Action, flow: _Flow):
    """A combine's landing: wait for its rows, unpermute, add the residual; the layer's
    output ``h`` is then the value the next node reads."""
    mb, node = a.mb, a.node
    sent = flow.take(flow.values, mb, node, f"land {node}")
    y, attn = flow.resolve(sent["y"]), sent["attn"]
    if flow.remat:
        if attn["routed"].exchange is not None:  # rows back across ranks: kept for the recompute
            flow.values[(mb, node.whole_layer)]["y"] = y.detach()
        h = _combine(flow, mb, node, y, attn, record=False).detach()
    else:
        h = _combine(flow, mb, node, y, attn)
    flow.values[(mb, node)] = {"h": h}
    return state


def _combine(flow: _Flow, mb: int, node: Node, y: torch.Tensor, attn: dict, record: bool = True) -> torch.Tensor:
    inputs = {"y": _leaf(y, flow.train)}
    inputs.update({name: _leaf(attn[name], flow.train) for name in ("h", "probs_TK", "shared")})
    routed = attn["routed"]
    probs = inputs["probs_TK"] if routed.row_probs_R1 is None else None
    h = combine_output(inputs["y"], inputs["h"], probs, inputs["shared"], routed)
    if record:
        flow.save(mb, node, _Computed(inputs, {"h": h}, {}))
    return h


def _recompute(state, a: Action, flow: _Flow):
    """``Plan.remat='full'``: re-run layer ``a.node``'s attn, experts and combine from
    what its forward kept, under autograd this time, leaving the records its backward
    actions read. The routing comes from the forward, and under expert parallelism so
    do the rows that crossed ranks: nothing is exchanged or read on the host again.
    Same inputs, same kernels: the same values as the forward, bit for bit."""
    plan, mb, layer = flow.plan, a.mb, a.node.layer
    what = f"recompute {a.node} (microbatch {mb})"
    kept = flow.take(flow.values, mb, a.node, what)
    routed = kept["routed"]
    attn, _, experts, combine = layer_nodes(layer)
    h = _leaf(kept["h"], True)
    weights = _weights(state, a.unit, attn, flow, what)
    res = attn_node(weights, h, plan, layer, flow.mesh.world.size, flow.ep, mb, flow.kernels, decided=routed,
                    docs=flow.docs_mb[mb])
    flow.save(mb, attn, _Computed({"h": h}, res.outputs, weights, res.objective, routed))
    crossed = routed.exchange is not None
    rows, probs = (kept["rows"], kept["row_probs"]) if crossed else (res.outputs["rows"], res.outputs["row_probs"])
    y = _run_experts(flow, mb, experts, _weights(state, a.unit, experts, flow, what), _leaf(rows, True),
                     _leaf(probs, True), routed)
    _combine(flow, mb, combine, kept["y"] if crossed else y.detach(), dict(res.outputs, routed=res.routed))
    return state


def _backward_dispatch(state, a: Action, flow: _Flow, got: dict, rec: _Computed | None):
    """Send the rows' gradients back to the ranks they came from (in flight until the
    attention's backward needs them)."""
    mb, node = a.mb, a.node
    routed = flow.routing(mb, node)
    if routed.exchange is not None:
        got = {name: None if g is None else flow.send(
                   from_experts(g, routed.exchange, flow.ep, routed.dispatch.capacity, "dispatch_grad"), node, mb)
               for name, g in got.items()}
    flow.grads_for(mb, node.sibling("attn")).update(got)
    return state


def _backward_h(state, a: Action, flow: _Flow, got: dict, rec: _Computed):
    """``head`` and ``attn``: the input's gradient to the node that produced ``h``."""
    flow.grads_for(a.mb, flow.previous[a.node])["h"] = got["h"]
    return state


def _backward_combine(state, a: Action, flow: _Flow, got: dict, rec: _Computed):
    """The rows' gradient to the experts (across ranks under EP), the rest to ``attn``."""
    mb, node = a.mb, a.node
    routed = flow.routing(mb, node)
    g_y = got.pop("y")
    if routed.exchange is not None and g_y is not None:
        g_y = flow.send(to_experts(g_y, routed.exchange, flow.ep, routed.dispatch.capacity, "combine_grad"),
                        node, mb)
    flow.grads_for(mb, node.sibling("experts"))["y"] = g_y
    flow.grads_for(mb, node.sibling("attn")).update(got)
    return state


def _backward_experts(state, a: Action, flow: _Flow, got: dict, rec: _Computed):
    """The rows' gradients to ``dispatch``; held-back weight GEMMs stay recorded
    (without the graph's tensors) for the ``wgrad`` action."""
    mb, node = a.mb, a.node
    flow.grads_for(mb, node.sibling("dispatch")).update(got)
    if rec.wgrad is not None:
        flow.records[(mb, node)] = _Computed({}, {}, {}, wgrad=rec.wgrad)
        if rec.wgrad[0].pending:
            state = lc.defer_wgrad(state, a.unit, mb)
    return state


BACKWARD = {"embed": lambda state, *_: state, "attn": _backward_h, "dispatch": _backward_dispatch,
            "experts": _backward_experts, "combine": _backward_combine, "head": _backward_h}
"""Each node kind's backward, given the gradients of its inputs (``got``) and its record
(None for ``dispatch``, which has no graph): where they go."""


def _backward(state, a: Action, flow: _Flow):
    """Run one node's backward: its recorded graph's gradients (weight gradients into
    the unit's buffer), then its kind sends those of its inputs to their producers (the
    all-to-all nodes across ranks, in flight until needed)."""
    mb, node = a.mb, a.node
    if a.unit is not None:
        lc.require_gathered(state, a.unit, f"backward {node} (microbatch {mb})")
    rec = None
    if node.kind == "dispatch":  # no graph of its own: its gradients only move
        got = flow.take(flow.grads, mb, node, f"backward {node}")
    else:
        rec = flow.take(flow.records, mb, node, f"backward {node}")
        grads_out = {name: flow.resolve(g) for name, g in flow.grads.pop((mb, node), {}).items()}
        got, weight_grads = _backprop(rec, grads_out)
        if weight_grads:
            state = lc.accumulate_grads(state, a.unit, weight_grads)
    return BACKWARD[node.kind](state, a, flow, got, rec)


def _wgrad(state, a: Action, flow: _Flow):
    """The delayed weight-gradient GEMMs of an ``experts`` node."""
    lc.require_gathered(state, a.unit, f"wgrad {a.node} (microbatch {a.mb})")
    deferred, paths = flow.take(flow.records, a.mb, a.node, f"wgrad {a.node}").wgrad
    state = lc.wgrad_done(state, a.unit, a.mb)
    return lc.accumulate_grads(state, a.unit, {paths[id(w)]: g for w, g in deferred.run()})


def _profiled(a: Action):
    """A ``torch.profiler`` range named after the action (its op, node or unit, microbatch),
    entered only while a profiler records: traces show the program, not bare kernels."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    mb = f" mb{a.mb}" if a.mb >= 0 else ""
    return torch.profiler.record_function(f"fmoe {a.op} {a.node or a.unit}{mb}")


def execute(program: list[Action], params_named: dict, batch: Batch, plan: Plan, mesh: Mesh,
            total_targets: int | torch.Tensor, slots: dict | None = None,
            kernels: Kernels | None = None) -> Executed:
    """Run ``program`` on this rank's params (``{path: leaf}``) and Batch (its rows;
    ``total_targets``: the global batch's counted targets, an int or a device scalar).

    ``slots`` come from ``check_program`` (double buffering), which ``step`` calls
    before its first collective; ``kernels`` are the functions the layer nodes call
    (None: compiled or eager as ``plan.compile`` says).
    """
    spec = shard_spec(plan)
    if slots is None:
        slots = check_program(plan, program)
    state = lc.start(plan, spec, mesh, lc.build_shards(params_named, spec, plan, mesh), max_live_units(plan), slots)
    flow = _Flow(plan, mesh, batch, total_targets, kernels_for(plan) if kernels is None else kernels)
    ce_sum = torch.zeros((), device=batch.tokens.device)
    objective = torch.zeros((), device=batch.tokens.device)
    stats: dict = {}
    for a in program:
        t0 = now()
        with _profiled(a):
            if a.op == "gather":
                state = lc.gather(state, a.unit)
            elif a.op == "wait":
                state = lc.wait(state, a.unit)
            elif a.op == "release":
                state = lc.release(state, a.unit)
            elif a.op == "reduce":
                state = lc.reduce_grads(state, a.unit, a.mb, last=a.mb == plan.microbatches - 1)
            elif a.op in ("forward", "land", "backward", "wgrad", "recompute"):
                if a.op == "forward":
                    state, res = _forward(state, a, flow)
                    if isinstance(res, Attended):
                        stats.setdefault(a.mb, []).append(res.stats)
                        if res.objective is not None:
                            objective += res.objective.detach()
                    elif res is not None:
                        objective += res[0]
                        ce_sum += res[1]
                elif a.op == "backward":
                    state = _backward(state, a, flow)
                elif a.op == "land":
                    state = _land(state, a, flow)
                elif a.op == "recompute":
                    state = _recompute(state, a, flow)
                else:
                    state = _wgrad(state, a, flow)
                split = [dataclasses.replace(e, node=str(a.node), mb=a.mb) for e in flow.ep_events]
                state = lc.record(state, *split, *flow.events, Event(a.op, a.unit, str(a.node), a.mb, t0, now()))
                flow.ep_events.clear()
                flow.events.clear()
            else:
                raise ValueError(f"unknown program op {a.op!r}")
    trained = any(a.op == "backward" for a in program)
    state = lc.finish(state, trained)
    grads = {}
    for u in spec.units if trained else ():
        for key, layout in u.groups.items():
            grads.update(local_leaves(state.units[u.name].grad_shard[key], layout,
                                      shard_rank(plan, mesh.world.rank, key[0]), spec.sharded(key[0])))
    per_mb = [stack_stats(stats[mb]) for mb in sorted(stats)]
    return Executed(ce_sum, objective, grads, per_mb, state)
