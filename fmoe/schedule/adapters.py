"""``Plan.lora`` in the executor: the adapter pieces a rank's nodes compute with, and their gradients.

The base is frozen: its gathered views hold no gradient, so autograd skips its weight
GEMMs and the lifecycle reduces nothing. Each adapted matrix a node reads comes as an
``Adapted`` (``fmoe.layers.adapted``): the base's view, this rank's piece of the adapter on
it and the scale. A piece is what the rank's view is of the full matrix: its experts
(``ep``), its tensor-parallel columns (``b``'s) or rows (``a``'s), ``q``, ``k`` and ``v``'s
adapters side by side on ``qkv`` (``a`` concatenated, ``b`` block-diagonal).

``start`` makes the pieces once per step and hands them to the nodes as fp32 leaves; an
adapter that is its matrix's whole piece (one adapter on all of a matrix the rank holds
whole) is its own leaf. Each node's backward adds its pieces' gradients up (``add_grads``);
``finish`` carries the sums of the pieces made from the adapters back to them in one
backward through their making. A rank's part is what its own products contributed: the
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
        made: ``{param path: (a, b)}``: the pieces made of several leaves or parts of them,
            as functions of ``leaves``.
        whole: ``{param path: (name of a, name of b)}``: the pieces that are leaves themselves.
        pieces: ``{param path: (a, b)}``: every piece as a leaf of the nodes' graphs.
        scales: ``{param path: alpha / rank}``.
        grads: ``{param path: [grad a, grad b]}`` (fp32) summed over the backwards so far.
    """

    leaves: dict
    made: dict
    whole: dict
    pieces: dict
    scales: dict
    grads: dict


def start(named: dict, adapted: tuple, spec: ShardSpec, rank: int, train: bool) -> AdapterRun:
    """This rank's pieces of the adapters ``named`` (``{leaf name: tensor}``, whole) on the
    parameters its stage holds; ``adapted``: ``Execution.adapted``,
    ``((path, scale, ((name, first column, end column), ...)), ...)``."""
    leaves = {name: t.detach().requires_grad_(train) for name, t in named.items()}
    made, whole, pieces, scales = {}, {}, {}, {}
    for path, scale, on in adapted:
        if not spec.holds(path, rank):
            continue
        scales[path] = scale
        if _is_whole(path, on, spec):
            whole[path] = (f"{on[0][0]}.a", f"{on[0][0]}.b")
            pieces[path] = tuple(leaves[name] for name in whole[path])
            continue
        with torch.set_grad_enabled(train):
            made[path] = _piece(path, on, leaves, spec, rank)
        pieces[path] = tuple(t.detach().requires_grad_(train) for t in made[path])
    return AdapterRun(leaves, made, whole, pieces, scales, {})


def _is_whole(path: str, on: tuple, spec: ShardSpec) -> bool:
    """Whether one adapter covers all of ``path`` and the rank's view of it is the whole
    matrix (no expert or tensor-parallel cut): the adapter's leaves are then the piece."""
    shape = tuple(spec.table[path].shape)
    (_, lo, hi), *more = on
    return not more and lo == 0 and hi == shape[-1] and spec.local_full_shape(path, shape) == shape


def _piece(path: str, on: tuple, leaves: dict, spec: ShardSpec, rank: int):
    """``(a [.., in, R], b [.., R, out])`` of the adapters ``on`` parameter ``path``, cut as
    the rank's view of it is."""
    leaf = spec.table[path]
    out = leaf.shape[-1]
    a = torch.cat([leaves[f"{name}.a"] for name, _, _ in on], dim=-1)
    b = torch.cat([F.pad(leaves[f"{name}.b"], (lo, out - hi)) for name, lo, hi in on], dim=-2)
    if leaf.domain == Domain.EXPERT and spec.ep > 1:
        first = spec.ep_index(rank) * spec.experts_per_rank
        a, b = a[first:first + spec.experts_per_rank], b[first:first + spec.experts_per_rank]
    if spec.cuts(path):  # a and b share the leading axes; the input axis is a's, the output axis b's
        last = len(leaf.shape) - 1
        if leaf.split.axis != last:
            a = spec.split_cut(a, path, rank)
        if leaf.split.axis != last - 1:
            b = spec.split_cut(b, path, rank)
    return a, b


def adapted(run: AdapterRun, weights: dict) -> dict:
    """A node's ``{path: weight}`` with each adapted one as an ``Adapted``."""
    return {p: Adapted(w, *run.pieces[p], run.scales[p]) if p in run.pieces else w for p, w in weights.items()}


def add_grads(run: AdapterRun, grads: dict) -> None:
    """Add a backward's ``{path: (grad a, grad b)}`` into the step's sums."""
    for path, pair in grads.items():  # autograd's gradients are tensors of their own: kept, then added into
        held = run.grads.get(path)
        if held is None:
            run.grads[path] = [None if g is None else g.float() for g in pair]
        else:
            for i, g in enumerate(pair):
                if g is not None:
                    held[i] = g.float() if held[i] is None else held[i].add_(g)


def finish(run: AdapterRun) -> dict:
    """``{adapter leaf name: fp32 gradient}``: this rank's part (zeros for the adapters on
    matrices it does not compute with)."""
    direct, outs, seeds = {}, [], []
    for path, pair in run.grads.items():
        if path in run.whole:
            direct.update((name, g) for name, g in zip(run.whole[path], pair) if g is not None)
            continue
        for made, g in zip(run.made[path], pair):
            if g is not None:
                outs.append(made)
                seeds.append(g)
    names = [n for n in run.leaves if n not in direct]
    got = dict(zip(names, torch.autograd.grad(outs, [run.leaves[n] for n in names], seeds, allow_unused=True)
                   if outs else [None] * len(names)))
    got.update(direct)
    # each its own contiguous tensor (a slice of a concatenation's gradient is a view), as the
    # optimizer's fused kernels take them
    return {n: torch.zeros_like(t) if got[n] is None else got[n].contiguous() for n, t in run.leaves.items()}
