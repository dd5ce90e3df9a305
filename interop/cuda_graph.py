"""CUDA-graph capture of node scopes and of a whole ``fmoe.step``.

Three ways to replay a step's kernels instead of launching them one by one:

- ``capture_step(params, batch, plan)`` captures ``fmoe.step`` whole (every node,
  gather, all-to-all and reduce of every microbatch) into one graph over static
  parameter and token buffers. Calling the result copies the new params and batch
  into those buffers and replays: a step after an optimizer update sees the new
  weights.
- ``GraphedTrainStep(plan, update)`` captures the step and the update after it
  (the optimizer, the expert biases' update) into one graph, after ``warmup``
  eager steps; the params and optimizer state it returns are the graph's own.
- ``capture_scopes(params, batch, plan, scopes)`` graphs the functions inside the
  layer nodes (``attn``: attention half; ``router``: scores and top-k; ``dispatch``:
  the permutation's index work, forward only; ``experts``: the grouped expert MLP)
  one graph pair (forward, backward) per layer and microbatch, and returns the
  ``fmoe.schedule.Kernels`` to pass as ``fmoe.step(..., kernels=...)``. A scope's
  graph replays the plan's own kernels for it (``Plan.compile``'s compiled attention,
  router and dispatch; ``Plan.remat='selective'``'s policy left out). Everything else
  (gathers, exchanges, the lifecycle) runs as the plan says around them, so every
  schedule and sharding works, dropless expert parallelism included for ``attn``,
  ``router`` and ``dispatch``; under ``Plan.tp`` a graphed attention holds its
  tensor-parallel all-gather and reduce-scatter, under ``Plan.etp`` a graphed
  ``experts`` runs between its group's exchanges.

A graph replays fixed kernels on fixed addresses, so nothing in a captured region may
read a device value on the host or change shape between steps. ``check_capturable``
refuses such plans (dropless expert parallelism, padded dropless routing, host-split
expert backends, the etp group's row counts in a whole step, context and pipeline
parallelism) with the plan setting that makes them capturable, before any CUDA work.

Where each part lives: the refusals in ``interop.capturable``, the capture of a function
(``graph_pair``, ``graph_forward``) in ``interop.graph_capture``, the scopes in
``interop.graph_scopes``; this module holds the whole-step graph and names them all.
"""

from __future__ import annotations

import optree
import torch

import fmoe
from fmoe import Plan, StepOutput
from fmoe.step import Prepared, check_batch, check_params, global_targets, prepare_step, run_step

from .capturable import SCOPES, check_capturable
from .graph_capture import CaptureError, capturing, graph_forward, graph_pair, warm_up
from .graph_scopes import NotGraphed, capture_scopes


class GraphedStep:
    """``fmoe.step`` for one batch shape, replayed from a CUDA graph (see ``capture_step``).

    Calling it returns a StepOutput whose tensors live in the graph's memory: the
    next call overwrites them, so use or clone them first (``opt.update`` does).
    ``metrics["trace"]`` is the captured step's trace.
    """

    def __init__(self, plan: Plan, graph, static_params, prepared: Prepared, out: StepOutput):
        self.plan, self.graph, self.out = plan, graph, out
        self.static_params, self.static_batch, self.divisor = static_params, prepared.batch, prepared.divisor
        self.setup = prepared.setup

    def release(self) -> None:
        """Free the graph now, with the memory and the collectives it holds; it cannot
        replay after. Call it before ``torch.distributed.destroy_process_group``: NCCL
        cannot destroy a communicator while a graph that captured its collectives
        lives, and the process hangs at exit (pytorch/pytorch#115388)."""
        if self.graph is not None:
            torch.cuda.synchronize()  # no replay still running
            self.graph.reset()
        self.graph = None

    def __call__(self, params: dict, batch: dict) -> StepOutput:
        """Copy ``params`` and ``batch`` into the graph's buffers and replay it.

        ``params`` and ``batch`` are checked as ``fmoe.step`` checks them (the token
        range check reads the batch's min and max on the host) and must have the
        captured shapes and keys. The loss's divisor, the global count of counted
        targets, is data too: the graph reads it from a device scalar.
        """
        if self.graph is None:
            raise ValueError("this GraphedStep was released (release()): capture the step again")
        if self.plan.lora is None:
            check_params(params, self.plan, self.setup)
        else:  # the adapters; the frozen base was read at the capture, where it stays
            fmoe.lora.check_adapters(params, self.plan, stepped=True)
        checked = check_batch(batch, self.plan)
        static = self.static_batch
        if checked.tokens.shape != static.tokens.shape or (checked.segments is None) != (static.segments is None):
            def keys(b):
                return ["tokens", *(["segments"] if b.segments is not None else [])]
            raise ValueError(f"batch['tokens'] has shape {list(checked.tokens.shape)} with keys {keys(checked)}; "
                             f"this graph was captured for {list(static.tokens.shape)} with {keys(static)} "
                             "(capture another for a new shape; a loss_mask may come and go)")
        total = global_targets(checked, self.setup.mesh)
        with torch.no_grad():
            _copy_into(self.static_params, params)
            for new, static_tensor in zip(checked[:3], static[:3]):
                if new is not None:
                    static_tensor.copy_(new)
            self.divisor.fill_(float(total))
        self.graph.replay()
        self.out.metrics["tokens"] = total
        return self.out


def _copy_into(static, new) -> None:
    """Copy every leaf of ``new`` into the same-place leaf of ``static`` unless it is
    already there (a donating optimizer updated it in place)."""
    for new_leaf, static_leaf in zip(optree.tree_leaves(new), optree.tree_leaves(static)):
        if not _same_memory(new_leaf, static_leaf):
            static_leaf.copy_(new_leaf)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride())


def capture_step(params: dict, batch: dict, plan: Plan, warmup: int = 2, donate: bool = False,
                 base=None) -> GraphedStep:
    """Capture ``fmoe.step(params, batch, plan, base=base)`` as one CUDA graph.

    Arguments:
        params, batch, plan, base: as for ``fmoe.step`` (under ``Plan.lora`` the params are
            the adapters and ``base`` the frozen params, best a ``fmoe.lora.FrozenBase``; the
            graph reads the base where it was at the capture); every rank captures together
            (the collectives are part of the graph). Their shapes are fixed from now on.
        warmup: eager steps run on a side stream before the capture.
        donate: the graph reads ``params``' own tensors instead of a copy of them.
            Pair it with an optimizer that updates them in place (``adamw(fused=True,
            donate=True)``): each call then finds the new params where the graph reads
            them and copies nothing. Params passed later that live elsewhere are copied
            into these tensors, overwriting them.

    Returns:
        A GraphedStep: ``graphed(params, batch)`` replays the step on new values.

    Raises:
        ValueError: the plan reads device values on the host during a step (see
            ``check_capturable``) or the inputs are invalid for ``fmoe.step``.
        CaptureError: a compiled kernel would compile inside the capture.
    """
    check_capturable(plan, ("step",))
    prepared = prepare_step(params, batch, plan, base=base)
    # the graph's own copy unless donated: replays read it as it is
    static_params = params if donate else optree.tree_map(lambda t: t.detach().clone(), params)
    prepared = _own_batch(prepared)
    warm_up(lambda: run_step(static_params, prepared, plan), warmup)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        out = run_step(static_params, prepared, plan)
    return GraphedStep(plan, graph, static_params, prepared, out)


def _own_batch(prepared: Prepared) -> Prepared:
    """``prepared`` with the graph's own copies of the batch, which each replay's batch is
    copied into. Each copy looks to compiled kernels as its tensor did in the eager steps:
    the same strides, and a view of a copy of the same base where it viewed one (tokens and
    targets cut from one ``[B, S + 1]`` buffer, row stride S + 1, share one copy of it).
    Compiled kernels guard on strides, and once a kernel has compiled for several shapes
    its guards relate a view's strides to its base's sizes; a capture that saw anything
    else would compile the head inside it."""
    b, bases = prepared.batch, {}
    static_batch = b._replace(tokens=aliased_copy(b.tokens, bases), targets=aliased_copy(b.targets, bases),
                              segments=None if b.segments is None else aliased_copy(b.segments, bases))
    return prepared._replace(batch=static_batch)


def aliased_copy(t: torch.Tensor, bases: dict) -> torch.Tensor:
    """A copy of ``t`` as ``strided_copy`` makes it; a view (``t._base``) becomes the same
    view of a copy of its base, one copy per base in ``bases`` (``{id(base): copy}``)."""
    base = t._base
    if base is None:
        return strided_copy(t)
    if id(base) not in bases:
        bases[id(base)] = strided_copy(base)
    return bases[id(base)].as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its shape and strides (``clone`` makes a strided view
    dense), or a dense one where its elements overlap (an expanded tensor)."""
    reach = 0  # the farthest offset the dims of smaller stride reach
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda dim: dim[1]):
        if size > 1 and stride <= reach:
            return t.clone(memory_format=torch.contiguous_format)
        reach += (size - 1) * stride
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class GraphedTrainStep:
    """A training step, ``fmoe.step`` and the update that follows it, as one CUDA graph.

    ``capture_step`` graphs the step; the optimizer then runs eagerly, one launch per
    leaf and a few more for the norm, the schedule and the skip decision. Here they
    are captured with it, so a step is one replay and no host work is left between
    its kernels.

    Arguments:
        plan: the Plan every step runs; refused (``check_capturable``) when its step
            cannot be captured.
        update: ``update(out, params, opt_state) -> (params, opt_state)``, what follows
            the step, e.g. ``opt.update(out.grads, opt_state, params)`` and
            ``update_expert_bias``. It must read no device value on the host and return
            trees shaped as the ones it was given.
        warmup: how many calls run eagerly before the one that captures. They are real
            steps (they update params and state) that compile and load every kernel
            outside the capture.
        base: under ``Plan.lora``, the frozen params (best a ``fmoe.lora.FrozenBase``);
            the params are then the adapters. The graph reads the base where it is.

    ``out, params, opt_state = graphed(params, opt_state, batch)`` takes one step: the
    first ``warmup`` calls eagerly, the next captures on its batch and replays, every
    later one replays. From the capture on, the params and state it returns are the
    graph's own tensors, written in place by each replay (a donating optimizer writes
    them directly; other leaves are copied back inside the graph): pass them back in.
    Other tensors passed in are copied into them first. ``out`` lives in the graph's
    memory, overwritten by the next call. The batch's shape and layout are fixed at the
    capture: a compiled kernel that would compile again inside it raises CaptureError.
    ``release()`` frees the graph (before ``destroy_process_group``: see
    ``GraphedStep.release``).
    """

    def __init__(self, plan: Plan, update, warmup: int = 2, base=None):
        check_capturable(plan, ("step",))
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"warmup={warmup!r} is invalid: an int >= 1 (eager steps before the capture)")
        self.plan, self.update, self.warmup, self.base = plan, update, warmup, base
        self.eager_steps, self.graphed, self.static_state = 0, None, None

    def release(self) -> None:
        """Free the captured graph (``GraphedStep.release``); the next call captures again."""
        if self.graphed is not None:
            self.graphed.release()
        self.graphed, self.static_state = None, None

    def __call__(self, params: dict, opt_state, batch: dict):
        if self.graphed is None and self.eager_steps < self.warmup:
            self.eager_steps += 1
            return self._eager(params, opt_state, batch)
        if self.graphed is None:
            self.graphed, self.static_state = self._capture(params, opt_state, batch)
        elif optree.tree_structure(opt_state) != optree.tree_structure(self.static_state):
            raise ValueError("opt_state has another structure than the state this graph was captured with "
                             "(pass back the state each call returns)")
        else:
            with torch.no_grad():
                _copy_into(self.static_state, opt_state)
        out = self.graphed(params, batch)
        return out, self.graphed.static_params, self.static_state

    def _eager(self, params, opt_state, batch):
        def one_step():  # on a side stream, as the capture runs: lazy state is made where it is used
            out = fmoe.step(params, batch, self.plan, base=self.base)
            return (out, *self.update(out, params, opt_state))
        return warm_up(one_step, 1)

    def _capture(self, params, opt_state, batch):
        prepared = _own_batch(prepare_step(params, batch, self.plan, base=self.base))
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            out = run_step(params, prepared, self.plan)
            new_params, new_state = self.update(out, params, opt_state)
            for name, new, static in (("params", new_params, params), ("opt_state", new_state, opt_state)):
                if optree.tree_structure(new) != optree.tree_structure(static):
                    raise ValueError(f"update returned {name} of another structure than it was given")
                with torch.no_grad():  # the next replay reads the new values where this one read
                    _copy_into(static, new)
        return GraphedStep(self.plan, graph, params, prepared, out), opt_state


__all__ = ["SCOPES", "CaptureError", "GraphedStep", "GraphedTrainStep", "NotGraphed", "capture_scopes",
           "aliased_copy", "capture_step", "check_capturable", "graph_forward", "graph_pair", "strided_copy"]
