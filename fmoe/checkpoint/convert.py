"""Layout conversions and plain state-dict export, for params and optimizer state.

All functions take and return *full* pytrees in the canonical layout (load a
checkpoint with a one-rank plan, or use ``fmoe.gather_full``).

- Grouped experts ``fc1 [E, D, 2F]`` <-> per-expert keys as TransformerEngine's
  GroupedLinear and Megatron name them: ``...experts.fc1.weight{e}`` of shape
  ``[2F, D]`` (``y = x @ weight.T``) and ``...experts.fc1.bias{e}``.
- GLU halves ``[gate | up]`` <-> blocks of ``n`` columns alternating gate, up.
- Export / import of a flat ``{key: tensor}`` file: torch (loaded with
  ``weights_only=True``) or safetensors.
"""

from __future__ import annotations

import re
from pathlib import Path

import optree
import torch

from ..config import ModelConfig
from ..params import glu_from_interleaved, glu_to_interleaved, named_leaves, param_table
from .files import chmod_as_umask

_EXPERT = re.compile(r"^(layers\.\d+\.moe\.experts)\.(fc1|fc2)(_bias)?$")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.moe\.experts)\.(fc1|fc2)\.(weight|bias)(\d+)$")


def to_per_expert(full: dict) -> dict:
    """Full params pytree -> flat state dict with one ``weight{e}`` / ``bias{e}`` per expert."""
    out = {}
    for path, t in named_leaves(full).items():
        m = _EXPERT.match(path)
        if not m:
            out[path] = t
            continue
        prefix, fc, is_bias = m.groups()
        for e in range(t.shape[0]):
            if is_bias:
                out[f"{prefix}.{fc}.bias{e}"] = t[e].clone()
            else:
                out[f"{prefix}.{fc}.weight{e}"] = t[e].t().contiguous()
    return out


def from_per_expert(flat: dict, cfg: ModelConfig) -> dict:
    """Inverse of ``to_per_expert``; ValueError naming the first missing or unexpected key."""
    grouped: dict = {}
    for key, t in flat.items():
        m = _PER_EXPERT.match(key)
        if m:
            prefix, fc, kind, e = m.groups()
            name = f"{prefix}.{fc}" + ("_bias" if kind == "bias" else "")
            grouped.setdefault(name, {})[int(e)] = t if kind == "bias" else t.t()
        else:
            grouped[key] = t
    table, leaves = param_table(cfg), []
    for path, shape in table.shapes().items():
        if path not in grouped:
            raise ValueError(f"state dict has no {path!r} (nor its per-expert keys)")
        value = grouped.pop(path)
        if isinstance(value, dict):
            missing = [e for e in range(cfg.experts) if e not in value]
            if missing:
                raise ValueError(f"state dict lacks expert {missing[0]} of {path!r}")
            value = torch.stack([value[e] for e in range(cfg.experts)])
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"state dict {path!r} has shape {list(value.shape)}, the model needs {list(shape)}")
        leaves.append(value.contiguous())
    if grouped:
        raise ValueError(f"state dict has keys the model does not: {sorted(grouped)[:4]}")
    return table.unflatten(leaves)


def convert_glu(full: dict, cfg: ModelConfig, interleave: int) -> tuple[dict, ModelConfig]:
    """Re-lay fc1's GLU halves from ``cfg.glu_interleave`` to ``interleave`` (0: ``[gate | up]``).

    Returns:
        ``(params, config)``: the converted pytree and the config that describes it.
    """
    if not cfg.is_glu:
        raise ValueError(f"convert_glu: activation {cfg.activation!r} has no GLU halves")
    target = cfg.replace(glu_interleave=interleave)  # validates the block size
    table = param_table(cfg)

    def convert(path, t):
        if not table.at(path).glu:
            return t
        halves = glu_from_interleaved(t, cfg.glu_interleave) if cfg.glu_interleave else t
        return glu_to_interleaved(halves, interleave) if interleave else halves.clone()

    return optree.tree_map_with_path(convert, full), target


def map_param_trees(opt_state, fn, cfg: ModelConfig):
    """Apply ``fn`` to every params-shaped subtree of an optimizer state (its moments)."""
    want = param_table(cfg).treedef

    def is_params(x):
        return isinstance(x, dict) and optree.tree_structure(x) == want

    return optree.tree_map(lambda x: fn(x) if is_params(x) else x, opt_state, is_leaf=is_params)


def export_state_dict(path, full: dict, per_expert: bool = False, format: str = "torch") -> Path:
    """Write full params as a flat ``{key: tensor}`` file (``torch`` or ``safetensors``)."""
    flat = to_per_expert(full) if per_expert else dict(named_leaves(full))
    flat = {k: v.detach().cpu().contiguous() for k, v in flat.items()}
    path = Path(path)
    if format == "torch":
        torch.save(flat, path)
    elif format == "safetensors":
        safetensors_torch().save_file(flat, str(path))
        chmod_as_umask(path)  # safetensors writes through a private (0600) temporary file
    else:
        raise ValueError(f"export_state_dict format={format!r} is invalid: allowed 'torch', 'safetensors'")
    return path


def import_state_dict(path, cfg: ModelConfig) -> dict:
    """Read a file written by ``export_state_dict`` (grouped or per-expert keys) into a
    full params pytree; torch files are loaded with ``weights_only=True``."""
    path = Path(path)
    if path.suffix == ".safetensors":
        flat = safetensors_torch().load_file(str(path))
    else:
        flat = torch.load(path, weights_only=True, map_location="cpu")
    return from_per_expert(flat, cfg)


def safetensors_torch(extra: str = "safetensors"):
    """The ``safetensors.torch`` module, or a ValueError naming the extra that installs it."""
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError(f"safetensors is not installed: pip install 'fmoe[{extra}]'") from None
    return safetensors.torch
