"""The collectives fmoe issues, as async calls over a process group.

Every call returns a ``Pending`` (the work handle plus what to do once it lands);
with a group of one rank nothing is sent and the result is ready at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Pending:
    """An issued collective: ``wait()`` blocks until its output may be read."""

    work: object = None
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            if self.work is not None:
                self.work.wait()
            self.done = True


@dataclass(frozen=True)
class Group:
    """A process group and this rank's place in it (``group=None``: the world)."""

    size: int
    rank: int
    group: object = field(default=None, compare=False)

    @staticmethod
    def world() -> "Group":
        if dist.is_available() and dist.is_initialized():
            return Group(dist.get_world_size(), dist.get_rank(), dist.group.WORLD)
        return Group(1, 0, None)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Pending:
        """``out[k*S:(k+1)*S] = shard of rank k``."""
        if self.size == 1:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return Pending(done=True)
        if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # moved as bytes: gloo has no FP8 types
            out, shard = out.view(torch.uint8), shard.view(torch.uint8)
        return Pending(_all_gather_flat(out, shard, group=self.group, async_op=True))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Pending:
        """``out = sum over ranks of full[rank*S:(rank+1)*S]``."""
        if self.size == 1:
            out.copy_(full)
            return Pending(done=True)
        return Pending(_reduce_scatter_flat(out, full, group=self.group, async_op=True))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> Pending:
        """Rows ``inp`` split by ``in_splits`` go one block per rank; ``out`` receives
        ``out_splits`` rows from each rank (equal blocks when the splits are None)."""
        if self.size == 1:
            out.copy_(inp)
            return Pending(done=True)
        return Pending(dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                                              input_split_sizes=in_splits, group=self.group, async_op=True))

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """World rank ``src``'s ``t`` on every rank of the group (in place; blocking)."""
        if self.size > 1:
            dist.broadcast(t, src=src, group=self.group)
        return t

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> Pending:
        """In-place sum (or ``op``: ``dist.ReduceOp.MAX``...) over ranks."""
        if self.size == 1:
            return Pending(done=True)
        return Pending(dist.all_reduce(t, op=op, group=self.group, async_op=True))


def summed(group: Group, tensors: list) -> list:
    """Each of ``tensors`` summed over ``group``'s ranks, as views of one flat buffer (one
    all-reduce for all of them, blocking); the tensors themselves when the group is one rank."""
    if group.size == 1 or not tensors:
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    group.all_reduce(flat).wait()
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def send(t: torch.Tensor, peer: int, group: Group | None = None) -> Pending:
    """Start sending ``t`` to world rank ``peer`` (point to point; on ``group``, else the world)."""
    return Pending(dist.isend(t.contiguous(), dst=peer, group=None if group is None else group.group))


def recv(out: torch.Tensor, peer: int, group: Group | None = None) -> Pending:
    """Start receiving into ``out`` from world rank ``peer`` (on ``group``, else the world)."""
    return Pending(dist.irecv(out, src=peer, group=None if group is None else group.group))


def gather_texts(text: str, world: Group, device) -> list[str]:
    """Every rank's ``text`` in rank order, on every rank of ``world`` (sent as tensors
    on ``device``, padded to the longest; no pickle involved)."""
    if world.size == 1:
        return [text]
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], device=device)
    lengths = [torch.empty_like(length) for _ in range(world.size)]
    dist.all_gather(lengths, length, group=world.group)
    sizes = [int(n) for n in lengths]
    padded = torch.zeros(max(1, *sizes), dtype=torch.uint8, device=device)  # never an empty collective
    padded[:data.numel()] = data
    got = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(got, padded, group=world.group)
    return [bytes(g[:n].cpu().tolist()).decode() for g, n in zip(got, sizes)]


def broadcast_text(text: str | None, world: Group, device) -> str | None:
    """Rank 0's ``text`` (or None) on every rank of ``world``, sent as tensors on
    ``device`` (NCCL has no CPU tensors); no pickle involved."""
    if world.size == 1:
        return text
    encoded = list((text or "").encode()) if world.rank == 0 else []
    length = torch.tensor([len(encoded) if (text is not None or world.rank != 0) else -1], device=device)
    dist.broadcast(length, src=0, group=world.group)
    if int(length) < 0:
        return None
    data = torch.tensor(encoded, dtype=torch.uint8, device=device) if world.rank == 0 else \
        torch.empty(int(length), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0, group=world.group)
    return bytes(data.cpu().tolist()).decode()
