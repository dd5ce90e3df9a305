"""The checks of a plan's parallel degrees against its model, when the Plan is built.

Tensor parallelism cuts attention by heads, the dense MLPs and the shared expert by
hidden units and the embedding and head by vocabulary rows; the experts' tensor
parallelism cuts each expert's hidden units. A degree that does not divide what it
cuts is a ValueError naming the field.
"""

from __future__ import annotations

from .checks import fail


def hidden_units(cfg, width: int) -> int:
    """The indivisible pieces of an MLP's hidden width: its units, or with interleaved GLU
    halves its (gate block, up block) pairs, which a cut must keep whole."""
    return width // cfg.glu_interleave if cfg.glu_interleave else width


def check_parallel(dims, cfg) -> None:
    """Raise ValueError naming ``Plan.tp``, ``Plan.etp`` or ``Plan.cp`` if the degree cannot
    cut ``cfg`` (a ModelConfig); ``dims``: the Plan's ParallelDims."""
    tp, etp = dims.tp, dims.etp
    if tp > 1:
        if cfg.heads % tp:
            fail("Plan.tp", tp, f"must divide model.heads ({cfg.heads}): tensor parallelism splits the heads")
        kv = cfg.num_kv_heads
        if kv % tp and tp % kv:
            fail("Plan.tp", tp, f"must divide model.kv_heads ({kv}), or be a multiple of it (each rank then "
                                "holds a copy of the one key/value head its query heads read)")
        if cfg.vocab % tp:
            fail("Plan.tp", tp, f"must divide model.vocab ({cfg.vocab}): the embedding and head are split "
                                "by vocabulary rows")
        for name in ("dense_ffn", "shared_ffn"):
            width = getattr(cfg, name)
            if width and hidden_units(cfg, width) % tp:
                fail("Plan.tp", tp, f"must divide model.{name}'s {_units_word(cfg)} ({hidden_units(cfg, width)})")
    if etp > 1:
        if hidden_units(cfg, cfg.ffn) % etp:
            fail("Plan.etp", etp, f"must divide model.ffn's {_units_word(cfg)} ({hidden_units(cfg, cfg.ffn)}): "
                                  "expert tensor parallelism splits each expert's hidden width")
        if dims.token_ranks % etp:
            fail("Plan.etp", etp, f"must divide dp * cp * tp = {dims.token_ranks}: an etp group is made of ranks "
                                  "of one expert index holding different tokens")


def _units_word(cfg) -> str:
    return f"blocks of glu_interleave={cfg.glu_interleave} pairs" if cfg.glu_interleave else "hidden width"
