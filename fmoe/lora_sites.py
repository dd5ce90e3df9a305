"""Which matrices of a model a ``fmoe.LoRA`` adapts: a ``Site`` per adapted matrix
(``sites``), and the adapters on each parameter (``adapted_params``), which the executor
reads to hand a node its adapted weights."""

from __future__ import annotations

import functools
from typing import NamedTuple

from .checks import fail
from .lora_spec import LoRA
from .model_config import ModelConfig
from .params import param_table

_QKV = {"q": 0, "k": 1, "v": 2}  # the target's part of the fused attn.qkv columns
_PAIRS = {"experts": ("moe", "experts"), "shared": ("moe", "shared"), "mlp": ("mlp",)}  # fc1 and fc2 each


class Site(NamedTuple):
    """One adapted matrix.

    Attributes:
        adapter: its adapter's keys in the adapter tree (``("layers", 3, "attn", "q")``).
        param: the base leaf it adapts (``"layers.3.attn.qkv"``).
        columns: the leaf's columns it adapts (``q``, ``k`` or ``v`` of ``qkv``), or None: all.
        shape: the adapted matrix's shape ``[..., in, out]``.
    """

    adapter: tuple
    param: str
    columns: slice | None
    shape: tuple


def sites(lora: LoRA, cfg: ModelConfig) -> tuple[Site, ...]:
    """Every matrix ``lora`` adapts in a model ``cfg``, layer by layer.

    Raises:
        ValueError: naming ``LoRA.targets``, for a target no layer of ``cfg`` holds.
    """
    table = param_table(cfg)
    shapes = {leaf.path: leaf.shape for leaf in table.leaves}
    found, out = set(), []
    for i in range(cfg.layers):
        for target in lora.targets:
            for site in _layer_sites(target, i, shapes, table):
                found.add(target)
                out.append(site)
    missing = [t for t in lora.targets if t not in found]
    if missing:
        fail("LoRA.targets", lora.targets, f"this model has no {', '.join(map(repr, missing))} to adapt "
             "(shared: ModelConfig.shared_ffn > 0; mlp: ModelConfig.dense_layers; q, k, v: grouped-query "
             "attention, q_down, q_up, kv_down, kv_up: latent attention)")
    return tuple(out)


def _layer_sites(target: str, i: int, shapes: dict, table) -> list[Site]:
    attn = f"layers.{i}.attn"
    if target in _QKV and f"{attn}.qkv" in shapes:
        sizes = [part.size for part in table[f"{attn}.qkv"].split.parts]
        k = _QKV[target]
        start = sum(sizes[:k])
        return [Site(("layers", i, "attn", target), f"{attn}.qkv", slice(start, start + sizes[k]),
                     (shapes[f"{attn}.qkv"][0], sizes[k]))]
    if target in _PAIRS:
        keys = _PAIRS[target]
        prefix = ".".join((f"layers.{i}", *keys))
        return [Site(("layers", i, *keys, fc), f"{prefix}.{fc}", None, shapes[f"{prefix}.{fc}"])
                for fc in ("fc1", "fc2") if f"{prefix}.{fc}" in shapes]
    path = f"{attn}.{target}"
    return [Site(("layers", i, "attn", target), path, None, shapes[path])] if path in shapes else []


def dotted(keys: tuple) -> str:
    return ".".join(map(str, keys))


@functools.lru_cache(maxsize=64)
def adapted_params(lora: LoRA, cfg: ModelConfig) -> dict:
    """``{param path: ((adapter name, first column, end column), ...)}``: the adapters on each
    adapted matrix of ``cfg`` (``qkv`` has up to three, on its ``q``, ``k``, ``v`` columns),
    each by its dotted name in the adapter tree (``layers.0.attn.q``). Read, never changed:
    the dict is cached."""
    out: dict = {}
    for site in sites(lora, cfg):
        cols = site.columns or slice(0, site.shape[-1])
        out.setdefault(site.param, []).append((dotted(site.adapter), cols.start, cols.stop))
    return {path: tuple(v) for path, v in out.items()}
