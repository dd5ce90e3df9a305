"""Run a program: thread the lifecycle state through its actions, matched by type.

A ``Transition`` moves a unit through the lifecycle (``fmoe.shard.lifecycle``); a node
run calls its kind's rule (``node_runs.RULES``) on the microbatch's record
(``flow.MicrobatchFlow``), first asking the lifecycle for the unit's gathered weights
(which raises unless the unit is gathered). So the executor, not a hook, decides when
weights are gathered, released and reduced.

The all-to-all nodes issue an exchange and return at once. A forward ``combine``'s
rows are waited for where the program lists its ``Land`` (right before the next node
of that microbatch reads them); the other exchanges where their result is first
needed (the next compute node of that microbatch, forward or backward). Whatever the
program runs in between, typically another microbatch's compute, overlaps the
exchange: on CUDA the collective runs on NCCL's stream, ordered against the compute
stream by events; on CPU on gloo's threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch

from ..batch import Batch
from ..comm.trace import Event, now
from ..layers.block_masks import documents
from ..layers.expert_parallel import ExpertParallel
from ..layers.model import stack_stats
from ..layers.moe import MoEStats
from ..layers.nodes import Kernels
from ..layers.parallel import with_parallel
from ..shard import lifecycle as lc
from ..shard.shards import Shards, build_shards
from ..shard.spec import local_leaves
from .adapters import AdapterRun, adapted
from .adapters import finish as finish_adapters
from .adapters import start as start_adapters
from .actions import Action, Backward, Forward, Gather, Land, Node, Recompute, Recv, Reduce, Release, Send, Wait, Wgrad
from .flow import LayerFlow, MicrobatchFlow, weight_leaf
from .node_runs import RULES, Run, land, recompute, wgrad
from .pipeline import Pipeline, recv, send


class Executed(NamedTuple):
    """What a program produced on this rank.

    Attributes:
        ce_sum: this rank's summed cross-entropy (fp32 scalar, detached).
        objective: this rank's share of the differentiated objective (detached).
        grads: ``{path: this rank's fp32 grad leaf}`` (empty without backward nodes); under
            ``Plan.lora`` ``{adapter leaf name: this rank's part of its gradient}``.
        stats: one MoEStats per microbatch, stacked over layers (in microbatch order).
        state: the final Lifecycle (its trace included).
    """

    ce_sum: torch.Tensor
    objective: torch.Tensor
    grads: dict
    stats: list
    state: lc.Lifecycle


def _weights(state, run: Run, unit: str, node: Node, what: str) -> dict:
    """Leaves viewing the gathered weights ``node`` computes with (raises unless gathered);
    under ``Plan.lora`` frozen, the adapted ones as ``Adapted``s."""
    views = lc.require_gathered(state, unit, what)
    if run.adapters is None:
        return {p: weight_leaf(v, run.train) for p, v in views.items() if node.uses(run.table[p], run.tie)}
    return adapted(run.adapters, {p: weight_leaf(v, False) for p, v in views.items()
                                  if node.uses(run.table[p], run.tie)})


def _profiled(a: Action):
    """A ``torch.profiler`` range named after the action (its op, node or unit, microbatch),
    entered only while a profiler records: traces show the program, not bare kernels."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    node = getattr(a, "node", None)
    mb = getattr(a, "mb", -1)
    return torch.profiler.record_function(f"fmoe {a.op} {node or a.unit}{f' mb{mb}' if mb >= 0 else ''}")


def _run_node(state, a: Action, run: Run):
    """One node run (forward, land, backward, wgrad or recompute) of microbatch ``a.mb``."""
    what = f"{a.op} {a.node} (microbatch {a.mb})"
    match a:
        case Forward(node, mb, unit):
            weights = {} if unit is None else _weights(state, run, unit, node, what)
            RULES[node.kind].forward(run, mb, node, weights)
        case Land(node, mb):
            land(run, mb, node)
        case Backward(node, mb, unit):
            if unit is not None:
                state = lc.gradients(state, unit, mb, what)
            state = RULES[node.kind].backward(run, state, node, mb, unit)
        case Wgrad(node, mb, unit):
            state = wgrad(run, state, node, mb, unit)
        case Recompute(node, mb, unit):
            recompute(run, state, node, mb, unit, lambda n: _weights(state, run, unit, n, what))
    return state


def _step(state, a: Action, run: Run):
    """Interpret one action."""
    match a:
        case Gather(unit):
            return lc.gather(state, unit)
        case Wait(unit):
            return lc.wait(state, unit)
        case Release(unit):
            return lc.release(state, unit)
        case Reduce(unit, mb, last):
            return lc.reduce_grads(state, unit, mb, last)
        case Send():
            return lc.record(state, send(run, a))
        case Recv():
            return lc.record(state, recv(run, a))
        case Forward() | Land() | Backward() | Wgrad() | Recompute():
            t0 = now()
            state = _run_node(state, a, run)
            split = [dataclasses.replace(e, node=str(a.node), mb=a.mb) for e in run.node_events]
            state = lc.record(state, *split, *run.events, Event(a.op, a.unit, str(a.node), a.mb, t0, now()))
            run.node_events.clear()
            run.events.clear()
            return state
    raise TypeError(f"not a program action: {a!r}")


def _start_run(setup, batch: Batch, divisor, kernels: Kernels, train: bool, adapters: AdapterRun | None) -> Run:
    how, mesh = setup.execution, setup.mesh
    node_events: list = []
    ep = ExpertParallel(mesh.ep, setup.spec.experts_per_rank, node_events, tokens=how.tokens_cross_once) \
        if how.expert_parallel else None
    cfg = how.model
    mbs = [MicrobatchFlow(b, None if b.documents is None else documents(b.documents, cfg.any_window),
                          [LayerFlow() for _ in range(cfg.layers)])
           for b in batch.microbatches(how.microbatches)]
    zero = torch.zeros((), device=batch.tokens.device)
    parallel = setup.parallel.recording(node_events) if how.records_collectives else setup.parallel
    pipeline = None if setup.peers is None else \
        Pipeline(*setup.peers, how.stream_dtype, how.stream_tp, mesh.pp_gradients)
    return Run(table=setup.table, kernels=with_parallel(kernels, parallel), ep=ep, cfg=cfg, tie=cfg.tie_embeddings,
               chunk=how.loss_chunk,
               # router losses are averaged over the ranks that see different tokens: one stage's
               router_parts=how.microbatches * mesh.stage.size, delay_wgrad=how.delay_wgrad, train=train,
               remat=train and how.remat_layers, divisor=divisor, reports_loss=mesh.tp.rank == 0, mbs=mbs,
               events=[], node_events=node_events, ce_sum=zero, objective=zero.clone(), stats={},
               pipeline=pipeline, adapters=adapters)


def execute(setup, params_named: dict | None, batch: Batch, divisor, program=None, kernels: Kernels | None = None,
            adapters: dict | None = None, shards: Shards | None = None) -> Executed:
    """Run a program of ``setup`` (``fmoe.resolve.Setup``) on this rank's params
    (``{path: leaf}``) and Batch (its rows).

    Arguments:
        divisor: the global batch's counted targets (an int or a device scalar).
        program: a ``fmoe.resolve.Program``; default the training one when autograd is
            on, else the forward-only one.
        kernels: the functions inside the nodes; default ``setup.kernels``.
        adapters: under ``Plan.lora``, the adapters (``{leaf name: tensor}``, whole):
            ``params_named`` are then frozen and the grads are the adapters' (this rank's part).
        shards: the params already laid out as the step's shards (a frozen base's,
            ``fmoe.lora.freeze``), read in place of ``params_named``.
    """
    train = torch.is_grad_enabled()
    program = setup.program(train) if program is None else program
    spec, mesh, how = setup.spec, setup.mesh, setup.execution
    shards = build_shards(params_named, spec, setup.units, mesh, how.device) if shards is None else shards
    state = lc.start(spec, mesh, shards, program.max_live, program.slots, how.device, how.allocates_each_gather,
                     how.microbatches, frozen=adapters is not None)
    lora = None if adapters is None else start_adapters(adapters, how.adapted, spec, mesh.world.rank, train)
    run = _start_run(setup, batch, divisor, setup.kernels if kernels is None else kernels, train, lora)
    for a in program.actions:
        with _profiled(a):
            state = _step(state, a, run)
    if run.pipeline is not None:
        run.pipeline.finish()
    state = lc.finish(state, program.trains)
    if lora is not None:
        grads = finish_adapters(lora) if program.trains else {}
        return Executed(run.ce_sum, run.objective, grads, _layer_stats(run, how), state)
    grads = {}
    for u in setup.units if program.trains else ():
        for key, layout in u.groups.items():
            grads.update(local_leaves(state.units[u.name].grad_shard[key], layout,
                                      spec.shard_rank(mesh.world.rank, key.domain), spec.sharded(key.domain)))
    return Executed(run.ce_sum, run.objective, grads, _layer_stats(run, how), state)


def _layer_stats(run: Run, how) -> list:
    """One MoEStats per microbatch stacked over every MoE layer of the model, in order;
    the layers another pipeline stage runs count nothing here (zeros), so every rank's
    sums have one shape."""
    moe_layers, E = how.model.moe_layers, how.model.experts
    device = run.ce_sum.device
    out = []
    for mb in range(how.microbatches):
        ran = run.stats.get(mb, {})
        out.append(stack_stats([ran[i] if i in ran else _no_stats(E, device) for i in moe_layers]))
    return out


def _no_stats(experts: int, device) -> MoEStats:
    zero = torch.zeros((), dtype=torch.long, device=device)
    return MoEStats(torch.zeros(experts, dtype=torch.long, device=device), torch.zeros((), device=device),
                    torch.zeros((), device=device), zero, zero, zero)
