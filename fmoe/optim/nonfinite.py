"""``adamw``'s default (``skip_nonfinite=None``): every step whose gradients hold a NaN
or an inf is skipped, and counted.

A skipped step leaves params, moments and counts as they were, bit for bit, as
``apply_if_finite`` does, but never gives up. Its record is an ``ApplyIfFiniteState``
with no inner state (``fmoe.skipped_steps`` reads it), kept in Adam's state
(``ScaleByAdamState.skips``), so the rest of the state keeps the layout it had before
skipping was the default (``state["adam"]``, ``state["lr"]`` ...). A state saved before
then has no record: its first update starts one.

The decision is a device bool that every rank agrees on, without a host read: with
clipping, the finiteness of the global norm the clip computes anyway; without, of this
rank's own norm, and on several ranks of one all-reduced flag over the world group
(finiteness needs no shard spec: an element counted on two ranks is as finite as on one).
A finite step computes exactly what it did before (``torch.where`` selects its values).
"""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

from .finite import ApplyIfFiniteState, select_where
from .transforms import ClipState, NormFn, ScaleByAdamState, StepNorm, Transform, device_of, global_norm


def fresh_record(device) -> ApplyIfFiniteState:
    """No step seen yet: counts 0, the last step finite and applied."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    yes = torch.ones((), dtype=torch.bool, device=device)
    return ApplyIfFiniteState(zero, yes, zero.clone(), yes.clone(), inner_state=None)


def with_fresh_record(state: dict, params) -> dict:
    """A new ``adamw`` chain state (``{"adam": ..., ...}``) with its record."""
    return join_record(state, fresh_record(device_of(params)))


def split_record(state, params):
    """``(record, state without it)``. A state saved before the record existed gets a
    fresh one; anything that is not an adamw state comes back as it is, with None, for
    the chain to say what is wrong with it."""
    adam = state.get("adam") if isinstance(state, dict) else None
    if not isinstance(adam, ScaleByAdamState):
        return None, state
    record = adam.skips if adam.skips is not None else fresh_record(device_of(params))
    return record, dict(state, adam=adam._replace(skips=None))


def join_record(state: dict, record: ApplyIfFiniteState) -> dict:
    return dict(state, adam=state["adam"]._replace(skips=record))


def next_record(record: ApplyIfFiniteState, applied: torch.Tensor) -> ApplyIfFiniteState:
    """The record after a step that was finite (``applied``) or skipped."""
    bad = (~applied).long()
    return record._replace(notfinite_count=(record.notfinite_count + bad) * bad, last_finite=applied,
                           total_notfinite=record.total_notfinite + bad, applied=applied)


def _several_ranks(norm_fn: NormFn) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return (norm_fn.world if norm_fn.world is not None else dist.get_world_size()) > 1


def finite_everywhere(grads, norm: torch.Tensor | None, norm_fn: NormFn) -> torch.Tensor:
    """Whether the step's gradients are finite on every rank (a 0-dim device bool).

    Arguments:
        grads: this rank's gradients.
        norm: the global norm already computed for clipping (the same on every rank),
            or None: this rank's norm is computed, and on several ranks a flag is
            all-reduced over the world group.
        norm_fn: the optimizer's NormFn (its ``world`` says whether there are several ranks).
    """
    if norm is not None:
        return torch.isfinite(norm)
    finite = torch.isfinite(global_norm(grads))
    if _several_ranks(norm_fn):
        bad = (~finite).float()
        dist.all_reduce(bad)  # a sum: NaN-free, unlike a max over NaNs
        finite = bad == 0
    return finite


def skip_every_nonfinite(chain: Transform, norm: StepNorm, clipping: bool) -> Transform:
    """``adamw``'s chain (a ``named_chain`` holding ``adam``) made to skip every
    non-finite step. ``norm``: the one its clip reads (when ``clipping``)."""

    def init(params):
        return with_fresh_record(chain.init(params), params)

    def update(grads, state, params=None):
        record, state = split_record(state, params)
        if clipping:
            with norm.held(grads) as n:  # the clip reads this norm, not a second one
                updates, new = chain.update(grads, state, params)
        else:
            n, (updates, new) = None, chain.update(grads, state, params)
        applied = finite_everywhere(grads, n, norm.norm)
        new = select_where(applied, new, state)
        if clipping:  # the norm of this step's gradients, skipped or not (the fused update's too)
            new["clip"] = ClipState(n)
        updates = optree.tree_map(lambda u: torch.where(applied, u, 0.0), updates)
        return updates, join_record(new, next_record(record, applied))

    return Transform(init, update)
