"""``fmoe.hf.config`` / ``load`` / ``save``: Hugging Face MoE checkpoints, streamed.

A Hugging Face directory holds ``config.json`` and safetensors files in the released
layout (per expert, ``...experts.{e}.w1.weight`` ``[out, in]``, or GPT-OSS's experts
stacked, ``...experts.gate_up_proj [E, in, out]``). ``load`` reads only
the rows and experts this rank holds under the plan; ``save`` gathers one unit at a
time and rank 0 writes it, so neither needs the whole model in one place.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from ..checkpoint.convert import safetensors_torch
from ..checkpoint.files import chmod_as_umask, staged_directory, write_atomically
from ..config import ModelConfig, Plan
from ..config_fields import Activation
from ..params import named_leaves
from ..runtime import check_runtime
from ..shard.layout import rows_cols
from ..comm.collectives import Group
from ..gather import iter_full
from ..resolve import resolve
from ..step import check_params
from .families import (WITH_EXPERT_BIAS, family_of, fp8_block, mxfp4, to_hf_config, to_model_config,
                       training_fields)
from .weights import (MXFP4_SUFFIXES, SCALE_SUFFIX, SafetensorsDir, file_keys, prediction_layer_keys,
                      read_local_leaf, recipes, to_file_tensors)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_config_json(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no config.json (a Hugging Face model directory has one)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None


def config(directory) -> ModelConfig:
    """The ModelConfig of a Hugging Face checkpoint directory (a family of
    ``fmoe.hf.families.FAMILIES``); ValueError naming the ``config.json`` key fmoe cannot
    represent.

    Arguments:
        directory: a directory with ``config.json``.

    Returns:
        The ModelConfig.
    """
    directory = Path(directory)
    return to_model_config(_read_config_json(directory), str(directory / "config.json"))


def _architecture_diff(mine: ModelConfig, theirs: ModelConfig) -> list[str]:
    ignore = set(training_fields(theirs)) | {"kv_heads", "head_size"}
    if theirs.activation_mode is not Activation.QUICK_GEGLU:
        ignore |= {"glu_limit", "glu_offset"}  # read by quick_geglu alone
    a, b = dataclasses.asdict(mine), dataclasses.asdict(theirs)
    diff = [f"{k}={a[k]!r} (the checkpoint's: {b[k]!r})" for k in a if k not in ignore and a[k] != b[k]]
    for name in ("num_kv_heads", "head_dim"):
        if getattr(mine, name) != getattr(theirs, name):
            diff.append(f"{name}={getattr(mine, name)} (the checkpoint's: {getattr(theirs, name)})")
    return diff


def load(directory, plan: Plan) -> dict:
    """This rank's params under ``plan`` from a Hugging Face checkpoint directory.

    Every rank reads only the experts and rows it holds. ``plan.model`` must compute
    what the checkpoint computes (build it from ``fmoe.hf.config(directory)``; the
    training fields — GLU interleave, capacity, padding, loss coefficients, expert-bias
    rate — may differ). ``expert_bias`` is the file's ``e_score_correction_bias`` where
    the family has one (GLM-4.5, DeepSeek-V3), zero otherwise. A checkpoint released in FP8 with
    block scales (``quantization_config`` ``fp8``, as DeepSeek-V3's and Qwen3's ``-FP8``)
    or with GPT-OSS's experts in MXFP4 (``mxfp4``) loads dequantised into the fp32 masters.

    Arguments:
        directory: a directory with ``config.json`` and safetensors files.
        plan: the Plan to lay the params out for.

    Returns:
        The params pytree, fp32 on ``plan.device``, as ``fmoe.init(plan)`` lays it out.
    """
    check_runtime(plan)
    directory = Path(directory)
    hf = _read_config_json(directory)
    theirs = to_model_config(hf, str(directory / "config.json"))
    diff = _architecture_diff(plan.model, theirs)
    if diff:
        raise ValueError(f"fmoe.hf.load: Plan.model differs from {directory / 'config.json'}: " + "; ".join(diff)
                         + " (build the model config with fmoe.hf.config)")
    cfg = plan.model
    files = SafetensorsDir(directory, fp8_block(hf, str(directory / "config.json")), mxfp4=mxfp4(hf))
    by_path = recipes(cfg, hf["model_type"])
    wanted = {k for r in by_path.values() for k in file_keys(r, cfg.experts)}
    harmless = {k for k in files.file_of if k.endswith("rotary_emb.inv_freq")}
    harmless.update(k + SCALE_SUFFIX for k in wanted if k + SCALE_SUFFIX in files.file_of)  # read with their weights
    harmless.update(k + s for k in wanted for s in MXFP4_SUFFIXES if k not in files.file_of)  # read as ``k``
    predicting = prediction_layer_keys(files.file_of, hf)
    if predicting:
        warnings.warn(f"fmoe.hf.load: {directory} holds {len(predicting)} tensors of multi-token-prediction "
                      f"layers ({predicting[0]}, ...), which fmoe does not compute or train; "
                      "fmoe.hf.save(..., source=this directory) writes them back unchanged", stacklevel=2)
        harmless.update(predicting)
    if cfg.tie_embeddings:
        harmless.add("lm_head.weight")  # some tied checkpoints store the copy too
    unread = sorted(set(files.file_of) - wanted - harmless)
    if unread:
        raise ValueError(f"fmoe.hf.load: {directory} holds tensors this model has no place for, e.g. {unread[:3]} "
                         f"(an architecture feature fmoe does not implement)")
    rank, spec = Group.world().rank, resolve(plan).spec
    local = spec.local_shapes(rank)
    leaves = []
    for path, shape in spec.table.shapes().items():
        if not spec.holds(path, rank):  # another pipeline stage's
            leaf = torch.empty(local[path])
        elif path not in by_path:  # expert_bias: no such tensor in these families
            leaf = spec.shard_leaf(torch.zeros(shape), path, rank)
        elif spec.cuts(path):  # a tensor-parallel piece is columns too: the rank's experts are read whole, then cut
            experts = spec.leaf_piece(path, shape, rank).experts
            held = tuple(shape) if experts is None else (experts[1] - experts[0],) + tuple(shape[1:])
            whole = read_local_leaf(files, by_path[path], cfg, held, experts, 0, rows_cols(held)[0], False)
            leaf = spec.shard_leaf(whole, path, rank, experts_cut=True)
        else:
            piece = spec.leaf_piece(path, shape, rank)
            leaf = read_local_leaf(files, by_path[path], cfg, spec.local_full_shape(path, shape), *piece)
        leaves.append(leaf.reshape(local[path]).to(device=plan.device, dtype=torch.float32).contiguous())
    return spec.table.unflatten(leaves)


def _check_expert_bias(named: dict, plan: Plan) -> None:
    """Refuse (on every rank alike) a model whose routing uses an expert bias: the
    released layouts have no place for it, so the file would route differently."""
    biases = [p for p in named if p.endswith("moe.expert_bias")]
    local = torch.tensor([float(named[p].abs().sum()) for p in biases], device=plan.device)
    Group.world().all_reduce(local).wait()
    used = [p for p, total in zip(biases, local.tolist()) if total > 0]
    if used:
        raise ValueError(f"fmoe.hf.save: {used[0]} is non-zero, but the softmax-routed Hugging Face MoE families "
                         "(Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GPT-OSS) select experts without a bias "
                         "(GLM-4.5's, with score_func='sigmoid', has one); train with expert_bias_rate=0 (balancing with "
                         "aux_loss_coef > 0, as the main job's default does) to export")


def kept_from_source(mine: dict, cfg: ModelConfig, source) -> dict:
    """``mine`` (a ``config.json`` fmoe wrote for ``cfg``) over the source checkpoint's
    own ``config.json``: every key fmoe did not change keeps the source's value (its
    token ids, ``max_position_embeddings``, ``router_aux_loss_coef``, Qwen3's dense
    ``intermediate_size`` ...). A key counts as unchanged when fmoe writes the same
    value for ``cfg`` as for the source's own ModelConfig."""
    source = Path(source)
    raw, source_cfg = _read_config_json(source), config(source)
    as_fmoe_writes_it = to_hf_config(source_cfg, family_of(source_cfg, str(source)), mine["dtype"])
    out = {k: v for k, v in raw.items() if k not in _NEVER_KEPT} if raw.get("model_type") == mine["model_type"] else {}
    for key, value in mine.items():
        unchanged = key in raw and key in as_fmoe_writes_it and as_fmoe_writes_it[key] == value
        if key in _ALWAYS_MINE or not unchanged:
            out[key] = value
    return out


def _copy_prediction_layers(source: Path, writer) -> None:
    """The source's multi-token-prediction layers, as released (``prediction_layer_keys``)."""
    files = SafetensorsDir(source)
    for key in prediction_layer_keys(files.file_of, _read_config_json(source)):
        writer.add({key: files.slice(key)[:]})


# What the written files are, whatever the source's were: fmoe writes plain floats, and
# its RoPE as ``rope_parameters`` (a kept released ``rope_scaling`` would override them).
_ALWAYS_MINE = ("architectures", "model_type", "dtype", "torch_dtype")
_NEVER_KEPT = ("quantization_config", "rope_scaling")


def save(directory, params: dict, plan: Plan, dtype: str = "float32", max_shard_bytes: int = 4 << 30,
         source=None) -> Path:
    """Write ``params`` as a Hugging Face checkpoint that ``from_pretrained`` reads.

    A collective: every rank passes its params; units are gathered one at a time and
    rank 0 writes them. The family follows the config (``score_func`` sigmoid: GLM-4.5,
    topk_softmax: GPT-OSS; else ``qk_norm`` head: Qwen3-MoE, full: OLMoE, a gated shared
    expert: Qwen2-MoE, otherwise Mixtral). Weights are written unquantised (no
    ``quantization_config``), whatever the source's were. Atomic: files go
    to a temporary sibling renamed into place, each readable as the umask allows
    (0644 under the usual 022).

    Arguments:
        directory: the output directory (created, or replaced if it holds a config.json).
        params: this rank's params pytree under ``plan``.
        plan: the Plan.
        dtype: the files' dtype, ``float32 | bfloat16 | float16``.
        max_shard_bytes: start a new safetensors file beyond this many bytes.
        source: the Hugging Face directory the model was loaded from, if any: its
            ``config.json``'s keys that fmoe did not change are kept (``kept_from_source``),
            and its multi-token-prediction layers' tensors are copied unchanged.

    Returns:
        The directory's Path.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"fmoe.hf.save dtype={dtype!r} is invalid: allowed " + ", ".join(map(repr, _DTYPES)))
    check_runtime(plan)
    check_params(params, plan)
    safetensors_torch("hf")  # before any collective, so a missing package fails every rank alike
    cfg, directory = plan.model, Path(directory)
    family = family_of(cfg)
    if directory.exists() and any(directory.iterdir()) and not (directory / "config.json").exists():
        raise ValueError(f"fmoe.hf.save: {directory} exists and is not a Hugging Face model directory; "
                         "refusing to replace it")
    hf_config = to_hf_config(cfg, family, dtype)
    if source is not None:
        hf_config = kept_from_source(hf_config, cfg, source)
    named = named_leaves(params)
    if family not in WITH_EXPERT_BIAS:
        _check_expert_bias(named, plan)
    world = Group.world()
    by_path = recipes(cfg, family)
    with staged_directory(directory, world, plan.device, "fmoe.hf.save") as (tmp, publish):
        writer, failed = None, []
        for views in iter_full(named, plan):  # every rank gathers every unit, even after a failure
            if world.rank != 0 or failed:
                continue
            try:  # rank 0 writes; a failure (a full disk) is reported to every rank by publish
                writer = writer or _ShardWriter(tmp, max_shard_bytes)
                for path, full in views.items():
                    if path in by_path:
                        writer.add(to_file_tensors(path, full, by_path[path], cfg, _DTYPES[dtype]))
            except Exception as err:
                failed.append(err)

        def finish():
            if failed:
                raise failed[0]
            if source is not None:
                _copy_prediction_layers(Path(source), writer)
            writer.finish(hf_config)

        publish(finish)
    return directory


class _ShardWriter:
    """Tensors into ``part-N.safetensors`` files of at most ``limit`` bytes, renamed at
    the end as ``from_pretrained`` expects, with the index when there are several."""

    def __init__(self, directory: Path, limit: int):
        directory.mkdir(parents=True)
        self.directory, self.limit = directory, limit
        self.pending: dict = {}
        self.files: list[dict] = []  # the keys of each written file

    def add(self, tensors: dict) -> None:
        # gathered leaves are views of one unit buffer; safetensors refuses shared storage
        self.pending.update({key: t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
                             for key, t in tensors.items()})
        if sum(t.numel() * t.element_size() for t in self.pending.values()) >= self.limit:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            path = self.directory / f"part-{len(self.files)}.safetensors"
            safetensors_torch("hf").save_file(self.pending, str(path), metadata={"format": "pt"})
            chmod_as_umask(path)  # safetensors writes through a 0600 temporary file
            self.files.append({k: t.numel() * t.element_size() for k, t in self.pending.items()})
            self.pending = {}

    def finish(self, hf_config: dict) -> None:
        self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            (self.directory / f"part-{i}.safetensors").rename(self.directory / name)
        if n > 1:
            index = {"metadata": {"total_size": sum(sum(f.values()) for f in self.files)},
                     "weight_map": {k: name for name, f in zip(names, self.files) for k in sorted(f)}}
            write_atomically(json.dumps(index, indent=2), self.directory / "model.safetensors.index.json")
        write_atomically(json.dumps(hf_config, indent=2), self.directory / "config.json")
