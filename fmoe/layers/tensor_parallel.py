"""Tensor parallelism inside the kernels: the collectives, and the vocabulary-parallel
embedding and cross-entropy.

Under ``Plan.tp > 1`` the residual stream is split by position over the ``tp`` ranks
(sequence parallelism): each holds ``[B, S / tp, D]``. A layer gathers the normalised
positions (``gather``), computes its heads or hidden units on all of them with its own
slice of the weights, and sums the partial outputs back into each rank's positions
(``scatter``, a reduce-scatter); the norms, the residual adds, the router and the
experts' input run on a rank's own positions. The collectives are torch's functional
ones: differentiable (each one's backward is the other) and traceable, so a compiled
kernel keeps them inside its graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as fc

from ..batch import IGNORE
from ..config import ModelConfig
from ..comm.trace import Event, now
from .embedding import embed
from .precision import upcast

# torch 2.13 renamed the flat functional collectives; older releases have only the old names
_gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
_gather_values = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_scatter = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd


class TensorParallel(NamedTuple):
    """A group of ranks that each hold one slice of the same weights.

    Attributes:
        size: the ranks in the group; ``rank``: this one's index.
        group: the process group.
        name: the group's name in the trace (``tp``, ``etp``).
        events: where an eager step records each forward collective (an Event with
            purpose ``name``; a compiled step records none, and the backward's
            collectives run inside autograd, within their node's span).
    """

    size: int
    rank: int
    group: object
    name: str = "tp"
    events: list | None = None

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (backward: the
        gradient's reduce-scatter)."""
        t0 = self._start()
        out = fc.wait_tensor(_gather(x.contiguous(), dim, self.group))
        return self._recorded("all_gather", t0, out)

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The sum of every rank's ``x``, this rank's ``1 / size`` of it along ``dim``
        (backward: the gradient's all-gather)."""
        t0 = self._start()
        out = fc.wait_tensor(_scatter(x.contiguous(), "sum", dim, self.group))
        return self._recorded("reduce_scatter", t0, x, out)

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked on a new first axis, in rank order; not differentiable."""
        t0 = self._start()
        out = fc.wait_tensor(_gather_values(x.contiguous(), 0, self.group)).view(self.size, *x.shape)
        return self._recorded("all_gather", t0, out)

    def exchange(self, x: torch.Tensor, out_splits: list, in_splits: list) -> torch.Tensor:
        """Rows of ``x`` (``in_splits[j]`` to rank ``j``) exchanged over the group, ``out_splits[j]``
        received from rank ``j`` (backward: the reverse exchange)."""
        t0 = self._start()
        out = fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, self.group))
        return self._recorded("all_to_all", t0, x, out)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``x`` reduced over the group (``sum`` or ``max``); not differentiable."""
        t0 = self._start()
        return self._recorded("all_reduce", t0, fc.wait_tensor(fc.all_reduce(x, op, self.group)))

    def _start(self) -> float | None:
        """The time a recorded collective starts (None: not recorded; dynamo reads no clock)."""
        return now() if self.events is not None and not torch.compiler.is_compiling() else None

    def _recorded(self, kind: str, t0: float | None, moved: torch.Tensor, out: torch.Tensor | None = None):
        if t0 is not None:
            self.events.append(Event(kind, None, None, -1, t0, now(), moved.numel() * moved.element_size(),
                                     self.name))
        return moved if out is None else out

    def recording(self, events: list) -> "TensorParallel":
        """The same group, recording its collectives into ``events``."""
        return self._replace(events=events)


@functools.lru_cache(maxsize=64)
def local_model(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The attention one of ``tp`` ranks computes: ``heads / tp`` query heads and their
    key/value heads (one copy when ``kv_heads < tp``), each of the same size."""
    if tp == 1:
        return cfg
    kv = 0 if not cfg.kv_heads else max(cfg.kv_heads // tp, 1)
    return cfg.replace(heads=cfg.heads // tp, kv_heads=kv, head_size=cfg.head_dim)


class _SumOverCopies(torch.autograd.Function):
    # Forward: ``w`` itself. Backward: the gradient of the columns from ``first`` on (a
    # key/value head that ``copies`` ranks of the group hold, each reading it for its
    # own query heads) summed over those ranks: one all-reduce over the group of a
    # buffer with a slot per head.
    @staticmethod
    def forward(ctx, w, tp, first, copies):
        ctx.tp, ctx.first, ctx.copies = tp, first, copies
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        tp, first, copies = ctx.tp, ctx.first, ctx.copies
        cols = grad[..., first:]
        slots = cols.new_zeros((tp.size // copies,) + tuple(cols.shape))
        slots[tp.rank // copies] = cols
        summed = tp.all_reduce(slots)[tp.rank // copies]
        return torch.cat([grad[..., :first], summed], dim=-1), None, None, None


def sum_over_copies(w: torch.Tensor, tp: TensorParallel, first: int, copies: int) -> torch.Tensor:
    """``w``, whose columns from ``first`` on are a copy that ``copies`` ranks of ``tp``
    hold: their gradient is summed over those ranks, so every copy gets the same one."""
    return _SumOverCopies.apply(w, tp, first, copies)


def kv_copies(cfg: ModelConfig, tp: int) -> int:
    """How many of ``tp`` ranks hold each key/value head (1: the heads are cut)."""
    kv = cfg.num_kv_heads
    return 1 if kv % tp == 0 else tp // kv


def embed_vocab_parallel(w_VlD: torch.Tensor, tokens_BS: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The embedding of ``tokens`` from this rank's ``V / tp`` vocabulary rows, summed over
    ``tp`` into this rank's positions: ``[B, S / tp, D]`` (each id's row lives on one
    rank; the others add zeros)."""
    rows = w_VlD.shape[0]
    local = tokens_BS - tp.rank * rows
    inside = (local >= 0) & (local < rows)
    h = embed(w_VlD, local.clamp(0, rows - 1)) * inside[..., None].to(w_VlD.dtype)
    return tp.scatter(h, 1)


class _VocabParallelCE(torch.autograd.Function):
    # Per-token cross-entropy of logits split by vocabulary over the group: the max, the
    # sum of exponentials and the target's logit are all-reduced, so no rank ever holds
    # [T, V]. Every rank gets the same losses; the backward gives each rank the gradient
    # of its own logits (softmax minus one-hot, on its columns), not multiplied by the
    # group's size.
    @staticmethod
    def forward(ctx, logits_TV, targets_T, tp):
        vocab = logits_TV.shape[-1]
        local = targets_T - tp.rank * vocab
        counted = targets_T != IGNORE
        inside = counted & (local >= 0) & (local < vocab)
        local = torch.where(inside, local, 0)
        top = tp.all_reduce(logits_TV.detach().amax(-1), "max")
        exp = (logits_TV - top[:, None]).exp()
        total = tp.all_reduce(exp.sum(-1))
        target = tp.all_reduce(torch.where(inside, logits_TV.gather(-1, local[:, None])[:, 0], 0.0))
        ctx.save_for_backward(exp, total, local, inside, counted)
        return torch.where(counted, total.log() + top - target, 0.0)

    @staticmethod
    def backward(ctx, grad_T):
        exp, total, local, inside, counted = ctx.saved_tensors
        grad = exp / total[:, None]
        grad.scatter_add_(-1, local[:, None], -inside[:, None].to(grad.dtype))
        return grad * (grad_T * counted)[:, None], None, None


def vocab_parallel_cross_entropy(logits_TV: torch.Tensor, targets_T: torch.Tensor,
                                 tp: TensorParallel) -> torch.Tensor:
    """``sum_t CE`` (fp32) of logits whose vocabulary is split over ``tp`` (this rank's
    columns: ``[T, V / tp]``) at the targets that are not ``IGNORE``."""
    return _VocabParallelCE.apply(upcast(logits_TV), targets_T, tp).sum()
