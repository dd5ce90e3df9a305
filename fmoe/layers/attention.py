"""Causal self-attention with rotary position embeddings, through SDPA."""

import torch
import torch.nn.functional as F
from einops import rearrange

from ..config import ModelConfig
from .precision import upcast


def rope_tables(seq: int, head_dim: int, theta: float, device=None):
    """``cos, sin`` of shape ``[S, head_dim / 2]`` in fp64 for positions ``0..S-1``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs ``(i, i + d/2)`` by the position's angle (the "rotate-half" form)."""
    x1, x2 = upcast(x_BHSd).chunk(2, dim=-1)
    cos_Sh, sin_Sh = cos_Sh.to(x1.dtype), sin_Sh.to(x1.dtype)
    out = torch.cat([x1 * cos_Sh - x2 * sin_Sh, x2 * cos_Sh + x1 * sin_Sh], dim=-1)
    return out.to(x_BHSd.dtype)


def attention(p: dict, x_BSD: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Multi-head causal attention of already-normalised ``x``; no residual.

    Arguments:
        p: one layer's ``attn`` subtree (``qkv [D, 3D]``, ``out [D, D]``).
        x_BSD: ``[B, S, D]`` normalised activations.
        cfg: the ModelConfig (heads, rope_theta).

    Returns:
        ``[B, S, D]``, ``attention(x) @ out``.
    """
    qkv = x_BSD @ p["qkv"]
    q, k, v = rearrange(qkv, "b s (three h d) -> three b h s d", three=3, h=cfg.heads)
    cos, sin = rope_tables(x_BSD.shape[1], cfg.head_dim, cfg.rope_theta, x_BSD.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return rearrange(o, "b h s d -> b s (h d)") @ p["out"]
