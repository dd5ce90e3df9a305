"""``adamw(fused=True)``: one pass over each leaf's parameter, gradient and moments.

On CUDA (with Triton) ``adamw_kernel``'s kernel updates each leaf, with fp32 or bf16
moments. Elsewhere fp32 moments go to torch's fused AdamW, which takes lists of tensors
and updates them in a few multi-tensor launches (one call per class of leaves:
trainable and decayed, trainable, frozen), and bf16 moments to the kernel's torch ops.

Pure by default: the kernel updates copies of the params and moments and returns
them. ``donate=True`` updates the params, moments and grads passed in instead:
nothing is copied, and those values are gone.
"""

from __future__ import annotations

import optree
import torch

from ..params import decays, trainable
from ..layers.triton_kernels import fused_kernels_available
from .adamw_kernel import adamw_leaf_
from .finite import finite_init, next_finite_state, skip_decision
from .nonfinite import finite_everywhere, join_record, next_record, split_record, with_fresh_record
from .transforms import ClipState, NormFn, ScaleByAdamState, ScheduleState, check_moment_state, check_named_state


ADAMW_STATES = ("clip", "adam", "decay", "lr", "freeze")
"""The names of ``adamw``'s states, in order (``clip`` only with ``max_grad_norm``)."""


def fused_adamw(chain_init, b1, b2, eps, weight_decay, lr, max_grad_norm, norm_fn: NormFn, max_skips: int | None,
                donate: bool, moments: torch.dtype = torch.float32):
    """``adamw(fused=True)``: the named chain's state (``clip``, ``adam``, ``decay``,
    ``lr``, ``freeze``) and meaning, one kernel per leaf (``adamw_kernel``) or, for fp32
    moments off CUDA, torch's fused kernel per class of leaves (trainable and decayed,
    trainable, frozen). ``max_skips``: ``adamw``'s ``skip_nonfinite`` (None: skip every
    non-finite step, ``nonfinite.py``). Returns ``(init, update)``."""
    clipping = max_grad_norm is not None
    names = list(ADAMW_STATES[0 if clipping else 1:])

    def fused_update(grads, state, params, norm, apply, record_clip: bool):
        check_named_state(state, names)
        adam, schedule = state["adam"], state["lr"]
        check_moment_state("adamw", adam, moments)
        rate = lr(schedule.count) if callable(lr) else lr
        grad_scale = None
        if clipping:  # the kernels divide gradients by grad_scale
            grad_scale = ((norm + 1e-6) / max_grad_norm).clamp(min=1.0).float()
        found_inf = None if apply is None else (~apply).float()  # a skipped step writes nothing
        paths, p_leaves, treedef = optree.tree_flatten_with_path(params)
        g_leaves = treedef.flatten_up_to(grads)
        device = p_leaves[0].device
        per_leaf = moments != torch.float32 or fused_kernels_available(p_leaves[0])
        if isinstance(rate, torch.Tensor):  # a schedule's rate stays on the device
            rate = rate.to(device=device, dtype=torch.float32)
        classes = [(True, decays(path[-1])) if trainable(path[-1]) else (False, False) for path in paths]
        step = (adam.count + 1).to(device=device, dtype=torch.float32)

        def own(t):  # what the kernel may write into
            return t if donate else t.clone()

        new_p, new_m, new_v, work = [], [], [], {}
        for p, g, m, v, cls in zip(p_leaves, g_leaves, treedef.flatten_up_to(adam.mu),
                                   treedef.flatten_up_to(adam.nu), classes):
            # frozen leaves keep their params: the kernel updates a scratch copy
            p_run = own(p) if cls[0] else p.clone()
            if g.dtype != torch.float32 and not per_leaf:  # the per-leaf kernel reads any float dtype
                g = g.to(torch.float32)
            elif clipping and not donate and not per_leaf:  # torch's kernel unscales grads in place
                g = g.clone()
            m, v = own(m), own(v)
            for lst, t in zip(work.setdefault(cls, ([], [], [], [])), (p_run, g, m, v)):
                lst.append(t)
            new_p.append(p_run if cls[0] else own(p))  # pure: never the tensor passed in
            new_m.append(m)
            new_v.append(v)
        if per_leaf:
            _leaf_steps(work, rate, step, b1, b2, eps, weight_decay, grad_scale, found_inf)
        else:
            for (updated, decay), (ps, gs, ms, vs) in work.items():
                torch._fused_adamw_(ps, gs, ms, vs, [], [step] * len(ps), lr=rate if updated else 0.0,
                                    beta1=b1, beta2=b2, weight_decay=weight_decay if decay else 0.0, eps=eps,
                                    amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)
        advance = 1 if apply is None else apply.long()  # a skipped step leaves the counts too
        new_state = dict(state, adam=ScaleByAdamState(adam.count + advance, treedef.unflatten(new_m),
                                                      treedef.unflatten(new_v)),
                         lr=ScheduleState(schedule.count + advance))
        if clipping and record_clip:  # the chain's clip records the norm (apply_if_finite does, around it)
            new_state["clip"] = ClipState(norm)
        return treedef.unflatten(new_p), new_state

    def update(grads, state, params):
        if max_skips is None:  # the default: every non-finite step skipped, recorded in state["adam"]
            record, state = split_record(state, params)
            norm = norm_fn(grads) if clipping else None
            apply = finite_everywhere(grads, norm, norm_fn)
            new_params, new_state = fused_update(grads, state, params, norm, apply, record_clip=True)
            return new_params, new_state if record is None else join_record(new_state, next_record(record, apply))
        if not max_skips:
            return fused_update(grads, state, params, norm_fn(grads) if clipping else None, None, True)
        norm = norm_fn(grads)  # once, for the finite check and the clipping
        apply = skip_decision(state, norm, max_skips)
        new_params, inner_state = fused_update(grads, state.inner_state, params, norm, apply, record_clip=False)
        return new_params, next_finite_state(state, norm, apply, inner_state)

    if max_skips is None:
        return (lambda params: with_fresh_record(chain_init(params), params)), update
    return (finite_init(chain_init) if max_skips else chain_init), update


def _leaf_steps(work: dict, rate, step: torch.Tensor, b1, b2, eps, weight_decay, grad_scale, found_inf) -> None:
    """``adamw_leaf_`` over every leaf of ``work`` (``{(updated, decayed): (params,
    grads, mus, nus)}``): the rate and bias corrections made once on the device."""
    device = step.device
    # a constant rate filled in on the device: a host-to-device copy could not be captured
    rate = (rate.to(device, torch.float32) if isinstance(rate, torch.Tensor)
            else torch.full((), rate, dtype=torch.float32, device=device))
    zero = torch.zeros((), dtype=torch.float32, device=device)
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    for (updated, decay), (ps, gs, ms, vs) in work.items():
        for p, g, m, v in zip(ps, gs, ms, vs):
            adamw_leaf_(p, g, m, v, lr=rate if updated else zero, c1=c1, c2=c2, b1=b1, b2=b2, eps=eps,
                        weight_decay=weight_decay if decay else 0.0, grad_scale=grad_scale, found_inf=found_inf)
