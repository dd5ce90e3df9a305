"""Pipeline parallelism's transfers: a microbatch's residual stream to the next stage,
its gradient back to the previous one (``Send`` and ``Recv`` actions of a program).

A stage's first node reads the stream a ``Recv`` left, as it would read the one the
node before it left; its last node's output is what the ``Send`` takes. Backward the
same in reverse with the stream's gradient. Sends are issued and left in flight (their
tensors kept alive) until the step ends; a ``Recv`` waits for its value, which the
1F1B order guarantees was sent before anything waits on this stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm import collectives
from ..comm.trace import Event, now
from ..shard.lifecycle import LifecycleError
from .actions import Boundary, Recv, Send
from .flow import Stream, take


@dataclass
class Pipeline:
    """This rank's neighbours and the transfers of one step.

    Attributes:
        previous, next: the world ranks of the same place in the stage before and after
            (None at the first and last stage; around the ring under interleaving).
        dtype: the stream's dtype (the plan's compute dtype).
        tp: the ranks that split a row's positions (the stream holds ``1 / tp`` of them).
        gradients: the group the stream's gradients travel on (``Mesh.pp_gradients``;
            None: the world's, as the stream's).
        sent: ``(Pending, tensor)`` of the sends in flight.
    """

    previous: int | None
    next: int | None
    dtype: torch.dtype
    tp: int = 1
    gradients: object = None
    sent: list = field(default_factory=list)

    def finish(self) -> None:
        """Wait for every send of the step."""
        for pending, _ in self.sent:
            pending.wait()
        self.sent.clear()


def send(run, a: Send) -> Event:
    """Start sending microbatch ``a.mb``'s stream to the next stage, or its gradient to the
    previous one."""
    pipe, mbf = run.pipeline, run.mbs[a.mb]
    what = f"send {a.boundary} (microbatch {a.mb})"
    if a.boundary.gradient:
        value, peer = mbf.grad_h, pipe.previous
        if value is None:
            raise LifecycleError(f"{what}: the stage's first backward has not run; the program runs nodes out of order")
        mbf.grad_h = None
    else:
        stream, peer = take(mbf, "stream", what), pipe.next
        if stream.h is None:
            raise LifecycleError(f"{what}: {stream.producer} has not landed; the program needs a land action before it")
        value = stream.h
    t0 = now()
    value = value.detach().contiguous()
    pipe.sent.append((collectives.send(value, peer, pipe.gradients if a.boundary.gradient else None), value))
    return Event("send", None, str(a.boundary), a.mb, t0, now(), value.numel() * value.element_size(), "pipeline")


def recv(run, a: Recv) -> Event:
    """Receive microbatch ``a.mb``'s stream from the previous stage (what the stage's first
    node reads), or its gradient from the next one (what its last node's backward takes)."""
    pipe, mbf = run.pipeline, run.mbs[a.mb]
    rows, positions = mbf.batch.inputs.shape
    out = torch.empty(rows, positions // pipe.tp, run.cfg.dim, dtype=pipe.dtype, device=mbf.batch.tokens.device)
    t0 = now()
    if a.boundary.gradient:
        collectives.recv(out, pipe.next, pipe.gradients).wait()
        mbf.grad_h = out
    else:
        collectives.recv(out, pipe.previous).wait()
        mbf.stream = Stream(a.boundary, out)
    return Event("recv", None, str(a.boundary), a.mb, t0, now(), out.numel() * out.element_size(), "pipeline")


def crossing_peers(dims, rank: int, ring: bool = False) -> tuple[int | None, int | None]:
    """The world ranks at ``rank``'s place in the stage before and after it; ``ring``
    (interleaved stages): the last stage's next is the first, and the other way."""
    at, P = dims.coords(rank), dims.pp
    previous = dims.rank_of(at.d, at.e, at.c, at.t, (at.s - 1) % P) if at.s > 0 or ring else None
    following = dims.rank_of(at.d, at.e, at.c, at.t, (at.s + 1) % P) if at.s < P - 1 or ring else None
    return previous, following


__all__ = ["Boundary", "Pipeline", "crossing_peers", "recv", "send"]
