"""CUDA-graph capture of a function on static inputs, every capture thread-local:
``graph_pair`` (a forward and a backward graph, replayed by an autograd function) and
``graph_forward`` (one graph, no gradient); ``warm_up`` runs a function on a side stream
first, so lazy initialisation is not captured; ``capturing`` is every capture's context,
in which nothing compiles (``compiles_nothing``: ``CaptureError`` says what would have)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import optree
import torch


def warm_up(run, iters: int):
    """``run()`` ``iters`` times on a side stream, then synchronised; returns the last
    call's result."""
    # Lazy initialisation (cuBLAS handles, NCCL communicators, allocator pools) must
    # happen outside the capture, on a side stream as capture itself uses.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    result = None
    with torch.cuda.stream(side):
        for _ in range(iters):
            result = run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return result


class CaptureError(ValueError):
    """A capture that would compile: a ``torch.compile``d function met inputs its eager
    warm-up never showed it (another shape, dtype or memory layout), or was first called
    inside the capture. Raised before that function launches anything."""


# torch's message for a frame the stance stopped from compiling (torch 2.6 to 2.13)
_STANCE_REFUSED = "torch.compile stance is 'fail_on_recompile'"


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **kwargs):
    """``torch.cuda.graph(graph, capture_error_mode="thread_local", **kwargs)`` in which
    nothing compiles (``compiles_nothing``): a capture replays what the warm-up compiled."""
    with compiles_nothing(), torch.cuda.graph(graph, capture_error_mode="thread_local", **kwargs):
        yield


@contextlib.contextmanager
def compiles_nothing():
    """Inside, a ``torch.compile``d function that would compile (again, or for the first
    time) raises CaptureError naming it and the guard that missed, before it runs.
    Compiling inside a capture would fail in inductor with a CUDA error from its first
    host copy, or invalidate the capture."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            yield
    except RuntimeError as err:
        if _STANCE_REFUSED not in str(err):
            raise
        raise CaptureError(_compile_refused(str(err))) from None


def _compile_refused(message: str) -> str:
    """CaptureError's one line from torch's refusal: the function, where it is, and
    the guards that failed (torch's lines joined where they are not in that form)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    fields = dict(part.split(": ", 1) for part in lines[0].split(". ", 1)[-1].split(", ") if ": " in part)
    if not {"function name", "filename", "line number"} <= fields.keys():
        what = " ".join(lines)
    else:
        guards = [line[2:] for line in lines[1:] if line.startswith("- ") and not line.startswith("- User stack")]
        name, path = (fields[key].strip("'") for key in ("function name", "filename"))
        why = f"its guards: {'; '.join(guards[:3])}" if guards else "the warm-up never called it"
        what = f"{name} ({path}:{fields['line number']}) ({why})"
    return (f"a CUDA graph's capture would compile {what}: everything a graph replays must compile in the "
            "eager steps before it, on inputs of the captured shapes, dtypes and memory layouts")


def _copy_in(statics, tensors) -> None:
    """Copy each of ``tensors`` into its static input unless it already is that tensor."""
    with torch.no_grad():
        for static, new in zip(statics, tensors):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs into the pair's own, replay its forward graph. Backward:
    copy the output gradients in, replay its backward graph."""

    @staticmethod
    def forward(ctx, pair: _GraphPair, *inputs):
        ctx.pair = pair
        _copy_in(pair.inputs, inputs)
        pair.forward_graph.replay()
        return tuple(o.detach() for o in pair.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        pair = ctx.pair
        for static, grad in zip(pair.output_grads, grads):
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        pair.backward_graph.replay()
        return (None, *(None if g is None else g.detach() for g in pair.input_grads))


class _GraphPair(NamedTuple):
    forward_graph: torch.cuda.CUDAGraph
    backward_graph: torch.cuda.CUDAGraph
    inputs: tuple  # the static tensors both graphs read
    outputs: tuple  # the forward's outputs, flat
    output_grads: tuple  # where the backward reads each output's gradient (None: not differentiable)
    input_grads: tuple  # where it writes each input's (None: none wanted or unused)
    treespec: optree.PyTreeSpec  # the outputs' tree


def _input_grads(outputs: list, output_grads: list, inputs: tuple) -> tuple:
    wanted = [t for t in inputs if t.requires_grad]
    differentiable = [(o, g) for o, g in zip(outputs, output_grads) if g is not None]
    if not wanted or not differentiable:
        return (None,) * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in differentiable], wanted, [g for _, g in differentiable],
                                   allow_unused=True))
    return tuple(next(got) if t.requires_grad else None for t in inputs)


def graph_pair(fn, inputs: tuple, warmup: int = 3):
    """``fn`` (tensors in, a tree of tensors out) as a forward and a backward CUDA graph
    on the static ``inputs``, replayed by an autograd function.

    As ``torch.cuda.make_graphed_callables`` does, but both graphs are captured in
    thread-local mode, as ``capture_step`` is: a CUDA call another thread makes meanwhile
    (a communicator's watchdog, autograd's device thread) cannot invalidate the capture,
    where the global mode refuses every thread's. The backward runs on autograd's device
    thread, so it is that thread's calls the global mode would have refused.

    Arguments:
        fn: the function; every call computes the same kernels on the same shapes.
        inputs: its arguments; the graphs read these tensors, and each call copies new
            arguments into them unless they are already there.
        warmup: forward and backward passes run on a side stream before capture, so
            lazy initialisation (kernel loads, cuBLAS workspaces) is not captured.

    Returns:
        ``call(*tensors)`` returning ``fn``'s tree of outputs, differentiable.
    """
    def forward_backward():
        outputs = optree.tree_leaves(fn(*inputs))
        _input_grads(outputs, [torch.empty_like(o) if o.requires_grad else None for o in outputs], inputs)

    warm_up(forward_backward, warmup)
    pool = torch.cuda.graph_pool_handle()  # the backward graph reads the forward's saved tensors
    forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with capturing(forward_graph, pool=pool):
        outputs, treespec = optree.tree_flatten(fn(*inputs))
    output_grads = [torch.empty_like(o) if o.requires_grad else None for o in outputs]
    with capturing(backward_graph, pool=pool):
        input_grads = _input_grads(outputs, output_grads, inputs)
    pair = _GraphPair(forward_graph, backward_graph, inputs, tuple(outputs), tuple(output_grads), input_grads,
                      treespec)
    return lambda *tensors: optree.tree_unflatten(pair.treespec, _Replay.apply(pair, *tensors))


def graph_forward(fn, inputs: tuple, warmup: int = 3):
    """``fn`` (tensors in, no gradient) as one CUDA graph on the static ``inputs``.

    Each call copies new arguments into ``inputs`` (unless already there), replays the
    graph and returns the captured output itself, whose tensors the next call
    overwrites. Captured in thread-local mode, as ``graph_pair``'s graphs are.
    """
    with torch.no_grad():
        warm_up(lambda: fn(*inputs), warmup)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            output = fn(*inputs)

    def call(*tensors):
        _copy_in(inputs, tensors)
        graph.replay()
        return output

    return call


__all__ = ["CaptureError", "capturing", "compiles_nothing", "graph_forward", "graph_pair", "warm_up"]
