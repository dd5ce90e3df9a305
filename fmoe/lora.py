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

Every rank holds the adapters whole; the base is laid out by the plan (sharded, split by
experts, tensor-parallel columns or pipeline stages). ``fmoe.step(adapters, batch, plan,
base=base)`` runs the adapters' products inside the layers, beside the frozen base's
(``fmoe/schedule/adapters.py``, ``fmoe/layers/adapted.py``): the base takes no gradient and
no reduction, and each rank's part of the adapters' gradients is summed over the ranks in
one all-reduce. ``freeze`` lays a base out once as the step's shards. ``merge`` folds the
adapters into the pieces of the base a rank holds (an export, and with ``adapter_grads`` the
reference path the step is tested against: the step of the merged weights, each piece's
gradient ``g`` carried to the adapters by the chain rule, ``a``: ``scale * g @ b.T``,
``b``: ``scale * a.T @ g``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import optree
import torch

from .checks import fail
from .lora_sites import Site, adapted_params, dotted, sites
from .lora_spec import TARGETS, LoRA
from .comm.collectives import Group, summed
from .params import named_leaves
from .param_checks import check_params
from .resolve import resolve
from .shard.boxes import local_boxes
from .shard.shards import Shards, build_shards

__all__ = ["FrozenBase", "LoRA", "Site", "TARGETS", "adapter_grads", "adapter_shapes", "check_adapters", "freeze",
           "from_named", "init", "merge", "pairs", "sites"]


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
        raise ValueError(f"{what} has no adapter at {dotted(keys)} ({{'a', 'b'}}), which the plan's LoRA "
                         "adapts: build the adapters with fmoe.lora.init(plan)") from None


def from_named(named: dict, plan) -> dict:
    """The adapter tree of ``plan.lora`` from its leaves by dotted name
    (``{"layers.0.attn.q.a": tensor, ...}``, as ``fmoe.params.named_leaves`` names them)."""
    tree: dict = {"layers": [{} for _ in range(plan.model.layers)]}
    for site in sites(plan_lora(plan), plan.model):
        name = dotted(site.adapter)
        _put(tree, site.adapter, {"a": named[f"{name}.a"], "b": named[f"{name}.b"]})
    return tree


def check_adapters(adapters, plan, stepped: bool = False) -> tuple[Site, ...]:
    """The plan's Sites; ValueError unless ``adapters`` holds exactly their ``a`` and ``b``,
    shaped ``[..., in, r]`` and ``[..., r, out]``, and for a step (``stepped``) float32 on
    the plan's device."""
    lora = plan_lora(plan)
    todo = sites(lora, plan.model)
    device = torch.device(plan.device).type
    for site in todo:
        for name, t, shape in zip("ab", _get(adapters, site.adapter, "adapters"), _ab_shapes(site, lora.rank)):
            where = f"adapters {dotted(site.adapter)}.{name}"
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{where} is {got}: expected {shape} (LoRA.rank={lora.rank})")
            if stepped and (t.dtype != torch.float32 or t.device.type != device):
                raise ValueError(f"{where} is {t.dtype} on {t.device}: adapters are float32 on "
                                 f"Plan.device={plan.device!r}")
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
    return {f"{dotted(site.adapter)}.{name}": shape for site in sites(lora, plan.model)
            for name, shape in zip("ab", _ab_shapes(site, lora.rank))}


def pairs(adapters: dict, plan) -> list[tuple[Site, torch.Tensor, torch.Tensor]]:
    """Each of the plan's Sites with its adapter's ``a`` and ``b``, once
    ``check_adapters`` has passed them."""
    return [(site, *_get(adapters, site.adapter, "adapters")) for site in check_adapters(adapters, plan)]


def merge(base: dict, adapters: dict, plan) -> dict:
    """This rank's params under ``plan`` with the adapters merged: each piece of an adapted
    matrix the rank holds (its experts, rows, tensor-parallel columns; ``q``, ``k``, ``v``'s
    columns of ``qkv``) is ``W + (alpha / rank) * a @ b`` over that piece, every other leaf
    ``base``'s own. On one process the pieces are the whole matrices. Differentiable in
    both; neither is written.

    Arguments:
        base: this rank's params under ``plan`` (``fmoe.init(plan)``'s layout).
        adapters: the adapters, whole (``fmoe.lora.init``).
        plan: the Plan with its ``lora``.
    """
    lora, todo = plan_lora(plan), pairs(adapters, plan)
    spec, rank = _spec_and_rank(plan)
    local, named = spec.local_shapes(rank), named_leaves(base)
    by_param: dict = {}
    for site, a, b in todo:
        w = named.get(site.param)
        if w is None or tuple(w.shape) != tuple(local[site.param]):
            got = tuple(w.shape) if w is not None else "missing"
            raise ValueError(f"base {site.param} is {got}: this rank holds {tuple(local[site.param])} of it under "
                             "the plan (fmoe.init(plan) or fmoe.hf.load(dir, plan) lay the base out)")
        by_param.setdefault(site.param, []).append((site, a, b))
    leaves, treedef = optree.tree_flatten(base)
    merged = [w + _delta(path, w, by_param[path], lora.scale, spec, rank).to(w.dtype) if path in by_param else w
              for path, w in zip(named, leaves)]
    return optree.tree_unflatten(treedef, merged)


def _spec_and_rank(plan):
    return resolve(plan).spec, Group.world().rank if plan.world > 1 else 0


def _delta(path: str, w: torch.Tensor, todo: list, scale: float, spec, rank: int) -> torch.Tensor:
    """``scale * a @ b`` of each adapter on parameter ``path``, over the boxes of it that
    this rank holds, laid out as its piece ``w``."""
    shape = spec.table[path].shape
    delta = torch.zeros(w.shape, dtype=todo[0][1].dtype, device=w.device)
    for offsets, view in local_boxes(path, shape, delta, spec, rank):
        lead = tuple(slice(o, o + n) for o, n in zip(offsets[:-2], view.shape[:-2]))
        rows = slice(offsets[-2], offsets[-2] + view.shape[-2])
        c0, c1 = offsets[-1], offsets[-1] + view.shape[-1]
        for site, a, b in todo:
            start, stop = (site.columns.start, site.columns.stop) if site.columns else (0, shape[-1])
            lo, hi = max(c0, start), min(c1, stop)
            if lo < hi:
                part = b[lead + (slice(None), slice(lo - start, hi - start))]
                view[..., lo - c0:hi - c0].add_(scale * torch.matmul(a[lead + (rows,)], part))
    return delta


def adapter_grads(base: dict, adapters: dict, plan, step) -> tuple[object, dict]:
    """``step(merged_params) -> StepOutput`` run on ``merge(base, adapters, plan)``, and the
    adapters' gradients from its gradients of the merged matrices (the chain rule through
    ``merge``).

    Each rank's gradients are those of the pieces it holds, so each rank's part of an
    adapter's gradient comes from its pieces. The parts are summed over the ranks (one
    all-reduce), each box of a parameter counted once however many ranks hold it. A
    parameter every rank holds whole needs no sum.

    Returns:
        ``(the step's output, grads shaped like adapters, the same on every rank)``.
    """
    a_leaves, a_def = optree.tree_flatten(adapters)
    held = [t.detach().requires_grad_(True) for t in a_leaves]
    with torch.enable_grad():
        merged = merge(base, optree.tree_unflatten(a_def, held), plan)
    out = step(optree.tree_map(torch.Tensor.detach, merged))
    rank = _spec_and_rank(plan)[1]
    named_merged, named_grads = named_leaves(merged), named_leaves(out.grads)
    touched = [p for p, w in named_merged.items() if w.requires_grad]
    adapted = _adapted_params(adapters, plan)
    split = {p for p in set(adapted) if not _whole_everywhere(plan, p)}  # the same on every rank
    outputs = [_counted_once(plan, p, named_grads[p].to(named_merged[p].dtype), rank) if p in split
               else named_grads[p].to(named_merged[p].dtype) for p in touched]
    got = torch.autograd.grad([named_merged[p] for p in touched], held, grad_outputs=outputs, allow_unused=True)
    grads = [torch.zeros_like(h) if g is None else g for h, g in zip(held, got)]
    parts = [i for i, path in enumerate(adapted) if path in split]  # the same leaves on every rank
    if parts:
        for i, g in zip(parts, summed(Group.world(), [grads[i] for i in parts])):
            grads[i] = g
    return out, optree.tree_unflatten(a_def, grads)


def _adapted_params(adapters: dict, plan) -> list[str]:
    """The parameter each leaf of ``adapters`` adapts, in the order of its flattened leaves."""
    param_of = {f"{name}.{ab}": path for path, on in adapted_params(plan_lora(plan), plan.model).items()
                for name, _, _ in on for ab in "ab"}
    return [param_of[name] for name in named_leaves(adapters)]


def _box_keys(spec, path: str, rank: int) -> tuple:
    """The boxes of parameter ``path`` rank ``rank`` holds, as ``(offsets, sizes)``."""
    meta = torch.empty(spec.local_shapes(rank)[path], device="meta")
    return tuple((tuple(o), tuple(v.shape)) for o, v in local_boxes(path, spec.table[path].shape, meta, spec, rank))


@functools.lru_cache(maxsize=4096)
def _holders(plan, path: str) -> dict:
    """``{(offsets, sizes): how many ranks hold that box}`` of parameter ``path`` under
    ``plan`` (read, never changed: the dict is cached)."""
    spec, count = resolve(plan).spec, {}
    for r in range(plan.world):
        for key in _box_keys(spec, path, r):
            count[key] = count.get(key, 0) + 1
    return count


def _whole_everywhere(plan, path: str) -> bool:
    """Whether every rank holds parameter ``path`` whole (so each has its whole gradient)."""
    shape = tuple(resolve(plan).spec.table[path].shape)
    return _holders(plan, path) == {((0,) * len(shape), shape): plan.world}


def _counted_once(plan, path: str, grad: torch.Tensor, rank: int) -> torch.Tensor:
    """``grad`` (this rank's piece of parameter ``path``) with each box divided by the
    number of ranks holding that box, so that summing every rank's part counts it once."""
    spec, holders, out = resolve(plan).spec, _holders(plan, path), grad.clone()
    for offsets, view in local_boxes(path, spec.table[path].shape, out, spec, rank):
        view.div_(holders[(tuple(offsets), tuple(view.shape))])
    return out


class FrozenBase(NamedTuple):
    """A LoRA base laid out once as the flat shards a step gathers from (``freeze``): a step
    handed it reads them instead of copying the base into new shards, and the base's own
    leaves can go. What the 30B model on one GPU needs: the bf16 base held once.

    Attributes:
        plan: the Plan it was laid out for, without its ``lora``.
        shards: this rank's flat shards (``fmoe.shard.shards.Shards``), never written.
    """

    plan: object
    shards: Shards


def freeze(base: dict, plan) -> FrozenBase:
    """``base`` (this rank's params under ``plan``, float32 or the compute dtype) checked and
    laid out once as the flat shards a step gathers from, cast to each group's dtype:
    ``fmoe.step(adapters, batch, plan, base=...)`` and ``fmoe.eval_loss`` read them without
    copying the base each step. Once it is made, the base's own leaves can be dropped.

    Raises:
        ValueError: naming ``Plan.lora`` without one, or as ``fmoe.step`` for params that do
            not fit the plan.
    """
    plan_lora(plan)
    setup = resolve(plan)
    check_params(base, plan, setup)
    shards = build_shards(named_leaves(base), setup.spec, setup.units, setup.mesh, setup.execution.device)
    return FrozenBase(plan.replace(lora=None), shards)
