"""The whole transformer as pure functions of the params pytree."""

import optree
import torch
import torch.nn.functional as F

from ..backends import bound_backend
from ..batch import IGNORE
from ..config import ModelConfig
from ..params import FP32_LEAVES
from .attention import KVSlot
from .block_masks import Documents, documents
from .fp8 import PLAIN, Gemms
from .loss import head_weight  # noqa: F401  (re-exported)
from .moe import MoEStats
from .nodes import bound_kernels, embed_node, layer_forward
from .norm import rms_norm
from .precision import upcast


def cast_for_compute(params: dict, dtype: torch.dtype) -> dict:
    """The pytree (the params, or a subtree of them) with every leaf in ``dtype``
    except those named in ``fmoe.params.FP32_LEAVES`` (kept fp32).

    The casts are differentiable: gradients flow back to the fp32 leaves as fp32.
    """
    def cast(path, leaf):
        return leaf if path[-1] in FP32_LEAVES else leaf.to(dtype)

    return optree.tree_map_with_path(cast, params)


def block(p: dict, h_BSD: torch.Tensor, cfg: ModelConfig, backend: str = "torch", ep=None,
          kv: KVSlot | None = None, gemms: Gemms = PLAIN, docs: Documents | None = None, layer: int = 0):
    """One pre-norm layer: ``h += attn(norm(h))``, ``h += moe(norm(h))`` (a dense layer:
    its ``mlp``), the nodes of ``fmoe.layers.nodes`` in order (``layer_forward``);
    decoding passes its cache as ``kv``, packed rows their ``docs``.

    ``ep`` is the layer's ExpertParallel group (None: this rank holds every expert);
    ``gemms`` the products its weights enter (``fmoe.layers.fp8``); ``layer`` its index
    (which picks its sliding window, ``cfg.layer_window``).

    Returns:
        ``(h_BSD, MoEStats)`` (a dense layer: None for the stats).
    """
    kernels = bound_kernels(gemms, bound_backend(backend))
    return layer_forward(p, h_BSD, cfg, kernels, ep, docs, site=(layer, 0), kv=kv, gemms=gemms)


def forward(params: dict, tokens_BS: torch.Tensor, cfg: ModelConfig, backend: str = "torch",
            gemms: Gemms = PLAIN, segments_BS: torch.Tensor | None = None):
    """Logits for every position.

    Arguments:
        params: the pytree, already in the compute dtype (see ``cast_for_compute``).
        tokens_BS: ``[B, S]`` token ids.
        cfg: the ModelConfig.
        backend: expert matmul backend.
        gemms: the layers' and the head's products (``Plan.fp8``: ``fmoe.layers.fp8``).
        segments_BS: ``[B, S]`` a document id per position (packed documents), or None.

    Returns:
        ``(logits_BSV, stats)``: logits in the compute dtype, one MoEStats per MoE layer.
    """
    kernels = bound_kernels(gemms, bound_backend(backend))
    h = embed_node(params, tokens_BS, kernels)
    docs = None if segments_BS is None else documents(segments_BS, cfg.any_window)
    stats = []
    for i, p in enumerate(params["layers"]):
        h, s = layer_forward(p, h, cfg, kernels, docs=docs, site=(i, 0))
        if s is not None:
            stats.append(s)
    h = rms_norm(h, params["final_norm"], cfg.norm_eps)
    return gemms.head(h, head_weight(params)), stats


def lm_loss_sum(params: dict, tokens_BS1: torch.Tensor, cfg: ModelConfig, backend: str = "torch",
                gemms: Gemms = PLAIN, targets_BS: torch.Tensor | None = None,
                segments_BS: torch.Tensor | None = None):
    """Summed next-token cross-entropy (fp32) of ``tokens[:, :-1] -> tokens[:, 1:]``
    (``backend``, ``gemms``, ``segments_BS``: as ``forward``).

    ``targets_BS``: the targets, ``fmoe.batch.IGNORE`` where one does not count (a
    ``Batch``'s ``targets``); default ``tokens[:, 1:]``, all of them.

    Returns:
        ``(ce_sum, stats)``: a fp32 scalar summed over the counted targets, and the
        per-layer MoEStats.
    """
    logits, stats = forward(params, tokens_BS1[:, :-1], cfg, backend, gemms, segments_BS)
    targets = tokens_BS1[:, 1:] if targets_BS is None else targets_BS
    ce = F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE)
    return ce, stats


def stack_stats(stats: list[MoEStats]) -> MoEStats:
    """Per-layer MoEStats -> one MoEStats whose fields have a leading layer axis."""
    return MoEStats(*(torch.stack(field) for field in zip(*stats)))
