"""``Plan.lora`` in the executor: the adapter pieces a rank's nodes compute with, and their gradients.

The base is frozen: its gathered views hold no gradient, so autograd skips its weight
GEMMs and the lifecycle reduces nothing. Each adapted matrix a node reads comes as an
``Adapted`` (``fmoe.layers.adapted``): the base's view and this rank's piece of the adapter
on it. A piece is what the rank's view is of the full matrix: its experts (``ep``), its
tensor-parallel columns (``b``'s) or rows (``a``'s), ``q``, ``k`` and ``v``'s adapters side by
side on ``qkv`` (``a`` concatenated, ``b`` block-diagonal), the scale folded into ``b``.

``start`` makes the pieces once per step, differentiably from the adapters, and hands
them to the nodes as fp32 leaves of their own; each node's backward adds its pieces'
gradients up (``add_grads``), and ``finish`` carries the sums to the adapters in one backward
through the pieces' making. A rank's part is what its own products contributed: the
step sums the parts over the ranks (``fmoe.step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layers.adapted import Adapted
from ..params import Domain
from ..shard.spec import ShardSpec


@dataclass
class AdapterRun:
    """One step's adapters.

    Attributes:
        leaves: ``{adapter leaf name: fp32 tensor}`` (``layers.0.attn.q.a``), requiring grad
            when training.
        made: ``{param path: (a, b)}``: the pieces as functions of ``leaves``.
        pieces: ``{param path: (a, b)}``: the same values as leaves of the nodes' graphs.
        grads: ``{param path: [grad a, grad b]}`` (fp32) summed over the backwards so far.
    """

    leaves: dict
    made: dict
    pieces: dict
    grads: dict


def start(named: dict, adapted: dict, spec: ShardSpec, rank: int, train: bool) -> AdapterRun:
    """This rank's pieces of the adapters ``named`` (``{leaf name: tensor}``, whole) on the
    parameters its stage holds; ``adapted``: ``Execution.adapted``,
    ``((path, scale, ((name, first column, end column), ...)), ...)``."""
    leaves = {name: t.detach().requires_grad_(train) for name, t in named.items()}
    made = {}
    with torch.set_grad_enabled(train):
        for path, scale, on in adapted:
            if spec.holds(path, rank):
                made[path] = _piece(path, on, scale, leaves, spec, rank)
    pieces = {path: tuple(t.detach().requires_grad_(train) for t in ab) for path, ab in made.items()}
    return AdapterRun(leaves, made, pieces, {})


def _piece(path: str, on: tuple, scale: float, leaves: dict, spec: ShardSpec, rank: int):
    """``(a [.., in, R], scale * b [.., R, out])`` of the adapters ``on`` parameter ``path``,
    cut as the rank's view of it is."""
    leaf = spec.table[path]
    out = leaf.shape[-1]
    a = torch.cat([leaves[f"{name}.a"] for name, _, _ in on], dim=-1)
    b = torch.cat([F.pad(leaves[f"{name}.b"], (lo, out - hi)) for name, lo, hi in on], dim=-2) * scale
    if leaf.domain == Domain.EXPERT and spec.ep > 1:
        first = spec.ep_index(rank) * spec.experts_per_rank
        a, b = a[first:first + spec.experts_per_rank], b[first:first + spec.experts_per_rank]
    if spec.cuts(path):
        split, degree, index = leaf.split, spec.degree(leaf), spec.split_index(leaf, rank)
        if split.axis == len(leaf.shape) - 1:
            b = split.cut(b, degree, index)
        elif split.axis == len(leaf.shape) - 2:
            a = split.cut(a, degree, index)
        else:
            raise NotImplementedError(f"{path}: adapters on a matrix cut along axis {split.axis}")
    return a, b


def adapted(run: AdapterRun, weights: dict) -> dict:
    """A node's ``{path: weight}`` with each adapted one as an ``Adapted``."""
    return {p: Adapted(w, *run.pieces[p]) if p in run.pieces else w for p, w in weights.items()}


def add_grads(run: AdapterRun, grads: dict) -> None:
    """Add a backward's ``{path: (grad a, grad b)}`` into the step's sums."""
    for path, pair in grads.items():
        held = run.grads.get(path)
        if held is None:
            run.grads[path] = [None if g is None else g.float().clone() for g in pair]
        else:
            for i, g in enumerate(pair):
                if g is not None:
                    held[i] = g.float().clone() if held[i] is None else held[i].add_(g)


def finish(run: AdapterRun) -> dict:
    """``{adapter leaf name: fp32 gradient}``: this rank's part (zeros for the adapters on
    matrices it does not compute with)."""
    outs, seeds = [], []
    for path, pair in run.grads.items():
        for made, g in zip(run.made[path], pair):
            if g is not None:
                outs.append(made)
                seeds.append(g)
    names = list(run.leaves)
    got = torch.autograd.grad(outs, [run.leaves[n] for n in names], seeds, allow_unused=True) if outs else \
        [None] * len(names)
    # each its own contiguous tensor (a slice of a concatenation's gradient is a view), as the
    # optimizer's fused kernels take them
    return {n: torch.zeros_like(run.leaves[n]) if g is None else g.contiguous() for n, g in zip(names, got)}
