"""``fmoe.step``: loss and gradients of one global batch, microbatched."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .config import Plan
from .layers.model import cast_for_compute, lm_loss_sum, stack_stats
from .params import flat_shapes, named_leaves
from .runtime import check_runtime


class StepOutput(NamedTuple):
    """Result of ``fmoe.step``.

    Attributes:
        loss: fp32 scalar, mean next-token cross-entropy over every target of the batch.
        grads: fp32 pytree shaped like ``params``; the gradient of
            ``loss + aux_loss_coef * aux_loss + z_loss_coef * z_loss``.
        metrics: dict of detached tensors: ``loss``, ``aux_loss`` and ``z_loss`` (summed
            over layers, averaged over microbatches), ``objective`` (what was
            differentiated), ``expert_counts [layers, E]``, ``padded_rows``,
            ``dropped_tokens``, and ``tokens`` (an int).
    """

    loss: torch.Tensor
    grads: dict
    metrics: dict


def check_params(params, plan: Plan) -> None:
    """Raise ValueError unless ``params`` has the plan's layout, shapes and dtype."""
    want = flat_shapes(plan.model)
    got = named_leaves(params)
    if list(got) != list(want):
        differing = sorted(set(want) ^ set(got)) or [p for p, q in zip(want, got) if p != q]
        raise ValueError(f"params do not match Plan.model's layout; differing leaves: {differing[:8]}")
    for path, leaf in got.items():
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"params[{path!r}] is a {type(leaf).__name__}, not a tensor")
        if tuple(leaf.shape) != want[path]:
            raise ValueError(f"params[{path!r}] has shape {list(leaf.shape)}, Plan.model needs {list(want[path])}")
        if leaf.dtype != torch.float32:
            raise ValueError(f"params[{path!r}] has dtype {leaf.dtype}; params are float32")
        if leaf.device.type != torch.device(plan.device).type:
            raise ValueError(f"params[{path!r}] is on {leaf.device}, but Plan.device={plan.device!r}")


def check_batch(batch, plan: Plan) -> torch.Tensor:
    """Validate ``batch`` for ``plan`` and return its ``tokens`` on the plan's device."""
    if not isinstance(batch, dict) or "tokens" not in batch:
        raise ValueError("batch must be a dict with 'tokens': LongTensor[B, S+1]")
    tokens = batch["tokens"]
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.dim() != 2:
        desc = f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"batch['tokens'] must be a LongTensor[B, S+1], got {desc}")
    rows, cols = tokens.shape
    if cols < 2:
        raise ValueError(f"batch['tokens'] has {cols} column(s); it needs S+1 >= 2 (inputs and shifted targets)")
    if rows == 0 or rows % plan.microbatches:
        raise ValueError(
            f"batch['tokens'] has {rows} rows, which Plan.microbatches={plan.microbatches} "
            f"does not divide (allowed: a positive multiple of {plan.microbatches})"
        )
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= plan.model.vocab:
        raise ValueError(f"batch['tokens'] holds ids in [{lo}, {hi}]; allowed: 0..{plan.model.vocab - 1}")
    return tokens.to(plan.device)


def check_inputs(params, batch, plan: Plan) -> torch.Tensor:
    """All of ``step``'s validation; returns the batch's tokens on the plan's device."""
    check_runtime(plan)
    check_params(params, plan)
    return check_batch(batch, plan)


def num_targets(tokens: torch.Tensor) -> int:
    """Next-token targets in a ``[B, S+1]`` batch: ``B * S``."""
    return tokens.shape[0] * (tokens.shape[1] - 1)


def microbatch_objective(params: dict, tokens_mb: torch.Tensor, plan: Plan, total_targets: int):
    """One microbatch's share of the step objective, differentiable w.r.t. ``params``.

    ``ce_sum / total_targets + (aux_coef * aux + z_coef * z) / microbatches``: summed
    over a batch's microbatches it is the batch's mean cross-entropy plus the
    microbatch-averaged router losses.

    Returns:
        ``(objective, ce_sum, stats)`` with ``stats`` a MoEStats stacked over layers.
    """
    cfg = plan.model
    compute_params = cast_for_compute(params, plan.compute_dtype)
    ce_sum, layer_stats = lm_loss_sum(compute_params, tokens_mb, cfg, plan.expert_backend)
    s = stack_stats(layer_stats)
    router_losses = cfg.aux_loss_coef * s.aux_loss.sum() + cfg.z_loss_coef * s.z_loss.sum()
    return ce_sum / total_targets + router_losses / plan.microbatches, ce_sum, s


def step(params: dict, batch: dict, plan: Plan) -> StepOutput:
    """Loss, gradients and metrics of one batch under ``plan``.

    The batch is split into ``plan.microbatches`` row blocks; each block's summed
    cross-entropy is divided by the batch's total target count before its backward,
    so the accumulated gradient is that of the batch mean whatever the split.
    Router aux losses are computed per microbatch and averaged.

    Arguments:
        params: fp32 parameter pytree (from ``fmoe.init``).
        batch: ``{"tokens": LongTensor[B, S+1]}``.
        plan: the Plan.

    Returns:
        A StepOutput. Nothing in ``params`` is modified.
    """
    tokens = check_inputs(params, batch, plan)
    M = plan.microbatches
    total_targets = num_targets(tokens)

    leaves, treedef = optree.tree_flatten(params)
    inputs = [leaf.detach().requires_grad_(True) for leaf in leaves]
    grads = [torch.zeros_like(leaf) for leaf in leaves]
    ce_total = torch.zeros((), device=tokens.device)
    objective = torch.zeros((), device=tokens.device)
    stats = []
    for tokens_mb in tokens.chunk(M):
        obj, ce_sum, s = microbatch_objective(optree.tree_unflatten(treedef, inputs), tokens_mb, plan, total_targets)
        mb_grads = torch.autograd.grad(obj, inputs, allow_unused=True)
        for acc, g in zip(grads, mb_grads):
            if g is not None:
                acc.add_(g)
        ce_total += ce_sum.detach()
        objective += obj.detach()
        stats.append(s)

    loss = ce_total / total_targets
    metrics = {
        "loss": loss,
        "objective": objective,
        "aux_loss": sum(s.aux_loss.detach().sum() for s in stats) / M,
        "z_loss": sum(s.z_loss.detach().sum() for s in stats) / M,
        "expert_counts": sum(s.counts_E for s in stats),
        "padded_rows": sum(s.padded_rows.sum() for s in stats),
        "dropped_tokens": sum(s.dropped_tokens.sum() for s in stats),
        "tokens": total_targets,
    }
    return StepOutput(loss, optree.tree_unflatten(treedef, grads), metrics)


@torch.no_grad()
def eval_loss(params: dict, batch: dict, plan: Plan) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch`` without gradients (held-out evaluation).

    Arguments and validation are those of ``step``; microbatches bound the memory.

    Returns:
        A fp32 scalar tensor.
    """
    tokens = check_inputs(params, batch, plan)
    compute_params = cast_for_compute(params, plan.compute_dtype)
    total = sum(lm_loss_sum(compute_params, mb, plan.model, plan.expert_backend)[0]
                for mb in tokens.chunk(plan.microbatches))
    return total / num_targets(tokens)
