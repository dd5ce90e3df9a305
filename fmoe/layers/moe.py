"""The MoE layer: route, permute, grouped experts, unpermute (+ shared expert)."""

from typing import NamedTuple

import torch

from ..config import ModelConfig
from .dispatch import make_dispatch, permute, row_weights, unpermute
from .experts import dense_mlp, expert_mlp
from .router import route


class MoEStats(NamedTuple):
    """Per-layer routing statistics (tensors, no host sync).

    Attributes:
        counts_E: tokens routed to each expert.
        aux_loss, z_loss: unscaled router losses (fp32 scalars, differentiable).
        padded_rows: rows added by ``pad_multiple`` (long scalar).
        dropped_tokens: assignments not computed (long scalar; 0 when dropless).
    """

    counts_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    padded_rows: torch.Tensor
    dropped_tokens: torch.Tensor


def moe(p: dict, x_TD: torch.Tensor, cfg: ModelConfig, backend: str = "torch"):
    """Dropless top-k MoE of already-normalised tokens; no residual.

    Arguments:
        p: one layer's ``moe`` subtree.
        x_TD: ``[T, D]`` normalised tokens.
        cfg: the ModelConfig.
        backend: expert matmul backend (``torch`` or ``loop``).

    Returns:
        ``(y_TD, stats)``: the layer output in ``x``'s dtype and a MoEStats.
    """
    r = route(p, x_TD, cfg)
    d = make_dispatch(r.indices_TK, cfg.experts, cfg.pad_multiple)
    x_RD = permute(x_TD, d)
    if cfg.prob_placement == "activation":
        y_RD = expert_mlp(p["experts"], x_RD, d, cfg, row_weights(r.probs_TK, d), backend)
        y_TD = unpermute(y_RD, d)
    else:
        y_RD = expert_mlp(p["experts"], x_RD, d, cfg, None, backend)
        y_TD = unpermute(y_RD, d, r.probs_TK)
    if "shared" in p:
        y_TD = y_TD + dense_mlp(p["shared"], x_TD, cfg)
    zero = torch.zeros((), dtype=torch.long, device=x_TD.device)
    stats = MoEStats(r.counts_E, r.aux_loss, r.z_loss, zero + d.padded_rows, zero)
    return y_TD, stats
