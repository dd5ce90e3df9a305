"""Expert parallelism: tokens travel to the ranks owning their experts and back.

With ``ep`` ranks, rank ``j`` owns experts ``[j*El, (j+1)*El)`` (``El = E / ep``).
After the local permute, the rows for each owner are one contiguous block, so
dispatch is one ``all_to_all`` and combine is its mirror image.

- Dropless: each rank sends a different number of rows to each owner. The split
  sizes are exchanged first (a small all-to-all of per-expert counts) and read on
  the host: that sync is an explicit step, recorded in the trace as ``a2a_splits``.
- Static capacity: every (source rank, expert) block has exactly ``C`` rows, so the
  all-to-all has equal splits and nothing is read on the host (CUDA-graph friendly).

``dispatch``, ``combine`` and ``all_to_all`` return handles; ``wait()`` gives the
received rows with autograd attached (their backward is the reverse all-to-all), so
a schedule can issue the exchange and compute something else before waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..shard.comm import Group, Pending
from ..shard.trace import Event, now


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


class A2AHandle:
    """An all-to-all in flight. ``wait()`` returns the received rows (differentiable)."""

    def __init__(self, x, out, pending: Pending, send_splits, recv_splits, group: Group, issued: float):
        self.x, self.out, self.pending = x, out, pending
        self.send_splits, self.recv_splits, self.group, self.issued = send_splits, recv_splits, group, issued

    def wait(self) -> torch.Tensor:
        return _Received.apply(self.x, self)


class _Received(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle: A2AHandle):
        handle.pending.wait()
        ctx.handle = handle
        return handle.out

    @staticmethod
    def backward(ctx, grad):
        h = ctx.handle
        grad = grad.contiguous()
        back = grad.new_empty((h.x.shape[0],) + tuple(grad.shape[1:]))
        h.group.all_to_all(back, grad, h.send_splits, h.recv_splits).wait()
        return back, None


def all_to_all(x: torch.Tensor, send_splits, recv_splits, group: Group) -> A2AHandle:
    """Start sending ``send_splits[j]`` rows of ``x`` to rank ``j`` (None: equal blocks)."""
    x = x.contiguous()
    rows = sum(recv_splits) if recv_splits is not None else x.shape[0]
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    issued = now()
    pending = group.all_to_all(out.detach(), x.detach(), recv_splits, send_splits)
    return A2AHandle(x, out, pending, send_splits, recv_splits, group, issued)


class _Reorder(torch.autograd.Function):
    # A permutation of rows: forward and backward are both gathers.
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class Segments(NamedTuple):
    """Row segments of the local experts, as ``grouped_matmul`` and the biases need."""

    rows_E: torch.Tensor
    offsets_E: torch.Tensor
    row_expert_R: torch.Tensor


def _segments(rows_E: torch.Tensor, total: int) -> Segments:
    experts = torch.arange(rows_E.shape[0], device=rows_E.device)
    return Segments(rows_E, torch.cumsum(rows_E, 0).to(torch.int32),
                    torch.repeat_interleave(experts, rows_E, output_size=total))


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
        return Exchange(None, None, None, None, _segments(rows, El * P * capacity))
    send_counts = rows_E.view(P, El)
    recv_counts = torch.empty_like(send_counts)
    t0 = now()
    ep.group.all_to_all(recv_counts.view(-1), send_counts.reshape(-1)).wait()
    send_splits = send_counts.sum(1).tolist()  # the host sync dropless dispatch needs
    recv_splits = recv_counts.sum(1).tolist()
    ep.events.append(Event("a2a_splits", None, None, -1, t0, now(), recv_counts.numel() * 8, "dispatch"))
    total = sum(recv_splits)
    # Received rows come source-major (src, expert); the experts want expert-major.
    sizes = recv_counts.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    by_expert = torch.arange(P * El, device=device).view(P, El).t().reshape(-1)
    sizes_t, starts_t = sizes[by_expert], starts[by_expert]
    out_starts = torch.cumsum(sizes_t, 0) - sizes_t
    order = torch.arange(total, device=device) + torch.repeat_interleave(starts_t - out_starts, sizes_t,
                                                                         output_size=total)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total, device=device)
    return Exchange(send_splits, recv_splits, order, inverse, _segments(recv_counts.sum(0), total))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class InFlight:
    """A dispatch or combine in flight: ``wait()`` returns its rows (differentiable)."""

    def __init__(self, handle: A2AHandle, finish, ep: ExpertParallel, purpose: str):
        self.handle, self.finish, self.ep, self.purpose = handle, finish, ep, purpose

    def wait(self) -> torch.Tensor:
        rows = self.handle.wait()
        nbytes = _bytes(self.handle.x)
        self.ep.events.append(Event("all_to_all", None, None, -1, self.handle.issued, now(), nbytes, self.purpose))
        return self.finish(rows)


def dispatch(x_RD: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None) -> InFlight:
    """Start sending rows permuted by global expert to their experts' ranks; ``wait()``
    gives this rank's rows grouped by local expert."""
    P, El = ep.group.size, ep.experts_per_rank
    if capacity is None:
        finish = lambda y: _Reorder.apply(y, ex.order, ex.inverse)  # noqa: E731
    else:
        finish = lambda y: y.view(P, El, capacity, -1).transpose(0, 1).reshape(El * P * capacity, -1)  # noqa: E731
    return InFlight(all_to_all(x_RD, ex.send_splits, ex.recv_splits, ep.group), finish, ep, "dispatch")


def combine(y_local: torch.Tensor, ex: Exchange, ep: ExpertParallel, capacity: int | None) -> InFlight:
    """Inverse of ``dispatch``: start sending this rank's expert outputs back to the
    rows' owners; ``wait()`` gives them in the original permuted order."""
    if capacity is None:
        y = _Reorder.apply(y_local, ex.inverse, ex.order)
    else:
        P, El = ep.group.size, ep.experts_per_rank
        y = y_local.view(El, P, capacity, -1).transpose(0, 1).reshape(P * El * capacity, -1)
    return InFlight(all_to_all(y, ex.recv_splits, ex.send_splits, ep.group), lambda rows: rows, ep, "combine")
