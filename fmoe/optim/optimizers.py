"""Optimizers: a Transform turned into ``params, state = opt.update(grads, state, params)``,
and ``adamw`` (a chain of the transforms, or a fused kernel, with the same state)."""

from __future__ import annotations

import optree

from ..checks import check, check_decay, check_finite, check_int, check_lr
from .finite import ApplyIfFiniteState, apply_if_finite_sharing, select_where, update_applied
from .fused import ADAMW_STATES, fused_adamw
from .nonfinite import skip_every_nonfinite
from .transforms import (ClipState, EmptyState, Optimizer, Schedule, ScaleByAdamState, ScheduleState, StepNorm,
                         Transform, add_decayed_weights, check_moments, check_norm_scope, clip_with_norm, freeze,
                         grad_norm_fn, named_chain, scale_by_adam, scale_by_learning_rate)

_POSITIONAL_ADAMW = (ScaleByAdamState, EmptyState, ScheduleState, EmptyState)  # adam, decay, lr, freeze


def _positional_adamw_state(state) -> bool:
    """Whether ``state`` is an ``adamw`` chain state from before its states were named:
    a plain tuple ``([clip,] adam, decay, lr, freeze)`` of exactly those state types."""
    if type(state) is not tuple or len(state) not in (4, 5):
        return False
    *clip, adam, decay, lr, frozen = state
    return all(isinstance(s, (ClipState, EmptyState)) for s in clip) and all(
        isinstance(s, kind) for s, kind in zip((adam, decay, lr, frozen), _POSITIONAL_ADAMW))


def migrate_state(state):
    """An optimizer state saved by an older fmoe, in the form this one's optimizers take.

    ``fmoe.load`` applies it once to the ``opt_state`` it reads; an optimizer's
    ``update`` takes only the current form. What it migrates: ``adamw``'s chain
    states were a tuple in ``ADAMW_STATES`` order before they were named; such a tuple
    (recognised by its length and the types of its states; also inside an
    ``ApplyIfFiniteState``) becomes the ``{name: state}`` dict, the same tensors. The
    state of a hand-built ``chain`` of those very transforms looks the same, and is
    renamed too. Any other state comes back as it is.
    """
    if isinstance(state, ApplyIfFiniteState):
        inner = migrate_state(state.inner_state)
        return state if inner is state.inner_state else state._replace(inner_state=inner)
    if _positional_adamw_state(state):
        return dict(zip(ADAMW_STATES[5 - len(state):], state))
    return state


def _moments(state):
    """The first ``ScaleByAdamState``'s first moment in ``state`` (a tree of states), or None."""
    if isinstance(state, ScaleByAdamState):
        return state.mu
    children = state.values() if isinstance(state, dict) else state if isinstance(state, tuple) else ()
    for child in children:
        if (found := _moments(child)) is not None:
            return found
    return None


def _check_moments_match(state, params) -> None:
    """ValueError, before any update, for a state whose moments mirror another tree than
    ``params`` (a full model's state handed the adapters of ``Plan.lora``, or the reverse)."""
    mu = _moments(state)
    if mu is None or optree.tree_structure(mu) == optree.tree_structure(params):
        return
    raise ValueError(f"opt_state's moments mirror a tree of {optree.tree_structure(mu).num_leaves} leaves, but the "
                     f"params updated have {optree.tree_structure(params).num_leaves} (a full model's state for "
                     "adapters, or the reverse?): build the state with opt.init(params) of the tree you update")


def optimizer(transform: Transform) -> Optimizer:
    """Turn a Transform into an Optimizer whose update returns ``params + updates``.

    Where an ``apply_if_finite`` anywhere in the transform skipped the step, the params
    come back as they were, selected with ``torch.where`` rather than ``params + 0``
    (which may change a NaN's bits, and turns -0.0 into 0.0).
    """

    def update(grads, state, params):
        _check_moments_match(state, params)
        updates, state = transform.update(grads, state, params)
        new = optree.tree_map(lambda p, u: p + u.to(p.dtype), params, updates)
        applied = update_applied(state)
        if applied is not None:
            new = select_where(applied, new, params)
        return new, state

    return Optimizer(transform.init, update)


def adamw(lr: float | Schedule = 1e-3, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.0, max_grad_norm: float | None = None, plan=None,
          fused: bool = False, skip_nonfinite: int | None = None, donate: bool = False,
          moments: str = "float32") -> Optimizer:
    """AdamW (decoupled weight decay on matrices), optional global-norm clipping, and
    non-finite steps skipped.

    By default no update holding a NaN or an inf is ever written: a step whose
    gradients are not all finite (on any rank) leaves params and state as they were,
    bit for bit, and is counted: ``fmoe.skipped_steps(state)`` gives ``(in a row,
    total)``. The decision stays on the device (``torch.where``; no host read, one
    all-reduced flag on several ranks), and a finite step computes exactly what it
    would without the check. Params that already hold a NaN give NaN gradients (and a
    NaN ``fmoe.step`` loss) at every step, so every later step is skipped and the
    params stay as they are: the count in a row grows by one a step; load a checkpoint.

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
        fused: True runs each update as one pass over memory instead of one per
            elementwise op (the same state, the same update up to rounding): on CUDA
            fmoe's Triton kernel per leaf (``adamw_kernel``; it leaves the gradients as
            they are), elsewhere torch's fused AdamW, one multi-tensor launch per class
            of leaves (trainable and decayed, trainable, frozen). False: the optax-style
            chain of elementwise transforms, bitwise the same for any sharding.
        skip_nonfinite: None (default): skip every non-finite step, as above; the
            record sits in ``state["adam"].skips``, so the state keeps its named
            layout, and a state saved without it (an older fmoe, or ``skip_nonfinite=0``)
            updates as well (its first update starts the record). The check reads the
            clip's norm when clipping, else this rank's gradient norm (an extra pass
            over the gradients) and, on several ranks, all-reduces one flag over the
            world group (``plan`` given: when ``plan.world > 1``), so every rank of
            the process group must update together. n > 0: wrap the update in
            ``apply_if_finite(..., max_skips=n)``: skipped and counted likewise, but the
            (n+1)-th such step in a row is applied, so a run that has gone wrong shows
            it (the main job's ``--max-skips``); the state is an ``ApplyIfFiniteState``
            around the named one and keeps the norm. 0: off, a non-finite update is
            written (NaN params from then on). The gradient norm is computed once per
            step for the check and the clipping. With clipping or n > 0 the state keeps
            that norm: ``fmoe.optim.last_grad_norm(state)`` reads it (for a log)
            without a second reduction.

        donate: with ``fused=True`` only. False (default): the update is pure; it
            copies each leaf of params and moments (and of grads, when clipping) once
            and updates the copies. True: as JAX's donated buffers, the update writes
            the new params and moments into the tensors passed in (and the clipped
            grads into the grads'), copying nothing: the old ``params``, ``state`` and
            ``grads`` values are gone, so pass only values you will not read again
            (``params, state = opt.update(grads, state, params)``). Frozen params
            (``expert_bias``) and grads that are not fp32 are never written into.
        moments: the dtype Adam's moments are kept in: ``float32`` (default) or
            ``bfloat16`` (half their memory; each step computes in fp32 and rounds the
            new moments once, see ``scale_by_adam``; with ``fused=True`` the same
            per-leaf kernel as fp32 moments on CUDA, moving 20 bytes an element where
            fp32 moments move 28, and its torch ops elsewhere). A state made with one
            setting is refused by an optimizer of the other.

    Returns:
        An Optimizer. ``expert_bias`` leaves are never changed by it. Without
        ``donate`` its update is pure: it returns new params and state and never writes
        into the ones passed.
    """
    check_lr("adamw lr", lr)
    check_decay("adamw b1", b1)
    check_decay("adamw b2", b2)
    check_finite("adamw eps", eps, positive=True)
    check_finite("adamw weight_decay", weight_decay, positive=False)
    if max_grad_norm is not None:
        check_finite("adamw max_grad_norm", max_grad_norm, positive=True, allowed_extra=", or None (no clipping)")
    check("adamw fused", fused, isinstance(fused, bool), "must be True or False")
    if skip_nonfinite is not None:
        check_int("adamw skip_nonfinite", skip_nonfinite, 0,
                  allowed_extra=" (0: off), or None (the default: skip every non-finite step)")
    moment_dtype = check_moments("adamw moments", moments)
    check("adamw donate", donate, isinstance(donate, bool) and (fused or not donate),
           "must be False, or True with fused=True (the chain builds new tensors)")
    norm_fn = grad_norm_fn(plan)
    if max_grad_norm is not None or skip_nonfinite:
        check_norm_scope(norm_fn, "adamw")
    norm = StepNorm(norm_fn)  # read by both the finite check and the clipping
    # the norm is kept in the state once: by apply_if_finite when skipping, else by the clip
    wrapped = bool(skip_nonfinite)  # apply_if_finite around the chain, which then records the norm
    parts = [] if max_grad_norm is None else [("clip", clip_with_norm(max_grad_norm, norm, record=not wrapped))]
    parts += [("adam", scale_by_adam(b1, b2, eps, moments)), ("decay", add_decayed_weights(weight_decay)),
              ("lr", scale_by_learning_rate(lr)), ("freeze", freeze())]
    transform = named_chain(*parts)
    if fused:
        init, fused_update = fused_adamw(transform.init, b1, b2, eps, weight_decay, lr, max_grad_norm, norm_fn,
                                         skip_nonfinite, donate, moment_dtype)

        def update(grads, state, params):
            _check_moments_match(state, params)
            return fused_update(grads, state, params)
        return Optimizer(init, update)
    if skip_nonfinite is None:
        transform = skip_every_nonfinite(transform, norm, max_grad_norm is not None)
    elif skip_nonfinite:
        transform = apply_if_finite_sharing(transform, skip_nonfinite, norm)
    return optimizer(transform)
