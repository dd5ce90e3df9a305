"""The MoE layer: route, permute, grouped experts, unpermute (+ shared expert)."""

from typing import NamedTuple

import torch

from ..config import ModelConfig
from .dispatch import capacity_rows, make_dispatch, permute, row_weights, unpermute
from .expert_parallel import ExpertParallel, combine, dispatch, plan_exchange
from .experts import dense_mlp, expert_mlp
from .router import route


class MoEStats(NamedTuple):
    """Per-layer routing statistics (tensors, no host sync).

    Attributes:
        counts_E: tokens routed to each expert (before any capacity drop).
        aux_loss, z_loss: unscaled router losses (fp32 scalars, differentiable).
        padded_rows: permuted rows holding no token (long scalar).
        dropped_tokens: assignments dropped by the capacity (long scalar; 0 when dropless).
        a2a_bytes: bytes this rank sent in the layer's forward dispatch + combine.
    """

    counts_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    padded_rows: torch.Tensor
    dropped_tokens: torch.Tensor
    a2a_bytes: torch.Tensor


def moe(p: dict, x_TD: torch.Tensor, cfg: ModelConfig, backend: str = "torch", ep: ExpertParallel | None = None):
    """Top-k MoE of already-normalised tokens; no residual.

    Dropless unless ``cfg.capacity_factor > 0`` (then each expert takes at most
    ``capacity_rows(T, K, E, factor)`` of this rank's assignments, first come first
    served in token order, and drops the rest).

    Arguments:
        p: one layer's ``moe`` subtree; under expert parallelism ``experts`` holds only
            this rank's ``E / ep`` experts.
        x_TD: ``[T, D]`` normalised tokens.
        cfg: the ModelConfig.
        backend: expert matmul backend (``torch`` or ``loop``).
        ep: the expert-parallel group, or None when this rank holds every expert.

    Returns:
        ``(y_TD, stats)``: the layer output in ``x``'s dtype and a MoEStats.
    """
    T, K = x_TD.shape[0], cfg.topk
    r = route(p, x_TD, cfg)
    capacity = capacity_rows(T, K, cfg.experts, cfg.capacity_factor, cfg.pad_multiple) \
        if cfg.capacity_factor else None
    d = make_dispatch(r.indices_TK, cfg.experts, 0 if capacity else cfg.pad_multiple, capacity)
    x_RD = permute(x_TD, d)
    probs_R = row_weights(r.probs_TK, d)[:, None] if cfg.prob_placement == "activation" else None
    sent = torch.zeros((), dtype=torch.long, device=x_TD.device)
    if ep is None or ep.group.size == 1:
        segments = d
    else:
        ex = plan_exchange(d.rows_E, capacity, ep)
        sending = dispatch(x_RD, ex, ep, capacity)
        if probs_R is not None:
            probs_R = dispatch(probs_R, ex, ep, capacity).wait()
        x_RD = sending.wait()
        segments = ex.segments
        sent = sent + 2 * d.num_rows * x_TD.shape[1] * x_TD.element_size()
    y_RD = expert_mlp(p["experts"], x_RD, segments, cfg, None if probs_R is None else probs_R[:, 0], backend)
    if ep is not None and ep.group.size > 1:
        y_RD = combine(y_RD, ex, ep, capacity).wait()
    y_TD = unpermute(y_RD, d, None if probs_R is not None else r.probs_TK)
    if "shared" in p:
        y_TD = y_TD + dense_mlp(p["shared"], x_TD, cfg)
    stats = MoEStats(r.counts_E, r.aux_loss, r.z_loss, torch.zeros_like(sent) + d.padded_rows, d.dropped, sent)
    return y_TD, stats
