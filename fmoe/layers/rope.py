"""Rotary position embeddings: the cos/sin tables (plain, or YaRN's blended frequencies
and attention factor), the rotate-half rotation (one fused Triton kernel on CUDA, whole
heads or their first ``rope_dims`` features) and DeepSeek's interleaved pairs regrouped into halves."""

import math

import torch
from einops import rearrange

from ..config import ModelConfig, Yarn
from . import triton_kernels
from .precision import upcast


def rope_tables(seq: int, head_dim: int, theta: float, device=None, start: int = 0,
                positions_BS: torch.Tensor | None = None, yarn: Yarn | None = None):
    """``cos, sin`` of shape ``[S, head_dim / 2]`` in fp64 for positions ``start..start+S-1``;
    with ``positions_BS`` (packed documents), ``[B, 1, S, head_dim / 2]`` for those positions.
    ``head_dim``: the features rotated (``ModelConfig.rope_dims``, fewer than a head's
    under partial RoPE), which set the frequencies ``theta ** (-2i / head_dim)``.
    ``yarn`` (``ModelConfig.yarn``): YaRN's frequencies instead, and cos/sin times its
    ``cos_factor``, as transformers' rotary embedding with ``rope_type="yarn"``."""
    if yarn is None:
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    else:
        inv_freq = yarn_inverse_frequencies(head_dim, theta, yarn, device)
    if positions_BS is not None:
        angles = positions_BS.to(torch.float64)[:, None, :, None] * inv_freq
    else:
        positions = torch.arange(start, start + seq, device=device, dtype=torch.float64)
        angles = positions[:, None] * inv_freq[None, :]
    if yarn is None:
        return angles.cos(), angles.sin()
    return angles.cos() * yarn.cos_factor, angles.sin() * yarn.cos_factor


def yarn_inverse_frequencies(dims: int, theta: float, yarn: Yarn, device=None) -> torch.Tensor:
    """YaRN's ``dims / 2`` inverse frequencies in fp64 on ``device`` (transformers'
    ``_compute_yarn_parameters``): pair ``i`` keeps ``theta ** (-2i / dims)``
    (extrapolates) where it turns more than ``beta_fast`` times over ``original_max``
    positions, takes it divided by ``factor`` (interpolates) where it turns fewer than
    ``beta_slow`` times, and blends the two linearly between. Made by tensor operations
    on the device from Python numbers: no host-to-device copy, which a CUDA graph's
    capture refuses."""
    low, high = _yarn_ramp_ends(dims, theta, yarn)
    if low == high:
        high += 0.001  # as transformers: an empty ramp would divide by zero
    wavelength = theta ** (torch.arange(0, dims, 2, device=device, dtype=torch.float64) / dims)  # over 2 pi
    ramp = ((torch.arange(dims // 2, device=device, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 below the ramp, 0 above
    return (1.0 / (yarn.factor * wavelength)) * (1.0 - keep) + (1.0 / wavelength) * keep


def _yarn_ramp_ends(dims: int, theta: float, yarn: Yarn) -> tuple[float, float]:
    """The pair indices where YaRN's ramp from keeping to interpolating starts and ends."""
    def pair_turning(rotations: float) -> float:
        # the (fractional) pair index whose wavelength fits `rotations` times in original_max
        return dims * math.log(yarn.original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(yarn.beta_fast), pair_turning(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dims - 1)


def apply_rope(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs ``(i, i + r/2)`` by the position's angle (the "rotate-half" form),
    in fp32 whatever x's dtype (on CUDA with Triton: one fused kernel, the same math).
    ``r = 2h`` (``h``: the tables' width) is ``d`` or, partial RoPE, fewer: the features
    from ``r`` on pass unchanged."""
    if triton_kernels.rope_fusable(x_BHSd, cos_Sh):
        return triton_kernels.rope_BHSd(x_BHSd, cos_Sh, sin_Sh)
    d, r = x_BHSd.shape[-1], 2 * cos_Sh.shape[-1]
    if r < d:
        x_BHSr, rest_BHSp = x_BHSd.split([r, d - r], dim=-1)
        return torch.cat([_rotate_half(x_BHSr, cos_Sh, sin_Sh), rest_BHSp], dim=-1)
    return _rotate_half(x_BHSd, cos_Sh, sin_Sh)


def _rotate_half(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
    x1, x2 = upcast(x_BHSd).chunk(2, dim=-1)
    cos_Sh, sin_Sh = cos_Sh.to(x1.dtype), sin_Sh.to(x1.dtype)
    out = torch.cat([x1 * cos_Sh - x2 * sin_Sh, x2 * cos_Sh + x1 * sin_Sh], dim=-1)
    return out.to(x_BHSd.dtype)


def pairs_as_halves(x_BHSr: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """With ``rope_interleave``, the rotated features regrouped from pairs ``(2i, 2i + 1)``
    into halves ``(i, i + r/2)``, the form ``apply_rope`` rotates: q and k are regrouped
    alike, so their products are unchanged (transformers' DeepSeek-V3 does the same)."""
    if not cfg.rope_interleave:
        return x_BHSr
    return rearrange(x_BHSr, "b h s (r two) -> b h s (two r)", two=2)
