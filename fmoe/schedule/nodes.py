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
unit of their member (``layers.i``, ``embed``, ``head``). A node is a value, ``Node(kind,
layer)``, named ``layers.3.attn`` in traces. The compute functions here are pure; the
executor gives them detached inputs and differentiates them.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from ..config import ModelConfig, Plan
from ..layers.attention import Documents
from ..layers.dispatch import make_dispatch
from ..layers.embedding import embed
from ..layers.experts import DeferredWgrad, dense_mlp, expert_mlp
from ..layers.loss import cross_entropy_sum, linear_cross_entropy_sum
from ..layers.expert_parallel import ExpertParallel
from ..layers.model import attention_half, head_weight
from ..layers.moe import MoEStats, Routed, moe_experts, moe_output, moe_route, moe_stats
from ..layers.norm import rms_norm
from ..layers.router import route, router_loss
from ..params import Leaf, param_table

LAYER_NODES = ("attn", "dispatch", "experts", "combine")
COMM_NODES = ("dispatch", "combine")


class Node(NamedTuple):
    """A piece of a step that a schedule orders.

    Attributes:
        kind: ``embed``, ``head``, or a layer's ``attn``, ``dispatch``, ``experts`` or
            ``combine``; ``layer`` for a whole layer (what a ``recompute`` re-runs).
        layer: the layer index; None for ``embed`` and ``head``.
    """

    kind: str
    layer: int | None = None

    def __str__(self) -> str:
        if self.layer is None:
            return self.kind
        return self.member if self.kind == "layer" else f"{self.member}.{self.kind}"

    @property
    def member(self) -> str:
        """The FSDP member it computes with: ``layers.<i>``, ``embed`` or ``head``."""
        return self.kind if self.layer is None else f"layers.{self.layer}"

    @property
    def is_comm(self) -> bool:
        """An all-to-all node: no weights, no FSDP unit."""
        return self.kind in COMM_NODES

    def sibling(self, kind: str) -> "Node":
        """The node ``kind`` of the same layer."""
        return Node(kind, self.layer)

    @property
    def whole_layer(self) -> "Node":
        """Its layer as one node, ``Node("layer", i)`` (what a recompute re-runs)."""
        return Node("layer", self.layer)

    def uses(self, leaf: Leaf, cfg: ModelConfig) -> bool:
        """Whether it computes with ``leaf``: its own kind's leaves of its member, and,
        with tied embeddings, ``embed`` in ``head`` too."""
        return (leaf.node == self.kind and leaf.layer == self.layer) or \
            (cfg.tie_embeddings and self.kind == "head" and leaf.path == "embed")


EMBED, HEAD = Node("embed"), Node("head")


def layer_nodes(layer: int) -> tuple[Node, ...]:
    """A layer's nodes in forward order."""
    return tuple(Node(kind, layer) for kind in LAYER_NODES)


def all_nodes(cfg: ModelConfig) -> tuple[Node, ...]:
    """Every node in forward order."""
    return (EMBED, *(n for i in range(cfg.layers) for n in layer_nodes(i)), HEAD)


def layer_tree(weights: dict, cfg: ModelConfig) -> dict:
    """One layer's ``{path: tensor}`` as its nested subtree (``{"attn": {"qkv": t}, ...}``);
    a weight gathered in FP8 is an ``Fp8Weight`` there (``fmoe.layers.fp8``)."""
    table = param_table(cfg)
    out: dict = {}
    for path, value in weights.items():
        *outer, name = table[path].keys[2:]  # past ("layers", i)
        d = out
        for k in outer:
            d = d.setdefault(k, {})
        d[name] = value
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
    replacement can keep one graph per site; the defaults ignore the site. The weights
    they get are tensors, or ``Fp8Weight``s for the dense products' weights when a
    ``fp8='tensorwise'`` plan gathers them in FP8 (only ``TENSORWISE``'s products
    take those).

    Attributes:
        attn: ``(site, p_layer, h_BSD, cfg, docs) -> (h_BSD, x_TD)``, as ``attention_half``
            (``docs``: the microbatch's packed ``Documents``, or None).
        router: ``(site, p_moe, x_TD, cfg) -> Routing``, as ``route``.
        experts: ``(site, p_experts, rows_RD, segs, cfg, row_probs_R, backend, deferred) -> y_RD``,
            as ``expert_mlp``.
        head: ``(site, weights, h_BSD, targets_BS, eps, chunk) -> ce_sum``, as
            ``head_loss_sum`` (``site = ("head", microbatch)``).
        dispatch: ``(site, indices_TK, experts, pad_multiple, capacity) -> Dispatch``, as
            ``make_dispatch`` (index arithmetic only: no weights, no gradient).
        shared: ``(site, p_shared, x_TD, cfg) -> y_TD``, as ``dense_mlp`` (the shared
            expert).

    ``kernels_for(plan)`` binds the plan's products (``Plan.fp8``: ``fmoe.layers.fp8``)
    into ``attn``, ``experts`` and ``shared``.
    """

    attn: Callable = at_any_site(attention_half)
    router: Callable = at_any_site(route)
    experts: Callable = at_any_site(expert_mlp)
    head: Callable = at_any_site(head_loss_sum)
    dispatch: Callable = at_any_site(make_dispatch)
    shared: Callable = at_any_site(dense_mlp)


EAGER = Kernels()


class Attended(NamedTuple):
    """What ``attn`` hands on: differentiable ``outputs`` (``h``, ``probs_TK``, ``rows``,
    ``row_probs``, ``shared``; absent ones None), the Routed plan, the router's share
    of the objective and the layer's MoEStats."""

    outputs: dict
    routed: Routed
    objective: torch.Tensor | None
    stats: MoEStats


def embed_node(weights: dict, inputs_BS: torch.Tensor) -> torch.Tensor:
    return embed(weights["embed"], inputs_BS)


def attn_node(weights: dict, h_BSD: torch.Tensor, plan: Plan, layer: int, world: int,
              ep: ExpertParallel | None, mb: int = 0, kernels: Kernels = EAGER,
              decided: Routed | None = None, docs: Documents | None = None) -> Attended:
    """Attention half of layer ``layer`` and the MoE up to the rows leaving for their
    experts (``decided``: the routing of the forward this run recomputes; ``docs``: the
    microbatch's packed documents)."""
    cfg = plan.model
    p, site = layer_tree(weights, cfg), (layer, mb)
    h_BSD, x_TD = kernels.attn(site, p, h_BSD, cfg, docs)
    routed = moe_route(p["moe"], x_TD, cfg, ep, functools.partial(kernels.router, site),
                       functools.partial(kernels.dispatch, site), decided)
    shared = kernels.shared(site, p["moe"]["shared"], x_TD, cfg) if "shared" in p["moe"] else None
    stats = moe_stats(routed, x_TD.shape[1], x_TD.dtype)
    objective = None
    if cfg.aux_loss_coef or cfg.z_loss_coef:
        objective = router_loss(stats.aux_loss, stats.z_loss, cfg) / (plan.microbatches * world)
    outputs = {"h": h_BSD, "probs_TK": routed.probs_TK, "rows": routed.rows_RD,
               "row_probs": routed.row_probs_R1, "shared": shared}
    return Attended(outputs, routed, objective, stats)


def experts_node(weights: dict, rows_RD: torch.Tensor, row_probs_R1: torch.Tensor | None, routed: Routed,
                 plan: Plan, layer: int, deferred: DeferredWgrad | None, mb: int = 0,
                 kernels: Kernels = EAGER) -> torch.Tensor:
    """The grouped expert MLPs of layer ``layer`` on the rows this rank computes."""
    p = layer_tree(weights, plan.model)
    return moe_experts(p["moe"], rows_RD, row_probs_R1, routed, plan.model, plan.expert_backend, deferred,
                       functools.partial(kernels.experts, (layer, mb)))


def combine_output(y_RD: torch.Tensor, h_BSD: torch.Tensor, probs_TK: torch.Tensor | None,
                   shared_TD: torch.Tensor | None, routed: Routed) -> torch.Tensor:
    """The layer's output: ``h + unpermute(y) (+ shared)``, as ``block`` computes it."""
    return h_BSD + moe_output(y_RD, routed.dispatch, probs_TK, shared_TD).view_as(h_BSD)


def head_node(weights: dict, h_BSD: torch.Tensor, targets_BS: torch.Tensor, total_targets, eps: float,
              mb: int = 0, kernels: Kernels = EAGER, chunk: int = 0):
    """``(objective, ce_sum)``: the cross-entropy summed over the counted targets
    (``IGNORE`` elsewhere), over ``total_targets``, the global batch's count (an int or
    a device scalar)."""
    ce_sum = kernels.head(("head", mb), weights, h_BSD, targets_BS, eps, chunk)
    return ce_sum / total_targets, ce_sum.detach()
