"""``fmoe.save`` / ``fmoe.load``: torch.distributed.checkpoint, any plan to any plan.

A checkpoint is a directory: DCP's data files hold every tensor in its global shape
(``params.<path>``, ``opt_state.<path>``, ``rng``), and ``fmoe.json`` holds the model
config, step, ``extra``, the optimizer state's structure, DCP's metadata and a
checksum per data file, all as JSON (the optimizer state's tree: ``state_tree.py``).
Saves go to a temporary sibling directory renamed into place; loads validate
everything before reading a tensor and never unpickle anything. ``load(path)`` with
no plan reads the whole model in one process, with its config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import lora, optim
from ..config import LoRA, ModelConfig, Plan
from ..comm.collectives import Group
from ..params import flat_shapes, named_leaves
from ..resolve import resolve
from ..runtime import check_runtime
from ..step import check_params
from ..shard.boxes import local_boxes
from .dcp_io import (BoxedTensor, BoxLoadPlanner, BoxSavePlanner, JsonMetadataReader, metadata_from_json,
                     metadata_to_json, unwritten)
from .files import (META_FILE, check_files, checkpoint_dir, gathered_checksums, io_threads, staged_directory,
                    write_atomically)
from .state_tree import decode, encode

FORMAT_VERSION = 2


class Checkpoint(NamedTuple):
    """What ``load`` returns: params and optimizer state laid out for the load plan (the
    full, unsharded pytrees on the CPU when ``load`` is given no plan), and the
    ModelConfig the checkpoint was saved with (``config``; last, so that the fields
    before it keep their places)."""

    params: dict
    opt_state: Any
    step: int
    extra: dict
    rng: torch.Tensor | None = None
    config: ModelConfig | None = None


@contextlib.contextmanager
def _quiet():
    """Silence DCP's notice that a one-process save/load runs without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def save(path, plan: Plan, params: dict, opt_state=None, step: int = 0, extra: dict | None = None,
         rng: torch.Tensor | None = None) -> Path:
    """Write a checkpoint of this rank's params (and optimizer state) in global shapes.

    A collective: every rank of the plan calls it with its own shards. Atomic: the
    previous checkpoint at ``path`` survives any failure.

    Arguments:
        path: the checkpoint directory (created or replaced).
        plan: the Plan the params are laid out by (its model config is recorded).
        params: this rank's parameter pytree.
        opt_state: the optimizer state, or None for model-only. A tensor in it that
            mirrors a parameter (its place ends in the parameter's pytree keys, or its
            key is the parameter's dotted name, and it has the parameter's local shape)
            is saved in global shape like the parameter; any other tensor must be the
            same on every rank.
        step: the training step count, an int >= 0.
        extra: JSON-serialisable user data (e.g. the data position).
        rng: an optional uint8 tensor (e.g. ``generator.get_state()``), the same on all ranks.

    Returns:
        The checkpoint's Path.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step < 2**63:
        raise ValueError(f"save: step={step!r} is invalid: must be an int in 0..{2**63 - 1}")
    check_runtime(plan)
    path = Path(path)
    world = Group.world()
    spec = resolve(plan).spec
    shapes = spec.table.shapes()
    local = spec.local_shapes(world.rank)
    tensors = {}
    meta: dict = {"format": FORMAT_VERSION, "model": dataclasses.asdict(plan.model), "step": int(step),
                  "extra": dict(extra or {}), "opt_state": None, "opt_params": {}}
    if plan.lora is not None:  # the adapters and their state, each whole on every rank; the base is not saved
        lora.check_adapters(params, plan)
        for p, t in named_leaves(params).items():
            tensors["adapters." + p] = BoxedTensor(t.shape, torch.float32, [((0,) * t.dim(), t.detach().cpu())])
        meta["lora"] = dataclasses.asdict(plan.lora)
    else:
        check_params(params, plan)
        for p, leaf in named_leaves(params).items():
            tensors["params." + p] = BoxedTensor(shapes[p], torch.float32,
                                                 local_boxes(p, shapes[p], leaf.detach().cpu(), spec, world.rank))
    if opt_state is not None:
        leaves, mirrors = {}, {}
        meta["opt_state"] = encode(opt_state, "opt_state", leaves, mirrors, None if plan.lora else spec.table)
        for key, t in leaves.items():
            p = mirrors.get(key)
            t = t.cpu()
            if p is not None and tuple(t.shape) == tuple(local[p]):
                meta["opt_params"][key] = p
                tensors[key] = BoxedTensor(shapes[p], t.dtype, local_boxes(p, shapes[p], t, spec, world.rank))
            else:  # what mirrors no parameter (step counts, norms): the same on every rank
                tensors[key] = BoxedTensor(t.shape, t.dtype, [((0,) * t.dim(), t)])
    if rng is not None:
        tensors["rng"] = BoxedTensor(rng.shape, rng.dtype, [((0,) * rng.dim(), rng.cpu())])
    meta["tensor_keys"] = sorted(tensors)
    try:
        json.dumps(meta)
    except TypeError as err:
        raise ValueError(f"save: extra must be JSON-serialisable ({err})") from None
    if path.exists() and not (path / META_FILE).exists():
        raise ValueError(f"save: {path} exists and is not an fmoe checkpoint; refusing to replace it")

    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(path, world, plan.device, "save") as (tmp, publish):
        with _quiet():
            try:
                # several files a rank, written at once: a large rank's share otherwise goes at one
                # thread's pace (minutes for a 30B model's 30 GB a rank on the 4 x H200 hosts)
                dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=io_threads()),
                         planner=BoxSavePlanner(tensors), no_dist=world.size == 1)
            except (CheckpointException, RuntimeError, OSError) as err:  # every rank gets DCP's verdict
                inner = _innermost(err)
                if not _is_write_failure(inner):
                    raise  # e.g. a collective that failed: the caller tells those apart
                raise OSError(_write_failure(path, tmp, inner)) from err

        sums = gathered_checksums(tmp, world, plan.device)  # every rank hashes its own files

        def finish():
            # DCP's metadata file was written by this save a moment ago (not every torch
            # release returns it complete); loads never read it, they read the JSON.
            meta["dcp"] = metadata_to_json(dcp.FileSystemReader(str(tmp)).read_metadata())
            missing = unwritten(meta["dcp"])
            if missing:
                raise OSError(f"no file holds {len(missing)} piece(s) ({', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''}): a writer thread failed (its error is above)")
            meta["checksums"] = sums
            write_atomically(json.dumps(meta, indent=1), tmp / META_FILE)

        publish(finish)
    return path


def _innermost(err: BaseException) -> BaseException:
    """The error under DCP's CheckpointException (``{rank: (exception, traceback)}``)."""
    failures = getattr(err, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return err


def _is_write_failure(err: BaseException) -> bool:
    """A file that could not be written: an OSError, or torch.save's writer failing
    (what a full disk gives half-way through a file)."""
    if isinstance(err, ConnectionError):  # an OSError too, but a peer's, not the disk's
        return False
    return isinstance(err, OSError) or any(mark in str(err) for mark in ("inline_container", "PytorchStreamWriter"))


def _write_failure(path: Path, tmp: Path, err: BaseException) -> str:
    """One line for a failed write: its error and the free space, since a full disk is
    what usually breaks a write half-way (torch reports it as ``unexpected pos``)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reason = f"{type(err).__name__}: {lines[-1] if lines else ''}"
    try:
        free = f"{shutil.disk_usage(tmp).free / 2**30:.1f} GiB free there"
    except OSError:
        free = "free space unknown"
    return (f"save: writing {path} failed ({reason}); {free}: a full disk is the usual cause. "
            f"Nothing was replaced: the checkpoint that was at {path}, if any, is intact")


def _saved_config(saved: dict) -> dict:
    """The saved model config with every field; a field added to ModelConfig after the
    checkpoint was written reads as its default, which is what that checkpoint meant."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    fields = {k: saved.get(k, default) for k, default in defaults.items()}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}  # JSON holds tuples as lists


def _config_mismatch(saved: dict, cfg: ModelConfig) -> list[str]:
    want, saved = dataclasses.asdict(cfg), _saved_config(saved)
    return [f"{k}: checkpoint {saved[k]!r}, plan {want[k]!r}" for k in want if saved[k] != want[k]]


def read_config(path) -> ModelConfig:
    """The ModelConfig a checkpoint was saved with (reads only its ``fmoe.json``)."""
    path, meta = read_meta(path)
    return ModelConfig(**_saved_config(meta["model"]))


def read_lora(path) -> LoRA | None:
    """The LoRA of the adapters a checkpoint holds, or None for a model's params (reads
    only its ``fmoe.json``)."""
    return _saved_lora(read_meta(path)[1])


def read_meta(path) -> tuple[Path, dict]:
    """The checkpoint directory and its parsed ``fmoe.json`` (ValueError if unreadable)."""
    path = checkpoint_dir(Path(path))
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: {META_FILE} is unreadable ({err})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this fmoe reads {FORMAT_VERSION}")
    return path, meta


def _validate(path: Path, meta: dict, plan: Plan, verify: bool, world: Group) -> None:
    diff = _config_mismatch(meta["model"], plan.model)
    if diff:
        raise ValueError(f"{path}: model config differs from Plan.model: " + "; ".join(diff))
    stored = meta["dcp"]["tensors"]
    saved_lora = _saved_lora(meta)
    if saved_lora != plan.lora:
        raise ValueError(f"{path}: the checkpoint holds {_what(saved_lora)}, and Plan.lora={plan.lora!r} asks for "
                         f"{_what(plan.lora)}")
    if plan.lora is not None:
        expected = {"adapters." + p: s for p, s in lora.adapter_shapes(plan).items()}
    else:
        shapes = flat_shapes(plan.model)
        expected = {"params." + p: s for p, s in shapes.items()}
        expected.update({k: shapes[p] for k, p in meta["opt_params"].items()})
    for key in meta["tensor_keys"]:
        if key not in stored:
            raise ValueError(f"{path}: missing tensor {key!r}")
    for key, shape in expected.items():
        if key not in stored:
            raise ValueError(f"{path}: missing tensor {key!r}")
        if tuple(stored[key]["size"]) != tuple(shape):
            raise ValueError(f"{path}: {key!r} has shape {stored[key]['size']}, Plan.model needs {list(shape)}")
    check_files(path, meta["dcp"]["storage"], meta.get("checksums") if verify else None,
                world if world.size > 1 else None, plan.device)


def _saved_lora(meta: dict) -> LoRA | None:
    saved = meta.get("lora")
    return None if saved is None else LoRA(**{**saved, "targets": tuple(saved["targets"])})


def _what(adapters: LoRA | None) -> str:
    return "the model's params" if adapters is None else f"adapters ({adapters!r})"


def load(path, plan: Plan | None = None, verify: bool = True) -> Checkpoint:
    """Read a checkpoint for ``plan``, whatever plan saved it (a collective), or whole.

    Everything is checked before a tensor is read: the model config must equal
    ``plan.model``, every tensor must be present with its shape, and the data files
    must be complete and (``verify``) match their checksums. Nothing is unpickled.

    Arguments:
        path: the checkpoint directory.
        plan: the Plan to load into (params land on ``plan.device``, sharded as it
            says). None: this process alone reads the full params and optimizer state
            (unsharded, fp32, on the CPU) under the saved config, with no process group
            needed and none used if there is one: what a script that inspects a
            checkpoint or computes logits wants (``fmoe.layers.forward(ck.params,
            tokens, ck.config)``).
        verify: check the data files' sha256 (reads them once more).

    Returns:
        A Checkpoint ``(params, opt_state, step, extra, rng, config)``.
    """
    if plan is None:
        return _load_whole(path, verify)
    check_runtime(plan)
    return _read(path, plan, verify, Group.world())


def _load_whole(path, verify: bool) -> Checkpoint:
    """``load(path)``: the full pytrees, read by this process alone."""
    path, meta = read_meta(path)
    plan = Plan(model=ModelConfig(**_saved_config(meta["model"])), lora=_saved_lora(meta))
    return _read(path, plan, verify, Group(1, 0, None))  # one rank: every tensor whole


def _read(path, plan: Plan, verify: bool, world: Group) -> Checkpoint:
    """``load``'s reading, for this process as rank ``world.rank`` of ``world.size``."""
    path, meta = read_meta(path)
    _validate(path, meta, plan, verify, world)
    spec = resolve(plan).spec
    shapes = spec.table.shapes()
    local = spec.local_shapes(world.rank)
    stored = meta["dcp"]["tensors"]
    dest, values = {}, {}

    def boxed(key, param):
        if param is not None:
            t = torch.empty(local[param], dtype=getattr(torch, stored[key]["dtype"]))
            return t, BoxedTensor(shapes[param], t.dtype, local_boxes(param, shapes[param], t, spec, world.rank))
        t = torch.empty(stored[key]["size"], dtype=getattr(torch, stored[key]["dtype"]))
        return t, BoxedTensor(t.shape, t.dtype, [((0,) * t.dim(), t)])

    for key in meta["tensor_keys"]:
        param = key[len("params."):] if key.startswith("params.") else meta["opt_params"].get(key)
        values[key], dest[key] = boxed(key, param)
    with _quiet():
        dcp.load({}, storage_reader=JsonMetadataReader(str(path), metadata_from_json(meta["dcp"])),
                 planner=BoxLoadPlanner(dest), no_dist=world.size == 1)
    values = {k: (v if k == "rng" else v.to(plan.device)) for k, v in values.items()}
    if plan.lora is not None:
        params = lora.from_named({k[len("adapters."):]: v for k, v in values.items() if k.startswith("adapters.")},
                                 plan)
    else:
        params = spec.table.unflatten(values["params." + p] for p in shapes)
    # a state saved by an older fmoe is brought to the current form here, once
    opt_state = None if meta["opt_state"] is None else optim.migrate_state(decode(meta["opt_state"], values))
    return Checkpoint(params, opt_state, meta["step"], meta["extra"], values.get("rng"),
                      ModelConfig(**_saved_config(meta["model"])))
