"""Where each rank sits in a plan's parallel dimensions, and which ranks form each group.

The world is ``dp x ep x cp x tp`` ranks, laid out with ``tp`` innermost::

    rank = ((d * ep + e) * cp + c) * tp + t

- ``tp`` ranks (same ``d, e, c``) hold one tensor-parallel slice each of attention, the
  dense MLPs, the shared expert, the embedding and the head, and split the residual
  stream's positions between them (sequence parallelism);
- ``cp`` ranks (same ``d, e, t``) hold different chunks of the same sequences;
- ``ep`` ranks (same ``d, c, t``) hold different experts and exchange tokens;
- the ``dp x ep`` row blocks (``d * ep + e``) read different rows of the global batch:
  expert parallelism splits the experts, not the data.

The experts' own tensor parallelism (``etp``) cuts each expert's hidden width over
``etp`` ranks of one ``ep`` index that hold different tokens: numbering those ranks by
``n = (d * cp + c) * tp + t``, an ``etp`` group is ``etp`` consecutive ``n`` (so with
``etp == tp`` it is the ``tp`` group), and the expert-data-parallel group ("edp", the
ranks holding the same expert slice, which shard it) is the ``n`` with the same
``n % etp``. Pure arithmetic: every rank derives every group without talking.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple


class Coords(NamedTuple):
    """A rank's place: data-parallel ``d``, expert ``e``, context ``c``, tensor ``t``."""

    d: int
    e: int
    c: int
    t: int


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a plan's parallel dimensions (``Plan.dims``)."""

    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    etp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.cp * self.tp

    @property
    def token_ranks(self) -> int:
        """Ranks of one expert index, each holding tokens of its own: ``dp * cp * tp``."""
        return self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Ranks holding the same slice of the same experts."""
        return self.token_ranks // self.etp

    def coords(self, rank: int) -> Coords:
        rank, t = divmod(rank, self.tp)
        rank, c = divmod(rank, self.cp)
        d, e = divmod(rank, self.ep)
        return Coords(d, e, c, t)

    def rank_of(self, d: int, e: int, c: int, t: int) -> int:
        return ((d * self.ep + e) * self.cp + c) * self.tp + t

    def token_index(self, rank: int) -> int:
        """``n = (d * cp + c) * tp + t``: the rank among those of its expert index."""
        d, _, c, t = self.coords(rank)
        return (d * self.cp + c) * self.tp + t

    def row_block(self, rank: int) -> int:
        """Which of the ``dp * ep`` row blocks of the global batch the rank reads."""
        d, e, _, _ = self.coords(rank)
        return d * self.ep + e

    def index(self, name: str, rank: int) -> int:
        """The rank's index inside its group ``name`` (see ``groups``)."""
        return _indices(self, name)[rank]

    def groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        """Every group of kind ``name`` as a tuple of world ranks, in a fixed order:

        - ``tp``, ``cp``, ``ep``: the ranks differing only in that coordinate;
        - ``tensor_data``: same ``t`` (who share a tensor-parallel slice: its shards
          and its gradient sum);
        - ``etp``, ``edp``: the experts' tensor-parallel and data-parallel groups;
        - ``expert_model``: same edp index, every ``e`` and etp index (who together
          hold one copy of every expert).
        """
        return _groups(self, name)


@functools.lru_cache(maxsize=256)
def _indices(dims: ParallelDims, name: str) -> dict:
    return {r: i for g in dims.groups(name) for i, r in enumerate(g)}


@functools.lru_cache(maxsize=256)
def _groups(dims: ParallelDims, name: str) -> tuple[tuple[int, ...], ...]:
    if name in ("tp", "cp", "ep", "tensor_data"):
        free = {"tp": "t", "cp": "c", "ep": "e", "tensor_data": "dec"}[name]

        def key(r):
            return tuple(v for k, v in dims.coords(r)._asdict().items() if k not in free)
    elif name in ("etp", "edp", "expert_model"):
        def key(r):
            e, n = dims.coords(r).e, dims.token_index(r)
            return {"etp": (e, n // dims.etp), "edp": (e, n % dims.etp), "expert_model": (n // dims.etp,)}[name]
    else:
        raise KeyError(f"no group {name!r}; allowed: tp, cp, ep, tensor_data, etp, edp, expert_model")
    out: dict = {}
    for r in range(dims.world):
        out.setdefault(key(r), []).append(r)
    return tuple(tuple(g) for g in out.values())
