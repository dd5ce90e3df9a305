"""Low-rank adapters (LoRA): a pytree of their own, trained while the params they adapt stay frozen.

An adapted matrix ``W [..., in, out]`` gets ``{"a": [..., in, r], "b": [..., r, out]}`` at the
same path in the adapter tree, and the layer computes ``x @ W + (alpha / r) * (x @ a) @ b``
(``../shared/DESIGN.md``, "LoRA"):

- ``adapters["layers"][i]["attn"]["q"]``, ``["k"]``, ``["v"]`` adapt the query, key and value
  columns of the fused ``attn.qkv``; ``["out"]`` adapts ``attn.out``; under multi-head latent
  attention ``["q"]`` (``attn.q``), ``["q_down"]``, ``["q_up"]``, ``["kv_down"]`` and
  ``["kv_up"]`` adapt the projections of those names;
- ``["moe"]["experts"]["fc1"]`` and ``["fc2"]``: one adapter per expert, stacked on the
  expert axis (``a [E, in, r]``, ``b [E, r, out]``);
- ``["moe"]["shared"]["fc1"]``, ``["fc2"]``; a dense layer's ``["mlp"]["fc1"]``, ``["fc2"]``.

A target applies in every layer that holds its matrix; a target no layer holds is refused.
``b`` starts at zero, so a fresh adapter leaves the model as it was.

This version trains the adapters on one process or on data-parallel replicas (every rank
holding the full params), through the merged weights: the step runs
on ``merge(base, adapters)`` and each adapted matrix's gradient ``g`` reaches its adapter by
the chain rule (``a``: ``scale * g @ b.T``, ``b``: ``scale * a.T @ g``). The base is never
written and holds no gradient after the step; its weight gradients are still computed, so
this path is the reference the adapter products inside the layers will be checked against,
not a faster step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import optree
import torch

from .checks import fail
from .lora_spec import TARGETS, LoRA
from .model_config import ModelConfig
from .params import named_leaves, param_table

__all__ = ["LoRA", "Site", "TARGETS", "adapter_grads", "adapter_shapes", "check_adapters", "check_plan", "from_named", "init", "merge",
           "pairs", "sites"]

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


def plan_lora(plan) -> LoRA:
    """``plan.lora``, or ValueError naming ``Plan.lora`` when it has none."""
    if plan.lora is None:
        fail("Plan.lora", None, "adapters need a fmoe.LoRA(rank, alpha, targets) on the plan")
    return plan.lora


def init(plan, seed: int = 0) -> dict:
    """Fresh adapters for ``plan.lora`` on ``plan.device``: each ``a`` uniform in
    ``+-1/sqrt(in)`` (PEFT's default draw), each ``b`` zero; fp32, deterministic per ``seed``
    (the same on every rank: each holds them whole).

    Returns:
        ``{"layers": [{...}, ...]}``, one dict per layer (empty where nothing is adapted).
    """
    lora = plan_lora(plan)
    check_plan(plan)
    g = torch.Generator().manual_seed(seed)
    tree: dict = {"layers": [{} for _ in range(plan.model.layers)]}
    for site in sites(lora, plan.model):
        a_shape, b_shape = _ab_shapes(site, lora.rank)
        a = (torch.rand(*a_shape, generator=g) * 2 - 1) / math.sqrt(a_shape[-2])
        b = torch.zeros(*b_shape)
        _put(tree, site.adapter, {"a": a.to(plan.device), "b": b.to(plan.device)})
    return tree


def _put(tree: dict, keys: tuple, value) -> None:
    node = tree["layers"][keys[1]]
    for key in keys[2:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def _get(tree: dict, keys: tuple, what: str):
    try:
        node = tree["layers"][keys[1]]
        for key in keys[2:]:
            node = node[key]
        return node["a"], node["b"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{what} has no adapter at {_dotted(keys)} ({{'a', 'b'}}), which the plan's LoRA "
                         "adapts: build the adapters with fmoe.lora.init(plan)") from None


def from_named(named: dict, plan) -> dict:
    """The adapter tree of ``plan.lora`` from its leaves by dotted name
    (``{"layers.0.attn.q.a": tensor, ...}``, as ``fmoe.params.named_leaves`` names them)."""
    tree: dict = {"layers": [{} for _ in range(plan.model.layers)]}
    for site in sites(plan_lora(plan), plan.model):
        name = _dotted(site.adapter)
        _put(tree, site.adapter, {"a": named[f"{name}.a"], "b": named[f"{name}.b"]})
    return tree


def _dotted(keys: tuple) -> str:
    return ".".join(map(str, keys))


def check_adapters(adapters, plan) -> tuple[Site, ...]:
    """The plan's Sites; ValueError unless ``adapters`` holds exactly their ``a`` and ``b``,
    shaped ``[..., in, r]`` and ``[..., r, out]``."""
    lora = plan_lora(plan)
    todo = sites(lora, plan.model)
    for site in todo:
        for name, t, shape in zip("ab", _get(adapters, site.adapter, "adapters"), _ab_shapes(site, lora.rank)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"adapters {_dotted(site.adapter)}.{name} is {got}: expected {shape} "
                                 f"(LoRA.rank={lora.rank})")
    extra = sorted(set(named_leaves(adapters)) - set(adapter_shapes(plan)))
    if extra:
        raise ValueError(f"adapters hold {extra[0]}, which the plan's LoRA does not adapt "
                         f"(LoRA.targets={lora.targets})")
    return todo


def _ab_shapes(site: Site, rank: int) -> tuple[tuple, tuple]:
    *lead, n_in, n_out = site.shape
    return (*lead, n_in, rank), (*lead, rank, n_out)


def adapter_shapes(plan) -> dict:
    """``{dotted name: shape}`` of every leaf of ``plan.lora``'s adapters
    (``layers.0.attn.q.a``, as ``fmoe.params.named_leaves`` names them)."""
    lora = plan_lora(plan)
    return {f"{_dotted(site.adapter)}.{name}": shape for site in sites(lora, plan.model)
            for name, shape in zip("ab", _ab_shapes(site, lora.rank))}


def pairs(adapters: dict, plan) -> list[tuple[Site, torch.Tensor, torch.Tensor]]:
    """Each of the plan's Sites with its adapter's ``a`` and ``b``, once
    ``check_adapters`` has passed them."""
    return [(site, *_get(adapters, site.adapter, "adapters")) for site in check_adapters(adapters, plan)]


def merge(base: dict, adapters: dict, plan) -> dict:
    """Plain params: each adapted matrix ``W + (alpha / rank) * a @ b`` (its columns, for
    ``q``, ``k``, ``v``), every other leaf ``base``'s own. Differentiable in both; neither
    is written."""
    lora, todo = plan_lora(plan), pairs(adapters, plan)
    named = named_leaves(base)
    table = param_table(plan.model)
    for site, _, _ in todo:
        if site.param not in named or tuple(named[site.param].shape) != table[site.param].shape:
            got = tuple(named[site.param].shape) if site.param in named else "missing"
            raise ValueError(f"base {site.param} is {got}: merge takes the full params "
                             f"{table[site.param].shape} (fmoe.gather_full(params, plan) on several ranks)")
    deltas: dict = {}
    for site, a, b in todo:
        delta = lora.scale * torch.matmul(a, b)
        if site.columns is not None:
            whole = deltas.get(site.param, named[site.param].new_zeros(named[site.param].shape))
            delta = torch.cat([whole[..., :site.columns.start], delta + whole[..., site.columns],
                               whole[..., site.columns.stop:]], -1)
        elif site.param in deltas:
            delta = deltas[site.param] + delta
        deltas[site.param] = delta
    leaves, treedef = optree.tree_flatten(base)
    merged = [w + deltas[path].to(w.dtype) if path in deltas else w for path, w in zip(named, leaves)]
    return optree.tree_unflatten(treedef, merged)


def check_plan(plan) -> None:
    """Adapters go through the merged weights, so each rank must hold the full params:
    data-parallel replicas (``sharding='no_shard'``), no other degree, in this version."""
    split = {name: getattr(plan, name) for name in ("ep", "tp", "etp", "cp", "pp") if getattr(plan, name) > 1}
    if plan.world > 1 and (plan.sharding != "no_shard" or split):
        held = f"sharding={plan.sharding!r}" + "".join(f", {k}={v}" for k, v in split.items())
        fail("Plan.lora", plan.lora, f"adapters train on one process or data-parallel replicas in this version: "
             f"sharding='no_shard' with dp only (the plan has {held})")


def adapter_grads(base: dict, adapters: dict, plan, step) -> tuple[object, dict]:
    """``step(merged_params) -> StepOutput`` run on ``merge(base, adapters, plan)``, and the
    adapters' gradients from its gradients of the merged matrices (the chain rule through
    ``merge``). Returns ``(the step's output, grads shaped like adapters)``."""
    check_plan(plan)
    a_leaves, a_def = optree.tree_flatten(adapters)
    held = [t.detach().requires_grad_(True) for t in a_leaves]
    with torch.enable_grad():
        merged = merge(base, optree.tree_unflatten(a_def, held), plan)
    out = step(optree.tree_map(torch.Tensor.detach, merged))
    named_merged, named_grads = named_leaves(merged), named_leaves(out.grads)
    touched = [p for p, w in named_merged.items() if w.requires_grad]
    got = torch.autograd.grad([named_merged[p] for p in touched], held,
                              grad_outputs=[named_grads[p].to(named_merged[p].dtype) for p in touched],
                              allow_unused=True)
    grads = [torch.zeros_like(h) if g is None else g for h, g in zip(held, got)]
    return out, optree.tree_unflatten(a_def, grads)
