"""Optimizers: a Transform turned into ``params, state = opt.update(grads, state, params)``,
and ``adamw`` (a chain of the transforms, or torch's fused kernel, with the same state)."""

from __future__ import annotations

import optree
import torch

from .finite import _apply_if_finite, _applied, _decide, _init_state, _select
from .transforms import (Optimizer, Schedule, ScaleByAdamState, ScheduleState, Transform, _check, _check_decay,
                         _check_finite, _check_int, _check_lr, _check_norm_scope, _clip, _decays, _map, _StepNorm,
                         _trainable, add_decayed_weights, chain, freeze, global_norm, scale_by_adam,
                         scale_by_learning_rate)


def optimizer(transform: Transform) -> Optimizer:
    """Turn a Transform into an Optimizer whose update returns ``params + updates``.

    Where an ``apply_if_finite`` anywhere in the transform skipped the step, the params
    come back as they were, selected with ``torch.where`` rather than ``params + 0``
    (which may change a NaN's bits, and turns -0.0 into 0.0).
    """

    def update(grads, state, params):
        updates, state = transform.update(grads, state, params)
        new = _map(lambda p, u: p + u.to(p.dtype), params, updates)
        applied = _applied(state)
        if applied is not None:
            new = _select(applied, new, params)
        return new, state

    return Optimizer(transform.init, update)


def _fused_adamw(chain_init, b1, b2, eps, weight_decay, lr, max_grad_norm, plan, max_skips: int) -> Optimizer:
    """``adamw(fused=True)``: the chain's state and meaning, one fused kernel per group."""
    clipping = max_grad_norm is not None

    def fused_update(grads, state, params, norm):
        adam, schedule = state[int(clipping)], state[int(clipping) + 2]
        count = adam.count + 1
        rate = lr(schedule.count) if callable(lr) else lr
        grad_scale = None
        if clipping:  # the kernel divides gradients by grad_scale
            grad_scale = ((norm + 1e-6) / max_grad_norm).clamp(min=1.0).float()
        paths, p_leaves, treedef = optree.tree_flatten_with_path(params)
        g_leaves, m_leaves, v_leaves = (treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu))
        device = p_leaves[0].device
        if isinstance(rate, torch.Tensor):  # a schedule's rate stays on the device
            rate = rate.to(device=device, dtype=torch.float32)
        # Pure: the kernel updates copies. Frozen leaves get their moments updated (as
        # the chain does) with a zero rate, and keep their params.
        new_p, new_m, new_v = list(p_leaves), list(m_leaves), list(v_leaves)
        step = count.to(device=device, dtype=torch.float32)
        groups = {(True, True): [], (True, False): [], (False, False): []}  # (trainable, decays)
        for i, (path, p) in enumerate(zip(paths, p_leaves)):
            groups[(True, _decays(path, p)) if _trainable(path) else (False, False)].append(i)
        for (trainable, decay), idx in groups.items():
            if not idx:
                continue
            params_copy = [p_leaves[i].clone() for i in idx]
            for out, src in ((new_m, m_leaves), (new_v, v_leaves)):
                for i in idx:
                    out[i] = src[i].clone()
            # copies of the grads too: with grad_scale the kernel unscales them in place
            torch._fused_adamw_(params_copy, [g_leaves[i].to(torch.float32, copy=True) for i in idx],
                                [new_m[i] for i in idx], [new_v[i] for i in idx], [], [step] * len(idx),
                                lr=rate if trainable else 0.0, beta1=b1, beta2=b2,
                                weight_decay=weight_decay if decay else 0.0, eps=eps, amsgrad=False,
                                maximize=False, grad_scale=grad_scale)
            if trainable:
                for i, p in zip(idx, params_copy):
                    new_p[i] = p
        new_state = list(state)
        new_state[int(clipping)] = ScaleByAdamState(count, treedef.unflatten(new_m), treedef.unflatten(new_v))
        new_state[int(clipping) + 2] = ScheduleState(schedule.count + 1)
        return treedef.unflatten(new_p), tuple(new_state)

    def update(grads, state, params):
        if not max_skips:
            return fused_update(grads, state, params, global_norm(grads, plan) if clipping else None)
        norm = global_norm(grads, plan)  # once, for the finite check and the clipping
        new_params, inner_state = fused_update(grads, state.inner_state, params, norm)
        apply, state = _decide(state, norm, max_skips, inner_state)
        return _select(apply, new_params, params), state

    return Optimizer(_init_state(chain_init) if max_skips else chain_init, update)


def adamw(lr: float | Schedule = 1e-3, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.0, max_grad_norm: float | None = None, plan=None,
          fused: bool = False, skip_nonfinite: int = 0) -> Optimizer:
    """AdamW (decoupled weight decay on matrices), optional global-norm clipping and
    skipping of non-finite steps.

    Every operation is per element, so it updates whatever each rank holds (full
    tensors or shards); only the gradient norm needs the other ranks. Settings are
    checked here (ValueError naming the argument and its allowed range).

    Arguments:
        lr: learning rate (finite, > 0), or a function of the update count (a 0-dim
            int64 tensor on the params' device).
        b1, b2: Adam's moment decays, in [0, 1).
        eps: Adam's epsilon (finite, > 0).
        weight_decay: decoupled decay (finite, >= 0), scaled by ``lr``; applied to
            matrices, not to norms or biases.
        max_grad_norm: clip gradients to this global norm (finite, > 0) first; None: no
            clipping (0 is refused rather than read as "off").
        plan: the Plan params are sharded by; needed with clipping or skipping on
            several ranks.
        fused: True runs each update as torch's fused AdamW kernel on copies of the
            params and moments (one pass over memory instead of one per elementwise op;
            the same state, the same update up to rounding). False: the optax-style
            chain of elementwise transforms, bitwise the same for any sharding.
        skip_nonfinite: 0 (off), or n > 0: wrap the update in
            ``apply_if_finite(..., max_skips=n)``. A step whose gradients hold a NaN or
            an inf leaves params and state unchanged, bit for bit, and is counted
            (``fmoe.optim.skipped_steps``); the (n+1)-th such step in a row is applied.
            The gradient norm is computed once per step for this check and the clipping.

    Returns:
        An Optimizer. ``expert_bias`` leaves are never changed by it. Its update is
        pure: it returns new params and state and never writes into the ones passed.
    """
    _check_lr("adamw", lr)
    _check_decay("adamw", "b1", b1)
    _check_decay("adamw", "b2", b2)
    _check_finite("adamw", "eps", eps, positive=True)
    _check_finite("adamw", "weight_decay", weight_decay, positive=False)
    if max_grad_norm is not None:
        _check_finite("adamw", "max_grad_norm", max_grad_norm, positive=True, allowed_extra=", or None (no clipping)")
    _check("adamw", "fused", fused, isinstance(fused, bool), "must be True or False")
    _check_int("adamw", "skip_nonfinite", skip_nonfinite, 0, allowed_extra=" (0: off)")
    if max_grad_norm is not None or skip_nonfinite:
        _check_norm_scope(plan, "adamw")
    norm = _StepNorm(plan)  # read by both the finite check and the clipping
    parts = [] if max_grad_norm is None else [_clip(max_grad_norm, norm)]
    parts += [scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr), freeze()]
    transform = chain(*parts)
    if fused:
        return _fused_adamw(transform.init, b1, b2, eps, weight_decay, lr, max_grad_norm, plan, skip_nonfinite)
    if skip_nonfinite:
        transform = _apply_if_finite(transform, skip_nonfinite, norm)
    return optimizer(transform)
