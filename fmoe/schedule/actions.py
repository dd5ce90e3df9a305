"""A program's actions: small frozen values an executor interprets with ``match``.

Lifecycle transitions of a unit (``Gather``, ``Wait``, ``Release``, ``Reduce``), node
runs for a microbatch (``Forward``, ``Land``, ``Backward``, ``Wgrad``, ``Recompute``)
and, under pipeline parallelism, a microbatch's residual stream or its gradient sent
to or received from the neighbouring stage (``Send``, ``Recv``). Each has an ``op``,
the name traces and profiles show; the executor never reads it to decide.
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


class Boundary(NamedTuple):
    """What crosses between pipeline stages: a microbatch's residual stream (forward,
    to the next stage) or its gradient (backward, to the previous one)."""

    gradient: bool

    def __str__(self) -> str:
        return "stream gradient" if self.gradient else "stream"


STREAM, STREAM_GRADIENT = Boundary(False), Boundary(True)


@dataclass(frozen=True, slots=True)
class _Crossing:
    """A pipeline transfer of microbatch ``mb``'s ``boundary`` value (no unit)."""

    mb: int
    boundary: Boundary
    unit: ClassVar[None] = None

    @property
    def node(self) -> Boundary:
        return self.boundary


@dataclass(frozen=True, slots=True)
class Send(_Crossing):
    """Start sending the value to the neighbouring stage (the next one for the stream,
    the previous one for its gradient); it is waited for when the step ends."""

    op: ClassVar[str] = "send"


@dataclass(frozen=True, slots=True)
class Recv(_Crossing):
    """Receive the value from the neighbouring stage: the stream the stage's first node
    reads, or the gradient its last node's backward takes."""

    op: ClassVar[str] = "recv"


Transition = Gather | Wait | Release | Reduce
NodeRun = Forward | Land | Backward | Wgrad | Recompute
Crossing = Send | Recv
Action = Transition | NodeRun | Crossing


def label(a: Action) -> str:
    """An action as errors name it: ``backward layers.0.experts mb1``, ``gather embed``."""
    node = getattr(a, "node", None)
    return f"{a.op} {node or a.unit}" + (f" mb{a.mb}" if getattr(a, "mb", -1) >= 0 else "")
