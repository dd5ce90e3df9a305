"""CUDA-graph capture of node scopes and of a whole ``fmoe.step``.

Two ways to replay a step's kernels instead of launching them one by one:

- ``capture_step(params, batch, plan)`` captures ``fmoe.step`` whole (every node,
  gather, all-to-all and reduce of every microbatch) into one graph over static
  parameter and token buffers. Calling the result copies the new params and batch
  into those buffers and replays: a step after an optimizer update sees the new
  weights.
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
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import optree
import torch

from fmoe import Plan, StepOutput
from fmoe.layers import expert_mlp
from fmoe.layers.fp8 import GEMMS
from fmoe.schedule import Kernels, kernels_for
from fmoe.backends import bound_backend
from fmoe.step import Prepared, check_batch, check_params, global_targets, prepare_step, run_step

SCOPES = ("attn", "router", "dispatch", "experts")


def _expert_host_reads(plan: Plan) -> list[str]:
    """Why the expert MLP would read a device value on the host or change shape."""
    cfg, reasons = plan.model, []
    dropless = not cfg.capacity_factor
    if dropless and plan.ep > 1:
        reasons.append(f"dropless routing over Plan.ep={plan.ep} reads the all-to-all split sizes on the host "
                       "and gives the experts a different row count every step (set ModelConfig.capacity_factor "
                       "> 0 for a static capacity)")
    if dropless and cfg.pad_multiple:
        reasons.append(f"padded dropless routing (ModelConfig.pad_multiple={cfg.pad_multiple}) reads the "
                       "permuted row count on the host (set pad_multiple=0 or capacity_factor > 0)")
    if plan.expert_backend == "loop":
        reasons.append("Plan.expert_backend='loop' reads each expert's row count on the host (use 'torch')")
    if plan.expert_backend == "te" and dropless:
        reasons.append("Plan.expert_backend='te' hands dropless row counts to TE's grouped GEMM on the host "
                       "(set ModelConfig.capacity_factor > 0, or use expert_backend 'torch')")
    if plan.expert_backend == "torch" and plan.dtype == "float32":
        reasons.append("torch._grouped_mm has no float32 CUDA kernel: its fallback copies between host and "
                       "device (use Plan.dtype='bfloat16')")
    per_16_bytes = 16 // torch.empty((), dtype=plan.compute_dtype).element_size()
    ffn = cfg.ffn // plan.etp  # the hidden units one rank's expert weights hold
    if plan.expert_backend == "torch" and any(n % per_16_bytes for n in (cfg.dim, ffn, cfg.fc1_width(ffn))):
        held = f" (ffn / Plan.etp={plan.etp} = {ffn} a rank)" if plan.etp > 1 else ""
        reasons.append(f"ModelConfig.dim={cfg.dim} / ffn={cfg.ffn}{held} are not multiples of 16 bytes in "
                       f"{plan.dtype}, so the torch backend falls back to a per-expert loop that reads row "
                       "counts on the host (use multiples of 8 for bfloat16, 4 for float32)")
    return reasons


def check_capturable(plan: Plan, scopes) -> None:
    """Raise ValueError unless every scope in ``scopes`` (``attn``, ``router``,
    ``dispatch``, ``experts`` or ``step``, the whole step) can be captured under ``plan``.

    Checks only the plan: it runs on any machine, before any CUDA work.
    """
    unknown = [s for s in scopes if s not in (*SCOPES, "step")]
    if unknown or not scopes:
        raise ValueError(f"scopes={list(scopes)!r} is invalid: allowed scopes are "
                         f"{', '.join(map(repr, (*SCOPES, 'step')))} (at least one)")
    parallel = {name: getattr(plan, name) for name in ("cp", "pp") if getattr(plan, name) > 1}
    if parallel:
        raise ValueError("cannot capture CUDA graphs under " + ", ".join(f"Plan.{k}={v}" for k, v in parallel.items())
                         + ": the graphed scopes do not take the context-parallel chunks or the pipeline's "
                         "transfers yet (allowed: cp = pp = 1, or no CUDA graph)")
    reasons = {}  # where -> why
    if "step" in scopes:
        reasons["a whole step"] = _expert_host_reads(plan)
        if plan.etp > 1:
            reasons["a whole step"].append(f"Plan.etp={plan.etp} reads its group's row counts on the host before "
                                           "the experts (allowed: etp = 1; or graph the scopes instead: 'experts' "
                                           "runs between those exchanges)")
    elif "experts" in scopes:
        reasons["scope 'experts'"] = _expert_host_reads(plan)
        if plan.delay_wgrad:
            reasons["scope 'experts'"].append("Plan.delay_wgrad=True defers the experts' weight GEMMs out of "
                                              "their backward, which a graphed 'experts' scope runs whole (set "
                                              "delay_wgrad=False or leave 'experts' out)")
    cfg = plan.model
    if "dispatch" in scopes and cfg.pad_multiple and not cfg.capacity_factor:
        reasons["scope 'dispatch'"] = [f"padded dropless routing (ModelConfig.pad_multiple={cfg.pad_multiple}) "
                                       "reads the permuted row count on the host (set pad_multiple=0 or "
                                       "capacity_factor > 0, or leave 'dispatch' out)"]
    refused = [f"cannot capture {where} in a CUDA graph: " + "; ".join(why) for where, why in reasons.items() if why]
    if refused:
        raise ValueError("; ".join(refused))
    if torch.device(plan.device).type != "cuda":
        raise ValueError(f"CUDA graphs need Plan.device='cuda' (or 'cuda:N'), got {plan.device!r}")


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

    def __call__(self, params: dict, batch: dict) -> StepOutput:
        """Copy ``params`` and ``batch`` into the graph's buffers and replay it.

        ``params`` and ``batch`` are checked as ``fmoe.step`` checks them (the token
        range check reads the batch's min and max on the host) and must have the
        captured shapes and keys. The loss's divisor, the global count of counted
        targets, is data too: the graph reads it from a device scalar.
        """
        check_params(params, self.plan, self.setup)
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
            for new, static_leaf in zip(optree.tree_leaves(params), optree.tree_leaves(self.static_params)):
                if not _same_memory(new, static_leaf):  # an optimizer that donated updated them in place
                    static_leaf.copy_(new)
            for new, static_tensor in zip(checked[:3], static[:3]):
                if new is not None:
                    static_tensor.copy_(new)
            self.divisor.fill_(float(total))
        self.graph.replay()
        self.out.metrics["tokens"] = total
        return self.out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride())


def _warm_up(run, iters: int) -> None:
    # Lazy initialisation (cuBLAS handles, NCCL communicators, allocator pools) must
    # happen outside the capture, on a side stream as capture itself uses.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_step(params: dict, batch: dict, plan: Plan, warmup: int = 2, donate: bool = False) -> GraphedStep:
    """Capture ``fmoe.step(params, batch, plan)`` as one CUDA graph.

    Arguments:
        params, batch, plan: as for ``fmoe.step``; every rank captures together
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
    """
    check_capturable(plan, ("step",))
    prepared = prepare_step(params, batch, plan)
    # the graph's own copy unless donated: replays read it as it is
    static_params = params if donate else optree.tree_map(lambda t: t.detach().clone(), params)
    # the graph's own copies of the batch (targets cloned apart from the tokens they may view)
    b = prepared.batch
    static_batch = b._replace(tokens=b.tokens.clone(), targets=b.targets.clone(),
                              segments=None if b.segments is None else b.segments.clone())
    prepared = prepared._replace(batch=static_batch)
    _warm_up(lambda: run_step(static_params, prepared, plan), warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = run_step(static_params, prepared, plan)
    return GraphedStep(plan, graph, static_params, prepared, out)


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs into the pair's own, replay its forward graph. Backward:
    copy the output gradients in, replay its backward graph."""

    @staticmethod
    def forward(ctx, pair: _GraphPair, *inputs):
        ctx.pair = pair
        with torch.no_grad():
            for static, new in zip(pair.inputs, inputs):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
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

    _warm_up(forward_backward, warmup)
    pool = torch.cuda.graph_pool_handle()  # the backward graph reads the forward's saved tensors
    forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward_graph, pool=pool, capture_error_mode="thread_local"):
        outputs, treespec = optree.tree_flatten(fn(*inputs))
    output_grads = [torch.empty_like(o) if o.requires_grad else None for o in outputs]
    with torch.cuda.graph(backward_graph, pool=pool, capture_error_mode="thread_local"):
        input_grads = _input_grads(outputs, output_grads, inputs)
    pair = _GraphPair(forward_graph, backward_graph, inputs, tuple(outputs), tuple(output_grads), input_grads,
                      treespec)
    return lambda *tensors: optree.tree_unflatten(pair.treespec, _Replay.apply(pair, *tensors))


# Scopes: each graphed function takes flat tensors; these rebuild the pure function's arguments.

def _scope_kernels(plan: Plan) -> Kernels:
    """The kernels a graphed scope replays: the plan's own (compiled under
    ``Plan.compile``), without ``Plan.remat='selective'``'s policy, which a graph
    does not take (it keeps what it saves in its own pool)."""
    return kernels_for(plan.replace(remat="none"))


def _attn_flat(p_layer: dict, attn, site: tuple, cfg, window: int, tp):
    mlp = "moe" if "moe" in p_layer else "mlp"  # a dense layer's MLP norm
    sub = {"attn": p_layer["attn"], mlp: {"norm": p_layer[mlp]["norm"]}}  # every attn leaf: sinks too
    leaves, treedef = optree.tree_flatten(sub)
    extra = {} if tp is None else {"tp": tp}
    return leaves, lambda: (lambda h, *w: attn(site, optree.tree_unflatten(treedef, w), h, cfg, None, window, **extra))


def _router_flat(p_moe: dict, router, site: tuple, cfg):
    names = [n for n in ("router", "expert_bias", "router_bias") if n in p_moe]
    return [p_moe[n] for n in names], lambda: (lambda x, *leaves: router(site, dict(zip(names, leaves)), x, cfg))


def _sample(t: torch.Tensor) -> torch.Tensor:
    """A graph's static input like ``t``: a fresh copy, except a tensor with no storage
    of its own (an ``Fp8Weight``'s ``grad_leaf``, at one address for the process), kept
    as it is rather than copied into a dense one on every replay."""
    if t.dim() and not any(t.stride()):
        return t.detach().requires_grad_(t.requires_grad)
    return t.detach().clone().requires_grad_(t.requires_grad)


def graph_forward(fn, inputs: tuple, warmup: int = 3):
    """``fn`` (tensors in, no gradient) as one CUDA graph on the static ``inputs``.

    Each call copies new arguments into ``inputs`` (unless already there), replays the
    graph and returns the captured output itself, whose tensors the next call
    overwrites. Captured in thread-local mode, as ``graph_pair``'s graphs are.
    """
    with torch.no_grad():
        _warm_up(lambda: fn(*inputs), warmup)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = fn(*inputs)

    def call(*tensors):
        with torch.no_grad():
            for static, new in zip(inputs, tensors):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
        graph.replay()
        return output

    return call


class NotGraphed(UserWarning):
    """A graphed scope was called, after the capture, with a key the recording step never
    saw (a dispatch of another shape: a rank received more tokens than its bound); that
    call runs the plan's kernel instead of a graph. Warned once per key."""


class _ScopeGraphs:
    """Per key (a scope and site ``(layer, microbatch)``; for ``dispatch`` also the
    shape and groups): the arguments seen in a recording step, then the graphed callable
    made from them (a ``graph_pair``; for ``dispatch`` a forward-only ``graph_forward``)."""

    def __init__(self, plan: Plan, scopes):
        self.plan, self.scopes = plan, tuple(scopes)
        self.samples: dict = {}  # key -> (fn, sample inputs, how to graph it)
        self.graphed: dict = {}
        self.recording = True  # until capture: the step that records the arguments
        self.not_graphed: set = set()  # keys first seen after the capture

    def _call(self, key, make, tensors, capture=graph_pair):
        if key in self.graphed:
            return self.graphed[key](*tensors)
        fn = make()
        if self.recording and key not in self.samples:  # remember fresh copies, compute eagerly
            self.samples[key] = (fn, [_sample(t) for t in tensors], capture)
        elif not self.recording and key not in self.not_graphed:
            self.not_graphed.add(key)
            warnings.warn(f"CUDA-graph scope {key[0]!r} at site {key[1]} has no graph for {key[2:] or 'this call'}: "
                          "it runs the plan's kernel", NotGraphed, stacklevel=3)
        return fn(*tensors)

    def capture(self) -> None:
        for key, (fn, sample, capture) in self.samples.items():
            self.graphed[key] = capture(fn, tuple(sample))
        self.samples.clear()
        self.recording = False

    def kernels(self) -> Kernels:
        chosen, replayed = {}, _scope_kernels(self.plan)
        if "attn" in self.scopes:
            def attn(site, p, h, cfg, docs=None, window=0, tp=None, cp=None):
                if docs is not None:
                    raise ValueError("a graphed 'attn' scope runs plain causal attention: batches with "
                                     "'segments' (packed documents) need the eager or compiled attention, or "
                                     "capture_step (capture without 'attn' in scopes)")
                if cp is not None:
                    raise ValueError("a graphed 'attn' scope does not take context-parallel chunks (Plan.cp > 1)")
                leaves, make = _attn_flat(p, replayed.attn, site, cfg, window, tp)  # one graph per site
                return self._call(("attn", site), make, [h, *leaves])
            chosen["attn"] = attn
        if "router" in self.scopes:
            def router(site, p, x, cfg):
                leaves, make = _router_flat(p, replayed.router, site, cfg)
                return self._call(("router", site), make, [x, *leaves])
            chosen["router"] = router
        if "dispatch" in self.scopes:
            chosen["dispatch"] = functools.partial(self._dispatch, replayed.dispatch)
        if "experts" in self.scopes:
            chosen["experts"] = functools.partial(self._experts, bound_backend(self.plan.expert_backend))
        return kernels_for(self.plan)._replace(**chosen)  # the scopes not graphed: as the plan says

    def _dispatch(self, dispatcher, site, indices_TK, num_experts, pad_multiple=0, capacity=None):
        # A site may build more than one permutation (tokens travelling: of (token, rank)
        # pairs, then of the tokens that came): one graph for each.
        key = ("dispatch", site, tuple(indices_TK.shape), num_experts, pad_multiple, capacity)
        if self.recording and key in self.samples:
            raise ValueError(f"scope 'dispatch' saw two permutations of the same shape at site {site} in one "
                             "step: their graph would overwrite one with the other (leave 'dispatch' out)")
        return self._call(key, lambda: (lambda idx: dispatcher(site, idx, num_experts, pad_multiple, capacity)),
                          [indices_TK], graph_forward)

    def _experts(self, backend, site, p, rows, segs, cfg, probs, deferred):
        if deferred is not None:
            raise ValueError("a graphed 'experts' scope computes its weight gradients in its backward graph; "
                             "run it under a plan with delay_wgrad=False (the plan it was captured for)")
        # The segments' tensors change every step: they are graph inputs like the rows.
        names = list(p)
        seg_fields = [(i, v) for i, v in enumerate(segs) if isinstance(v, torch.Tensor)]
        has_probs = probs is not None

        def make():
            def fn(rows, *rest):
                rest = list(rest)
                pr = rest.pop(0) if has_probs else None
                weights = {n: rest.pop(0) for n in names}
                fields = list(segs)
                for i, _ in seg_fields:
                    fields[i] = rest.pop(0)
                return expert_mlp(weights, rows, type(segs)(*fields), cfg, pr, backend, None,
                                  gemms=GEMMS[self.plan.fp8])
            return fn
        tensors = [rows, *([probs] if has_probs else []), *(p[n] for n in names), *(v for _, v in seg_fields)]
        return self._call(("experts", site), make, tensors)


def capture_scopes(params: dict, batch: dict, plan: Plan, scopes=("attn",)) -> Kernels:
    """Graph the functions of ``scopes`` inside every layer node, per layer and microbatch.

    Runs one eager ``fmoe.step`` that records each scope's arguments, then captures
    one forward and one backward graph per (scope, layer, microbatch) with
    ``graph_pair`` (which warms up on a side stream first); ``dispatch``, which has no
    gradient, one forward graph per (layer, microbatch) and permutation shape
    (``graph_forward``). Each graph has its own memory pool, so any schedule may
    interleave them. A call the recording step did not see (a dispatch of another shape)
    runs the plan's kernel and warns ``NotGraphed`` once.

    Arguments:
        params, batch, plan: as for ``fmoe.step``; fixes the shapes.
        scopes: any of ``attn``, ``router``, ``dispatch``, ``experts``.

    Returns:
        Kernels for ``fmoe.step(params, batch, plan, kernels=...)``. A graphed scope
        copies its inputs into the graph's buffers unless they are already there.

    Raises:
        ValueError: a scope cannot be captured under ``plan`` (``check_capturable``);
            ``dispatch`` met two permutations of one shape at one site in a step.
    """
    check_capturable(plan, tuple(scopes))
    if "attn" in scopes and isinstance(batch, dict) and batch.get("segments") is not None:
        raise ValueError("scopes=['attn'] graphs plain causal attention, but the batch has 'segments' (packed "
                         "documents); graph the other scopes, or the whole step with capture_step")
    graphs = _ScopeGraphs(plan, scopes)
    kernels = graphs.kernels()
    run_step(params, prepare_step(params, batch, plan), plan, kernels)
    torch.cuda.synchronize()
    graphs.capture()
    return kernels


__all__ = ["GraphedStep", "NotGraphed", "capture_scopes", "capture_step", "check_capturable", "graph_forward",
           "graph_pair"]
