"""The MoE layer: route, permute, grouped experts, unpermute (+ shared expert)."""

import functools
from typing import NamedTuple

import torch

from ..config import ModelConfig
from .dispatch import Dispatch, capacity_rows, make_dispatch, permute, row_weights, unpermute
from .expert_parallel import Exchange, ExpertParallel, combine, dispatch, plan_exchange
from .experts import DeferredWgrad, dense_mlp, expert_mlp
from .fp8 import PLAIN, Gemms
from .router import Routing, route


class MoEStats(NamedTuple):
    """Per-layer routing statistics (tensors, no host sync).

    Attributes:
        counts_E: tokens routed to each expert (before any capacity drop).
        aux_loss, z_loss: unscaled router losses (fp32 scalars, differentiable).
        padded_rows: permuted rows holding no token (long scalar).
        dropped_tokens: assignments dropped by the capacity (long scalar; 0 when dropless).
        a2a_bytes: bytes this rank sent in the layer's forward dispatch + combine.
    """

    counts_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    padded_rows: torch.Tensor
    dropped_tokens: torch.Tensor
    a2a_bytes: torch.Tensor


class Routed(NamedTuple):
    """One MoE layer's tokens after routing, permuted and ready to leave for their experts.

    Attributes:
        rows_RD: ``[R, D]`` tokens permuted by global expert (differentiable).
        row_probs_R1: ``[R, 1]`` probabilities travelling with the rows (prob placement
            ``activation``), else None.
        probs_TK: ``[T, K]`` router probabilities (applied at unpermute, placement ``output``).
        dispatch: where each assignment went (the Dispatch).
        exchange: how rows travel between expert ranks (None without expert parallelism).
        segments: the row segments of the experts this rank computes.
        routing: the router's Routing (for the statistics).
    """

    rows_RD: torch.Tensor
    row_probs_R1: torch.Tensor | None
    probs_TK: torch.Tensor
    dispatch: Dispatch
    exchange: Exchange | None
    segments: object
    routing: Routing


def _crosses_ranks(ep: ExpertParallel | None) -> bool:
    return ep is not None and ep.group.size > 1


def moe_route(p: dict, x_TD: torch.Tensor, cfg: ModelConfig, ep: ExpertParallel | None = None,
              router=route, dispatcher=make_dispatch, decided: Routed | None = None) -> Routed:
    """Route (with ``router``, ``route``'s signature) and permute ``x_TD`` (the
    permutation from ``dispatcher``, ``make_dispatch``'s signature); with expert
    parallelism also plan the exchange (for dropless routing, a small all-to-all of
    counts and one host read of split sizes).

    ``decided``: a Routed from an earlier run on the same inputs (a recomputation):
    its permutation and exchange plan are reused, so nothing is exchanged or read on
    the host again; the router still runs, for its differentiable probabilities."""
    T, K = x_TD.shape[0], cfg.topk
    r = router(p, x_TD, cfg)
    if decided is not None:
        d, ex, segments = decided.dispatch, decided.exchange, decided.segments
    else:
        capacity = capacity_rows(T, K, cfg.experts, cfg.capacity_factor, cfg.pad_multiple) \
            if cfg.capacity_factor else None
        d = dispatcher(r.indices_TK, cfg.experts, 0 if capacity else cfg.pad_multiple, capacity)
        ex = plan_exchange(d.rows_E, capacity, ep) if _crosses_ranks(ep) else None
        segments = d if ex is None else ex.segments
    rows_RD = permute(x_TD, d)
    row_probs_R1 = row_weights(r.probs_TK, d)[:, None] if cfg.prob_placement == "activation" else None
    return Routed(rows_RD, row_probs_R1, r.probs_TK, d, ex, segments, r)


def moe_experts(p: dict, rows_RD: torch.Tensor, row_probs_R1: torch.Tensor | None, routed: Routed,
                cfg: ModelConfig, backend: str = "torch", deferred: DeferredWgrad | None = None,
                mlp=expert_mlp) -> torch.Tensor:
    """The routed experts on the rows this rank computes (``mlp``: ``expert_mlp``'s signature)."""
    probs = None if row_probs_R1 is None else row_probs_R1[:, 0]
    return mlp(p["experts"], rows_RD, routed.segments, cfg, probs, backend, deferred)


def moe_output(y_RD: torch.Tensor, d: Dispatch, probs_TK: torch.Tensor | None,
               shared_TD: torch.Tensor | None) -> torch.Tensor:
    """Expert outputs back in token order, weighted by ``probs_TK`` (None when the
    probabilities were applied in the activation), plus the shared expert's output."""
    y_TD = unpermute(y_RD, d, probs_TK)
    return y_TD if shared_TD is None else y_TD + shared_TD


def output_probs(routed: Routed) -> torch.Tensor | None:
    """The probabilities ``moe_output`` applies: None under placement ``activation``."""
    return routed.probs_TK if routed.row_probs_R1 is None else None


def moe_stats(routed: Routed, dim: int, dtype: torch.dtype) -> MoEStats:
    """The layer's MoEStats (no host sync)."""
    d, r = routed.dispatch, routed.routing
    sent = torch.zeros((), dtype=torch.long, device=d.pos_TK.device)
    if routed.exchange is not None:
        sent = sent + 2 * d.num_rows * dim * torch.empty((), dtype=dtype).element_size()
    return MoEStats(r.counts_E, r.aux_loss, r.z_loss, torch.zeros_like(sent) + d.padded_rows, d.dropped, sent)


def moe(p: dict, x_TD: torch.Tensor, cfg: ModelConfig, backend: str = "torch", ep: ExpertParallel | None = None,
        gemms: Gemms = PLAIN):
    """Top-k MoE of already-normalised tokens; no residual.

    Dropless unless ``cfg.capacity_factor > 0`` (then each expert takes at most
    ``capacity_rows(T, K, E, factor)`` of this rank's assignments, first come first
    served in token order, and drops the rest). The schedule's layer nodes run the
    same phases (``moe_route``, ``moe_experts``, ``moe_output``) one at a time.

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
    routed = moe_route(p, x_TD, cfg, ep)
    rows_RD, row_probs_R1 = routed.rows_RD, routed.row_probs_R1
    ex, capacity = routed.exchange, routed.dispatch.capacity
    if ex is not None:  # the rows this rank's experts compute, from every rank
        sending = dispatch(rows_RD, ex, ep, capacity)
        if row_probs_R1 is not None:
            row_probs_R1 = dispatch(row_probs_R1, ex, ep, capacity).wait()
        rows_RD = sending.wait()
    y_RD = moe_experts(p, rows_RD, row_probs_R1, routed, cfg, backend,
                       mlp=functools.partial(expert_mlp, gemms=gemms))
    if ex is not None:
        y_RD = combine(y_RD, ex, ep, capacity).wait()
    shared_TD = dense_mlp(p["shared"], x_TD, cfg, gemms) if "shared" in p else None
    y_TD = moe_output(y_RD, routed.dispatch, output_probs(routed), shared_TD)
    return y_TD, moe_stats(routed, x_TD.shape[1], x_TD.dtype)
