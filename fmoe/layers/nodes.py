"""A layer's nodes as pure functions, and the one place the MoE layer is composed.

A step is split into nodes: ``embed``, then per MoE layer ``attn`` (norm, attention,
residual, the MoE's norm, router, permute, the exchange plan and the shared expert:
``attn_node -> Attended``), ``dispatch`` (rows to their experts' ranks: ``dispatch_node
-> Sent``), ``experts`` (the grouped MLPs: ``experts_node -> y``) and ``combine`` (rows
back: ``combine_node -> Landing``; then unpermute and the residual add, ``land_node``),
or per dense layer one ``dense`` node (attention and the MLP, each with its norm and
residual), then ``head``. Each MoE node also takes the layer's ``Routed`` plan, whose
``Exchange.crossing`` says whether and how rows cross ranks. ``NODES`` names each kind
once, and whether it computes with its member's weights (the exchanges hold none).

The schedule's executor runs these functions one node at a time under its own autograd
boundaries (``fmoe.schedule``), an exchange's rows in flight until a later node needs
them; ``layer_forward`` (and ``moe_forward``, the MoE alone) runs the same functions in
order under plain autograd, each exchange waited for at once, for ``block`` and
``forward`` (``FMoEModule``, generation, the references' tests).
"""

from __future__ import annotations

import enum
import functools
from typing import Callable, NamedTuple

import optree
import torch

from ..backends import ExpertBackend, bound_backend
from ..config import ModelConfig
from .attention import KVSlot, attention_half
from .block_masks import Documents
from .dispatch import make_dispatch
from .embedding import embed
from .expert_parallel import ExpertParallel, InFlight, combine, dispatch
from .experts import DeferredWgrad, dense_mlp, experts_with
from .fp8 import PLAIN, Gemms
from .loss import cross_entropy_sum, head_loss_sum
from .moe import MoEStats, Routed, moe_experts, moe_output, moe_route, moe_stats, output_probs
from .router import route
from .tensor_parallel import TensorParallel, embed_vocab_parallel


class Kind(enum.StrEnum):
    """A node's kind; ``LAYER`` names a whole layer (what a recompute re-runs)."""

    EMBED = "embed"
    ATTN = "attn"
    DISPATCH = "dispatch"
    EXPERTS = "experts"
    COMBINE = "combine"
    DENSE = "dense"
    HEAD = "head"
    LAYER = "layer"


class NodeSpec(NamedTuple):
    """One node kind.

    Attributes:
        kind: the Kind.
        weights: whether it computes with its member's weights (an exchange does not,
            and belongs to no FSDP unit).
    """

    kind: Kind
    weights: bool = True


NODES = {spec.kind: spec for spec in (
    NodeSpec(Kind.EMBED),
    NodeSpec(Kind.ATTN),
    NodeSpec(Kind.DISPATCH, weights=False),
    NodeSpec(Kind.EXPERTS),
    NodeSpec(Kind.COMBINE, weights=False),
    NodeSpec(Kind.DENSE),
    NodeSpec(Kind.HEAD),
)}
"""Every node kind in forward order of a step (a layer runs the four MoE kinds or ``dense``)."""

MOE_KINDS = (Kind.ATTN, Kind.DISPATCH, Kind.EXPERTS, Kind.COMBINE)
DENSE_KINDS = (Kind.DENSE,)


def layer_kinds(cfg: ModelConfig, layer: int) -> tuple[Kind, ...]:
    """Layer ``layer``'s node kinds in forward order."""
    return DENSE_KINDS if cfg.is_dense(layer) else MOE_KINDS


def at_any_site(fn: Callable) -> Callable:
    """``fn`` as a Kernels entry: called with a site first, which it ignores."""
    return lambda site, *args, **kwargs: fn(*args, **kwargs)


def embed_tokens(w_VD: torch.Tensor, tokens_BS: torch.Tensor, tp: TensorParallel | None = None) -> torch.Tensor:
    """The token embedding (``tp``: from this rank's vocabulary rows, into its positions:
    ``embed_vocab_parallel``)."""
    return embed(w_VD, tokens_BS) if tp is None else embed_vocab_parallel(w_VD, tokens_BS, tp)


class Kernels(NamedTuple):
    """The pure functions inside the nodes, each one a scope that
    ``interop.cuda_graph`` can replace by a CUDA-graphed version of itself.

    Each is called as ``fn(site, *args)``, ``site = (layer, microbatch)``, so a
    replacement can keep one graph per site; the defaults ignore the site. The weights
    they get are tensors, or ``Fp8Weight``s for the dense products' weights when a
    ``fp8='tensorwise'`` plan gathers them in FP8 (only ``TENSORWISE``'s products
    take those).

    Attributes:
        attn: ``(site, p_layer, h_BSD, cfg, docs, window) -> (h_BSD, x_TD)``, as
            ``attention_half`` (``docs``: the microbatch's packed ``Documents``, or None;
            ``window``: the layer's sliding window, ``cfg.layer_window(layer)``, 0 for none).
        router: ``(site, p_moe, x_TD, cfg) -> Routing``, as ``route``.
        experts: ``(site, p_experts, rows_RD, segs, cfg, row_probs_R, deferred) -> y_RD``,
            as ``expert_mlp`` with the plan's expert backend bound in.
        head: ``(site, weights, h_BSD, targets_BS, eps, chunk) -> ce_sum``, as
            ``head_loss_sum`` (``site = ("head", microbatch)``).
        dispatch: ``(site, indices_TK, experts, pad_multiple, capacity) -> Dispatch``, as
            ``make_dispatch`` (index arithmetic only: no weights, no gradient).
        shared: ``(site, p_mlp, x_TD, cfg) -> y_TD``, as ``dense_mlp`` (the shared
            expert, and a dense layer's MLP).
        embed: ``(site, w_VD, tokens_BS) -> h_BSD``, as ``embed`` (``site = ("embed",
            microbatch)``).

    Under tensor, context or expert-tensor parallelism ``fmoe.layers.parallel.with_parallel``
    binds the groups in: the entries then also take ``tp=`` (``attn``, ``shared``,
    ``head``, ``embed``) or ``etp=`` (``experts``).

    ``bound_kernels`` (eager) and ``fmoe.schedule.kernels_for`` bind a plan's products
    (``Plan.fp8``: ``fmoe.layers.fp8``) and expert backend in.
    """

    attn: Callable = at_any_site(attention_half)
    router: Callable = at_any_site(route)
    experts: Callable = at_any_site(experts_with("torch"))
    head: Callable = at_any_site(head_loss_sum)
    dispatch: Callable = at_any_site(make_dispatch)
    shared: Callable = at_any_site(dense_mlp)
    embed: Callable = at_any_site(embed_tokens)


EAGER = Kernels()


@functools.cache
def bound_kernels(gemms: Gemms = PLAIN, backend: str | ExpertBackend = "torch") -> Kernels:
    """``EAGER`` with ``gemms``' products and the expert ``backend`` (a built-in's name or
    a registered ExpertBackend) bound in; ``EAGER`` itself for plain products and
    ``torch``."""
    kernels = EAGER
    if gemms != PLAIN:
        kernels = kernels._replace(attn=at_any_site(functools.partial(attention_half, gemms=gemms)),
                                   shared=at_any_site(functools.partial(dense_mlp, gemms=gemms)),
                                   head=at_any_site(_head_loss(gemms)))
    if gemms != PLAIN or backend != "torch":
        kernels = kernels._replace(experts=at_any_site(experts_with(backend, gemms)))
    return kernels


@functools.cache
def logits_loss(matmul):
    """``cross_entropy_sum`` with ``matmul`` for the logits. One object per product: the
    compiled head guards on its identity, so every Kernels value shares its graphs."""
    return functools.partial(cross_entropy_sum, matmul=matmul)


def _head_loss(gemms: Gemms):
    """``head_loss_sum`` with ``gemms.head`` for the logits' product."""
    return functools.partial(head_loss_sum, piece=logits_loss(gemms.head))


class Attended(NamedTuple):
    """What ``attn`` hands on (each differentiable; absent ones None).

    Attributes:
        h: ``[B, S, D]`` the stream after attention, to which ``land`` adds the MoE's
            output (None for the MoE alone, ``moe_forward``: no residual).
        probs_TK: the probabilities the unpermute applies (``output_probs``), or None.
        rows: the routed rows leaving for their experts (``Routed.rows_RD``).
        row_probs: the probabilities travelling with them (``Routed.row_probs_R1``).
        shared: ``[T, D]`` the shared expert's output.
    """

    h: torch.Tensor | None
    probs_TK: torch.Tensor | None
    rows: torch.Tensor
    row_probs: torch.Tensor | None
    shared: torch.Tensor | None


class Sent(NamedTuple):
    """What ``dispatch`` hands on: the experts' inputs, on the experts' rank or in
    flight there (``rows``, and ``row_probs`` or None)."""

    rows: object
    row_probs: object


class Landing(NamedTuple):
    """What ``combine`` hands on: the experts' output ``y`` (on its tokens' rank or in
    flight there) and what ``land`` adds to it (``Attended``'s fields of those names)."""

    y: object
    h: torch.Tensor | None
    probs_TK: torch.Tensor | None
    shared: torch.Tensor | None


def embed_node(p: dict, inputs_BS: torch.Tensor, kernels: Kernels = EAGER, mb: int = 0) -> torch.Tensor:
    return kernels.embed(("embed", mb), p["embed"], inputs_BS)


def route_node(p_moe: dict, x_TD: torch.Tensor, cfg: ModelConfig, site: tuple, kernels: Kernels = EAGER,
               ep: ExpertParallel | None = None, decided: Routed | None = None,
               h_BSD: torch.Tensor | None = None) -> tuple[Attended, Routed, MoEStats]:
    """The MoE up to the rows leaving for their experts: router, permute, the exchange
    plan, and the shared expert. ``decided``: the routing of the forward a recompute
    re-runs; ``h_BSD``: the stream ``x_TD`` was normalised from (the residual), or None.
    """
    routed = moe_route(p_moe, x_TD, cfg, ep, functools.partial(kernels.router, site),
                       functools.partial(kernels.dispatch, site), decided)
    shared = kernels.shared(site, p_moe["shared"], x_TD, cfg) if "shared" in p_moe else None
    attended = Attended(h_BSD, output_probs(routed), routed.rows_RD, routed.row_probs_R1, shared)
    return attended, routed, moe_stats(routed, x_TD.shape[1], x_TD.dtype)


def attn_node(p: dict, h_BSD: torch.Tensor, cfg: ModelConfig, site: tuple, kernels: Kernels = EAGER,
              ep: ExpertParallel | None = None, docs: Documents | None = None,
              decided: Routed | None = None) -> tuple[Attended, Routed, MoEStats]:
    """Attention half of a layer (``p``: its subtree), then ``route_node``; ``docs``: the
    microbatch's packed documents."""
    h_BSD, x_TD = kernels.attn(site, p, h_BSD, cfg, docs, cfg.layer_window(site[0]))
    return route_node(p["moe"], x_TD, cfg, site, kernels, ep, decided, h_BSD)


def dense_node(p: dict, h_BSD: torch.Tensor, cfg: ModelConfig, site: tuple, kernels: Kernels = EAGER,
               docs: Documents | None = None) -> torch.Tensor:
    """A dense layer (``p``: its subtree): ``h += attn(norm(h))``, ``h += mlp(norm(h))``."""
    return layer_forward(p, h_BSD, cfg, kernels, docs=docs, site=site)[0]


def dispatch_node(attended: Attended, routed: Routed, ep: ExpertParallel | None, send=dispatch) -> Sent:
    """The rows (and their probabilities) to their experts' ranks, when they leave this
    one. ``send``: ``(x, exchange, ep, capacity) -> rows in flight``, ``dispatch``
    (differentiable) or the executor's ``to_experts``."""
    sent = Sent(attended.rows, attended.row_probs)
    if not routed.exchange.crosses:
        return sent
    return optree.tree_map(lambda x: send(x, routed.exchange, ep, routed.dispatch.capacity), sent)


def experts_node(p_moe: dict, sent: Sent, routed: Routed, cfg: ModelConfig, site: tuple, kernels: Kernels = EAGER,
                 deferred: DeferredWgrad | None = None) -> torch.Tensor:
    """The grouped expert MLPs of a layer on the rows this rank computes (landed)."""
    return moe_experts(p_moe, sent.rows, sent.row_probs, routed, cfg, deferred,
                       functools.partial(kernels.experts, site))


def combine_node(y_RD: torch.Tensor, attended: Attended, routed: Routed, ep: ExpertParallel | None,
                 send=combine) -> Landing:
    """The experts' rows back to their tokens' ranks, when they left them. ``send``:
    ``(y, exchange, ep, capacity) -> rows in flight``, ``combine`` (differentiable) or
    the executor's ``from_experts``."""
    if routed.exchange.crosses:
        y_RD = send(y_RD, routed.exchange, ep, routed.dispatch.capacity)
    return Landing(y_RD, attended.h, attended.probs_TK, attended.shared)


def unpermute_node(landing: Landing, routed: Routed) -> torch.Tensor:
    """The MoE's output once its rows are back: ``unpermute(y) (+ shared)``, ``[T, D]``."""
    return moe_output(landing.y, routed.dispatch, landing.probs_TK, landing.shared)


def land_node(landing: Landing, routed: Routed) -> torch.Tensor:
    """The layer's output once its rows are back: ``h + unpermute(y) (+ shared)``."""
    return landing.h + unpermute_node(landing, routed).view_as(landing.h)


def _waited(x):
    """``x``, or its rows once landed if it is in flight (``InFlight``)."""
    return x.wait() if isinstance(x, InFlight) else x


def through_experts(p_moe: dict, attended: Attended, routed: Routed, cfg: ModelConfig, site: tuple,
                    kernels: Kernels = EAGER, ep: ExpertParallel | None = None) -> Landing:
    """``dispatch_node``, ``experts_node`` and ``combine_node`` in order under plain
    autograd, each exchange waited for at once (its backward is the reverse exchange)."""
    sent = dispatch_node(attended, routed, ep)
    # probabilities waited first: the backward runs the reverse exchanges latest-landed
    # first, so the rows' gradient goes back (and is summed into x's) first, as it always was
    row_probs = _waited(sent.row_probs)
    y_RD = experts_node(p_moe, Sent(_waited(sent.rows), row_probs), routed, cfg, site, kernels)
    landing = combine_node(y_RD, attended, routed, ep)
    return landing._replace(y=_waited(landing.y))


def moe_forward(p_moe: dict, x_TD: torch.Tensor, cfg: ModelConfig, kernels: Kernels = EAGER,
                ep: ExpertParallel | None = None, site: tuple = (0, 0)):
    """The MoE nodes in order under plain autograd (``route_node``, ``through_experts``,
    ``unpermute_node``). No residual.

    Returns:
        ``(y_TD, MoEStats)``.
    """
    attended, routed, stats = route_node(p_moe, x_TD, cfg, site, kernels, ep)
    return unpermute_node(through_experts(p_moe, attended, routed, cfg, site, kernels, ep), routed), stats


def moe(p: dict, x_TD: torch.Tensor, cfg: ModelConfig, backend: str = "torch", ep: ExpertParallel | None = None,
        gemms: Gemms = PLAIN):
    """Top-k MoE of already-normalised tokens; no residual (``moe_forward`` with the
    eager kernels).

    Dropless unless ``cfg.capacity_factor > 0`` (then each expert takes at most
    ``capacity_rows(T, K, E, factor)`` of this rank's assignments, first come first
    served in token order, and drops the rest).

    Arguments:
        p: one layer's ``moe`` subtree; under expert parallelism ``experts`` holds only
            this rank's ``E / ep`` experts.
        x_TD: ``[T, D]`` normalised tokens.
        cfg: the ModelConfig.
        backend: the experts' backend: ``torch``, ``loop``, or a name given to
            ``register_expert_backend`` (``te``, once ``interop.te`` is imported).
        ep: the expert-parallel group, or None when this rank holds every expert.
        gemms: the products of the routed and shared experts (``fmoe.layers.fp8``).

    Returns:
        ``(y_TD, stats)``: the layer output in ``x``'s dtype and a MoEStats.
    """
    return moe_forward(p, x_TD, cfg, bound_kernels(gemms, bound_backend(backend)), ep)


def layer_forward(p: dict, h_BSD: torch.Tensor, cfg: ModelConfig, kernels: Kernels = EAGER,
                  ep: ExpertParallel | None = None, docs: Documents | None = None, site: tuple = (0, 0),
                  kv: KVSlot | None = None, gemms: Gemms = PLAIN):
    """One layer (``p``: its subtree) under plain autograd: ``kernels.attn``, or with a
    decoding cache ``kv`` the attention with ``gemms``' products, then ``moe_forward``
    (a dense layer: its MLP, ``kernels.shared``). ``site = (layer, microbatch)``: the
    layer's index also picks its sliding window.

    Returns:
        ``(h_BSD, MoEStats)``; a dense layer's stats are None.
    """
    window = cfg.layer_window(site[0])
    if kv is None:
        h_BSD, x_TD = kernels.attn(site, p, h_BSD, cfg, docs, window)
    else:
        h_BSD, x_TD = attention_half(p, h_BSD, cfg, docs, window, kv, gemms)
    if "mlp" in p:
        return h_BSD + kernels.shared(site, p["mlp"], x_TD, cfg).view_as(h_BSD), None
    attended, routed, stats = route_node(p["moe"], x_TD, cfg, site, kernels, ep, h_BSD=h_BSD)
    return land_node(through_experts(p["moe"], attended, routed, cfg, site, kernels, ep), routed), stats
