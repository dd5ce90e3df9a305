"""The routed experts' own tensor parallelism (``Plan.etp``): each expert's hidden width
split over the ``etp`` ranks of an etp group, which hold different tokens.

After the expert-parallel exchange a rank holds the rows its experts compute. The etp
group's rows are gathered (rank ``j`` sends its rows to every rank: an all-to-all with
uneven splits, since dropless routing gives each rank its own count), put in expert
order, and every rank runs its ``F / etp`` hidden units on all of them; the partial
outputs go back to the rows' ranks and are summed there, in rank order, so every
rank's rows get the same sum. ``fc2``'s bias, which every etp rank holds whole, is
added once, on the rank's own rows, and its gradient summed over the group.
"""

from __future__ import annotations

from typing import Callable

import torch

from .expert_parallel import expert_major, segments_of
from .experts import add_expert_bias
from .tensor_parallel import TensorParallel, sum_over_copies


def _gather_rows(x: torch.Tensor, mine: int, every: list, etp: TensorParallel) -> torch.Tensor:
    """Every etp rank's rows (``every[j]`` of rank ``j``), source-major."""
    return etp.exchange(torch.cat([x] * etp.size), every, [mine] * etp.size)


def _sum_back(y: torch.Tensor, mine: int, every: list, etp: TensorParallel) -> torch.Tensor:
    """Each source rank's partial rows of ``y`` (source-major) back to it, summed there."""
    parts = etp.exchange(y, [mine] * etp.size, every)
    return parts.view(etp.size, mine, *y.shape[1:]).sum(0)


def experts_over_etp(experts: Callable, etp: TensorParallel) -> Callable:
    """A Kernels ``experts`` entry (``(site, p, rows_RD, segs, cfg, row_probs_R, deferred)
    -> y_RD``) whose ``p`` is this rank's hidden-unit slice of its experts, computing the
    full output of this rank's rows together with the rest of its etp group."""
    def run(site, p: dict, rows_RD: torch.Tensor, segs, cfg, row_probs_R=None, deferred=None):
        rows_E = segs.rows_E
        if segs.capacity is not None:  # every rank the same, known without asking
            counts_PE = rows_E.expand(etp.size, -1)
        else:
            counts_PE = etp.stack(rows_E)
        every = counts_PE.sum(1).tolist()  # the host read the uneven exchange needs
        mine, total = rows_RD.shape[0], sum(every)
        order, inverse = expert_major(counts_PE, total)
        capacity = None if segs.capacity is None else segs.capacity * etp.size
        together = segments_of(counts_PE.sum(0), total, capacity)
        rows = _gather_rows(rows_RD, mine, every, etp).index_select(0, order)
        probs = None
        if row_probs_R is not None:
            probs = _gather_rows(row_probs_R[:, None], mine, every, etp)[:, 0].index_select(0, order)
        inner = {name: w for name, w in p.items() if name != "fc2_bias"}
        y = experts(site, inner, rows, together, cfg, probs, deferred).index_select(0, inverse)
        y = _sum_back(y, mine, every, etp)
        if "fc2_bias" in p:
            y = add_expert_bias(y, sum_over_copies(p["fc2_bias"], etp, 0, etp.size), segs)
        return y

    return run
