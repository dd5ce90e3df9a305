"""Compute nodes: the pieces of the model a schedule runs one at a time.

A node is a pure function of its weights and its input: ``embed`` (token ids ->
hidden states), ``layers.<i>`` (one transformer block) and ``head`` (final norm,
logits, summed cross-entropy). Each returns the tensors its backward starts from.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import Plan
from ..layers.expert_parallel import ExpertParallel
from ..layers.model import block
from ..layers.moe import MoEStats
from ..layers.norm import rms_norm
from ..layers.precision import upcast
from ..shard.mesh import Mesh


class NodeResult(NamedTuple):
    """``output`` feeds the next node; ``objective`` is this node's scalar share of the
    loss being differentiated (None if it has none); ``stats`` per layer."""

    output: torch.Tensor | None
    objective: torch.Tensor | None
    stats: MoEStats | None = None
    ce_sum: torch.Tensor | None = None


def nest(flat: dict, prefix: str) -> dict:
    """``{"layers.0.attn.qkv": t, ...}`` with ``prefix="layers.0"`` -> ``{"attn": {"qkv": t}}``."""
    out: dict = {}
    for path, value in flat.items():
        if path.startswith(prefix + "."):
            keys = path[len(prefix) + 1:].split(".")
            d = out
            for k in keys[:-1]:
                d = d.setdefault(k, {})
            d[keys[-1]] = value
    return out


def run_node(node: str, weights: dict, x: torch.Tensor, tokens_mb: torch.Tensor, plan: Plan,
             total_targets: int, mesh: Mesh, events: list) -> NodeResult:
    """Forward of one node.

    Arguments:
        node: ``embed``, ``layers.<i>`` or ``head``.
        weights: ``{path: tensor}`` of the node's parameters (compute dtype).
        x: the previous node's output (ignored by ``embed``).
        tokens_mb: this microbatch's ``[b, S+1]`` tokens.
        plan: the Plan.
        total_targets: targets in the whole global batch (the loss's denominator).
        mesh: this rank's groups (router losses average over all ranks; experts
            exchange tokens over ``mesh.ep``).
        events: the layer's all-to-all exchanges and host syncs are appended here.
    """
    cfg = plan.model
    if node == "embed":
        return NodeResult(weights["embed"][tokens_mb[:, :-1]], None)
    if node == "head":
        logits = rms_norm(x, weights["final_norm"], cfg.norm_eps) @ weights["head"]
        ce_sum = torch.nn.functional.cross_entropy(upcast(logits).flatten(0, 1), tokens_mb[:, 1:].flatten(),
                                                   reduction="sum")
        return NodeResult(None, ce_sum / total_targets, ce_sum=ce_sum.detach())
    ep = ExpertParallel(mesh.ep, cfg.experts // plan.ep, events) if plan.ep > 1 else None
    h, stats = block(nest(weights, node), x, cfg, plan.expert_backend, ep)
    objective = None
    if cfg.aux_loss_coef or cfg.z_loss_coef:
        router = cfg.aux_loss_coef * stats.aux_loss + cfg.z_loss_coef * stats.z_loss
        objective = router / (plan.microbatches * mesh.world.size)
    return NodeResult(h, objective, stats)
