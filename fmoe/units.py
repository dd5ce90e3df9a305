"""FSDP units: groups of parameters gathered, released and reduced together.

A model is made of *members*: ``embed``, ``layers.0`` .. ``layers.{L-1}`` and ``head``
(``final_norm`` + ``head``). A unit is one or more members; the default is one unit
per member. Every parameter belongs to exactly one member (``fmoe.params.Leaf.member``). ``cfg`` below is a
``ModelConfig`` (only its ``layers`` and ``tie_embeddings`` are read); ``config``
imports this module, so it imports nothing of fmoe.
"""

from __future__ import annotations


def members(cfg) -> tuple[str, ...]:
    """Member names in forward order."""
    return ("embed", *(f"layers.{i}" for i in range(cfg.layers)), "head")


def default_units(cfg) -> tuple[tuple[str, ...], ...]:
    """One unit per member; with tied embeddings ``embed`` and ``head`` share one,
    since the head computes with ``embed``."""
    if cfg.tie_embeddings:
        return (("embed", "head"), *((m,) for m in members(cfg)[1:-1]))
    return tuple((m,) for m in members(cfg))


def check_units(units, cfg) -> tuple[tuple[str, ...], ...]:
    """Validate ``Plan.units`` against the model; returns it as a tuple of tuples."""
    known = members(cfg)
    if units is None:
        return default_units(cfg)
    try:
        units = tuple(tuple(u) for u in units)
    except TypeError:
        raise ValueError(f"Plan.units={units!r} is invalid: a sequence of sequences of member names") from None
    seen = [m for u in units for m in u]
    unknown = sorted(set(seen) - set(known), key=str)
    if unknown:
        raise ValueError(f"Plan.units names unknown members {unknown}; allowed: {', '.join(known)}")
    twice = sorted({m for m in seen if seen.count(m) > 1})
    missing = [m for m in known if m not in seen]
    if twice or missing or any(not u for u in units):
        raise ValueError(f"Plan.units must put every member in exactly one non-empty unit "
                         f"(repeated: {twice}, missing: {missing})")
    if cfg.tie_embeddings and not any("embed" in u and "head" in u for u in units):
        raise ValueError("Plan.units must put 'embed' and 'head' in one unit when model.tie_embeddings=True "
                         "(the head computes with embed)")
    return units


def unit_name(unit: tuple[str, ...]) -> str:
    return "+".join(unit)


def even_stages(cfg, pp: int) -> tuple[tuple[str, ...], ...]:
    """``pp`` pipeline stages of contiguous layers, as even as they come (the first
    stages one layer more when ``pp`` does not divide them), ``embed`` in the first and
    ``head`` in the last."""
    per, extra = divmod(cfg.layers, pp)
    stages, first = [], 0
    for s in range(pp):
        count = per + (s < extra)
        stages.append(tuple(f"layers.{i}" for i in range(first, first + count)))
        first += count
    stages[0] = ("embed",) + stages[0]
    stages[-1] = stages[-1] + ("head",)
    return tuple(stages)


def check_stages(stages, cfg, pp: int, virtual: int = 1) -> tuple[tuple[str, ...], ...]:
    """Validate ``Plan.pp_layout`` (the members of each of the ``pp * virtual`` stages,
    in forward order) against the model; None: ``even_stages``. Returns it as a tuple
    of tuples."""
    count = pp * virtual
    named = f"Plan.pp={pp}" + (f" x Plan.virtual_stages={virtual}" if virtual > 1 else "")
    if stages is None:
        if count > cfg.layers:
            raise ValueError(f"{named} is invalid: {count} stages, more than model.layers ({cfg.layers}); "
                             f"allowed: at most {cfg.layers} stages")
        return even_stages(cfg, count)
    try:
        stages = tuple(tuple(m) for m in stages)
    except TypeError:
        raise ValueError(f"Plan.pp_layout={stages!r} is invalid: a sequence of {count} sequences of member "
                         "names") from None
    order = members(cfg)
    if len(stages) != count or any(not m for m in stages) or tuple(m for st in stages for m in st) != order:
        raise ValueError(f"Plan.pp_layout must list every member once, in order ({', '.join(order)}), cut into "
                         f"{count} non-empty stages ({named}); got {stages!r}")
    return stages
