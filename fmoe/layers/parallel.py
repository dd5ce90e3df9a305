"""The groups a step's kernels reach other ranks with, bound into its Kernels once.

``Parallel`` holds this rank's tensor-, context- and expert-tensor-parallel groups
(None where the plan's degree is 1). ``with_parallel(kernels, par)`` returns Kernels
whose entries take the same arguments as without and pass the groups on: the
attention gets its rank's heads (``local_model``; a copied key/value head's gradient
summed over its holders), ``tp`` and ``cp``; the shared expert and dense MLPs, the head and
the embedding get ``tp``; the experts run over their etp group
(``experts_over_etp``). With every degree 1 it is the Kernels themselves, so a plan
without these dimensions runs exactly the functions it ran before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config_fields import QkNorm
from .context_parallel import ContextParallel
from .expert_tensor_parallel import experts_over_etp
from .nodes import Kernels
from .tensor_parallel import TensorParallel, kv_copies, local_model, sum_over_copies


class Parallel(NamedTuple):
    """This rank's groups for the kernels (``fmoe.resolve.Setup.parallel``).

    Attributes:
        tp: tensor parallelism (``Plan.tp``), or None.
        cp: context parallelism (``Plan.cp``), or None.
        etp: the experts' tensor parallelism (``Plan.etp``), or None.
    """

    tp: TensorParallel | None = None
    cp: ContextParallel | None = None
    etp: TensorParallel | None = None

    def recording(self, events: list) -> "Parallel":
        """The same groups, each recording its collectives into ``events`` (an eager
        step's; a compiled kernel takes its groups as they are: a changing list inside
        them would make it compile again)."""
        return Parallel(*(None if g is None else g.recording(events) for g in self))


ALONE = Parallel()


def _with_kv_copies(p: dict, cfg, tp: TensorParallel, copies: int) -> dict:
    """``p`` (a layer's subtree) with the key/value columns that ``copies`` ranks hold
    marked so their gradient is summed over them (``sum_over_copies``)."""
    attn, first = dict(p["attn"]), cfg.q_width
    for name in ("qkv", "qkv_bias"):
        if name in attn and isinstance(attn[name], torch.Tensor):  # an Adapted base holds no gradient
            attn[name] = sum_over_copies(attn[name], tp, first, copies)
    if "k_norm" in attn and cfg.qk_norm_mode is QkNorm.FULL:
        attn["k_norm"] = sum_over_copies(attn["k_norm"], tp, 0, copies)
    return dict(p, attn=attn)


def with_parallel(kernels: Kernels, par: Parallel) -> Kernels:
    """``kernels`` with ``par``'s groups bound in (themselves when ``par`` is ``ALONE``)."""
    if par == ALONE:
        return kernels
    changes = {}
    tp, cp = par.tp, par.cp
    if tp is not None or cp is not None:
        attn = kernels.attn

        def attn_parallel(site, p, h_BSD, cfg, docs=None, window=0):
            if tp is not None:
                cfg, copies = local_model(cfg, tp.size), kv_copies(cfg, tp.size)
                if copies > 1:
                    p = _with_kv_copies(p, cfg, tp, copies)
            chunks = None if cp is None else cp.for_chunks_of(h_BSD.shape[1] * (1 if tp is None else tp.size))
            return attn(site, p, h_BSD, cfg, docs, window, tp=tp, cp=chunks)

        changes["attn"] = attn_parallel
    if tp is not None:
        shared, head, embed = kernels.shared, kernels.head, kernels.embed
        changes.update(shared=lambda site, p, x_TD, cfg: shared(site, p, x_TD, cfg, tp=tp),
                       head=lambda site, w, h_BSD, targets, eps, chunk=0: head(site, w, h_BSD, targets, eps, chunk,
                                                                               tp=tp),
                       embed=lambda site, w, tokens: embed(site, w, tokens, tp=tp))
    if par.etp is not None:
        changes["experts"] = experts_over_etp(kernels.experts, par.etp)
    return kernels._replace(**changes)
