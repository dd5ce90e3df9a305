"""``adamw(fused=True)``: torch's fused AdamW kernel, over flat storage where there is one.

Params from ``fmoe.init`` (and grads from ``fmoe.step``) are views into a few flat
buffers (``fmoe.flat``). The kernel then runs on ranges of those buffers, a handful
of tensors per unit instead of one per leaf, and the moments live in buffers laid
out like the params'. The kernel is elementwise, so where it runs over the padding
between leaves it only touches padding (zero grads and moments stay zero), never a
neighbour.

Pure by default: the kernel updates copies (one per buffer) and the results are
views into those copies, laid out like the inputs. ``donate=True`` updates the
buffers of the params, moments and grads passed in instead: nothing is copied, and
those values are gone.
"""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from ..params import decays, trainable
from .finite import finite_init, next_finite_state, skip_decision
from .transforms import ClipState, ScaleByAdamState, ScheduleState, check_named_state, global_norm


ADAMW_STATES = ("clip", "adam", "decay", "lr", "freeze")
"""The names of ``adamw``'s states, in order (``clip`` only with ``max_grad_norm``)."""


def _storage(t: torch.Tensor):
    """``(buffer, offset)`` when ``t`` is a contiguous view into a 1-D buffer of its dtype, else None."""
    base = t._base
    if base is None or base.dim() != 1 or base.dtype != t.dtype or not base.is_contiguous() or not t.is_contiguous():
        return None
    return base, t.storage_offset() - base.storage_offset()


class _Buffer(NamedTuple):
    """Leaves that view one params buffer: ``members`` are ``(offset, leaf index)`` by offset."""

    base: torch.Tensor
    members: list


def _buffers(leaves: list) -> tuple[list[_Buffer], list[int]]:
    """Group leaves by the buffer they view; leaves viewing none (or overlapping) stand alone."""
    by_base, alone = {}, []
    for i, t in enumerate(leaves):
        found = _storage(t)
        if found is None:
            alone.append(i)
        else:
            by_base.setdefault(id(found[0]), (found[0], []))[1].append((found[1], i))
    groups = []
    for base, members in by_base.values():
        members.sort()
        filled = [(off, off + leaves[i].numel()) for off, i in members if leaves[i].numel()]
        if any(nxt < end for (_, end), (nxt, _) in zip(filled, filled[1:])):
            alone += [i for _, i in members]
        else:
            groups.append(_Buffer(base, members))
    return groups, alone


def _aligned(buf: _Buffer, leaves: list) -> torch.Tensor | None:
    """The buffer holding ``leaves`` at the offsets ``buf``'s leaves have in theirs, or None."""
    base = None
    for off, i in buf.members:
        found = _storage(leaves[i])
        if found is None or found[1] != off or (base is not None and found[0] is not base):
            return None
        base = found[0]
    if base.numel() != buf.base.numel() or base.dtype != buf.base.dtype or base.device != buf.base.device:
        return None
    return base


def _views(base: torch.Tensor, buf: _Buffer, like: list, out: list) -> None:
    """Put views of ``base`` into ``out`` where ``buf``'s leaves sit, shaped like ``like``."""
    for off, i in buf.members:
        out[i] = base[off:off + like[i].numel()].view(like[i].shape)


def _moments_like(p_leaves: list, buffers: list[_Buffer], leaves: list | None) -> list:
    """Moments in buffers laid out like the params' (zeros, or copies of ``leaves``).
    ``init`` builds them so; a state from elsewhere (a checkpoint) is moved in once."""
    out = [torch.zeros_like(p) if leaves is None else m for p, m in zip(p_leaves, leaves or p_leaves)]
    for buf in buffers:
        if leaves is not None and _aligned(buf, leaves) is not None:
            continue
        base = torch.zeros_like(buf.base)
        _views(base, buf, p_leaves, out)
        if leaves is not None:
            for _, i in buf.members:
                out[i].copy_(leaves[i])
    return out


def _runs(buf: _Buffer, leaves: list, classes: list) -> list[tuple[int, int, tuple]]:
    """``(start, end, class)``: the buffer's ranges of consecutive leaves of one class."""
    runs = []
    for off, i in buf.members:
        n = leaves[i].numel()
        if not n:
            continue
        if runs and runs[-1][2] == classes[i]:
            runs[-1] = (runs[-1][0], off + n, classes[i])
        else:
            runs.append((off, off + n, classes[i]))
    return runs


def fused_adamw(chain_init, b1, b2, eps, weight_decay, lr, max_grad_norm, plan, max_skips: int, donate: bool):
    """``adamw(fused=True)``: the named chain's state (``clip``, ``adam``, ``decay``,
    ``lr``, ``freeze``) and meaning, one fused kernel per class of leaves (trainable and
    decayed, trainable, frozen). Returns ``(init, update)``."""
    clipping = max_grad_norm is not None
    names = list(ADAMW_STATES[0 if clipping else 1:])

    def init(params):
        state = chain_init(params)
        leaves, treedef = optree.tree_flatten(params)
        buffers, _ = _buffers(leaves)
        mu, nu = (treedef.unflatten(_moments_like(leaves, buffers, None)) for _ in range(2))
        return dict(state, adam=ScaleByAdamState(state["adam"].count, mu, nu))

    def fused_update(grads, state, params, norm, apply):
        check_named_state(state, names)
        adam, schedule = state["adam"], state["lr"]
        rate = lr(schedule.count) if callable(lr) else lr
        grad_scale = None
        if clipping:  # the kernel divides gradients by grad_scale (in place)
            grad_scale = ((norm + 1e-6) / max_grad_norm).clamp(min=1.0).float()
        found_inf = None if apply is None else (~apply).float()  # a skipped step writes nothing
        paths, p_leaves, treedef = optree.tree_flatten_with_path(params)
        g_leaves = treedef.flatten_up_to(grads)
        device = p_leaves[0].device
        if isinstance(rate, torch.Tensor):  # a schedule's rate stays on the device
            rate = rate.to(device=device, dtype=torch.float32)
        classes = [(True, decays(path[-1])) if trainable(path[-1]) else (False, False) for path in paths]
        buffers, alone = _buffers(p_leaves)
        m_leaves = _moments_like(p_leaves, buffers, treedef.flatten_up_to(adam.mu))
        v_leaves = _moments_like(p_leaves, buffers, treedef.flatten_up_to(adam.nu))
        new_p, new_m, new_v = list(p_leaves), list(m_leaves), list(v_leaves)
        step = (adam.count + 1).to(device=device, dtype=torch.float32)

        def run(work: dict) -> None:
            """The kernel on ``{class: (params, grads, mus, nus)}``. Issued per buffer as
            soon as it is ready, so the GPU updates one while the host sorts out the next
            (the kernel is elementwise: how the tensors are grouped changes no value)."""
            for (updated, decay), (ps, gs, ms, vs) in work.items():
                torch._fused_adamw_(ps, gs, ms, vs, [], [step] * len(ps), lr=rate if updated else 0.0,
                                    beta1=b1, beta2=b2, weight_decay=weight_decay if decay else 0.0, eps=eps,
                                    amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)

        def own(t):  # what the kernel may write into
            return t if donate else t.clone()

        for buf in buffers:
            g_base = _aligned(buf, g_leaves)
            if g_base is None or g_base.dtype != torch.float32:
                alone += [i for _, i in buf.members]
                continue
            p, m, v = own(buf.base), own(_aligned(buf, m_leaves)), own(_aligned(buf, v_leaves))
            g = own(g_base) if clipping else g_base
            work = {}
            for lo, hi, cls in _runs(buf, p_leaves, classes):
                # frozen leaves keep their params: the kernel updates a scratch copy
                p_run = p[lo:hi] if cls[0] else p[lo:hi].clone()
                for lst, t in zip(work.setdefault(cls, ([], [], [], [])), (p_run, g[lo:hi], m[lo:hi], v[lo:hi])):
                    lst.append(t)
            run(work)
            for base, out in ((p, new_p), (m, new_m), (v, new_v)):
                _views(base, buf, p_leaves, out)
        work = {}
        for i in alone:  # leaves outside flat storage: one copy each, never donated
            p_copy = p_leaves[i].clone()
            new_m[i], new_v[i] = m_leaves[i].clone(), v_leaves[i].clone()
            lists = work.setdefault(classes[i], ([], [], [], []))
            for lst, t in zip(lists, (p_copy, g_leaves[i].to(torch.float32, copy=True), new_m[i], new_v[i])):
                lst.append(t)
            if classes[i][0]:
                new_p[i] = p_copy
        run(work)
        advance = 1 if apply is None else apply.long()  # a skipped step leaves the counts too
        new_state = dict(state, adam=ScaleByAdamState(adam.count + advance, treedef.unflatten(new_m),
                                                      treedef.unflatten(new_v)),
                         lr=ScheduleState(schedule.count + advance))
        if clipping and apply is None:  # the chain's clip records the norm (apply_if_finite does, when skipping)
            new_state["clip"] = ClipState(norm)
        return treedef.unflatten(new_p), new_state

    def update(grads, state, params):
        if not max_skips:
            return fused_update(grads, state, params, global_norm(grads, plan) if clipping else None, None)
        norm = global_norm(grads, plan)  # once, for the finite check and the clipping
        apply = skip_decision(state, norm, max_skips)
        new_params, inner_state = fused_update(grads, state.inner_state, params, norm, apply)
        return new_params, next_finite_state(state, norm, apply, inner_state)

    return (finite_init(init) if max_skips else init), update
