"""Optimizers as optax-style pairs of pure functions, and the expert-bias update.

A ``Transform`` is ``(init(params) -> state, update(grads, state, params) ->
(updates, state))``; ``chain`` and ``named_chain`` compose them. ``Optimizer`` wraps a transform so that
``update`` returns new params: ``params, state = opt.update(grads, state, params)``.
Nothing is modified in place, except what ``adamw(fused=True, donate=True)`` and
``update_expert_bias(donate=True)`` are handed;
every state is a NamedTuple of tensors (a ``named_chain``'s a dict of them by name).

``transforms.py``: the transforms, ``global_norm`` (and the ``NormFn`` the optimizers hold in
place of the plan), schedules, ``update_expert_bias``;
``finite.py``: ``apply_if_finite`` (skip non-finite steps), ``skipped_steps`` and
``last_grad_norm`` (the norm the last update computed, read from the state);
``nonfinite.py``: ``adamw``'s default, every non-finite step skipped and counted;
``optimizers.py``: ``optimizer``, ``adamw`` (a chain, or ``fused=True``: ``fused.py``,
``adamw_kernel.py``'s per-leaf kernel on CUDA, torch's multi-tensor fused kernel
elsewhere, optionally donating its inputs) and ``migrate_state``
(a state saved by an older fmoe into the current form; ``fmoe.load`` applies it).
"""

from .finite import ApplyIfFiniteState, apply_if_finite, last_grad_norm, skipped_steps
from .optimizers import adamw, migrate_state, optimizer
from .transforms import (ClipState, EmptyState, Optimizer, ScaleByAdamState, Schedule, ScheduleState, Transform,
                         add_decayed_weights, chain, clip_by_global_norm, freeze, global_norm, named_chain,
                         scale_by_adam, scale_by_learning_rate, update_expert_bias, warmup_cosine)

__all__ = ["ApplyIfFiniteState", "ClipState", "EmptyState", "Optimizer", "ScaleByAdamState", "Schedule",
           "ScheduleState", "Transform", "add_decayed_weights", "apply_if_finite", "adamw", "chain",
           "clip_by_global_norm", "freeze", "global_norm", "last_grad_norm", "migrate_state", "named_chain",
           "optimizer", "scale_by_adam", "scale_by_learning_rate", "skipped_steps", "update_expert_bias",
           "warmup_cosine"]
