"""Expert parallelism: tokens travel to the ranks owning their experts and back.

With ``ep`` ranks, rank ``j`` owns experts ``[j*El, (j+1)*El)`` (``El = E / ep``).
After the local permute, the rows for each owner are one contiguous block, so
dispatch is one ``all_to_all`` and combine is its mirror image.

- Dropless: each rank sends a different number of rows to each owner. The split
  sizes are exchanged first (a small all-to-all of per-expert counts) and read on
  the host: that sync is an explicit step, recorded in the trace as ``a2a_splits``.
- Static capacity: every (source rank, expert) block has exactly ``C`` rows, so the
  all-to-all has equal splits and nothing is read on the host (CUDA-graph friendly).

``to_experts`` and ``from_experts`` (each the other's adjoint) return Transfers
that a schedule issues and waits for explicitly, computing something else in
between; ``dispatch`` and ``combine`` wrap them for plain autograd (``moe``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..dist.comm import Group, Pending
from ..dist.trace import Event, now


@dataclass
class ExpertParallel:
    """What an MoE layer needs to reach the other expert ranks.

    Attributes:
        group: the expert-parallel group (size ``ep``).
        experts_per_rank: ``El = E / ep``.
        events: host syncs and exchanges are appended here (the step's trace).
    """

    group: Group
    experts_per_rank: int
    events: list = field(default_factory=list)


class Segments(NamedTuple):
    """Row segments of the local experts, as ``grouped_matmul`` and the biases need."""

    rows_E: torch.Tensor
    offsets_E: torch.Tensor
    row_expert_R: torch.Tensor
    capacity: int | None = None  # rows of every segment, when a static capacity fixes them


def segments_of(rows_E: torch.Tensor, total: int, capacity: int | None = None) -> Segments:
    """The Segments of ``total`` rows grouped by expert, ``rows_E`` of each."""
    experts = torch.arange(rows_E.shape[0], device=rows_E.device)
    return Segments(rows_E, torch.cumsum(rows_E, 0).to(torch.int32),
                    torch.repeat_interleave(experts, rows_E, output_size=total), capacity)


class Exchange(NamedTuple):
    """How one layer's rows travel: split sizes, and the source-major <-> expert-major
    permutation of the received rows (dropless), or None with a static capacity."""

    send_splits: list | None
    recv_splits: list | None
    order: torch.Tensor | None
    inverse: torch.Tensor | None
    segments: Segments


def plan_exchange(rows_E: torch.Tensor, capacity: int | None, ep: ExpertParallel) -> Exchange:
    """Split sizes and local-expert segments for rows permuted by global expert
    (``rows_E``: the permuted buffer's segment sizes)."""
    P, El = ep.group.size, ep.experts_per_rank
    device = rows_E.device
    if capacity is not None:
        rows = torch.full((El,), P * capacity, dtype=torch.long, device=device)
        return Exchange(None, None, None, None, segments_of(rows, El * P * capacity, P * capacity))
    send_counts = rows_E.view(P, El)
    recv_counts = torch.empty_like(send_counts)
    t0 = now()
    ep.group.all_to_all(recv_counts.view(-1), send_counts.reshape(-1)).wait()
    # The one host sync dropless dispatch needs: both split lists in one read.
    send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    ep.events.append(Event("a2a_splits", None, None, -1, t0, now(), recv_counts.numel() * 8, "dispatch"))
    total = sum(recv_splits)
    order, inverse = expert_major(recv_counts, total)
    return Exchange(send_splits, recv_splits, order, inverse, segments_of(recv_counts.sum(0), total))


def expert_major(counts_PE: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows received source-major (``counts_PE[src, expert]`` of each) put expert-major,
    the order the grouped GEMMs want: ``(order, inverse)``, ``expert_major_rows =
    rows[order]`` and back ``rows = expert_major_rows[inverse]``."""
    P, El = counts_PE.shape
    device = counts_PE.device
    sizes = counts_PE.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    by_expert = torch.arange(P * El, device=device).view(P, El).t().reshape(-1)
    sizes_t, starts_t = sizes[by_expert], starts[by_expert]
    out_starts = torch.cumsum(sizes_t, 0) - sizes_t
    order = torch.arange(total, device=device) + torch.repeat_interleave(starts_t - out_starts, sizes_t,
                                                                         output_size=total)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total, device=device)
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
    P, El = ep.group.size, ep.experts_per_rank
    if capacity is None:
        finish = lambda y: y.index_select(0, ex.order)  # noqa: E731
    else:
        finish = lambda y: y.view(P, El, capacity, -1).transpose(0, 1).reshape(El * P * capacity, -1)  # noqa: E731
    return _exchange(x_RD, ex.send_splits, ex.recv_splits, ep.group, finish, purpose)


def from_experts(y_local: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None,
                 purpose: str = "combine") -> Transfer:
    """Inverse of ``to_experts``: start sending this rank's expert-major rows back to
    their owners; the Transfer lands in the owner's permuted order.

    Used for the forward combine and, as its adjoint, for the dispatch's backward.
    """
    if capacity is None:
        y = y_local.index_select(0, ex.inverse)
    else:
        P, El = ep.group.size, ep.experts_per_rank
        y = y_local.view(El, P, capacity, -1).transpose(0, 1).reshape(P * El * capacity, -1)
    return _exchange(y, ex.recv_splits, ex.send_splits, ep.group, lambda rows: rows, purpose)


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
