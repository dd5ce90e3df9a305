"""``Plan.remat='selective'``: the layer nodes' kernels keep their GEMM outputs and
recompute the cheap work around them in their backward.

Inside ``attn`` (both norms, q/k norms, RoPE, the residual add), ``router`` (the fp32
copy of the tokens, softmax, top-k) and ``experts`` (the activation between the two
grouped GEMMs, with its probability scaling), autograd would save every elementwise
result some backward formula reads. Under this policy a kernel saves only the outputs
of matmuls, grouped matmuls and the SDPA kernels (with the region's inputs, which its
caller holds anyway); the node's backward re-runs the rest from those, from the same
inputs with the same kernels, so the values are bitwise the forward's.

This is torch's selective activation checkpointing (``torch.utils.checkpoint`` with a
``create_selective_checkpoint_contexts`` policy), applied per kernel. Under
``Plan.compile`` it is applied inside the compiled region, where the partitioner
follows it and fuses the recompute into the backward (~3% of a step). Eager, it runs
as a Python dispatch mode over every op of the region, forward and recompute (~20%:
BENCHMARKS.md; ``full`` is the eager choice). The recompute happens inside the node's
``backward`` action; a profiler shows it as ``fmoe selective <kernel>`` inside that
action's range (eager). ``full`` remat instead is a program action (``program.py``).

A registered expert backend (``te``) runs its GEMMs outside torch's dispatcher, where
no policy sees them: its experts keep what they save.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..layers.nodes import Kernels

_aten = torch.ops.aten
KEPT_OPS = frozenset({
    _aten.mm, _aten.addmm, _aten.bmm, _aten._grouped_mm, _aten._scaled_mm, _aten._scaled_grouped_mm,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
    # not FlexAttention's higher-order op: kept under torch 2.11's compiled selective
    # checkpointing, it changed the forward of packed rows (a 0.5% different loss on
    # the GPU), so it is recomputed in the backward like the elementwise work
})
"""The ops whose outputs a selective kernel keeps (as overload packets)."""


def keeps(op) -> bool:
    """Whether ``op``'s output is kept under the selective policy."""
    return getattr(op, "overloadpacket", op) in KEPT_OPS


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE


class _QuietWhileFmoeCompiles(logging.Filter):
    # torch warns, once per process, that a region with a checkpoint policy under
    # torch.compile must not mutate what it saves. fmoe's kernels mutate nothing they
    # save (the router's only in-place op fills a fresh integer count); the warning is
    # dropped only while one of them runs (compiles), never for the user's own code.
    active = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and "context_fn is passed to torch.utils.checkpoint" in record.getMessage())


_QUIET = _QuietWhileFmoeCompiles()
logging.getLogger("torch._higher_order_ops.wrap").addFilter(_QUIET)


def quiet_compiled(fn: Callable) -> Callable:
    """A compiled selective kernel that compiles without torch's warning (see above)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _QUIET.active += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _QUIET.active -= 1

    return run


def selective(fn: Callable, name: str | None = None) -> Callable:
    """``fn`` (a pure function of tensors and configs) keeping only ``KEPT_OPS``'s
    outputs for its backward; outside autograd, ``fn`` itself.

    Arguments:
        fn: the kernel.
        name: for eager kernels, the profiler range ``fmoe selective <name>`` around
            each run (in a node's backward range: the recompute). None for a function
            about to be compiled, whose recompute is fused into its compiled backward.

    Returns:
        A function with ``fn``'s signature and values.
    """
    def named(*args, **kwargs):
        if not torch.autograd.profiler._is_profiler_enabled:
            return fn(*args, **kwargs)
        with torch.profiler.record_function(f"fmoe selective {name}"):
            return fn(*args, **kwargs)

    inner = fn if name is None else named

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(inner, *args, **kwargs, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))

    return run


def selective_experts(experts: Callable, registered: bool) -> Callable:
    """A Kernels ``experts`` entry under the selective policy; a registered backend's
    experts (``registered``) run as they are (see the module's note)."""
    return experts if registered else selective(experts, "experts")


def selective_kernels(kernels: Kernels, registered: bool) -> Kernels:
    """Eager ``kernels`` with ``attn``, ``router`` and ``experts`` under the selective
    policy (``compiled.py`` wraps its functions before compiling them instead);
    ``registered``: the experts run a registered backend."""
    return kernels._replace(attn=selective(kernels.attn, "attn"), router=selective(kernels.router, "router"),
                            experts=selective_experts(kernels.experts, registered))
