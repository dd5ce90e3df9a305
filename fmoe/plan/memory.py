"""What one rank of each pipeline stage holds at its peak, estimated from the plan: the
fp32 parameters and gradients and the AdamW moments (fp32 or bf16) at rest (its shards and
slices), the step's compute-dtype copy of them, the gathered units at their most and the
fp32 gradient buffers accumulating before their reduction (both walked through the stage's program),
and the activations each microbatch in flight keeps (by ``Plan.remat``; a layer's, from
its first forward of the microbatch to its last backward).

An estimate from shapes: the activations count each layer's kept tensors per token
(``_layer_activations``), not the allocator's rounding or the kernels' workspaces.
"""

from __future__ import annotations

import functools
from collections import Counter

from ..config import Plan
from ..config_fields import Remat
from ..layers.nodes import Kind
from ..optim.transforms import check_moments
from ..resolve import resolve_stage, stage_program
from ..schedule.actions import Backward, Forward, Gather, Reduce, Release, Wgrad
from ..schedule.program import with_live_units
from .simulate import _rank_elements, _sizes, busiest_share

PARTS = ("params", "grads", "optimizer", "step copy", "gathered", "grad buffers", "activations")


def _layer_activations(cfg, layer: int, held: float, seen: float, tp: int, remat: Remat, ep: int,
                       share: float = 1.0) -> float:
    """Elements one microbatch keeps for layer ``layer``'s backward (``held``: the
    positions of the rank's stream, ``seen``: those its attention computes on; ``share``:
    the rank's routed rows over an even share, ``busiest_share``)."""
    D, K = cfg.dim, cfg.topk
    if remat.whole_layers:  # its input, and under expert parallelism the rows that crossed, both ways
        return held * D + (2 * held * K * D * share if ep > 1 and not cfg.is_dense(layer) else 0)
    attention = seen * (2 * cfg.q_width + 2 * cfg.kv_width) / tp + seen * D  # q, k, v, output; the input
    kept = not remat.selected_kernels  # what selective recomputation runs again instead
    if kept:
        attention += 3 * held * D  # the norms' inputs and outputs, the residual
    if cfg.is_dense(layer):
        hidden = cfg.fc1_width(cfg.dense_ffn) + (cfg.dense_ffn if kept else 0)
        return attention + seen * hidden / tp + seen * D
    F = cfg.ffn
    experts = held * K * share * (2 * D + cfg.fc1_width(F) + (F if kept else 0))
    shared = seen * (cfg.fc1_width(cfg.shared_ffn) + cfg.shared_ffn) / tp if cfg.shared_ffn else 0
    router = held * cfg.experts * 2  # fp32 logits: two compute-dtype elements' worth each
    return attention + experts + shared + router


def _walk(plan: Plan, spec, stage: int, units: dict, kept) -> tuple[float, float, float]:
    """Through the stage's training program: the most bytes of gathered units, of fp32
    gradient buffers, and of activations kept for backwards (``kept(node)``: what one
    microbatch keeps for the node's member), at any one time. A member's activations of a
    microbatch are held from its first forward to its last backward."""
    @functools.cache
    def full(unit, fp32: bool) -> float:
        return sum(layout.full_size * (4 if fp32 else spec.dtype(key).itemsize)
                   for key, layout in units[unit].groups.items() if fp32 or spec.sharded(key.domain))

    program = stage_program(plan, stage, True).actions
    backwards = Counter((a.mb, a.node.member) for a in program if isinstance(a, Backward))
    accumulating, in_flight = set(), {}
    gathered = grads = activations = 0.0
    now = {"gathered": 0.0, "grads": 0.0, "activations": 0.0}  # running sums of the three
    for a, live in with_live_units(program):
        match a:
            case Gather(unit) if unit not in live:
                now["gathered"] += full(unit, False)
            case Release(unit) if unit in live:
                now["gathered"] -= full(unit, False)
            case Reduce(unit) if unit in accumulating:
                accumulating.discard(unit)
                now["grads"] -= full(unit, True)
            case Forward(node, mb) if (mb, node.member) not in in_flight:
                in_flight[(mb, node.member)] = kept(node)
                now["activations"] += in_flight[(mb, node.member)]
            case Backward(node, mb, unit) | Wgrad(node, mb, unit):
                if unit is not None and unit not in accumulating:
                    accumulating.add(unit)
                    now["grads"] += full(unit, True)
                if isinstance(a, Backward):
                    backwards[(mb, node.member)] -= 1
                    if not backwards[(mb, node.member)]:
                        now["activations"] -= in_flight.pop((mb, node.member), 0.0)
        gathered = max(gathered, now["gathered"])
        grads = max(grads, now["grads"])
        activations = max(activations, now["activations"])
    return gathered, grads, activations


def estimate_memory(plan: Plan, rows: int, seq: int, stage: int = 0, moments: str = "float32",
                    skew: float = 1.0) -> dict:
    """``{part: bytes}`` (``PARTS`` and ``total``) one rank of pipeline stage ``stage``
    holds at its peak, for a global batch of ``rows`` sequences of ``seq``; AdamW's
    moments in ``moments`` (``float32`` or ``bfloat16``, ``adamw(moments=...)``); the
    busiest expert rank's, its routed rows ``skew`` times an even share (``busiest_share``)."""
    cfg, spec = plan.model, resolve_stage(plan, stage).spec
    rank = plan.dims.rank_of(0, 0, 0, 0, stage)
    elements = _rank_elements(spec, rank)
    units = {u.name: u for u in spec.stage_units(stage)}
    sizes, itemsize = _sizes(plan, rows, seq), plan.compute_dtype.itemsize

    def kept(node) -> float:
        if node.kind == Kind.HEAD:  # the logits' fp32 copy, whole or a piece at a time, and the final norm's input
            return (plan.loss_chunk or sizes["seen"]) * cfg.vocab / plan.tp * 4 + sizes["held"] * cfg.dim * itemsize
        if node.layer is not None:
            return _layer_activations(cfg, node.layer, sizes["held"], sizes["seen"], plan.tp, plan.remat_mode,
                                      plan.ep, busiest_share(plan, skew)) * itemsize
        return 0.0

    gathered, grads, activations = _walk(plan, spec, stage, units, kept)
    step_copy = sum(layout.shard_size * spec.dtype(key).itemsize for u in units.values()
                    for key, layout in u.groups.items())
    moment_bytes = check_moments("moments", moments).itemsize
    parts = {"params": 4 * elements, "grads": 4 * elements, "optimizer": 2 * moment_bytes * elements,
             "step copy": step_copy, "gathered": gathered, "grad buffers": grads, "activations": activations}
    parts["total"] = sum(parts.values())
    return parts
