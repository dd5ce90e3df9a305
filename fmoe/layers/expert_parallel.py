"""Expert parallelism: tokens travel to the ranks owning their experts and back.

With ``ep`` ranks, rank ``j`` owns experts ``[j*El, (j+1)*El)`` (``El = E / ep``).
After the local permute, the rows for each owner are one contiguous block, so
dispatch is one ``all_to_all`` and combine is its mirror image.

- Dropless: each rank sends a different number of rows to each owner. The split
  sizes are exchanged first (a small all-to-all of per-expert counts) and read on
  the host: that sync is an explicit step, recorded in the trace as ``a2a_splits``.
- Static capacity: every (source rank, expert) block has exactly ``C`` rows, so the
  all-to-all has equal splits and nothing is read on the host (CUDA-graph friendly).
- Tokens (``Plan.ep_exchange='tokens'``, dropless): a token travels once to each rank
  holding any of its experts, with its probabilities and which of that rank's experts
  it chose (``plan_token_exchange``); the rank expands it into its experts' rows, and
  sums a token's weighted expert outputs before sending it back, so every exchange
  moves one row per (token, rank) instead of one per (token, expert). Same rows into
  the grouped GEMMs in the same order; the output's sum over experts runs per rank
  first.

``to_experts`` and ``from_experts`` (each the other's adjoint) return Transfers
that a schedule issues and waits for explicitly, computing something else in
between; ``dispatch`` and ``combine`` wrap them for plain autograd (``moe``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..comm.collectives import Group, Pending
from ..comm.trace import Event, now
from .dispatch import Dispatch, make_dispatch, without_missing
from .router import expert_counts


@dataclass
class ExpertParallel:
    """What an MoE layer needs to reach the other expert ranks.

    Attributes:
        group: the expert-parallel group (size ``ep``).
        experts_per_rank: ``El = E / ep``.
        events: host syncs and exchanges are appended here (the step's trace).
        tokens: dropless routing sends each token once per rank holding any of its
            experts, not once per expert (``Plan.ep_exchange='tokens'``).
    """

    group: Group
    experts_per_rank: int
    events: list = field(default_factory=list)
    tokens: bool = False


class Segments(NamedTuple):
    """Row segments of the local experts, as ``grouped_matmul`` and the biases need."""

    rows_E: torch.Tensor
    offsets_E: torch.Tensor
    row_expert_R: torch.Tensor
    capacity: int | None = None  # rows of every segment, when a static capacity fixes them


def segments_of(rows_E: torch.Tensor, rows: int, capacity: int | None = None) -> Segments:
    """The Segments of rows grouped by expert, ``rows_E`` of each. ``rows``: the length of
    ``row_expert_R``, at least ``rows_E.sum()`` (past it the entries are ``E``, to be cut
    once the total is known)."""
    offsets_E = torch.cumsum(rows_E, 0)
    row_expert = torch.searchsorted(offsets_E, torch.arange(rows, device=rows_E.device), right=True)
    return Segments(rows_E, offsets_E.to(torch.int32), row_expert, capacity)


class Arrivals:
    """When tokens travel: the tokens this rank received, and which of its experts each
    chose. ``slots_NK`` (int32, ``El`` for another rank's expert) holds them in its first
    ``tokens`` rows and ``El`` in the rest, so its shape is fixed by the batch when every
    rank routes as many tokens (one compiled graph). Their Dispatch to this rank's
    ``rows`` rows is built on first use, in the experts' node: by then the tokens are on
    their way, so the host launches its kernels while the GPU moves them (they run once
    the tokens landed)."""

    def __init__(self, slots_NK: torch.Tensor, tokens: int, rows: int, experts: int, dispatcher=make_dispatch):
        self.slots_NK, self.tokens, self.rows, self.experts = slots_NK, tokens, rows, experts
        self._dispatcher, self._dispatch = dispatcher, None

    @property
    def dispatch(self) -> Dispatch:
        if self._dispatch is None:
            whole = self._dispatcher(self.slots_NK.long(), self.experts + 1)
            cut = without_missing(whole, self.rows, self.experts, self.tokens)
            # copies, not views of the bounded buffers: the Dispatch lives until the backward
            self._dispatch = cut._replace(row_source_R=cut.row_source_R.clone(),
                                          row_expert_R=cut.row_expert_R.clone())
        return self._dispatch


class Crossing(enum.Enum):
    """How an MoE layer's rows reach their experts: which variant an Exchange is."""

    NONE = "none"  # every expert on this rank (no expert parallelism, or ep=1): nothing crosses
    ROWS = "rows"  # dropless: a row per (token, expert), split sizes read on the host
    CAPACITY = "capacity"  # static capacity: equal blocks of C rows, nothing read on the host
    TOKENS = "tokens"  # Plan.ep_exchange='tokens': a token once per rank holding any of its experts


class Exchange(NamedTuple):
    """How one layer's rows travel (``crossing``): split sizes and the source-major <->
    expert-major permutation of the received rows (``ROWS``; None under ``CAPACITY``),
    and their local-expert ``segments``; under ``TOKENS``, ``arrivals`` instead of the
    last three (``local``: the received tokens' Dispatch to this rank's experts). Under
    ``NONE`` (``LOCAL``) every field but ``crossing`` is None."""

    crossing: Crossing
    send_splits: list | None
    recv_splits: list | None
    order: torch.Tensor | None
    inverse: torch.Tensor | None
    segments: Segments | None
    arrivals: Arrivals | None = None

    @property
    def crosses(self) -> bool:
        """Whether rows leave this rank (every variant but ``NONE``)."""
        return self.crossing is not Crossing.NONE

    @property
    def local(self) -> Dispatch | None:
        return self.arrivals.dispatch if self.crossing is Crossing.TOKENS else None


LOCAL = Exchange(Crossing.NONE, None, None, None, None, None)
"""The Exchange of a layer whose experts are all on this rank."""


def plan_exchange(rows_E: torch.Tensor, capacity: int | None, ep: ExpertParallel, bound: int = 0) -> Exchange:
    """Split sizes and local-expert segments for rows permuted by global expert
    (``rows_E``: the permuted buffer's segment sizes).

    ``bound``: the most rows this rank can receive (``P * T * min(K, El)`` when every
    rank routes ``T`` tokens), or 0. With it the received rows' order and segments are
    built before the host read, while the GPU still has work queued, and after the read
    only cut (or built again, should more rows arrive): the host's work between the
    read and the exchange, when the GPU has nothing else to run, is three copies."""
    P, El = ep.group.size, ep.experts_per_rank
    device = rows_E.device
    if capacity is not None:
        rows = torch.full((El,), P * capacity, dtype=torch.long, device=device)
        return Exchange(Crossing.CAPACITY, None, None, None, None, segments_of(rows, El * P * capacity, P * capacity))
    send_counts = rows_E.view(P, El)
    recv_counts = torch.empty_like(send_counts)
    t0 = now()
    ep.group.all_to_all(recv_counts.view(-1), send_counts.reshape(-1)).wait()
    splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)])
    early = (expert_major(recv_counts, bound), segments_of(recv_counts.sum(0), bound)) if bound else None
    # The one host sync dropless dispatch needs: both split lists in one read.
    send_splits, recv_splits = splits.tolist()
    ep.events.append(Event("a2a_splits", None, None, -1, t0, now(), recv_counts.numel() * 8, "dispatch"))
    total = sum(recv_splits)
    if early is None or total > bound:
        order, inverse = expert_major(recv_counts, total)
        return Exchange(Crossing.ROWS, send_splits, recv_splits, order, inverse, segments_of(recv_counts.sum(0), total))
    (order, inverse), segments = early
    # copies, not views: the exchange is kept for the backward, and the bound may be
    # several times the rows that came (ep x at ep ranks under uniform routing)
    return Exchange(Crossing.ROWS, send_splits, recv_splits, order[:total].clone(), inverse[:total].clone(),
                    segments._replace(row_expert_R=segments.row_expert_R[:total].clone()))


def plan_token_exchange(indices_TK: torch.Tensor, ep: ExpertParallel,
                        dispatcher=make_dispatch) -> tuple[Dispatch, Exchange]:
    """Where each token travels when tokens, not rows, cross ranks.

    Arguments:
        indices_TK: ``[T, K]`` chosen (global) experts.
        ep: the expert-parallel ranks.
        dispatcher: ``make_dispatch`` or its compiled form (``Kernels.dispatch``).

    Returns:
        ``(by_rank, exchange)``: ``by_rank``, a partial Dispatch of the ``[T, P]``
        (token, rank) pairs a token has experts on, rows grouped by rank in token order
        (``permute`` makes the tokens to send, ``unpermute`` sums what comes back); the
        Exchange's splits in tokens and its ``arrivals``. Two small exchanges: the counts
        (read on the host once, as ``plan_exchange`` does) and each sent token's slots,
        which of the receiving rank's experts it chose (int32, on the device; ``slots``
        in the trace). Everything that needs no host value is built before the read;
        after it, the slots are cut and sent.
    """
    P, El = ep.group.size, ep.experts_per_rank
    T, K = indices_TK.shape
    device = indices_TK.device
    held_TP = torch.zeros(T, P, dtype=torch.bool, device=device)
    held_TP.scatter_(1, indices_TK // El, True)
    ranks = torch.arange(P, device=device)
    unheld = dispatcher(torch.where(held_TP, ranks, P), P + 1)  # group P: pairs that travel nowhere
    send = torch.cat([expert_counts(indices_TK, P * El).view(P, El), unheld.counts_E[:P, None]], 1)
    recv = torch.empty_like(send)
    t0 = now()
    ep.group.all_to_all(recv.view(-1), send.reshape(-1)).wait()
    counts = torch.stack([send[:, El], recv[:, El], recv[:, :El].sum(1)])
    # Before the read: every pair's slots (those that travel come first) and where they land.
    token_S, rank_S = unheld.row_source_R // P, unheld.row_expert_R
    slots_SK = indices_TK[token_S] - (rank_S * El)[:, None]
    slots_SK = torch.where((slots_SK >= 0) & (slots_SK < El), slots_SK, El).to(torch.int32)  # El: elsewhere
    arrived_NK = torch.full((P * T, K), El, dtype=torch.int32, device=device)
    # The one host sync: tokens to send and to receive per rank, rows for each local expert.
    send_splits, recv_splits, recv_rows = counts.tolist()
    ep.events.append(Event("a2a_splits", None, None, -1, t0, now(), recv.numel() * 8, "dispatch"))
    sent, received = sum(send_splits), sum(recv_splits)
    if received > arrived_NK.shape[0]:  # another rank routes more tokens than this one
        arrived_NK = torch.full((received, K), El, dtype=torch.int32, device=device)
    t0 = now()
    ep.group.all_to_all(arrived_NK[:received], slots_SK[:sent], recv_splits, send_splits).wait()
    ep.events.append(Event("all_to_all", None, None, -1, t0, now(), sent * K * 4, "slots"))
    arrivals = Arrivals(arrived_NK, received, sum(recv_rows), El, dispatcher)
    return without_missing(unheld, sent, P), Exchange(Crossing.TOKENS, send_splits, recv_splits, None, None, None,
                                                      arrivals)


def expert_major(counts_PE: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows received source-major (``counts_PE[src, expert]`` of each) put expert-major,
    the order the grouped GEMMs want: ``(order, inverse)``, ``expert_major_rows =
    rows[order]`` and back ``rows = expert_major_rows[inverse]``. ``rows``: their
    length, at least the rows received (past those both are the identity); fewer gives
    indices in range but meaningless."""
    P, El = counts_PE.shape
    device = counts_PE.device
    sizes = counts_PE.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    by_expert = torch.arange(P * El, device=device).view(P, El).t().reshape(-1)
    sizes_t = sizes[by_expert]
    ends_t = torch.cumsum(sizes_t, 0)
    shift = torch.cat([starts[by_expert] - (ends_t - sizes_t), sizes.new_zeros(1)])
    out_row = torch.arange(rows, device=device)
    order = (out_row + shift[torch.searchsorted(ends_t, out_row, right=True)]).clamp_(max=rows - 1)
    inverse = torch.empty_like(order)
    inverse[order] = out_row
    return order, inverse


class Transfer:
    """Rows in flight between the expert-parallel ranks (no autograd).

    ``wait()`` blocks until they landed and returns them in the receiver's order;
    ``event()`` describes the exchange for the trace (``node`` and ``mb``: who issued it).
    """

    def __init__(self, out: torch.Tensor, pending: Pending, finish, nbytes: int, purpose: str):
        self.out, self.pending, self.finish, self.nbytes, self.purpose = out, pending, finish, nbytes, purpose
        self.issued, self.landed = now(), None
        self.node, self.mb = None, -1

    def wait(self) -> torch.Tensor:
        if self.landed is None:
            self.pending.wait()
            self.landed = now()
            self.out = self.finish(self.out)
        return self.out

    def event(self) -> Event:
        return Event("all_to_all", None, self.node, self.mb, self.issued, self.landed, self.nbytes, self.purpose)


def _exchange(x: torch.Tensor, send_splits, recv_splits, group: Group, finish, purpose: str) -> Transfer:
    x = x.detach().contiguous()
    rows = sum(recv_splits) if recv_splits is not None else x.shape[0]
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    nbytes = x.numel() * x.element_size()
    return Transfer(out, group.all_to_all(out, x, recv_splits, send_splits), finish, nbytes, purpose)


def to_experts(x_RD: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None,
               purpose: str = "dispatch") -> Transfer:
    """Start sending rows permuted by global expert to their experts' ranks; the
    Transfer lands as this rank's rows grouped by local expert.

    Used for the forward dispatch and, as its adjoint, for the combine's backward.
    """
    return _exchange(x_RD, ex.send_splits, ex.recv_splits, ep.group, _expert_major(ex, ep, capacity), purpose)


def _expert_major(ex: Exchange, ep: ExpertParallel, capacity: int | None):
    """How the rows landing on an expert rank are put in the grouped GEMMs' order."""
    P, El = ep.group.size, ep.experts_per_rank
    match ex.crossing:
        case Crossing.ROWS:
            return lambda y: y.index_select(0, ex.order)
        case Crossing.CAPACITY:
            return lambda y: y.view(P, El, capacity, -1).transpose(0, 1).reshape(El * P * capacity, -1)
        case Crossing.TOKENS:  # the receiver's Dispatch orders their rows
            return lambda y: y
    raise ValueError(f"{ex.crossing}: no row crosses ranks")


def from_experts(y_local: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None,
                 purpose: str = "combine") -> Transfer:
    """Inverse of ``to_experts``: start sending this rank's expert-major rows back to
    their owners; the Transfer lands in the owner's permuted order.

    Used for the forward combine and, as its adjoint, for the dispatch's backward.
    """
    return _exchange(_source_major(y_local, ex, ep, capacity), ex.recv_splits, ex.send_splits, ep.group,
                     lambda rows: rows, purpose)


def _source_major(y_local: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None) -> torch.Tensor:
    """An expert rank's rows in the order they go back to their ranks (``_expert_major``'s inverse)."""
    P, El = ep.group.size, ep.experts_per_rank
    match ex.crossing:
        case Crossing.ROWS:
            return y_local.index_select(0, ex.inverse)
        case Crossing.CAPACITY:
            return y_local.view(El, P, capacity, -1).transpose(0, 1).reshape(P * El * capacity, -1)
        case Crossing.TOKENS:  # a token's rows already summed, in the order its Dispatch received them
            return y_local
    raise ValueError(f"{ex.crossing}: no row crosses ranks")


class _Landed(torch.autograd.Function):
    # The received rows of ``transfer``; backward sends the gradient back by ``adjoint``.
    @staticmethod
    def forward(ctx, x, transfer: Transfer, adjoint, events: list):
        ctx.adjoint, ctx.events = adjoint, events
        rows = transfer.wait()
        events.append(transfer.event())
        return rows

    @staticmethod
    def backward(ctx, grad):
        back = ctx.adjoint(grad)
        rows = back.wait()
        ctx.events.append(back.event())
        return rows, None, None, None


class InFlight:
    """A differentiable dispatch or combine in flight: ``wait()`` returns its rows,
    whose backward is the reverse exchange (issued and waited at once)."""

    def __init__(self, x: torch.Tensor, transfer: Transfer, adjoint, ep: ExpertParallel):
        self.x, self.transfer, self.adjoint, self.ep = x, transfer, adjoint, ep

    def wait(self) -> torch.Tensor:
        return _Landed.apply(self.x, self.transfer, self.adjoint, self.ep.events)


def dispatch(x_RD: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None) -> InFlight:
    """``to_experts`` under autograd: ``wait()`` gives this rank's rows grouped by local expert."""
    return InFlight(x_RD, to_experts(x_RD, ex, ep, capacity),
                    lambda g: from_experts(g, ex, ep, capacity, "dispatch_grad"), ep)


def combine(y_local: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None) -> InFlight:
    """``from_experts`` under autograd: ``wait()`` gives the rows in the original permuted order."""
    return InFlight(y_local, from_experts(y_local, ex, ep, capacity),
                    lambda g: to_experts(g, ex, ep, capacity, "combine_grad"), ep)
