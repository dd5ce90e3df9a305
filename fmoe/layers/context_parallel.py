"""Context parallelism (``Plan.cp``): one sequence's attention over ``cp`` ranks.

Each sequence of ``S`` positions is cut into ``2 cp`` chunks of ``L``; the rank of
context index ``c`` holds chunks ``c`` and ``2 cp - 1 - c`` (``fmoe.local_batch``), as
two consecutive rows. Under causal attention a late chunk costs more than an early one,
so each rank's pair costs the same. Everything but attention works on positions
alone; attention gathers every rank's keys and values (an all-gather whose backward
is the reduce-scatter of their gradients), puts them in sequence order, and attends
each of the rank's two query chunks to the keys up to its own end (``causal`` aligned
bottom-right: SDPA's flash-class kernels, no mask tensor). RoPE rotates each position
by its place in the sequence. Packed documents (``segments``) are refused.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as fc
from einops import rearrange
from torch.nn.attention.bias import causal_lower_right

from ..comm.trace import Event, now

_gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


class ContextParallel(NamedTuple):
    """The ranks holding chunks of the same sequences: ``size`` of them, this one
    ``rank``; ``events``: where an eager step records the keys' and values' gather (as
    ``TensorParallel``'s)."""

    size: int
    rank: int
    group: object
    events: list | None = None
    causal: tuple | None = None

    def recording(self, events: list) -> "ContextParallel":
        return self._replace(events=events)

    def for_chunks_of(self, length: int) -> "ContextParallel":
        """With the two chunks' bottom-right causal biases for chunks of ``length``
        positions made here, outside any compiled region: dynamo takes such a bias as
        an input but cannot construct one."""
        return self._replace(causal=_causal_biases(length, self.chunks()))

    def chunks(self) -> tuple[int, int]:
        """The sequence chunks this rank holds, ``(c, 2 cp - 1 - c)``."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, rows: int, length: int, device) -> torch.Tensor:
        """``[rows, length]``: the sequence position of every local position (rows come
        in pairs, the two chunks of one sequence)."""
        first, second = self.chunks()
        starts = torch.arange(2, device=device) * (second - first) * length + first * length
        return (starts[:, None] + torch.arange(length, device=device)).repeat(rows // 2, 1)

    def sequence_keys(self, k_BKLd: torch.Tensor) -> torch.Tensor:
        """Every rank's keys (or values) ``[2b, K, L, d]`` (pairs of chunks) as the whole
        sequences' ``[b, K, S, d]``, in sequence order."""
        pairs = rearrange(k_BKLd, "(b two) k l d -> b k (two l) d", two=2)
        recording = self.events is not None and not torch.compiler.is_compiling()
        t0 = now() if recording else 0.0
        every = fc.wait_tensor(_gather(pairs.contiguous(), 2, self.group))  # [b, K, cp * 2L, d], rank-major
        if recording:
            self.events.append(Event("all_gather", None, None, -1, t0, now(), every.numel() * every.element_size(),
                                     "cp"))
        every = rearrange(every, "b k (r two l) d -> b k r two l d", r=self.size, two=2)
        firsts, seconds = every[:, :, :, 0], every[:, :, :, 1].flip(2)  # chunks 0..cp-1, then cp..2cp-1
        return rearrange(torch.cat([firsts, seconds], dim=2), "b k c l d -> b k (c l) d")


@functools.lru_cache(maxsize=64)
def _causal_biases(length: int, chunks: tuple) -> tuple:
    return tuple(causal_lower_right(length, (chunk + 1) * length) for chunk in chunks)


def attend_chunks(q_BHLd: torch.Tensor, k_bKSd: torch.Tensor, v_bKSe: torch.Tensor, cp: ContextParallel,
                  attend) -> torch.Tensor:
    """Causal attention of this rank's query chunks ``[2b, H, L, d]`` over the whole
    sequences' keys and values (``sequence_keys``).

    Arguments:
        attend: ``(q, k, v, causal, q_start) -> o`` for one chunk of queries starting at
            sequence position ``q_start`` over the keys before its end; ``causal``: the
            bottom-right causal bias (the caller may work out a mask of its own from
            ``q_start``, for a window).

    Returns:
        ``[2b, L, H * e]``, rows as the queries'.
    """
    L = q_BHLd.shape[2]
    q_bH2Ld = rearrange(q_BHLd, "(b two) h l d -> b h two l d", two=2)
    outs = []
    causal = cp.causal or _causal_biases(L, cp.chunks())
    for slot, chunk in enumerate(cp.chunks()):
        keys = (chunk + 1) * L
        outs.append(attend(q_bH2Ld[:, :, slot], k_bKSd[:, :, :keys], v_bKSe[:, :, :keys], causal[slot], chunk * L))
    return rearrange(torch.stack(outs, dim=1), "b two h l e -> (b two) l (h e)")
