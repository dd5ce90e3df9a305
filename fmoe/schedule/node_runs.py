"""How the executor runs each node kind: ``RULES``, one ``NodeRule`` per Kind of
``fmoe.layers.nodes.NODES``, its forward and its backward over a microbatch's
``MicrobatchFlow``.

Each compute node runs the pure function of ``fmoe.layers.nodes`` under plain autograd
on its own: its inputs are detached leaves and its weights are leaves viewing the
unit's gathered buffer; its backward is ``torch.autograd.grad`` from its ``Tape``,
weight gradients go into the unit's buffer and input gradients to the node that
produced those inputs. The exchange nodes issue an all-to-all and return at once;
their rows (forward) or gradients (backward) are waited for where first needed.
``Land`` (a ``combine``'s rows are back) and ``Recompute`` (``Plan.remat='full'``)
are here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..layers.expert_parallel import ExpertParallel, Transfer, from_experts, to_experts
from ..layers.experts import DeferredWgrad
from ..layers.moe import Routed
from ..layers.nodes import (NODES, Attended, Kernels, Kind, Landing, NodeSpec, Sent, attn_node, combine_node,
                            dense_node, dispatch_node, embed_node, experts_node, land_node)
from ..layers.router import router_share
from ..params import ParamTable
from ..shard import lifecycle as lc
from .actions import Node
from .adapters import AdapterRun, add_grads
from .flow import Kept, LayerFlow, MicrobatchFlow, Stream, Tape, detached, leaf, leaves, take, take_tape


@dataclass
class Run:
    """One program run's context: what the node runs read (fixed for the step) and
    what they add up.

    Attributes:
        table, kernels, ep: the plan's ParamTable, Kernels and ExpertParallel (None
            without expert parallelism).
        cfg, tie, chunk, router_parts, delay_wgrad: the model config, tied embeddings,
            ``Plan.loss_chunk``, the count the router losses are averaged over
            (microbatches x ranks), ``Plan.delay_wgrad``.
        train: autograd is on; ``remat``: ``Plan.remat='full'`` and training.
        divisor: the global batch's counted targets (an int or a device scalar).
        reports_loss: this rank adds its cross-entropy into ``ce_sum`` and ``objective``
            (under tensor parallelism every rank of a ``tp`` group computes the same
            loss and only the first reports it, so sums over ranks count it once).
        mbs: a MicrobatchFlow per microbatch.
        events: exchanges that landed, for the trace; ``node_events``: what a node's kernels
            recorded (exchange plans; tp, cp and etp collectives), tagged with the node after it.
        ce_sum, objective: this rank's sums so far; ``stats``: ``{mb: {layer: MoEStats}}``.
        pipeline: the stage's neighbours and sends in flight (None without pipeline
            parallelism).
        adapters: under ``Plan.lora`` the step's adapter pieces and their gradients
            (``AdapterRun``), None otherwise.
    """

    table: ParamTable
    kernels: Kernels
    ep: ExpertParallel | None
    cfg: object
    tie: bool
    chunk: int
    router_parts: int
    delay_wgrad: bool
    train: bool
    remat: bool
    divisor: object
    reports_loss: bool
    mbs: list[MicrobatchFlow]
    events: list
    node_events: list
    ce_sum: torch.Tensor
    objective: torch.Tensor
    stats: dict
    pipeline: object = None
    adapters: AdapterRun | None = None

    def send(self, transfer: Transfer, node: Node, mb: int) -> Transfer:
        """Tag an exchange just issued by ``node`` for the trace."""
        transfer.node, transfer.mb = str(node), mb
        return transfer

    def landed(self, value):
        """A value or gradient, waiting for it if it is in flight."""
        if isinstance(value, Transfer):
            first = value.landed is None
            out = value.wait()
            if first:
                self.events.append(value.event())
            return out
        return value

    def save(self, tapes: dict, kind: Kind, tape: Tape) -> None:
        if self.train:
            tapes[kind] = tape

    def layer_tree(self, weights: dict) -> dict:
        """One layer's ``{path: tensor}`` as its nested subtree (``{"attn": {"qkv": t}, ...}``)."""
        out: dict = {}
        for path, value in weights.items():
            *outer, name = self.table[path].keys[2:]  # past ("layers", i)
            d = out
            for k in outer:
                d = d.setdefault(k, {})
            d[name] = value
        return out


class NodeRule(NamedTuple):
    """A node kind as the executor runs it: its spec, ``forward(run, mb, node, weights)``
    and ``backward(run, state, node, mb, unit) -> state``."""

    spec: NodeSpec
    forward: Callable
    backward: Callable


def _take_stream(run: Run, mb: int, node: Node) -> torch.Tensor:
    """The residual stream ``node`` reads, as a leaf of its own graph."""
    stream = take(run.mbs[mb], "stream", f"forward {node} (microbatch {mb})")
    if stream.h is None:
        raise lc.LifecycleError(f"forward {node} (microbatch {mb}): {stream.producer} has not landed; "
                                "the program needs a land action before it")
    return leaf(stream.h, run.train)


def _backprop(run: Run, state, unit: str | None, tape: Tape, grads_out: dict):
    """``tape``'s input gradients; its weight gradients are added into ``unit``'s buffer
    (under ``Plan.lora`` its adapter pieces' into the step's sums)."""
    got, weight_grads = tape.backprop({name: run.landed(g) for name, g in grads_out.items()})
    if run.adapters is not None:
        add_grads(run.adapters, weight_grads)
    elif weight_grads:
        state = lc.accumulate_grads(state, unit, weight_grads)
    return state, got


def _take_grad_h(mbf: MicrobatchFlow) -> dict:
    grad, mbf.grad_h = mbf.grad_h, None
    return {} if grad is None else {"h": grad}


def _embed_forward(run: Run, mb: int, node: Node, weights: dict):
    mbf = run.mbs[mb]
    h = embed_node(weights, mbf.batch.inputs, run.kernels, mb)
    mbf.stream = Stream(node, h)
    run.save(mbf.tapes, Kind.EMBED, Tape({}, {"h": h}, weights))


def _embed_backward(run: Run, state, node: Node, mb: int, unit: str):
    mbf = run.mbs[mb]
    tape = take_tape(mbf.tapes, Kind.EMBED, f"backward {node} (microbatch {mb})")
    state, _ = _backprop(run, state, unit, tape, _take_grad_h(mbf))
    return state


def _attend(run: Run, mb: int, node: Node, weights: dict, h: torch.Tensor, decided: Routed | None = None):
    """``attn_node`` on the stream ``h``, and its router losses' share of the objective.

    Returns:
        ``(Attended, Routed, MoEStats, objective or None)``.
    """
    attended, routed, stats = attn_node(run.layer_tree(weights), h, run.cfg, (node.layer, mb), run.kernels,
                                        run.ep, run.mbs[mb].docs, decided)
    return attended, routed, stats, router_share(stats.aux_loss, stats.z_loss, run.cfg, run.router_parts)


def _attn_tape(h: torch.Tensor, attended: Attended, weights: dict, objective, routed: Routed) -> Tape:
    return Tape({"h": h}, attended._asdict(), weights, objective, routed)


def _attn_forward(run: Run, mb: int, node: Node, weights: dict):
    layer = run.mbs[mb].layers[node.layer]
    h = _take_stream(run, mb, node)
    attended, routed, stats, objective = _attend(run, mb, node, weights, h)
    if run.remat:  # kept: the input and the routing; the rows go on as an output and a recompute makes them again
        attended, routed, stats, objective = detached((attended, routed, stats, objective))
        layer.kept = Kept(h.detach(), routed._replace(rows_RD=None))
    else:
        run.save(layer.tapes, Kind.ATTN, _attn_tape(h, attended, weights, objective, routed))
    layer.attended, layer.routed = attended, routed
    run.stats.setdefault(mb, {})[node.layer] = stats
    if objective is not None:
        run.objective += objective.detach()


def _attn_backward(run: Run, state, node: Node, mb: int, unit: str):
    mbf = run.mbs[mb]
    layer = mbf.layers[node.layer]
    tape = take_tape(layer.tapes, Kind.ATTN, f"backward {node} (microbatch {mb})")
    state, got = _backprop(run, state, unit, tape, layer.grads.pop(Kind.ATTN, {}))
    mbf.grad_h = got["h"]
    return state


def _sending(run: Run, node: Node, mb: int, way: Callable) -> Callable:
    """``way`` (``to_experts`` or ``from_experts``) as a node function's ``send``: the
    Transfer is left in flight, tagged with ``node`` for the trace."""
    return lambda *args: run.send(way(*args), node, mb)


def _dispatch_forward(run: Run, mb: int, node: Node, weights: dict):
    """Issue the all-to-all of the rows (and their probabilities) to their experts' ranks."""
    layer = run.mbs[mb].layers[node.layer]
    layer.sent = dispatch_node(layer.attended, layer.routed, run.ep, _sending(run, node, mb, to_experts))


def _routing(run: Run, mb: int, node: Node):
    """The routing of ``node``'s layer, from its ``attn`` Tape (kept until the ``attn``
    backward, the layer's last)."""
    tape = run.mbs[mb].layers[node.layer].tapes.get(Kind.ATTN)
    if tape is None:
        raise lc.LifecycleError(f"backward {node} (microbatch {mb}): its layer's attn has no record; "
                                "the program runs nodes out of order")
    return tape.routed


def _dispatch_backward(run: Run, state, node: Node, mb: int, unit: None):
    """Send the rows' gradients back to the ranks they came from (in flight until the
    attention's backward needs them)."""
    layer = run.mbs[mb].layers[node.layer]
    if Kind.DISPATCH not in layer.grads:
        raise lc.LifecycleError(f"backward {node} (microbatch {mb}): the experts' backward has not run; "
                                "the program runs nodes out of order")
    got = layer.grads.pop(Kind.DISPATCH)
    routed = _routing(run, mb, node)
    if routed.exchange.crosses:
        cap = routed.dispatch.capacity
        got = {name: None if g is None else run.send(
                   from_experts(g, routed.exchange, run.ep, cap, "dispatch_grad"), node, mb)
               for name, g in got.items()}
    layer.grads_for(Kind.ATTN).update(got)
    return state


def run_experts(run: Run, mb: int, node: Node, weights: dict, sent: Sent, routed: Routed) -> torch.Tensor:
    """The experts' forward under autograd (``sent``: landed leaves), its Tape kept for the backward."""
    deferred = DeferredWgrad() if run.train and run.delay_wgrad else None
    p = run.layer_tree(weights)["moe"]
    y = experts_node(p, sent, routed, run.cfg, (node.layer, mb), run.kernels, deferred)
    wgrad = None if deferred is None else (deferred, {id(w): path for path, w in weights.items()})
    run.save(run.mbs[mb].layers[node.layer].tapes, Kind.EXPERTS, Tape(sent._asdict(), {"y": y}, weights, wgrad=wgrad))
    return y


def _experts_forward(run: Run, mb: int, node: Node, weights: dict):
    layer = run.mbs[mb].layers[node.layer]
    sent = take(layer, "sent", f"forward {node} (microbatch {mb})")
    routed = layer.routed
    sent = leaves(Sent(*map(run.landed, sent)), run.train)
    if run.remat:
        p = run.layer_tree(weights)["moe"]
        layer.y = experts_node(p, sent, routed, run.cfg, (node.layer, mb), run.kernels).detach()
        if routed.exchange.crosses:  # these rows crossed ranks: kept, never exchanged again
            layer.kept.sent = detached(sent)
    else:
        layer.y = run_experts(run, mb, node, weights, sent, routed)


def _experts_backward(run: Run, state, node: Node, mb: int, unit: str):
    """The rows' gradients to ``dispatch``; held-back weight GEMMs stay recorded
    (without the graph's tensors) for the ``Wgrad`` action."""
    layer = run.mbs[mb].layers[node.layer]
    tape = take_tape(layer.tapes, Kind.EXPERTS, f"backward {node} (microbatch {mb})")
    state, got = _backprop(run, state, unit, tape, layer.grads.pop(Kind.EXPERTS, {}))
    layer.grads_for(Kind.DISPATCH).update(got)
    if tape.wgrad is not None:
        layer.tapes[Kind.EXPERTS] = Tape({}, {}, {}, wgrad=tape.wgrad)
        if tape.wgrad[0].pending:
            state = lc.defer_wgrad(state, unit, mb)
    return state


def wgrad(run: Run, state, node: Node, mb: int, unit: str):
    """The delayed weight-gradient GEMMs of an ``experts`` node."""
    what = f"wgrad {node} (microbatch {mb})"
    state = lc.gradients(state, unit, mb, what)
    deferred, paths = take_tape(run.mbs[mb].layers[node.layer].tapes, Kind.EXPERTS, what).wgrad
    state = lc.wgrad_done(state, unit, mb)
    return lc.accumulate_grads(state, unit, {paths[id(w)]: g for w, g in deferred.run()})


def _combine_forward(run: Run, mb: int, node: Node, weights: dict):
    """Issue the all-to-all bringing the rows back; unpermute and the residual add run
    at the node's ``Land`` (``land``)."""
    mbf = run.mbs[mb]
    layer = mbf.layers[node.layer]
    y = take(layer, "y", f"forward {node} (microbatch {mb})")
    attended = take(layer, "attended", f"forward {node} (microbatch {mb})")
    layer.landing = combine_node(y, attended, layer.routed, run.ep, _sending(run, node, mb, from_experts))
    # the Land needs the routing, not the rows sent: freed here, as attn's outputs are
    layer.routed = layer.routed._replace(rows_RD=None)
    mbf.stream = Stream(node, None)


def land(run: Run, mb: int, node: Node) -> None:
    """A combine's landing: wait for its rows, unpermute, add the residual; the layer's
    output ``h`` is then the stream the next node reads."""
    mbf = run.mbs[mb]
    layer = mbf.layers[node.layer]
    landing = take(layer, "landing", f"land {node} (microbatch {mb})")
    routed = take(layer, "routed", f"land {node} (microbatch {mb})")
    landing = landing._replace(y=run.landed(landing.y))
    if run.remat:
        if routed.exchange.crosses:  # rows back across ranks: kept for the recompute
            layer.kept.y = landing.y.detach()
        h = _land(run, layer, landing, routed, record=False).detach()
    else:
        h = _land(run, layer, landing, routed)
    mbf.stream = Stream(node, h)


def _land(run: Run, layer: LayerFlow, landing: Landing, routed: Routed, record: bool = True) -> torch.Tensor:
    """``land_node`` on leaves of ``landing``, its Tape kept when ``record``."""
    inputs = leaves(landing, run.train)
    h = land_node(inputs, routed)
    if record:
        run.save(layer.tapes, Kind.COMBINE, Tape(inputs._asdict(), {"h": h}, {}))
    return h


def _combine_backward(run: Run, state, node: Node, mb: int, unit: None):
    """The rows' gradient to the experts (across ranks under EP), the rest to ``attn``."""
    mbf = run.mbs[mb]
    layer = mbf.layers[node.layer]
    tape = take_tape(layer.tapes, Kind.COMBINE, f"backward {node} (microbatch {mb})")
    state, got = _backprop(run, state, unit, tape, _take_grad_h(mbf))
    routed = _routing(run, mb, node)
    g_y = got.pop("y")
    if routed.exchange.crosses and g_y is not None:
        g_y = run.send(to_experts(g_y, routed.exchange, run.ep, routed.dispatch.capacity, "combine_grad"), node, mb)
    layer.grads_for(Kind.EXPERTS)["y"] = g_y
    layer.grads_for(Kind.ATTN).update(got)
    return state


def _dense_forward(run: Run, mb: int, node: Node, weights: dict):
    mbf = run.mbs[mb]
    h = _take_stream(run, mb, node)
    out = dense_node(run.layer_tree(weights), h, run.cfg, (node.layer, mb), run.kernels, mbf.docs)
    layer = mbf.layers[node.layer]
    if run.remat:  # kept: the input; the recompute makes the rest again
        layer.kept, out = Kept(h.detach(), None), out.detach()
    else:
        run.save(layer.tapes, Kind.DENSE, Tape({"h": h}, {"h": out}, weights))
    mbf.stream = Stream(node, out)


def _dense_backward(run: Run, state, node: Node, mb: int, unit: str):
    mbf = run.mbs[mb]
    tape = take_tape(mbf.layers[node.layer].tapes, Kind.DENSE, f"backward {node} (microbatch {mb})")
    state, got = _backprop(run, state, unit, tape, _take_grad_h(mbf))
    mbf.grad_h = got["h"]
    return state


def _recompute_dense(run: Run, node: Node, mb: int, kept: Kept, weights: Callable) -> None:
    dense = node.sibling(Kind.DENSE)
    w, h = weights(dense), leaf(kept.h, True)
    out = dense_node(run.layer_tree(w), h, run.cfg, (node.layer, mb), run.kernels, run.mbs[mb].docs)
    run.save(run.mbs[mb].layers[node.layer].tapes, Kind.DENSE, Tape({"h": h}, {"h": out}, w))


def _replay(kept) -> Callable:
    """A node function's ``send`` that hands back, in order, what crossed ranks in the
    forward (``kept``), so a recompute exchanges nothing again."""
    values = iter(kept or ())
    return lambda *args: next(values)


def recompute(run: Run, state, node: Node, mb: int, unit: str, weights: Callable):
    """``Plan.remat='full'``: re-run layer ``node``'s attn, experts and combine (a dense
    layer: its ``dense`` node) from what its forward kept, under autograd this time, leaving the Tapes its backward actions
    read. The routing comes from the forward, and under expert parallelism so do the
    rows that crossed ranks: nothing is exchanged or read on the host again. Same
    inputs, same kernels: the same values as the forward, bit for bit.
    ``weights(node)``: the leaves a node of the layer computes with."""
    layer = run.mbs[mb].layers[node.layer]
    kept = take(layer, "kept", f"recompute {node} (microbatch {mb})")
    if run.cfg.is_dense(node.layer):
        return _recompute_dense(run, node, mb, kept, weights)
    attn, experts = node.sibling(Kind.ATTN), node.sibling(Kind.EXPERTS)
    h, attn_weights = leaf(kept.h, True), weights(attn)
    attended, routed, _, objective = _attend(run, mb, attn, attn_weights, h, decided=kept.routed)
    run.save(layer.tapes, Kind.ATTN, _attn_tape(h, attended, attn_weights, objective, kept.routed))
    sent = dispatch_node(attended, routed, run.ep, _replay(kept.sent))
    y = run_experts(run, mb, experts, weights(experts), leaves(sent, True), routed)
    _land(run, layer, combine_node(y, attended, routed, run.ep, _replay([kept.y])), routed)


def _head_forward(run: Run, mb: int, node: Node, weights: dict):
    mbf = run.mbs[mb]
    h = _take_stream(run, mb, node)
    ce_sum = run.kernels.head(("head", mb), weights, h, mbf.batch.targets, run.cfg.norm_eps, run.chunk)
    objective = ce_sum / run.divisor
    run.save(mbf.tapes, Kind.HEAD, Tape({"h": h}, {}, weights, objective))
    if run.reports_loss:
        run.objective += objective.detach()
        run.ce_sum += ce_sum.detach()


def _head_backward(run: Run, state, node: Node, mb: int, unit: str):
    mbf = run.mbs[mb]
    tape = take_tape(mbf.tapes, Kind.HEAD, f"backward {node} (microbatch {mb})")
    state, got = _backprop(run, state, unit, tape, {})
    mbf.grad_h = got["h"]
    return state


RULES = {rule.spec.kind: rule for rule in (
    NodeRule(NODES[Kind.EMBED], _embed_forward, _embed_backward),
    NodeRule(NODES[Kind.ATTN], _attn_forward, _attn_backward),
    NodeRule(NODES[Kind.DISPATCH], _dispatch_forward, _dispatch_backward),
    NodeRule(NODES[Kind.EXPERTS], _experts_forward, _experts_backward),
    NodeRule(NODES[Kind.COMBINE], _combine_forward, _combine_backward),
    NodeRule(NODES[Kind.DENSE], _dense_forward, _dense_backward),
    NodeRule(NODES[Kind.HEAD], _head_forward, _head_backward),
)}
"""Each node kind's forward and backward, by Kind."""
