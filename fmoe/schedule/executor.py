"""Run a program: thread the lifecycle state through gathers, nodes and reductions.

Each node runs under plain autograd on its own: its input is a detached boundary
tensor and its weights are leaves viewing the unit's gathered buffer. Its backward
is ``torch.autograd.grad`` from the saved outputs, so the executor, not a hook,
decides when weights are gathered, released and reduced, and every backward node
first asks the lifecycle for its unit (which raises if the unit is not gathered).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..config import Plan
from ..layers.model import stack_stats
from ..shard import lifecycle as lc
from ..shard.mesh import Mesh
from ..shard.spec import local_leaves, shard_rank, shard_spec
from ..shard.trace import Event, now
from ..shard.units import member_of, members
from .nodes import run_node
from .program import Action, double_buffer_slots, max_live_units


class Executed(NamedTuple):
    """What a program produced on this rank.

    Attributes:
        ce_sum: this rank's summed cross-entropy (fp32 scalar, detached).
        objective: this rank's share of the differentiated objective (detached).
        grads: ``{path: this rank's fp32 grad leaf}`` (empty without backward nodes).
        stats: per-microbatch MoEStats stacked over layers (None for layerless runs).
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


class _Activations:
    """What flows between nodes of one step: outputs waiting for the next node's
    forward, saved forwards waiting for their backward, and gradients flowing back."""

    def __init__(self, order):
        self.previous = {n: order[i - 1] for i, n in enumerate(order) if i}
        self.outputs, self.saved, self.grad_in = {}, {}, {}


def _forward(state, a: Action, acts: _Activations, tokens_mb, plan: Plan, total_targets: int, mesh: Mesh):
    t0 = now()
    views = lc.require_gathered(state, a.unit, f"forward {a.node} (microbatch {a.mb})")
    train = torch.is_grad_enabled()
    weights = {p: v.detach().requires_grad_(train) for p, v in views.items() if member_of(p) == a.node}
    x = acts.outputs.pop((a.mb, acts.previous[a.node])) if a.node in acts.previous else None
    x_in = x.detach().requires_grad_(train) if x is not None else None
    events: list = []
    res = run_node(a.node, weights, x_in, tokens_mb, plan, total_targets, mesh, events)
    state = lc.record(state, *(dataclasses.replace(e, node=a.node, mb=a.mb) for e in events))
    if res.output is not None:
        acts.outputs[(a.mb, a.node)] = res.output
    if train:
        acts.saved[(a.mb, a.node)] = (x_in, res, weights)
    return lc.record(state, Event("forward", a.unit, a.node, a.mb, t0, now())), res


def _backward(state, a: Action, acts: _Activations):
    t0 = now()
    lc.require_gathered(state, a.unit, f"backward {a.node} (microbatch {a.mb})")
    x_in, res, weights = acts.saved.pop((a.mb, a.node))
    outs, grads_out = [], []
    if res.output is not None:
        outs.append(res.output)
        grads_out.append(acts.grad_in.pop((a.mb, a.node)))
    if res.objective is not None:
        outs.append(res.objective)
        grads_out.append(None)
    inputs = ([x_in] if x_in is not None else []) + list(weights.values())
    got = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
    if x_in is not None:
        acts.grad_in[(a.mb, acts.previous[a.node])] = got[0]
        got = got[1:]
    state = lc.accumulate_grads(state, a.unit, dict(zip(weights, got)))
    return lc.record(state, Event("backward", a.unit, a.node, a.mb, t0, now()))


def execute(program: list[Action], params_named: dict, tokens: torch.Tensor, plan: Plan, mesh: Mesh,
            total_targets: int, slots: dict | None = None) -> Executed:
    """Run ``program`` on this rank's params (``{path: leaf}``) and batch slice ``tokens``.

    ``slots`` come from ``check_program`` (double buffering), which ``step`` calls
    before its first collective.
    """
    spec = shard_spec(plan)
    if slots is None:
        slots = check_program(plan, program)
    state = lc.start(plan, spec, mesh, lc.build_shards(params_named, spec, plan, mesh), max_live_units(plan), slots)
    order = members(plan.model)
    acts = _Activations(order)
    tokens_mb = tokens.chunk(plan.microbatches)
    ce_sum = torch.zeros((), device=tokens.device)
    objective = torch.zeros((), device=tokens.device)
    stats: dict = {}
    for a in program:
        if a.op == "gather":
            state = lc.gather(state, a.unit)
        elif a.op == "wait":
            state = lc.wait(state, a.unit)
        elif a.op == "release":
            state = lc.release(state, a.unit)
        elif a.op == "reduce":
            state = lc.reduce_grads(state, a.unit, a.mb, last=a.mb == plan.microbatches - 1)
        elif a.op == "forward":
            state, res = _forward(state, a, acts, tokens_mb[a.mb], plan, total_targets, mesh)
            if res.ce_sum is not None:
                ce_sum += res.ce_sum
            if res.objective is not None:
                objective += res.objective.detach()
            if res.stats is not None:
                stats.setdefault(a.mb, {})[a.node] = res.stats
        elif a.op == "backward":
            state = _backward(state, a, acts)
        else:
            raise ValueError(f"unknown program op {a.op!r}")
    trained = any(a.op == "backward" for a in program)
    state = lc.finish(state, trained)
    grads = {}
    for u in spec.units if trained else ():
        for key, layout in u.groups.items():
            grads.update(local_leaves(state.units[u.name].grad_shard[key], layout,
                                      shard_rank(plan, mesh.world.rank, key[0]), spec.sharded(key[0])))
    per_mb = [stack_stats([stats[mb][n] for n in order if n in stats[mb]]) for mb in sorted(stats)]
    return Executed(ce_sum, objective, grads, per_mb, state)
