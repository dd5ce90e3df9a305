"""A program's actions: small frozen values an executor interprets with ``match``.

Lifecycle transitions of a unit (``Gather``, ``Wait``, ``Release``, ``Reduce``) and
node runs for a microbatch (``Forward``, ``Land``, ``Backward``, ``Wgrad``,
``Recompute``). Each has an ``op``, the name traces and profiles show; the executor
never reads it to decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from ..layers.nodes import NODES, Kind
from ..params import Leaf


class Node(NamedTuple):
    """A piece of a step that a schedule orders.

    Attributes:
        kind: a Kind (``embed``, ``head``, or a layer's ``attn``, ``dispatch``,
            ``experts`` or ``combine``; ``layer`` for a whole layer, what a
            ``Recompute`` re-runs).
        layer: the layer index; None for ``embed`` and ``head``.
    """

    kind: Kind
    layer: int | None = None

    def __str__(self) -> str:
        if self.layer is None:
            return self.member
        return self.member if self.kind == Kind.LAYER else f"{self.member}.{Kind(self.kind).value}"

    @property
    def member(self) -> str:
        """The FSDP member it computes with: ``layers.<i>``, ``embed`` or ``head``."""
        return str(Kind(self.kind).value) if self.layer is None else f"layers.{self.layer}"

    @property
    def is_comm(self) -> bool:
        """An exchange node: no weights, no FSDP unit."""
        return self.kind in NODES and not NODES[self.kind].weights

    def sibling(self, kind: Kind) -> "Node":
        """The node ``kind`` of the same layer."""
        return Node(kind, self.layer)

    def uses(self, leaf: Leaf, tie_embeddings: bool) -> bool:
        """Whether it computes with ``leaf``: its own kind's leaves of its member, and,
        with tied embeddings, ``embed`` in ``head`` too."""
        return (leaf.node == self.kind and leaf.layer == self.layer) or \
            (tie_embeddings and self.kind == Kind.HEAD and leaf.path == "embed")


@dataclass(frozen=True, slots=True)
class _OnUnit:
    """A lifecycle transition of ``unit``."""

    unit: str


@dataclass(frozen=True, slots=True)
class Gather(_OnUnit):
    """Issue the all-gather of ``unit``'s shards (async)."""

    op: ClassVar[str] = "gather"


@dataclass(frozen=True, slots=True)
class Wait(_OnUnit):
    """Wait for ``unit``'s gather: its weights may be read."""

    op: ClassVar[str] = "wait"


@dataclass(frozen=True, slots=True)
class Release(_OnUnit):
    """Drop ``unit``'s gathered weights."""

    op: ClassVar[str] = "release"


@dataclass(frozen=True, slots=True)
class Reduce(_OnUnit):
    """Reduce ``unit``'s gradients of microbatch ``mb`` over the ranks (async);
    ``last``: the step's last microbatch."""

    mb: int
    last: bool
    op: ClassVar[str] = "reduce"


@dataclass(frozen=True, slots=True)
class _OfNode:
    """A run of ``node`` for microbatch ``mb``; ``unit``: its FSDP unit (None for an
    exchange)."""

    node: Node
    mb: int
    unit: str | None


@dataclass(frozen=True, slots=True)
class Forward(_OfNode):
    """Run ``node``'s forward."""

    op: ClassVar[str] = "forward"


@dataclass(frozen=True, slots=True)
class Land(_OfNode):
    """A ``combine``'s rows are back: wait for its exchange, unpermute, add the residual
    (right before the next node of the microbatch reads ``h``)."""

    unit: None = None
    op: ClassVar[str] = "land"


@dataclass(frozen=True, slots=True)
class Backward(_OfNode):
    """Run ``node``'s backward."""

    op: ClassVar[str] = "backward"


@dataclass(frozen=True, slots=True)
class Wgrad(_OfNode):
    """Run an ``experts`` node's delayed weight-gradient GEMMs (``Plan.delay_wgrad``)."""

    op: ClassVar[str] = "wgrad"


@dataclass(frozen=True, slots=True)
class Recompute(_OfNode):
    """``Plan.remat='full'``: re-run layer ``node`` (``Node("layer", i)``) under autograd
    before its backward."""

    op: ClassVar[str] = "recompute"


Transition = Gather | Wait | Release | Reduce
NodeRun = Forward | Land | Backward | Wgrad | Recompute
Action = Transition | NodeRun
