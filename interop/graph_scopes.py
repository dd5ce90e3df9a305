"""CUDA-graphed scopes inside the layer nodes: ``capture_scopes`` records each scope's
arguments in one eager step and graphs it per site (``_ScopeGraphs``), returning the
``Kernels`` a step runs with (see ``interop.cuda_graph``)."""

from __future__ import annotations

import functools
import warnings

import optree
import torch

from fmoe import Plan
from fmoe.backends import bound_backend
from fmoe.layers import expert_mlp
from fmoe.layers.fp8 import GEMMS
from fmoe.resolve import plan_kernels
from fmoe.schedule import Kernels
from fmoe.step import prepare_step, run_step

from .capturable import check_capturable
from .graph_capture import graph_forward, graph_pair


# Scopes: each graphed function takes flat tensors; these rebuild the pure function's arguments.

def _scope_kernels(plan: Plan) -> Kernels:
    """The kernels a graphed scope replays: the plan's own (compiled under
    ``Plan.compile``), without ``Plan.remat='selective'``'s policy, which a graph
    does not take (it keeps what it saves in its own pool)."""
    return plan_kernels(plan.replace(remat="none"))


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
        return plan_kernels(self.plan)._replace(**chosen)  # the scopes not graphed: as the plan says

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


__all__ = ["NotGraphed", "capture_scopes"]
