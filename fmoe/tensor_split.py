"""How tensor parallelism cuts a parameter: ``Split``, one per leaf that it cuts.

A cut runs along one axis of the full leaf, which is made of parts laid end to end
(``qkv``'s columns are ``[q | k | v]``, a GLU ``fc1``'s ``[gate | up]``); each part is cut
into the degree's equal pieces of whole units (heads, hidden units, vocabulary rows),
and rank ``i`` of the group holds piece ``i`` of every part, side by side. A part with
fewer units than ranks (grouped-query attention's key/value heads under a larger ``tp``)
is not cut but copied: rank ``i`` holds the unit its pieces of the other parts read,
``i * units // degree``, and ``degree / units`` ranks hold each copy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config_fields import QkNorm
from .parallel_checks import hidden_units


class Part(NamedTuple):
    """A run of ``size`` positions along the cut axis made of ``units`` equal units."""

    size: int
    units: int


class Piece(NamedTuple):
    """What one rank holds of one part: ``length`` positions from ``start`` (of the full
    axis), at ``local`` in its own leaf; ``copies``: how many ranks hold the same."""

    start: int
    length: int
    local: int
    copies: int


class Split(NamedTuple):
    """A leaf's tensor-parallel cut: along ``axis`` of its full shape, over ``parts``."""

    axis: int
    parts: tuple[Part, ...]

    def pieces(self, degree: int, index: int) -> tuple[Piece, ...]:
        """Rank ``index``'s piece of every part, in order, for a group of ``degree`` ranks."""
        out, start, local = [], 0, 0
        for part in self.parts:
            if part.units >= degree:
                length = part.size // degree
                lo, copies = start + index * length, 1
            else:
                length = part.size // part.units
                lo, copies = start + (index * part.units // degree) * length, degree // part.units
            out.append(Piece(lo, length, local, copies))
            start, local = start + part.size, local + length
        return tuple(out)

    def local_shape(self, shape: tuple, degree: int) -> tuple:
        """The shape a rank holds of a leaf of ``shape`` (after any expert cut)."""
        out = list(shape)
        out[self.axis] = sum(p.length for p in self.pieces(degree, 0))
        return tuple(out)

    def cut(self, full: torch.Tensor, degree: int, index: int) -> torch.Tensor:
        """Rank ``index``'s part of ``full`` (a view when it is one piece)."""
        if degree == 1:
            return full
        pieces = [full.narrow(self.axis, p.start, p.length) for p in self.pieces(degree, index)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.axis)

    def assemble(self, local: list[torch.Tensor], degree: int) -> torch.Tensor:
        """The full leaf from every rank's part (``local[i]``: rank ``i``'s), in order."""
        if degree == 1:
            return local[0]
        runs = []
        for k, part in enumerate(self.parts):
            holders = range(degree) if part.units >= degree else \
                [u * degree // part.units for u in range(part.units)]
            for i in holders:
                p = self.pieces(degree, i)[k]
                runs.append(local[i].narrow(self.axis, p.local, p.length))
        return torch.cat(runs, dim=self.axis)


def split_of(keys: tuple, cfg) -> Split | None:
    """How tensor parallelism cuts the leaf at ``keys`` of ``cfg``'s params (a ModelConfig):
    attention by heads, the MLPs by hidden units (fc1's columns, fc2's rows), the
    embedding and head by vocabulary; None for what every rank holds whole."""
    name, parent = keys[-1], keys[-2] if len(keys) > 1 else None
    V, H = cfg.vocab, cfg.heads
    if keys == ("embed",):
        return Split(0, (Part(V, V),))
    if keys == ("head",):
        return Split(1, (Part(V, V),))
    if parent == "attn":
        Q, K, Kh = cfg.q_width, cfg.kv_width, cfg.num_kv_heads
        qkv = (Part(Q, H), Part(K, Kh), Part(K, Kh))
        heads = {"qkv": Split(1, qkv), "qkv_bias": Split(0, qkv), "out": Split(0, (Part(cfg.attn_out_width, H),)),
                 "sinks": Split(0, (Part(H, H),)), "q": Split(1, (Part(Q, H),)), "q_up": Split(1, (Part(Q, H),))}
        if cfg.latent:
            heads["kv_up"] = Split(1, (Part(H * (cfg.head_dim - cfg.rope_head_dim + cfg.v_head_dim), H),))
        if cfg.qk_norm_mode is QkNorm.FULL:
            heads.update(q_norm=Split(0, (Part(Q, H),)), k_norm=Split(0, (Part(K, Kh),)))
        return heads.get(name)
    experts = keys[2:4] == ("moe", "experts")
    if experts or parent in ("mlp", "shared"):
        width = cfg.ffn if experts else cfg.dense_ffn if parent == "mlp" else cfg.shared_ffn
        units = hidden_units(cfg, width)
        if not cfg.is_glu:
            fc1 = (Part(width, units),)
        elif cfg.glu_interleave:  # blocks of (gate, up) pairs: a contiguous cut keeps them whole
            fc1 = (Part(2 * width, units),)
        else:
            fc1 = (Part(width, units), Part(width, units))
        axis = 1 if experts else 0  # past the experts' leading axis
        cuts = {"fc1": Split(axis + 1, fc1), "fc1_bias": Split(axis, fc1), "fc2": Split(axis, (Part(width, units),))}
        return cuts.get(name)
    return None
