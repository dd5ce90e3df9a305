"""``Plan.compile``: the layer nodes' kernels through ``torch.compile``.

The schedule, the lifecycle and the exchanges stay plain Python; what is compiled is
the pure compute inside a node, where fusion pays:

- ``attn``: both norms, the q/k/v projection, q/k norms, RoPE, SDPA (FlexAttention
  for windows, sinks and packed documents; a plain row's block mask enters the graph
  as a constant), the output projection and the residual add (eager: a dozen
  elementwise kernels around the GEMMs);
- ``router``: fp32 logits, softmax or sigmoid, top-k, the counts and the aux losses;
- ``head``: the final norm, logits and the fp32 cross-entropy (the upcast happens in
  registers instead of a ``[tokens, vocab]`` fp32 copy); with ``Plan.loss_chunk``
  each piece's logits and cross-entropy, forward and backward;
- ``dispatch``: the permutation's index arithmetic (sort, counts, scans, scatters:
  about twenty small kernels eager, whose launches the host pays every layer), unless
  padded dropless routing reads its row count on the host;
- ``experts``: the activation between the two grouped GEMMs, when it is torch code
  (biases, GeGLU, ReLU^2, or no Triton); the fused SwiGLU kernel and the grouped GEMMs
  already run as single kernels, so they stay eager (and delayed wgrad keeps working).

The Triton kernels are ``torch.library`` custom ops (``fmoe::rope``, ``fmoe::swiglu``,
...) with fake shapes and registered backwards, so compiled graphs call them without
a graph break. Every region is compiled with ``fullgraph=True``: a break is an error,
not a silent slowdown. Shapes inside ``attn``, ``router`` and ``head`` are fixed by
the batch; ``attn`` is compiled with static shapes, one graph per batch shape and
config (symbolic sizes inside it would reach FlexAttention's lowering, and RoPE's
tables fused into it, which inductor cannot take); the experts' row count changes
with routing, so the activation is compiled for a dynamic row count up front (no
recompile after the first step).

Compiled and eager agree up to floating-point reassociation inside fused kernels (see
``tests/test_compile.py`` for the tolerances and why).
"""

from __future__ import annotations

import functools

import torch

from ..backends import ExpertBackend
from ..layers.attention import attention_half
from ..layers.dispatch import make_dispatch
from ..layers.experts import activation, dense_mlp, experts_with, fused_activation, torch_activation
from ..layers.fp8 import PLAIN, Gemms
from ..layers.loss import cross_entropy_sum, head_loss_sum
from ..layers.nodes import Kernels, at_any_site, bound_kernels, logits_loss
from ..layers.router import route
from .remat import quiet_compiled, selective, selective_experts, selective_kernels


def _compile(fn, dynamic=None):
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)


def _compiled_activation():
    compiled = _compile(torch_activation)

    def act(h: torch.Tensor, cfg, row_probs_R: torch.Tensor | None = None, bias=None) -> torch.Tensor:
        if fused_activation(h, cfg, row_probs_R):  # one Triton kernel each way already
            return activation(h, cfg, row_probs_R, bias)
        # routing changes the row count every step: one graph for all of them
        for rows in (h, row_probs_R, None if bias is None else bias.row_expert_R):
            if rows is not None:
                torch._dynamo.maybe_mark_dynamic(rows, 0)
        return compiled(h, cfg, row_probs_R, bias)

    return act


def _compiled_head(gemms: Gemms):
    # Functions, not partials, go to torch.compile: dynamo wraps every partial in one
    # shared code object, whose recompile limit all of them would then share.
    compiled = _compile(head_loss_sum)
    whole = logits_loss(gemms.head)
    # In pieces the loop and each piece's backward stay eager (an autograd Function
    # running autograd); the pieces' logits + cross-entropy are compiled, one graph per
    # piece size.
    piece = functools.partial(torch.compile(cross_entropy_sum, fullgraph=True, dynamic=False), matmul=gemms.head)

    def head(weights, h_BSD, targets_BS, eps, chunk=0, tp=None):
        if chunk and chunk < targets_BS.numel():
            return head_loss_sum(weights, h_BSD, targets_BS, eps, chunk, piece, tp)
        return compiled(weights, h_BSD, targets_BS, eps, 0, whole, tp)

    return head


def _compiled_dispatch():
    # One graph per token count (fixed by the batch): traced with a symbolic count,
    # inductor 2.13's pattern passes fail on the capacity's index arithmetic.
    compiled = torch.compile(make_dispatch, fullgraph=True, dynamic=False)

    def dispatch(indices_TK, num_experts, pad_multiple=0, capacity=None):
        if pad_multiple and capacity is None:  # the padded row count is read on the host
            return make_dispatch(indices_TK, num_experts, pad_multiple, capacity)
        return compiled(indices_TK, num_experts, pad_multiple, capacity)

    return dispatch


def compiled_kernels(selective_remat: bool = False, gemms: Gemms = PLAIN,
                     backend: str | ExpertBackend = "torch") -> Kernels:
    """The Kernels ``Plan(compile=True)`` runs (built once per process, policy, products
    and backend; ``torch.compile`` compiles each on its first call and keeps one graph
    per shape and config). ``selective_remat``: ``Plan.remat='selective'``, its policy
    inside the compiled attention and router (``remat.py``) and around the experts.
    ``gemms``: the products of ``Plan.fp8`` (``fmoe.layers.fp8``); ``backend``: the
    experts' (``fmoe.backends.bound_backend``)."""
    return _compiled_kernels(bool(selective_remat), gemms, backend)


@functools.cache
def _compiled_kernels(selective_remat: bool, gemms: Gemms, backend) -> Kernels:
    act = _compiled_activation()

    def keep(fn, dynamic=None):  # the policy inside the region to compile
        return quiet_compiled(_compile(selective(fn), dynamic)) if selective_remat else _compile(fn, dynamic)

    experts = at_any_site(experts_with(backend, gemms, act=act))
    registered = isinstance(backend, ExpertBackend)
    attn = functools.partial(attention_half, gemms=gemms)
    return Kernels(attn=at_any_site(_by_documents(keep(attn, dynamic=False), _compile(attn, dynamic=False))
                                    if selective_remat else keep(attn, dynamic=False)),
                   router=at_any_site(keep(route)),
                   experts=selective_experts(experts, registered) if selective_remat else experts,
                   head=at_any_site(_compiled_head(gemms)), dispatch=at_any_site(_compiled_dispatch()),
                   shared=at_any_site(functools.partial(dense_mlp, gemms=gemms)))


def _by_documents(selective_attn, plain_attn):
    """The compiled attention under the selective policy, but for rows whose documents
    carry FlexAttention's block mask: torch 2.11's compiled selective checkpointing
    changed their forward (packed rows' loss 4.577 against 4.553, 0.5%, on an H100; plain
    rows' did not move), so those keep their activations as without remat."""
    def attn(p, h_BSD, cfg, docs=None, window=0, **parallel):
        if docs is not None and docs.block_mask is not None:
            return plain_attn(p, h_BSD, cfg, docs, window, **parallel)
        return selective_attn(p, h_BSD, cfg, docs, window, **parallel)
    return attn


@functools.cache
def eager_kernels(selective_remat: bool = False, gemms: Gemms = PLAIN,
                  backend: str | ExpertBackend = "torch") -> Kernels:
    """The Kernels of an eager step: ``bound_kernels(gemms, backend)``, under
    ``Plan.remat='selective'``'s policy or not."""
    kernels = bound_kernels(gemms, backend)
    return selective_kernels(kernels, isinstance(backend, ExpertBackend)) if selective_remat else kernels


def kernels_for(compile: bool, selective_remat: bool, gemms: Gemms, backend: str | ExpertBackend) -> Kernels:
    """The Kernels a step runs unless told otherwise: compiled or eager, under
    ``Plan.remat='selective'``'s policy or not, with ``gemms`` (``Plan.fp8``'s products) and
    the expert backend bound in (``fmoe.resolve.plan_kernels`` reads them from a plan)."""
    if compile:
        return compiled_kernels(selective_remat, gemms, backend)
    return eager_kernels(selective_remat, gemms, backend)
