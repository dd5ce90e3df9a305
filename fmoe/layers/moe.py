"""The MoE layer's phases: route and permute (``moe_route``), the grouped experts
(``moe_experts``), unpermute (+ shared expert, ``moe_output``); ``fmoe.layers.nodes``
composes them."""

from typing import NamedTuple

import torch

from ..config import ModelConfig
from .dispatch import Dispatch, capacity_rows, make_dispatch, permute, row_weights, unpermute
from .expert_parallel import LOCAL, Crossing, Exchange, ExpertParallel, plan_exchange, plan_token_exchange
from .experts import DeferredWgrad, expert_mlp
from .router import Routing, route


class MoEStats(NamedTuple):
    """Per-layer routing statistics (tensors, no host sync).

    Attributes:
        counts_E: tokens routed to each expert (before any capacity drop).
        aux_loss, z_loss: unscaled router losses (fp32 scalars, differentiable).
        padded_rows: permuted rows holding no token (long scalar).
        dropped_tokens: assignments dropped by the capacity (long scalar; 0 when dropless).
        a2a_bytes: bytes of the layer's forward dispatch and combine as this rank
            permuted them (its own rank's share included); when tokens travel, with
            their probabilities and expert slots.
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
        rows_RD: ``[R, D]`` tokens permuted by global expert (differentiable); when
            tokens travel (``tokens_travel``), ``[S, D]`` each token once per rank
            holding any of its experts, grouped by rank.
        row_probs_R1: ``[R, 1]`` probabilities travelling with the rows (prob placement
            ``activation``), else None; when tokens travel, ``[S, K]`` each sent token's
            probabilities (applied on the experts' rank, whatever the placement).
        probs_TK: ``[T, K]`` router probabilities (applied at unpermute under placement
            ``output``, unless tokens travel: ``output_probs``).
        dispatch: where each assignment went (the Dispatch; when tokens travel, where
            each (token, rank) pair went).
        exchange: how rows travel between expert ranks (``LOCAL`` when none leaves).
        routing: the router's Routing (for the statistics).
    """

    rows_RD: torch.Tensor
    row_probs_R1: torch.Tensor | None
    probs_TK: torch.Tensor
    dispatch: Dispatch
    exchange: Exchange
    routing: Routing

    @property
    def tokens_travel(self) -> bool:
        """Whether tokens, not rows, cross ranks (``Plan.ep_exchange='tokens'``)."""
        return self.exchange.crossing is Crossing.TOKENS

    @property
    def local(self) -> Dispatch | None:
        """When tokens travel: the received tokens' Dispatch to this rank's experts
        (built on first use)."""
        return self.exchange.local

    @property
    def segments(self):
        """The row segments of the experts this rank computes (None when tokens travel:
        ``local`` has them)."""
        match self.exchange.crossing:
            case Crossing.NONE:
                return self.dispatch
            case Crossing.TOKENS:
                return None
        return self.exchange.segments


def crossing(ep: ExpertParallel | None, cfg: ModelConfig) -> Crossing:
    """How a layer's rows reach their experts under ``ep``."""
    if ep is None or ep.group.size == 1:
        return Crossing.NONE
    if ep.tokens:
        return Crossing.TOKENS
    return Crossing.CAPACITY if cfg.capacity_factor else Crossing.ROWS


def moe_route(p: dict, x_TD: torch.Tensor, cfg: ModelConfig, ep: ExpertParallel | None = None,
              router=route, dispatcher=make_dispatch, decided: Routed | None = None) -> Routed:
    """Route (with ``router``, ``route``'s signature) and permute ``x_TD`` (the
    permutation from ``dispatcher``, ``make_dispatch``'s signature); with expert
    parallelism also plan the exchange (for dropless routing, a small all-to-all of
    counts and one host read of split sizes; with ``ep.tokens``, of tokens per rank).

    ``decided``: a Routed from an earlier run on the same inputs (a recomputation):
    its permutation and exchange plan are reused, so nothing is exchanged or read on
    the host again; the router still runs, for its differentiable probabilities."""
    T, K = x_TD.shape[0], cfg.topk
    r = router(p, x_TD, cfg)
    how = crossing(ep, cfg)
    ex = LOCAL
    if decided is not None:
        d, ex = decided.dispatch, decided.exchange
    elif how is Crossing.TOKENS:
        if cfg.capacity_factor or cfg.pad_multiple:  # a Plan refuses these when it is built
            raise ValueError(f"ExpertParallel.tokens sends tokens under dropless routing only: needs "
                             f"capacity_factor=0 and pad_multiple=0, not {cfg.capacity_factor} and "
                             f"{cfg.pad_multiple}")
        d, ex = plan_token_exchange(r.indices_TK, ep, dispatcher)
    else:
        capacity = capacity_rows(T, K, cfg.experts, cfg.capacity_factor, cfg.pad_multiple) \
            if cfg.capacity_factor else None
        d = dispatcher(r.indices_TK, cfg.experts, 0 if capacity else cfg.pad_multiple, capacity)
    rows_RD = permute(x_TD, d)
    if how is Crossing.TOKENS:
        row_probs_R1 = permute(r.probs_TK, d)
    else:
        row_probs_R1 = row_weights(r.probs_TK, d)[:, None] if cfg.prob_placement == "activation" else None
    if decided is None and how in (Crossing.ROWS, Crossing.CAPACITY):
        # Planned after the permute: the GPU has the rows' gather to run while the host
        # waits for the split sizes.
        bound = ep.group.size * T * min(K, ep.experts_per_rank) if cfg.pad_multiple == 0 else 0
        ex = plan_exchange(d.rows_E, d.capacity, ep, bound)
    return Routed(rows_RD, row_probs_R1, r.probs_TK, d, ex, r)


def moe_experts(p: dict, rows_RD: torch.Tensor, row_probs_R1: torch.Tensor | None, routed: Routed,
                cfg: ModelConfig, deferred: DeferredWgrad | None = None, mlp=expert_mlp) -> torch.Tensor:
    """The routed experts on the rows this rank computes (``mlp``: ``(p, rows_RD, segs,
    cfg, row_probs_R, deferred) -> y_RD``, the plan's backend bound in: ``experts_with``).

    When tokens travel (``routed.tokens_travel``), ``rows_RD`` and ``row_probs_R1`` are
    the received tokens ``[U, D]`` and their probabilities ``[U, K]``: each token is
    expanded into its rows here and its weighted expert outputs summed, ``[U, D]``."""
    if not routed.tokens_travel:
        probs = None if row_probs_R1 is None else row_probs_R1[:, 0]
        return mlp(p["experts"], rows_RD, routed.segments, cfg, probs, deferred)
    local = routed.local
    in_activation = cfg.prob_placement == "activation"
    probs = row_weights(row_probs_R1, local) if in_activation else None
    y_RD = mlp(p["experts"], permute(rows_RD, local), local, cfg, probs, deferred)
    return unpermute(y_RD, local, None if in_activation else row_probs_R1)


def moe_output(y_RD: torch.Tensor, d: Dispatch, probs_TK: torch.Tensor | None,
               shared_TD: torch.Tensor | None) -> torch.Tensor:
    """Expert outputs back in token order, weighted by ``probs_TK`` (None when the
    probabilities were applied in the activation), plus the shared expert's output."""
    y_TD = unpermute(y_RD, d, probs_TK)
    return y_TD if shared_TD is None else y_TD + shared_TD


def output_probs(routed: Routed) -> torch.Tensor | None:
    """The probabilities ``moe_output`` applies: None under placement ``activation``, or
    when tokens travel (their experts' rank applied them)."""
    return routed.probs_TK if routed.row_probs_R1 is None else None


def moe_stats(routed: Routed, dim: int, dtype: torch.dtype) -> MoEStats:
    """The layer's MoEStats (no host sync)."""
    d, r = routed.dispatch, routed.routing
    sent = torch.zeros((), dtype=torch.long, device=d.pos_TK.device)
    if routed.exchange.crosses:
        sent = sent + 2 * d.num_rows * dim * torch.empty((), dtype=dtype).element_size()
        if routed.tokens_travel:  # each token's probabilities and its int32 expert slots
            sent = sent + d.num_rows * routed.row_probs_R1.shape[1] * (routed.row_probs_R1.element_size() + 4)
    return MoEStats(r.counts_E, r.aux_loss, r.z_loss, torch.zeros_like(sent) + d.padded_rows, d.dropped, sent)
