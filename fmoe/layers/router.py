"""Token-choice top-k routing: scores, expert-bias selection, aux losses."""

from typing import NamedTuple

import torch

from ..config import ModelConfig
from .precision import upcast


class Routing(NamedTuple):
    """What the router decided for ``T`` tokens.

    Attributes:
        indices_TK: ``[T, K]`` chosen experts (long), best first.
        probs_TK: ``[T, K]`` fp32 weights applied to those experts' outputs.
        counts_E: ``[E]`` assignments per expert (long).
        aux_loss: load-balancing loss ``E * sum_e f_e * P_e`` (fp32 scalar, unscaled).
        z_loss: ``mean(logsumexp(logits)^2)`` (fp32 scalar, unscaled).
    """

    indices_TK: torch.Tensor
    probs_TK: torch.Tensor
    counts_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (long ``[E]``) of any-shaped ``indices``.

    A scatter-add of ones, not ``torch.bincount``: on CUDA bincount reads the indices'
    min and max on the host, a sync that would stall every layer of every microbatch.
    Integer sums are exact, so the result does not depend on the order of the adds.
    """
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def limit_to_groups(selection_TE: torch.Tensor, groups: int, kept_groups: int) -> torch.Tensor:
    """Selection scores with every expert outside each token's ``kept_groups`` best
    groups set to ``-inf``, so that the top-k cannot pick it (DeepSeek-V3's group-limited
    routing).

    Arguments:
        selection_TE: ``[T, E]`` selection scores (``E`` divisible by ``groups``, at least
            2 experts a group).
        groups: equal groups of consecutive experts.
        kept_groups: groups each token keeps.

    Returns:
        ``[T, E]``: the kept groups' scores unchanged, the others ``-inf``.
    """
    T, E = selection_TE.shape
    selection_TGe = selection_TE.view(T, groups, E // groups)
    # DeepSeek-V3's rule: the sum of a group's 2 best, so one outlier expert alone does
    # not carry its group
    group_scores_TG = selection_TGe.topk(2, dim=-1).values.sum(-1)
    kept_TG = group_scores_TG.topk(kept_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, kept_TG, True)
    return selection_TGe.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)


def route(p: dict, x_TD: torch.Tensor, cfg: ModelConfig) -> Routing:
    """Route normalised tokens to ``cfg.topk`` experts.

    Scores are ``softmax`` or ``sigmoid`` of fp32 logits. The expert bias is added to
    the scores for *selection only*: it never weights an output and gets no gradient
    (it is updated from counts by ``fmoe.update_expert_bias``). With ``expert_groups >
    1`` a token selects only inside its ``topk_groups`` best groups (``limit_to_groups``).
    The chosen experts' scores, renormalised if ``norm_topk_prob``, times
    ``routed_scaling``, are the probabilities.

    Arguments:
        p: one layer's ``moe`` subtree (``router [D, E]``, ``expert_bias [E]``, optional
            ``router_bias [E]``).
        x_TD: ``[T, D]`` normalised tokens.
        cfg: the ModelConfig.

    Returns:
        A Routing.
    """
    E, K = cfg.experts, cfg.topk
    logits_TE = upcast(x_TD) @ upcast(p["router"])
    if "router_bias" in p:
        logits_TE = logits_TE + upcast(p["router_bias"])
    mode = cfg.score_func_mode
    scores_TE = logits_TE.sigmoid() if mode.independent else logits_TE.softmax(-1)
    top_logits = mode.selects_by_logit  # chosen by logit, weighted by a softmax over the k
    selection_TE = (logits_TE if top_logits else scores_TE).detach() + upcast(p["expert_bias"].detach())
    if cfg.expert_groups > 1:
        selection_TE = limit_to_groups(selection_TE, cfg.expert_groups, cfg.topk_groups)
    indices_TK = selection_TE.topk(K, dim=-1, sorted=True).indices
    probs_TK = (logits_TE if top_logits else scores_TE).gather(-1, indices_TK)
    if top_logits:
        probs_TK = probs_TK.softmax(-1)
    if cfg.norm_topk_prob:
        probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True).clamp_min(1e-20)
    if cfg.routed_scaling != 1.0:
        probs_TK = probs_TK * cfg.routed_scaling
    counts_E = expert_counts(indices_TK, E)
    token_share_E = counts_E.to(scores_TE.dtype) / indices_TK.numel()
    score_share_TE = scores_TE / scores_TE.sum(-1, keepdim=True) if mode.independent else scores_TE
    aux = E * (token_share_E * score_share_TE.mean(0)).sum()
    z = torch.logsumexp(logits_TE, dim=-1).square().mean()
    return Routing(indices_TK, probs_TK, counts_E, aux, z)


def router_loss(aux_loss: torch.Tensor, z_loss: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The router's term of the objective: ``aux_loss_coef * aux + z_loss_coef * z`` (of
    one layer, or of sums over layers)."""
    return cfg.aux_loss_coef * aux_loss + cfg.z_loss_coef * z_loss


def router_share(aux_loss: torch.Tensor, z_loss: torch.Tensor, cfg: ModelConfig, parts: int) -> torch.Tensor | None:
    """One part's share of the router's term: ``router_loss / parts`` (the objective
    averages it over the microbatches of every rank); None when both coefficients are 0."""
    if not (cfg.aux_loss_coef or cfg.z_loss_coef):
        return None
    return router_loss(aux_loss, z_loss, cfg) / parts
