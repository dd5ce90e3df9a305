"""Where each rank sits in a plan's parallel dimensions, and which ranks form each group.

The world is ``pp x dp x ep x cp x tp`` ranks, laid out with ``tp`` innermost::

    rank = (((s * dp + d) * ep + e) * cp + c) * tp + t

- each pipeline stage ``s`` is a whole ``dp x ep x cp x tp`` mesh of its own: every
  group below is inside one stage, and ``pp`` ranks (same ``d, e, c, t``) hand each
  other the activations and their gradients;

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

import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple


class GroupName(enum.StrEnum):
    """A kind of group of ranks (``ParallelDims.groups``): ``TP``, ``CP``, ``EP``, ``PP`` the
    ranks differing only in that coordinate; ``STAGE`` a pipeline stage's ranks;
    ``TENSOR_DATA`` those holding one tensor-parallel slice; ``ETP`` and ``EDP`` the
    experts' tensor- and data-parallel groups; ``EXPERT_MODEL`` those holding one copy of
    a stage's experts between them."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    PP = "pp"
    STAGE = "stage"
    TENSOR_DATA = "tensor_data"
    ETP = "etp"
    EDP = "edp"
    EXPERT_MODEL = "expert_model"


# the groups inside one pipeline stage that a rank's collectives run on (not PP, which
# spans the stages, nor EXPERT_MODEL, which no collective uses)
STAGE_GROUPS = (GroupName.TP, GroupName.CP, GroupName.EP, GroupName.ETP, GroupName.STAGE, GroupName.TENSOR_DATA,
                GroupName.EDP)


class Coords(NamedTuple):
    """A rank's place: data-parallel ``d``, expert ``e``, context ``c``, tensor ``t``, and
    its pipeline stage ``s``."""

    d: int
    e: int
    c: int
    t: int
    s: int = 0


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a plan's parallel dimensions (``Plan.dims``)."""

    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    etp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.stage_size

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage: ``dp * ep * cp * tp``."""
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
        rank, e = divmod(rank, self.ep)
        s, d = divmod(rank, self.dp)
        return Coords(d, e, c, t, s)

    def rank_of(self, d: int, e: int, c: int, t: int, s: int = 0) -> int:
        return (((s * self.dp + d) * self.ep + e) * self.cp + c) * self.tp + t

    def token_index(self, rank: int) -> int:
        """``n = (d * cp + c) * tp + t``: the rank among those of its stage and expert index."""
        at = self.coords(rank)
        return (at.d * self.cp + at.c) * self.tp + at.t

    def row_block(self, rank: int) -> int:
        """Which of the ``dp * ep`` row blocks of the global batch the rank reads (every
        stage of a pipeline reads the same rows)."""
        at = self.coords(rank)
        return at.d * self.ep + at.e

    def stage(self, rank: int) -> int:
        """The rank's pipeline stage."""
        return self.coords(rank).s

    def index(self, name: GroupName, rank: int) -> int:
        """The rank's index inside its group ``name`` (see ``groups``)."""
        return _indices(self, _group_name(name))[rank]

    def groups(self, name: GroupName) -> tuple[tuple[int, ...], ...]:
        """Every group of kind ``name`` (a GroupName, or its value) as a tuple of world
        ranks, in a fixed order:

        - ``tp``, ``cp``, ``ep``, ``pp``: the ranks differing only in that coordinate;
        - ``stage``: the ranks of one pipeline stage (the world when ``pp`` is 1);
        - ``tensor_data``: same stage and ``t`` (who share a tensor-parallel slice: its
          shards and its gradient sum);
        - ``etp``, ``edp``: the experts' tensor-parallel and data-parallel groups;
        - ``expert_model``: same stage and edp index, every ``e`` and etp index (who
          together hold one copy of the stage's experts).
        """
        return _groups(self, _group_name(name))


def _group_name(name) -> GroupName:
    try:
        return GroupName(name)
    except ValueError:
        raise KeyError(f"no group {name!r}; allowed: {', '.join(GroupName)}") from None


@functools.lru_cache(maxsize=256)
def _indices(dims: ParallelDims, name: GroupName) -> dict:
    return {r: i for g in dims.groups(name) for i, r in enumerate(g)}


@functools.lru_cache(maxsize=256)
def _groups(dims: ParallelDims, name: GroupName) -> tuple[tuple[int, ...], ...]:
    match name:
        case GroupName.TP | GroupName.CP | GroupName.EP | GroupName.PP | GroupName.STAGE | GroupName.TENSOR_DATA:
            free = {GroupName.TP: "t", GroupName.CP: "c", GroupName.EP: "e", GroupName.PP: "s",
                    GroupName.STAGE: "dect", GroupName.TENSOR_DATA: "dec"}[name]

            def key(r):
                return tuple(v for k, v in dims.coords(r)._asdict().items() if k not in free)
        case GroupName.ETP | GroupName.EDP | GroupName.EXPERT_MODEL:
            def key(r):
                at, n = dims.coords(r), dims.token_index(r)
                return {GroupName.ETP: (at.s, at.e, n // dims.etp), GroupName.EDP: (at.s, at.e, n % dims.etp),
                        GroupName.EXPERT_MODEL: (at.s, n // dims.etp)}[name]
    out: dict = {}
    for r in range(dims.world):
        out.setdefault(key(r), []).append(r)
    return tuple(tuple(g) for g in out.values())
