"""``check_params``: whether params are what a rank holds under a plan (the check ``fmoe.step``,
``fmoe.lora.freeze``, checkpoints and Hugging Face loads run before any compute)."""

from __future__ import annotations

import torch

from .comm.collectives import Group
from .config import Plan
from .params import named_leaves
from .resolve import Setup, resolve


def check_params(params, plan: Plan, setup: Setup | None = None) -> None:
    """Raise ValueError unless ``params`` has the layout, shapes, dtype and device this
    rank holds under ``plan`` (``setup``: its Setup, if the caller has it). Params are
    float32; under ``plan.lora`` they are the frozen base, which may also be held in
    ``plan.compute_dtype``."""
    setup = resolve(plan) if setup is None else setup
    want = setup.spec.local_shapes(Group.world().rank)
    got = named_leaves(params)
    if list(got) != list(want):
        differing = sorted(set(want) ^ set(got)) or [p for p, q in zip(want, got) if p != q]
        raise ValueError(f"params do not match Plan.model's layout; differing leaves: {differing[:8]}")
    for path, leaf in got.items():
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"params[{path!r}] is a {type(leaf).__name__}, not a tensor")
        if tuple(leaf.shape) != want[path]:
            raise ValueError(f"params[{path!r}] has shape {list(leaf.shape)}; this rank's part under the plan "
                             f"is {list(want[path])} (sharding={plan.sharding!r})")
        if leaf.dtype != torch.float32 and not (plan.lora is not None and leaf.dtype == plan.compute_dtype):
            allowed = "float32" if plan.lora is None else f"float32 or the compute dtype {plan.compute_dtype}"
            raise ValueError(f"params[{path!r}] has dtype {leaf.dtype}; params are {allowed}")
        if leaf.device.type != torch.device(plan.device).type:
            raise ValueError(f"params[{path!r}] is on {leaf.device}, but Plan.device={plan.device!r}")


__all__ = ["check_params"]
