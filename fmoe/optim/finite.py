"""``apply_if_finite``: skip the updates whose gradients hold a NaN or an inf.

A skipped step leaves the wrapped transform's state as it was, bit for bit, and an
Optimizer over it returns the params as they were, so the next finite step proceeds as
if the bad one had not happened. The decision is a device tensor used by
``torch.where``: no step reads a value back to the host.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..checks import check_int
from .transforms import StepNorm, Transform, check_norm_scope, device_of, grad_norm_fn


class ApplyIfFiniteState(NamedTuple):
    """State of ``apply_if_finite``: 0-dim tensors on the params' device.

    Attributes:
        notfinite_count: non-finite steps in a row (int64; 0 after a finite one).
        last_finite: whether the last step's gradients were finite (bool).
        total_notfinite: non-finite steps in all (int64).
        applied: whether the last update was applied: finite, or given up on (bool).
        inner_state: the wrapped transform's state.
        grad_norm: the global norm of the last update's gradients, the one the check
            (and a clip inside sharing it) used (fp32; 0 before the first update), so
            a training loop logs it without computing it again (``last_grad_norm``).
            Last, with a default, so that states saved before it existed still load
            (None until their next update).
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    applied: torch.Tensor
    inner_state: Any
    grad_norm: torch.Tensor | None = None


def apply_if_finite(inner: Transform, max_skips: int, plan=None) -> Transform:
    """Skip the updates whose gradients hold a NaN or an inf (optax's ``apply_if_finite``).

    A skipped step returns zero updates and the inner state unchanged, bit for bit;
    an Optimizer built on it (``fmoe.optimizer``) returns the params unchanged, bit
    for bit (NaN params included). After ``max_skips`` non-finite steps in a row it
    gives up protecting: the next non-finite update is applied (and so is every one
    after it until a finite step resets the count), so a run that has gone wrong
    shows it instead of silently standing still. A training loop that would rather
    stop reads ``skipped_steps`` and stops when the first count reaches ``max_skips``.

    The check is the finiteness of the global gradient norm: one reduction, over
    every rank with ``plan`` (so every rank takes the same decision), which ``adamw``
    shares with its clipping. A gradient whose sum of squares overflows fp32 (norm
    above ~1.8e19) counts as non-finite too.

    Arguments:
        inner: the transform to protect.
        max_skips: non-finite steps in a row to skip before giving up (an int >= 1).
        plan: the Plan the gradients are laid out by (needed on several ranks).

    Returns:
        A Transform whose state is an ``ApplyIfFiniteState``.
    """
    check_int("apply_if_finite max_skips", max_skips, 1)
    norm = grad_norm_fn(plan)
    check_norm_scope(norm, "apply_if_finite")
    return apply_if_finite_sharing(inner, max_skips, StepNorm(norm))


def apply_if_finite_sharing(inner: Transform, max_skips: int, norm: StepNorm) -> Transform:
    def update(grads, state, params=None):
        with norm.held(grads) as n:  # a clip inside ``inner`` reads this norm, not a second one
            updates, inner_state = inner.update(grads, state.inner_state, params)
        apply, state = _decide(state, n, max_skips, inner_state)
        return optree.tree_map(lambda u: torch.where(apply, u, 0.0), updates), state

    return Transform(finite_init(inner.init), update)


def finite_init(inner_init):
    def init(params):
        device = device_of(params)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        yes = torch.ones((), dtype=torch.bool, device=device)
        return ApplyIfFiniteState(zero, yes, zero.clone(), yes.clone(), inner_init(params),
                                  torch.zeros((), dtype=torch.float32, device=device))

    return init


def skip_decision(state: ApplyIfFiniteState, norm: torch.Tensor, max_skips: int) -> torch.Tensor:
    """Whether this step applies: its norm is finite, or ``max_skips`` non-finite steps
    came right before it (a device bool)."""
    return torch.isfinite(norm) | (state.notfinite_count >= max_skips)


def next_finite_state(state: ApplyIfFiniteState, norm: torch.Tensor, apply: torch.Tensor,
                inner_state) -> ApplyIfFiniteState:
    """The state after a step that ``apply``-ed or not; ``inner_state`` is taken as given."""
    finite = torch.isfinite(norm)
    bad = (~finite).long()
    return ApplyIfFiniteState(notfinite_count=(state.notfinite_count + bad) * bad, last_finite=finite,
                              total_notfinite=state.total_notfinite + bad, applied=apply, inner_state=inner_state,
                              grad_norm=norm)


def _decide(state: ApplyIfFiniteState, norm: torch.Tensor, max_skips: int,
            inner_state) -> tuple[torch.Tensor, ApplyIfFiniteState]:
    """Whether this step applies, and the state after it: the inner state moves on only if so."""
    apply = skip_decision(state, norm, max_skips)
    return apply, next_finite_state(state, norm, apply, select_where(apply, inner_state, state.inner_state))


def select_where(apply: torch.Tensor, new, old):
    """``new`` where ``apply`` else ``old``, leaf by leaf. Not ``old + 0 * ...``: the old
    bits survive a skip (NaNs, whose payload arithmetic may change, and -0.0)."""
    return optree.tree_map(lambda n, o: torch.where(apply, n, o) if isinstance(n, torch.Tensor) else n, new, old)


def _finite_states(opt_state) -> list[ApplyIfFiniteState]:
    """Every ``ApplyIfFiniteState`` in an optimizer state, outermost first."""
    found = []
    for node in optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ApplyIfFiniteState)):
        if isinstance(node, ApplyIfFiniteState):
            found += [node, *_finite_states(node.inner_state)]
    return found


def update_applied(opt_state) -> torch.Tensor | None:
    """Whether every ``apply_if_finite`` in the state applied its last update (a device
    bool), or None where the state has none."""
    flags = [s.applied for s in _finite_states(opt_state)]
    return torch.stack(flags).all() if flags else None


def skipped_steps(opt_state) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-finite step counts of the (outermost) ``apply_if_finite`` in an optimizer state.

    Arguments:
        opt_state: an optimizer state holding an ``ApplyIfFiniteState`` anywhere
            (``fmoe.adamw``'s does, unless built with ``skip_nonfinite=0``).

    Returns:
        ``(in_a_row, total)``: 0-dim int64 device tensors (reading them is a host sync;
        read them when the loop syncs anyway, e.g. when it logs). Steps applied after
        giving up count too: ``in_a_row > max_skips`` means protection has ended
        (``fmoe.adamw``'s default never gives up).
    """
    found = _finite_states(opt_state)
    if not found:
        raise ValueError("skipped_steps: the optimizer state holds no apply_if_finite state (fmoe.adamw keeps "
                         "one unless built with skip_nonfinite=0; wrap any other transform in apply_if_finite)")
    return found[0].notfinite_count, found[0].total_notfinite


def _states(opt_state):
    """Every NamedTuple state in an optimizer state, outermost first (pre-order)."""
    if isinstance(opt_state, tuple) and hasattr(opt_state, "_fields"):
        yield opt_state
    if isinstance(opt_state, (tuple, list)):
        for part in opt_state:
            yield from _states(part)
    elif isinstance(opt_state, dict):
        for part in opt_state.values():
            yield from _states(part)


def last_grad_norm(opt_state) -> torch.Tensor:
    """The global gradient norm the optimizer computed in its last update, read from
    its state: the outermost state with a ``grad_norm`` (``apply_if_finite``'s, else
    ``clip_by_global_norm``'s), so a loop that logs the norm needs no second reduction.

    Arguments:
        opt_state: the state after an update of an optimizer that computes the norm
            (``fmoe.adamw`` with ``max_grad_norm`` or ``skip_nonfinite``, or any chain
            holding ``clip_by_global_norm`` or ``apply_if_finite``).

    Returns:
        A 0-dim fp32 device tensor: the norm of the gradients before clipping, NaN or
        inf for a skipped step (reading it is a host sync; read it when the loop syncs
        anyway, e.g. when it logs).
    """
    for state in _states(opt_state):
        norm = getattr(state, "grad_norm", None)
        if isinstance(norm, torch.Tensor):
            return norm
    raise ValueError("last_grad_norm: the optimizer state records no gradient norm (build the optimizer with "
                     "max_grad_norm or skip_nonfinite, or compute fmoe.global_norm(grads) yourself)")
