"""Checkpoints on torch.distributed.checkpoint (DCP), written atomically.

A checkpoint is a directory: DCP's files hold every tensor (params under
``params.<path>``, optimizer state under ``opt_state.<path>``) and ``fmoe.json`` holds
the model config, step, ``extra`` and the optimizer state's structure (JSON, no
pickle). A save is written to a temporary sibling directory and renamed into place;
the previous checkpoint is removed only after the new one is complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp

from . import optim
from .config import ModelConfig, Plan
from .params import flat_shapes
from .runtime import check_runtime
from .step import check_params

FORMAT_VERSION = 1
META_FILE = "fmoe.json"
_STATE_TYPES = {cls.__name__: cls for cls in (optim.EmptyState, optim.ScaleByAdamState, optim.ScheduleState)}


class Checkpoint(NamedTuple):
    params: dict
    opt_state: Any
    step: int
    extra: dict


def _single_process(plan: Plan, what: str) -> None:
    if plan.world > 1:
        raise ValueError(f"{what}: Plan.dp * Plan.ep = {plan.world}; this build reads and writes checkpoints "
                         "from one process (allowed: dp=1, ep=1); gather_full(params, plan) gives the full "
                         "tensors to save from one rank")


def _encode(tree, prefix: str, tensors: dict):
    """A JSON description of ``tree``; its tensors go into ``tensors`` by dotted key."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach()
        return {"tensor": prefix}
    if isinstance(tree, dict):
        return {"dict": {str(k): _encode(v, f"{prefix}.{k}", tensors) for k, v in tree.items()}}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        name = type(tree).__name__
        if name not in _STATE_TYPES:
            raise ValueError(f"cannot save optimizer state of type {name}; known: {sorted(_STATE_TYPES)}")
        return {"state": name, "fields": [_encode(v, f"{prefix}.{f}", tensors) for f, v in zip(tree._fields, tree)]}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {kind: [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(tree)]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"value": tree}
    raise ValueError(f"cannot save {prefix!r} of type {type(tree).__name__}")


def _decode(desc, tensors: dict):
    if "tensor" in desc:
        return tensors[desc["tensor"]]
    if "dict" in desc:
        return {k: _decode(v, tensors) for k, v in desc["dict"].items()}
    if "state" in desc:
        return _STATE_TYPES[desc["state"]](*(_decode(v, tensors) for v in desc["fields"]))
    if "list" in desc:
        return [_decode(v, tensors) for v in desc["list"]]
    if "tuple" in desc:
        return tuple(_decode(v, tensors) for v in desc["tuple"])
    return desc["value"]


def save(path, plan: Plan, params: dict, opt_state=None, step: int = 0, extra: dict | None = None) -> Path:
    """Write a checkpoint to ``path`` atomically (the old one survives any failure).

    Arguments:
        path: the checkpoint directory (created or replaced).
        plan: the Plan the params belong to (its model config is recorded).
        params: the parameter pytree.
        opt_state: the optimizer state, or None for a model-only checkpoint.
        step: the training step count.
        extra: JSON-serialisable user data (e.g. the data position).

    Returns:
        The checkpoint's Path.
    """
    check_runtime(plan)
    _single_process(plan, "save")
    check_params(params, plan)
    path = Path(path)
    extra = dict(extra or {})
    tensors: dict = {}
    meta = {
        "format": FORMAT_VERSION,
        "model": dataclasses.asdict(plan.model),
        "step": int(step),
        "extra": extra,
        "params": _encode(params, "params", tensors),
        "opt_state": None if opt_state is None else _encode(opt_state, "opt_state", tensors),
    }
    try:
        meta_text = json.dumps(meta, indent=1)
    except TypeError as err:
        raise ValueError(f"save: extra must be JSON-serialisable ({err})") from None
    if path.exists() and not (path / META_FILE).exists():
        raise ValueError(f"save: {path} exists and is not an fmoe checkpoint; refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
            dcp.save({k: v.cpu() for k, v in tensors.items()}, checkpoint_id=str(tmp))
        with open(tmp / META_FILE, "w") as f:
            f.write(meta_text)
            f.flush()
            os.fsync(f.fileno())
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        for stale in path.parent.glob(f".{path.name}.old-*"):  # ours, or left by a crash
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _resolve(path: Path) -> Path:
    if (path / META_FILE).exists():
        return path
    # A crash between the two renames of ``save`` leaves the previous checkpoint here.
    olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    olds = [p for p in olds if (p / META_FILE).exists()]
    if not path.exists() and olds:
        return olds[-1]
    raise FileNotFoundError(f"no fmoe checkpoint at {path} ({META_FILE} missing)")


def _config_mismatch(saved: dict, cfg: ModelConfig) -> list[str]:
    want = dataclasses.asdict(cfg)
    return [f"{k}: checkpoint {saved.get(k)!r}, plan {want[k]!r}" for k in want if saved.get(k) != want[k]]


def load(path, plan: Plan) -> Checkpoint:
    """Read a checkpoint written by ``save`` for ``plan``.

    Everything is validated before tensors are read: the model config must equal
    ``plan.model`` and every parameter must have its layout's shape.

    Arguments:
        path: the checkpoint directory.
        plan: the Plan to load into (params land on ``plan.device``).

    Returns:
        A Checkpoint ``(params, opt_state, step, extra)``.
    """
    check_runtime(plan)
    _single_process(plan, "load")
    path = _resolve(Path(path))
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this fmoe reads {FORMAT_VERSION}")
    diff = _config_mismatch(meta["model"], plan.model)
    if diff:
        raise ValueError(f"{path}: model config differs from Plan.model: " + "; ".join(diff))
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, shape in flat_shapes(plan.model).items():
        key = "params." + key
        if key not in stored:
            raise ValueError(f"{path}: missing tensor {key!r}")
        if tuple(stored[key].size) != shape:
            raise ValueError(f"{path}: {key!r} has shape {list(stored[key].size)}, Plan.model needs {list(shape)}")
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in stored.items() if hasattr(m, "size")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(tensors, checkpoint_id=str(path))
    tensors = {k: v.to(plan.device) for k, v in tensors.items()}
    params = _decode(meta["params"], tensors)
    opt_state = None if meta["opt_state"] is None else _decode(meta["opt_state"], tensors)
    return Checkpoint(params, opt_state, meta["step"], meta["extra"])
