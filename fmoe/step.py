"""``fmoe.step``: loss and gradients of one global batch, microbatched."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from . import lora
from .backends import BUILT_IN
from .batch import Batch, no_counted_target, read_batch
from .config import Plan
from .comm.collectives import Group, summed
from .comm.trace import Event, now
from .layers.fp8 import GEMMS
from .layers.model import cast_for_compute, lm_loss_sum, stack_stats
from .layers.nodes import Kernels
from .layers.router import router_share
from .param_checks import check_params
from .params import named_leaves
from .resolve import Program, Setup, check_memory, resolve
from .runtime import check_runtime
from .schedule.executor import execute


class StepOutput(NamedTuple):
    """Result of ``fmoe.step``.

    Attributes:
        loss: fp32 scalar, mean next-token cross-entropy over every counted target of the
            global batch (``loss_mask`` and ``segments``: ``fmoe.batch``).
        grads: fp32 pytree shaped like ``params``; the gradient of
            ``loss + aux_loss_coef * aux_loss + z_loss_coef * z_loss``.
        metrics: dict of detached tensors, summed over ranks: ``loss``, ``aux_loss`` and
            ``z_loss`` (summed over layers, averaged over microbatches and ranks),
            ``objective`` (what was differentiated), ``expert_counts [MoE layers, E]`` (the
            load on the global batch), ``padded_rows``, ``dropped_tokens``,
            ``a2a_bytes`` (sent by the forward all-to-alls); ``tokens`` (an int, the global count
            of counted targets) and ``trace`` (the step's lifecycle and compute Events).
    """

    loss: torch.Tensor
    grads: dict
    metrics: dict


def check_batch(batch, plan: Plan) -> Batch:
    """Validate ``batch`` for ``plan`` (``fmoe.batch.read_batch``) and return it as a
    Batch on the plan's device."""
    return read_batch(batch, plan.model.vocab, plan.microbatches, plan.device, plan.tp, plan.cp)


def check_inputs(params, batch, plan: Plan) -> Batch:
    """All of ``step``'s validation; returns the Batch on the plan's device."""
    return _checked(params, batch, plan)[0]


def _checked(params, batch, plan: Plan) -> tuple[Batch, Setup]:
    check_runtime(plan)  # first: resolving binds the expert backend it checks
    setup = resolve(plan)
    if not isinstance(params, lora.FrozenBase):  # a FrozenBase was checked when it was made
        check_params(params, plan, setup)
    checked = check_batch(batch, plan)
    check_memory(setup)  # the last check; collectives start after it
    return checked, setup


def num_targets(batch: Batch) -> int:
    """The counted next-token targets of a Batch's rows (``B * S`` without a loss mask
    or segments)."""
    return batch.counted


def microbatch_objective(params: dict, batch_mb: Batch, plan: Plan, total_targets: int):
    """One microbatch's share of the step objective, differentiable w.r.t. ``params``.

    ``ce_sum / total_targets + (aux_coef * aux + z_coef * z) / microbatches``: summed
    over a batch's microbatches it is the batch's mean cross-entropy plus the
    microbatch-averaged router losses.

    Returns:
        ``(objective, ce_sum, stats)`` with ``stats`` a MoEStats stacked over layers.
    """
    cfg = plan.model
    compute_params = cast_for_compute(params, plan.compute_dtype)
    ce_sum, layer_stats = lm_loss_sum(compute_params, batch_mb.tokens, cfg, plan.expert_backend, GEMMS[plan.fp8],
                                      batch_mb.targets, batch_mb.documents)
    s = stack_stats(layer_stats)
    router = router_share(s.aux_loss.sum(), s.z_loss.sum(), cfg, plan.microbatches)
    objective = ce_sum / total_targets
    return objective if router is None else objective + router, ce_sum, s


def _sum_over_ranks(group: Group, t: torch.Tensor) -> torch.Tensor:
    group.all_reduce(t).wait()
    return t


class Prepared(NamedTuple):
    """A validated step, ready to run: everything ``step`` settles before its compute.

    Attributes:
        batch: this rank's Batch on the plan's device.
        setup: the plan resolved (``fmoe.resolve``); ``program``: the one to run.
        total: the global count of counted targets (summed over ranks); ``divisor``:
            the same as a fp32 device scalar, what the loss is divided by (data, so a
            CUDA-graphed step reads each batch's own count).
        base: under ``Plan.lora``, the frozen base the adapters (the params) adapt: its
            named leaves, or a ``fmoe.lora.FrozenBase``; None otherwise.
    """

    batch: Batch
    setup: Setup
    program: Program
    total: int
    divisor: torch.Tensor
    base: object = None


def prepare_step(params: dict, batch: dict, plan: Plan, train: bool = True, base=None) -> Prepared:
    """``step``'s validation (ValueErrors before any collective), its Setup and program,
    and the global target count (on several ranks one small all-reduce and host read).
    Under ``plan.lora`` ``params`` are the adapters and ``base`` the frozen params (or a
    ``fmoe.lora.FrozenBase``), as for ``step``."""
    adapted = base is not None or plan.lora is not None
    if adapted:
        _check_adapter_call(plan, base)
        lora.check_adapters(params, plan, stepped=True)
    checked, setup = _checked(base if adapted else params, batch, plan)
    held = _base_of(base, plan) if adapted else None
    total = global_targets(checked, setup.mesh)  # the first collective
    divisor = torch.tensor(float(total), device=checked.tokens.device)
    return Prepared(checked, setup, setup.program(train), total, divisor, held)


def global_targets(checked: Batch, mesh) -> int:
    """The counted targets of the global batch: this rank's count summed over the
    ranks (one small all-reduce and host read; a single rank knows its own).

    Raises:
        ValueError: none counts (every rank reads the same sum, so all raise, before
            any compute).
    """
    # a tp group's ranks, and every pipeline stage, read the same rows: one of them counts
    total = num_targets(checked) if mesh.tp.rank == 0 and mesh.pp.rank == 0 else 0
    if mesh.world.size > 1:
        total = int(_sum_over_ranks(mesh.world, torch.tensor(total, device=checked.tokens.device)))
    if total == 0:
        raise no_counted_target()
    return total


def step(params: dict, batch: dict, plan: Plan, kernels: Kernels | None = None, base: dict | None = None) -> StepOutput:
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
        batch: ``{"tokens": LongTensor[B, S+1]}``, this rank's rows, optionally with
            ``"loss_mask": BoolTensor[B, S]`` (which targets count) and ``"segments":
            IntTensor[B, S+1]`` (a document id per position: attention stays inside a
            document, positions restart at each one's first token); see ``fmoe.batch``.
        plan: the Plan.
        kernels: the functions inside the layer nodes (``interop.cuda_graph`` passes
            CUDA-graphed ones); by default the pure functions, compiled when
            ``plan.compile`` is set.
        base: under ``plan.lora``, the frozen params the adapters adapt (float32 or the
            compute dtype; or a ``fmoe.lora.FrozenBase``, ``fmoe.lora.freeze``, laid out once);
            ``params`` are then the adapters (``fmoe.lora.init``), and the grads theirs.

    Returns:
        A StepOutput whose grads are sharded like ``params``; ``metrics["trace"]``
        holds the step's Events. Nothing in ``params`` (or ``base``) is modified.
    """
    return run_step(params, prepare_step(params, batch, plan, base=base), plan, kernels)


def _check_adapter_call(plan: Plan, base: dict | None) -> None:
    if plan.lora is None:
        raise ValueError("fmoe.step: base= holds the frozen params of adapters, but Plan.lora is None: give "
                         "the plan a fmoe.LoRA(rank, alpha, targets), or pass the params without base=")
    if base is None:
        raise ValueError("fmoe.step: Plan.lora trains adapters on frozen params: pass them as base= "
                         "(fmoe.step(adapters, batch, plan, base=params))")
    if plan.expert_backend not in BUILT_IN:
        raise ValueError(f"Plan.expert_backend={plan.expert_backend!r} is invalid under Plan.lora: the adapters' "
                         f"products run in fmoe's grouped GEMMs (allowed: {', '.join(map(repr, BUILT_IN))})")


def _base_of(base, plan: Plan) -> dict | lora.FrozenBase:
    """A step's ``base`` as ``Prepared.base``: its named leaves, or the FrozenBase (for this plan)."""
    if not isinstance(base, lora.FrozenBase):
        return named_leaves(base)
    if base.plan != plan.replace(lora=None):
        raise ValueError("fmoe.step: base= is a FrozenBase laid out for another plan: freeze the base under "
                         "this plan (fmoe.lora.freeze(params, plan))")
    return base


def _execute(params: dict, prepared: Prepared, kernels: Kernels | None = None):
    """The program on ``params``, or under ``Plan.lora`` on the prepared base with ``params``
    as the adapters."""
    base = prepared.base
    if base is None:
        return execute(prepared.setup, named_leaves(params), prepared.batch, prepared.divisor, prepared.program,
                       kernels)
    frozen = isinstance(base, lora.FrozenBase)
    return execute(prepared.setup, None if frozen else base, prepared.batch, prepared.divisor, prepared.program,
                   kernels, adapters=named_leaves(params), shards=base.shards if frozen else None)


def run_step(params: dict, prepared: Prepared, plan: Plan, kernels: Kernels | None = None) -> StepOutput:
    """The compute of ``step`` for a Prepared batch: no host read of a device value
    under a static-shape plan (capacity routing or no expert parallelism), so it can
    be captured in a CUDA graph (``interop.cuda_graph.capture_step``)."""
    run = _execute(params, prepared, kernels)
    loss, metrics = _results(run, prepared, plan)
    if prepared.base is not None:
        return StepOutput(loss, _adapter_grads(run, params, prepared, metrics), metrics)
    grads = [run.grads[p] if p in run.grads else leaf.new_empty(leaf.shape)  # another stage's: no rows
             for p, leaf in named_leaves(params).items()]
    return StepOutput(loss, optree.tree_unflatten(optree.tree_structure(params), grads), metrics)


def _adapter_grads(run, adapters: dict, prepared: Prepared, metrics: dict) -> dict:
    """Under ``Plan.lora``: the adapters' gradients, each rank's part (what its own products
    contributed) summed over the ranks in one all-reduce, added to the step's trace."""
    grads = [run.grads[name] for name in named_leaves(adapters)]
    world = prepared.setup.mesh.world
    if world.size > 1:
        issued = now()
        grads = summed(world, grads)
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        metrics["trace"] = metrics["trace"] + (Event("all_reduce", None, None, -1, issued, now(), nbytes, "grads"),)
    return optree.tree_unflatten(optree.tree_structure(adapters), grads)


def _results(run, prepared: Prepared, plan: Plan) -> tuple[torch.Tensor, dict]:
    """A run's loss and metrics, summed over the ranks."""
    total, group = prepared.total, prepared.setup.mesh.world

    M, world = plan.microbatches, prepared.setup.mesh.stage.size  # a stage's ranks see different tokens
    floats = torch.stack([run.ce_sum, run.objective,
                          sum(s.aux_loss.detach().sum() for s in run.stats),
                          sum(s.z_loss.detach().sum() for s in run.stats)]).float()
    counts = sum(s.counts_E for s in run.stats)
    extra = torch.stack([sum(s.padded_rows.sum() for s in run.stats),
                         sum(s.dropped_tokens.sum() for s in run.stats),
                         sum(s.a2a_bytes.sum() for s in run.stats)])
    ints = _sum_over_ranks(group, torch.cat([counts.flatten(), extra]))
    floats = _sum_over_ranks(group, floats)
    loss = floats[0] / prepared.divisor
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
    return loss, metrics


@torch.no_grad()
def eval_loss(params: dict, batch: dict, plan: Plan, base: dict | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of the global batch, without gradients.

    Arguments and validation are those of ``step`` (each rank passes its rows; under
    ``plan.lora``, ``params`` are the adapters and ``base`` the frozen params);
    microbatches bound the memory.

    Returns:
        A fp32 scalar tensor, the same on every rank.
    """
    prepared = prepare_step(params, batch, plan, train=False, base=base)
    run = _execute(params, prepared)
    return _sum_over_ranks(prepared.setup.mesh.world, run.ce_sum.clone()) / prepared.total


# What fmoe.step is made of, for adapters (interop): the checks, a step split into its
# validation (run once, outside a CUDA-graph capture) and its compute.
__all__ = ["Prepared", "StepOutput", "check_batch", "check_inputs", "check_params", "eval_loss", "global_targets",
           "microbatch_objective",
           "num_targets", "prepare_step", "run_step", "step"]
