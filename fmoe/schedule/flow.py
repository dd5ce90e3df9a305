"""What moves between a program's actions: one typed record per microbatch.

A ``MicrobatchFlow`` holds the microbatch's rows, the residual stream ``h`` between
nodes (``embed``, each ``Land`` and each ``dense`` leave it, the next ``attn``, ``dense`` or
``head`` takes it)
and its gradient on the way back, and per layer a ``LayerFlow``: what its nodes hand
each other forward (the records of ``fmoe.layers.nodes``: ``Attended`` -> ``Sent`` ->
``y`` -> ``Landing``, beside the layer's ``Routed`` plan), the autograd
``Tape`` of each node until its backward, and the gradients of each node's outputs
until that node's backward takes them. Every slot is written by one action and taken
by a later one (``take``), which raises if the program runs them out of order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import optree
import torch

from ..batch import Batch
from ..layers.block_masks import Documents
from ..layers.adapted import Adapted
from ..layers.experts import DeferredWgrad
from ..layers.fp8 import Fp8Weight
from ..layers.moe import Routed
from ..layers.nodes import Attended, Landing, Sent
from ..shard.lifecycle import LifecycleError
from .actions import Node


@dataclass
class Tape:
    """A node's autograd record, kept for its backward: detached ``inputs`` (by name: a
    record's fields, ``_asdict()``), differentiable ``outputs`` (by name), its weight leaves and an optional scalar
    ``objective``; an ``attn`` tape's ``routed`` (its layer's exchange backwards read
    it); an ``experts`` tape's held-back weight GEMMs (``Plan.delay_wgrad``), which stay
    recorded after the backward until the ``Wgrad`` action runs them."""

    inputs: dict
    outputs: dict
    weights: dict
    objective: torch.Tensor | None = None
    routed: Routed | None = None
    wgrad: tuple[DeferredWgrad, dict] | None = None

    def backprop(self, grads_out: dict) -> tuple[dict, dict]:
        """Gradients of the inputs and weights from the outputs' gradients (and the objective):
        ``({input: grad}, {path: grad, or (grad a, grad b) of an Adapted's pieces}``; a frozen
        weight gets none."""
        outs, seeds = [], []
        for name, grad in grads_out.items():
            if grad is not None and self.outputs.get(name) is not None:
                outs.append(self.outputs[name])
                seeds.append(grad)
        if self.objective is not None:
            outs.append(self.objective)
            seeds.append(None)
        names = [n for n, x in self.inputs.items() if x is not None and x.requires_grad]
        weights = {p: _grad_targets(w) for p, w in self.weights.items()}
        weights = {p: ts for p, ts in weights.items() if ts}
        targets = [self.inputs[n] for n in names] + [t for ts in weights.values() for t in ts]
        if not outs or not targets:
            return dict.fromkeys(names), {}
        got = iter(torch.autograd.grad(outs, targets, seeds, allow_unused=True))
        inputs = {n: next(got) for n in names}
        return inputs, {p: tuple(next(got) for _ in ts) if isinstance(self.weights[p], Adapted) else next(got)
                        for p, ts in weights.items()}


@dataclass
class Kept:
    """``Plan.remat='full'``: what a layer's forward keeps for its ``Recompute`` (its input
    and a MoE layer's routing; under expert parallelism the rows that crossed ranks,
    both ways)."""

    h: torch.Tensor
    routed: Routed | None
    sent: Sent | None = None
    y: torch.Tensor | None = None


@dataclass
class LayerFlow:
    """One layer of one microbatch.

    Attributes:
        attended: ``attn``'s outputs, read by ``dispatch``, taken by ``combine``.
        routed: the layer's routing and exchange plan, left by ``attn``, read by
            ``dispatch``, ``experts`` and ``combine``, taken by its ``Land``.
        sent: ``dispatch``'s rows (and probabilities), in flight until ``experts`` takes them.
        y: ``experts``' output, taken by ``combine``.
        landing: ``combine``'s rows in flight and what the ``Land`` adds to them, taken by it.
        kept: ``Plan.remat='full'``: what the layer's ``Recompute`` takes.
        tapes: ``{Kind: Tape}`` waiting for their backward.
        grads: ``{Kind: {output: gradient, or a Transfer in flight}}`` for that backward.
    """

    attended: Attended | None = None
    routed: Routed | None = None
    sent: Sent | None = None
    y: torch.Tensor | None = None
    landing: Landing | None = None
    kept: Kept | None = None
    tapes: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)

    def grads_for(self, kind) -> dict:
        return self.grads.setdefault(kind, {})


@dataclass
class Stream:
    """The residual stream between nodes: who left it, and ``h`` (None while that
    ``combine``'s rows are in flight, until its ``Land``)."""

    producer: Node
    h: torch.Tensor | None


@dataclass
class MicrobatchFlow:
    """One microbatch's record.

    Attributes:
        batch: its rows; ``docs``: their packed Documents (worked out once, read by
            every layer), or None.
        stream: the residual stream forward; ``grad_h``: its gradient backward (left by
            ``head``, each ``attn`` and each ``dense``, taken by the node before them).
        layers: a LayerFlow per layer; ``tapes``: the ``embed`` and ``head`` Tapes.
    """

    batch: Batch
    docs: Documents | None
    layers: list[LayerFlow]
    stream: Stream | None = None
    grad_h: torch.Tensor | None = None
    tapes: dict = field(default_factory=dict)


def take(record, name: str, what: str):
    """Take ``record.name`` (leaving None); LifecycleError if no action has written it."""
    value = getattr(record, name)
    if value is None:
        raise LifecycleError(f"{what}: its input {name!r} has not been produced; the program runs nodes out of order")
    setattr(record, name, None)
    return value


def take_tape(tapes: dict, kind, what: str) -> Tape:
    try:
        return tapes.pop(kind)
    except KeyError:
        raise LifecycleError(f"{what}: no forward record; the program runs nodes out of order") from None


def leaf(x, train: bool):
    """``x`` detached as an input leaf of a node's graph."""
    if x is None:
        return None
    return x.detach().requires_grad_(train and x.is_floating_point())


def leaves(record, train: bool):
    """Each field of ``record`` (a NamedTuple of tensors or None) as ``leaf``."""
    return type(record)(*(leaf(x, train) for x in record))


def weight_leaf(w, train: bool):
    """A gathered weight as a leaf of the node's graph; an ``Fp8Weight``'s gradient
    goes to its ``grad_leaf``."""
    if isinstance(w, Fp8Weight):
        return w._replace(grad_leaf=w.grad_leaf.detach().requires_grad_(train))
    return w.detach().requires_grad_(train)


def _grad_targets(w) -> tuple:
    """What a weight's gradient is taken of: the tensor (an ``Fp8Weight``'s ``grad_leaf``),
    an ``Adapted``'s adapter pieces (its base is frozen); nothing for a frozen weight."""
    if isinstance(w, Adapted):
        return w.a, w.b
    t = w.grad_leaf if isinstance(w, Fp8Weight) else w
    return (t,) if t.requires_grad else ()


def detached(tree):
    """``tree`` with every tensor detached. A forward whose layer is recomputed runs
    under autograd like any other (the same kernels: a compiled region's inference
    graph would round differently) and keeps none of it: once its outputs are
    detached, nothing holds the graph and what it saved."""
    return optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True)
