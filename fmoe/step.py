"""``fmoe.step``: loss and gradients of one global batch, microbatched."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .config import Plan
from .layers.fp8 import GEMMS
from .layers.model import cast_for_compute, lm_loss_sum, stack_stats
from .layers.router import router_loss
from .params import named_leaves
from .runtime import check_runtime
from .schedule import Kernels, check_program, execute
from .schedule.program import program_for
from .shard.comm import Group
from .shard.mesh import Mesh, mesh_for
from .shard.spec import local_shapes


class StepOutput(NamedTuple):
    """Result of ``fmoe.step``.

    Attributes:
        loss: fp32 scalar, mean next-token cross-entropy over every target of the batch.
        grads: fp32 pytree shaped like ``params``; the gradient of
            ``loss + aux_loss_coef * aux_loss + z_loss_coef * z_loss``.
        metrics: dict of detached tensors, summed over ranks: ``loss``, ``aux_loss`` and
            ``z_loss`` (summed over layers, averaged over microbatches and ranks),
            ``objective`` (what was differentiated), ``expert_counts [layers, E]`` (the
            load on the global batch), ``padded_rows``, ``dropped_tokens``,
            ``a2a_bytes`` (sent by the forward all-to-alls); ``tokens`` (an int, the global target
            count) and ``trace`` (the step's lifecycle and compute Events).
    """

    loss: torch.Tensor
    grads: dict
    metrics: dict


def check_params(params, plan: Plan) -> None:
    """Raise ValueError unless ``params`` has the layout, shapes, dtype and device this
    rank holds under ``plan``."""
    want = local_shapes(plan, Group.world().rank)
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
    if tokens.device.type == "meta":
        raise ValueError("batch['tokens'] is on the meta device, which holds no values; allowed: ids on a device "
                         f"that holds data (they are moved to Plan.device={plan.device!r})")
    rows, cols = tokens.shape
    if cols < 2:
        raise ValueError(f"batch['tokens'] has {cols} column(s); it needs S+1 >= 2 (inputs and shifted targets)")
    if rows == 0 or rows % plan.microbatches:
        raise ValueError(
            f"batch['tokens'] has {rows} rows, which Plan.microbatches={plan.microbatches} "
            f"does not divide (allowed: a positive multiple of {plan.microbatches})"
        )
    lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one host read
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
    ce_sum, layer_stats = lm_loss_sum(compute_params, tokens_mb, cfg, plan.expert_backend, GEMMS[plan.fp8])
    s = stack_stats(layer_stats)
    router_losses = router_loss(s.aux_loss.sum(), s.z_loss.sum(), cfg)
    return ce_sum / total_targets + router_losses / plan.microbatches, ce_sum, s


def _sum_over_ranks(group: Group, t: torch.Tensor) -> torch.Tensor:
    group.all_reduce(t).wait()
    return t


class Prepared(NamedTuple):
    """A validated step, ready to run: everything ``step`` settles before its compute.

    Attributes:
        tokens: this rank's ``[B, S+1]`` batch on the plan's device.
        program: the schedule's program; ``slots``: its double-buffer slots.
        mesh: the plan's Mesh; ``total``: the global target count (summed over ranks).
    """

    tokens: torch.Tensor
    program: tuple
    slots: dict | None
    mesh: Mesh
    total: int


def prepare_step(params: dict, batch: dict, plan: Plan, train: bool = True) -> Prepared:
    """``step``'s validation (ValueErrors before any collective), its program, and the
    global target count (on several ranks one small all-reduce and host read)."""
    tokens = check_inputs(params, batch, plan)
    program = program_for(plan, train)
    slots = check_program(plan, program)  # the last check; collectives start below
    mesh = mesh_for(plan)
    total = num_targets(tokens)
    if mesh.world.size > 1:  # one small all-reduce and host read; a single rank knows its count
        total = int(_sum_over_ranks(mesh.world, torch.tensor(total, device=tokens.device)))
    return Prepared(tokens, program, slots, mesh, total)


def step(params: dict, batch: dict, plan: Plan, kernels: Kernels | None = None) -> StepOutput:
    """Loss, gradients and metrics of one batch under ``plan``.

    Each rank passes its own slice of the global batch. The slice is split into
    ``plan.microbatches`` row blocks run in the order of ``plan.schedule``
    (``standard`` or ``1f1b_overlap``; ``fmoe.schedule``) with the plan's recomputation
    and delayed wgrad: every node's cross-entropy is divided by the *global* target
    count, and gradients are summed over ranks, so loss and gradients are those of
    the global batch mean whatever the split. Router losses are averaged over all
    microbatches of all ranks.

    Arguments:
        params: this rank's fp32 parameter pytree (from ``fmoe.init``).
        batch: ``{"tokens": LongTensor[B, S+1]}``, this rank's rows.
        plan: the Plan.
        kernels: the functions inside the layer nodes (``interop.cuda_graph`` passes
            CUDA-graphed ones); by default the pure functions, compiled when
            ``plan.compile`` is set.

    Returns:
        A StepOutput whose grads are sharded like ``params``; ``metrics["trace"]``
        holds the step's Events. Nothing in ``params`` is modified.
    """
    return run_step(params, prepare_step(params, batch, plan), plan, kernels)


def run_step(params: dict, prepared: Prepared, plan: Plan, kernels: Kernels | None = None) -> StepOutput:
    """The compute of ``step`` for a Prepared batch: no host read of a device value
    under a static-shape plan (capacity routing or no expert parallelism), so it can
    be captured in a CUDA graph (``interop.cuda_graph.capture_step``)."""
    tokens, mesh, total = prepared.tokens, prepared.mesh, prepared.total
    group = mesh.world
    run = execute(prepared.program, named_leaves(params), tokens, plan, mesh, total, prepared.slots, kernels)

    M, world = plan.microbatches, group.size
    floats = torch.stack([run.ce_sum, run.objective,
                          sum(s.aux_loss.detach().sum() for s in run.stats),
                          sum(s.z_loss.detach().sum() for s in run.stats)]).float()
    counts = sum(s.counts_E for s in run.stats)
    extra = torch.stack([sum(s.padded_rows.sum() for s in run.stats),
                         sum(s.dropped_tokens.sum() for s in run.stats),
                         sum(s.a2a_bytes.sum() for s in run.stats)])
    ints = _sum_over_ranks(group, torch.cat([counts.flatten(), extra]))
    floats = _sum_over_ranks(group, floats)
    loss = floats[0] / total
    metrics = {
        "loss": loss,
        "objective": floats[1],
        "aux_loss": floats[2] / (M * world),
        "z_loss": floats[3] / (M * world),
        "expert_counts": ints[:counts.numel()].view_as(counts),
        "padded_rows": ints[-3],
        "dropped_tokens": ints[-2],
        "a2a_bytes": ints[-1],
        "tokens": total,
        "trace": run.state.trace,
    }
    leaves, treedef = optree.tree_flatten(params)
    grads = [run.grads[p] for p in named_leaves(params)]
    return StepOutput(loss, optree.tree_unflatten(treedef, grads), metrics)


@torch.no_grad()
def eval_loss(params: dict, batch: dict, plan: Plan) -> torch.Tensor:
    """Mean next-token cross-entropy of the global batch, without gradients.

    Arguments and validation are those of ``step`` (each rank passes its rows);
    microbatches bound the memory.

    Returns:
        A fp32 scalar tensor, the same on every rank.
    """
    tokens, program, slots, mesh, total = prepare_step(params, batch, plan, train=False)
    run = execute(program, named_leaves(params), tokens, plan, mesh, total, slots)
    return _sum_over_ranks(mesh.world, run.ce_sum.clone()) / total


# What fmoe.step is made of, for adapters (interop): the checks, a step split into its
# validation (run once, outside a CUDA-graph capture) and its compute.
__all__ = ["Prepared", "StepOutput", "check_batch", "check_inputs", "check_params", "eval_loss", "microbatch_objective",
           "num_targets", "prepare_step", "run_step", "step"]
