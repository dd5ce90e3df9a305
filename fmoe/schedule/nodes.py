"""Compute and communication nodes: the pieces of a step a schedule orders.

``embed`` (token ids -> hidden states), then per layer ``i``:

- ``layers.i.attn``: norm, attention, residual, the MoE's norm, router, permute and
  the exchange plan (dispatch preprocessing), and the shared expert;
- ``layers.i.dispatch``: the all-to-all taking rows to their experts' ranks;
- ``layers.i.experts``: the grouped expert MLPs;
- ``layers.i.combine``: the all-to-all bringing the rows back, then unpermute and the
  residual add (run when the next node first needs the result);

and ``head`` (final norm, logits, summed cross-entropy). ``dispatch`` and
``combine`` hold no weights and belong to no FSDP unit; the others belong to the
unit of their member (``layers.i``, ``embed``, ``head``). The compute functions
here are pure; the executor gives them detached inputs and differentiates them.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from ..config import ModelConfig, Plan
from ..layers.dispatch import make_dispatch
from ..layers.embedding import embed
from ..layers.experts import DeferredWgrad, dense_mlp, expert_mlp
from ..layers.loss import cross_entropy_sum, linear_cross_entropy_sum
from ..layers.expert_parallel import ExpertParallel
from ..layers.model import attention_half, head_weight
from ..layers.moe import MoEStats, Routed, moe_experts, moe_output, moe_route, moe_stats
from ..layers.norm import rms_norm
from ..layers.router import route

LAYER_NODES = ("attn", "dispatch", "experts", "combine")
COMM_NODES = ("dispatch", "combine")


def node_names(cfg: ModelConfig) -> tuple[str, ...]:
    """Every node in forward order."""
    layers = (f"layers.{i}.{kind}" for i in range(cfg.layers) for kind in LAYER_NODES)
    return ("embed", *layers, "head")


def member_of_node(node: str) -> str:
    """``layers.3.experts`` -> ``layers.3``; ``embed`` and ``head`` are their own members."""
    return node.rsplit(".", 1)[0] if node.startswith("layers.") else node


def kind_of(node: str) -> str:
    """``attn``, ``dispatch``, ``experts``, ``combine``, ``embed`` or ``head``."""
    return node.rsplit(".", 1)[1] if node.startswith("layers.") else node


def is_comm(node: str) -> bool:
    return kind_of(node) in COMM_NODES


def node_of_param(path: str) -> str:
    """The node computing with a parameter: expert weights -> ``experts``, the rest of
    a layer -> ``attn``; ``final_norm`` and ``head`` -> ``head``."""
    parts = path.split(".")
    if parts[0] == "layers":
        kind = "experts" if parts[2:4] == ["moe", "experts"] else "attn"
        return f"layers.{parts[1]}.{kind}"
    return "head" if parts[0] in ("head", "final_norm") else parts[0]


def uses_param(node: str, path: str, cfg: ModelConfig) -> bool:
    """Whether ``node`` computes with parameter ``path``: its own node's parameters,
    and, with tied embeddings, ``embed`` in the ``head`` node too."""
    return node_of_param(path) == node or (cfg.tie_embeddings and node == "head" and path == "embed")


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


def head_loss_sum(weights: dict, h_BSD: torch.Tensor, targets_BS: torch.Tensor, eps: float,
                  chunk: int = 0, piece=cross_entropy_sum) -> torch.Tensor:
    """Final norm, logits and the fp32 cross-entropy summed over ``targets_BS``
    (``chunk`` tokens at a time: ``Plan.loss_chunk``; each piece through ``piece``)."""
    x_TD = rms_norm(h_BSD, weights["final_norm"], eps).flatten(0, 1)
    return linear_cross_entropy_sum(x_TD, head_weight(weights), targets_BS.flatten(), chunk, piece)


def at_any_site(fn: Callable) -> Callable:
    """``fn`` as a Kernels entry: called with a site first, which it ignores."""
    return lambda site, *args: fn(*args)


class Kernels(NamedTuple):
    """The pure functions inside the layer nodes, each one a scope that
    ``interop.cuda_graph`` can replace by a CUDA-graphed version of itself.

    Each is called as ``fn(site, *args)``, ``site = (layer, microbatch)``, so a
    replacement can keep one graph per site; the defaults ignore the site.

    Attributes:
        attn: ``(site, p_layer, h_BSD, cfg) -> (h_BSD, x_TD)``, as ``attention_half``.
        router: ``(site, p_moe, x_TD, cfg) -> Routing``, as ``route``.
        experts: ``(site, p_experts, rows_RD, segs, cfg, row_probs_R, backend, deferred) -> y_RD``,
            as ``expert_mlp``.
        head: ``(site, weights, h_BSD, targets_BS, eps, chunk) -> ce_sum``, as
            ``head_loss_sum`` (``site = ("head", microbatch)``).
        dispatch: ``(site, indices_TK, experts, pad_multiple, capacity) -> Dispatch``, as
            ``make_dispatch`` (index arithmetic only: no weights, no gradient).
    """

    attn: Callable = at_any_site(attention_half)
    router: Callable = at_any_site(route)
    experts: Callable = at_any_site(expert_mlp)
    head: Callable = at_any_site(head_loss_sum)
    dispatch: Callable = at_any_site(make_dispatch)


EAGER = Kernels()


class Attended(NamedTuple):
    """What ``attn`` hands on: differentiable ``outputs`` (``h``, ``probs_TK``, ``rows``,
    ``row_probs``, ``shared``; absent ones None), the Routed plan, the router's share
    of the objective and the layer's MoEStats."""

    outputs: dict
    routed: Routed
    objective: torch.Tensor | None
    stats: MoEStats


def embed_node(weights: dict, tokens_mb: torch.Tensor) -> torch.Tensor:
    return embed(weights["embed"], tokens_mb[:, :-1])


def attn_node(weights: dict, h_BSD: torch.Tensor, plan: Plan, layer: int, world: int,
              ep: ExpertParallel | None, mb: int = 0, kernels: Kernels = EAGER,
              decided: Routed | None = None) -> Attended:
    """Attention half of layer ``layer`` and the MoE up to the rows leaving for their
    experts (``decided``: the routing of the forward this run recomputes)."""
    cfg = plan.model
    p, site = nest(weights, f"layers.{layer}"), (layer, mb)
    h_BSD, x_TD = kernels.attn(site, p, h_BSD, cfg)
    routed = moe_route(p["moe"], x_TD, cfg, ep, functools.partial(kernels.router, site),
                       functools.partial(kernels.dispatch, site), decided)
    shared = dense_mlp(p["moe"]["shared"], x_TD, cfg) if "shared" in p["moe"] else None
    stats = moe_stats(routed, x_TD.shape[1], x_TD.dtype)
    objective = None
    if cfg.aux_loss_coef or cfg.z_loss_coef:
        router = cfg.aux_loss_coef * stats.aux_loss + cfg.z_loss_coef * stats.z_loss
        objective = router / (plan.microbatches * world)
    outputs = {"h": h_BSD, "probs_TK": routed.probs_TK, "rows": routed.rows_RD,
               "row_probs": routed.row_probs_R, "shared": shared}
    return Attended(outputs, routed, objective, stats)


def experts_node(weights: dict, rows_RD: torch.Tensor, row_probs_R: torch.Tensor | None, routed: Routed,
                 plan: Plan, layer: int, deferred: DeferredWgrad | None, mb: int = 0,
                 kernels: Kernels = EAGER) -> torch.Tensor:
    """The grouped expert MLPs of layer ``layer`` on the rows this rank computes."""
    p = nest(weights, f"layers.{layer}")
    return moe_experts(p["moe"], rows_RD, row_probs_R, routed, plan.model, plan.expert_backend, deferred,
                       functools.partial(kernels.experts, (layer, mb)))


def combine_output(y_RD: torch.Tensor, h_BSD: torch.Tensor, probs_TK: torch.Tensor | None,
                   shared_TD: torch.Tensor | None, routed: Routed) -> torch.Tensor:
    """The layer's output: ``h + unpermute(y) (+ shared)``, as ``block`` computes it."""
    return h_BSD + moe_output(y_RD, routed.dispatch, probs_TK, shared_TD).view_as(h_BSD)


def head_node(weights: dict, h_BSD: torch.Tensor, tokens_mb: torch.Tensor, total_targets: int, eps: float,
              mb: int = 0, kernels: Kernels = EAGER, chunk: int = 0):
    """``(objective, ce_sum)``: summed next-token cross-entropy over ``total_targets``."""
    ce_sum = kernels.head(("head", mb), weights, h_BSD, tokens_mb[:, 1:], eps, chunk)
    return ce_sum / total_targets, ce_sum.detach()
