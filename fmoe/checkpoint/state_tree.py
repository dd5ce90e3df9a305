"""The optimizer state's tree in a checkpoint's ``fmoe.json``: its structure as JSON,
its tensors by dotted key (stored by DCP). Only the NamedTuple states named in
``STATE_TYPES`` are allowed, so loading never builds an arbitrary type.
"""

from __future__ import annotations

import torch

from .. import optim

STATE_TYPES = {cls.__name__: cls for cls in (optim.EmptyState, optim.ScaleByAdamState, optim.ScheduleState,
                                               optim.ApplyIfFiniteState, optim.ClipState)}
"""The NamedTuple states an opt_state may hold, by name."""


def encode(tree, prefix: str, tensors: dict, mirrors: dict | None = None, table=None, keys: tuple = ()):
    """A JSON description of ``tree``; its tensors go into ``tensors`` by dotted key.
    With a ParamTable, ``mirrors`` records which parameter each tensor mirrors
    (``{key: path}``, see ``ParamTable.mirrored_by``)."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach()
        if table is not None and (leaf := table.mirrored_by(keys)) is not None:
            mirrors[prefix] = leaf.path
        return {"tensor": prefix}
    if isinstance(tree, dict):
        return {"dict": {str(k): encode(v, f"{prefix}.{k}", tensors, mirrors, table, keys + (k,))
                         for k, v in tree.items()}}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        name = type(tree).__name__
        if name not in STATE_TYPES:
            raise ValueError(f"save: cannot save opt_state {prefix!r} of type {name}; "
                             f"allowed NamedTuple states: {sorted(STATE_TYPES)}")
        return {"state": name, "fields": [encode(v, f"{prefix}.{f}", tensors, mirrors, table, keys + (f,))
                                          for f, v in zip(tree._fields, tree)]}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {kind: [encode(v, f"{prefix}.{i}", tensors, mirrors, table, keys + (i,)) for i, v in enumerate(tree)]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"value": tree}
    raise ValueError(f"save: cannot save opt_state {prefix!r} of type {type(tree).__name__}; allowed: tensors, "
                     f"dicts, lists, tuples, the states in {sorted(STATE_TYPES)}, None, bool, int, float, str")


def decode(desc, tensors: dict):
    """The tree ``encode`` described, its tensors taken from ``tensors`` by key. A
    state saved with fewer fields than its NamedTuple has now (a field added later,
    with a default) gets the default."""
    if "tensor" in desc:
        return tensors[desc["tensor"]]
    if "dict" in desc:
        return {k: decode(v, tensors) for k, v in desc["dict"].items()}
    if "state" in desc:
        return STATE_TYPES[desc["state"]](*(decode(v, tensors) for v in desc["fields"]))
    if "list" in desc:
        return [decode(v, tensors) for v in desc["list"]]
    if "tuple" in desc:
        return tuple(decode(v, tensors) for v in desc["tuple"])
    return desc["value"]
