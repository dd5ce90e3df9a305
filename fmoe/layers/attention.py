"""Causal self-attention with rotary position embeddings, through SDPA or FlexAttention.

Multi-head or grouped-query (``kv_heads < heads``), an optional q/k/v bias and an
optional RMSNorm of queries and keys (per head, or over the whole projection); or
DeepSeek-V3's multi-head latent attention (``project_latent``: keys and values up
from a low-rank latent, a rotated key part shared by the heads, values of their own
width).
GPT-OSS's two features: attention sinks (a learned logit per head that joins each
query's softmax as one more column with no value) and sliding-window layers (a query
at position i sees the keys j with ``i - W < j <= i``).

Value heads may have another width than query/key heads (multi-head latent attention:
q/k heads of 192 features, v heads of 128): ``attend`` returns ``H * e`` features.

Which kernel runs (on CUDA, with heads of 16 features or more, no ``[S, S]`` mask or
scores outside decoding):

- plain causal rows without sinks or window: SDPA's ``is_causal`` (flash-class: flash,
  or for MLA's narrower value heads cuDNN or the memory-efficient kernel, see ``_sdpa``);
- plain rows with a window and/or sinks, on CUDA: FlexAttention (compiled) under a
  causal (+ window) BlockMask that depends only on the length and the window, worked
  out from block arithmetic once per (length, window, device) and cached
  (``_row_block_mask``); the sinks from its log-sum-exp (``with_sinks``);
- packed documents (``Documents``): a query sees only the keys of its own document
  at or before it, and positions restart at 0 at each document's first token. On
  CUDA that runs through FlexAttention with a document block mask (compiled: only the
  blocks a document touches are computed);
- elsewhere (CPU, heads under 16 features, decoding over a KV cache): SDPA with the
  exact ``[B or 1, 1, S, L]`` boolean mask, or with sinks the softmax written out
  (``_explicit_attend``).
"""

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:  # torch 2.9 on asks FlexAttention for the lse this way (return_lse is deprecated)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # an older torch: return_lse
    AuxRequest = None

from ..config import ModelConfig, Yarn
from . import triton_kernels
from .fp8 import PLAIN, Gemms
from .norm import rms_norm
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


class Documents(NamedTuple):
    """The packed documents of a microbatch's rows, as attention needs them.

    Attributes:
        ids_BS: ``[B, S]`` document id of each input position (non-decreasing along a row).
        positions_BS: ``[B, S]`` each position's index inside its document (RoPE's position).
        block_mask: on CUDA, FlexAttention's BlockMask of "same document, at or before"
            (built once per microbatch, read by every layer); None elsewhere.
        window_mask: on CUDA with a sliding window, the BlockMask of the windowed
            layers (``block_mask`` within the window); None elsewhere.
    """

    ids_BS: torch.Tensor
    positions_BS: torch.Tensor
    block_mask: object | None = None
    window_mask: object | None = None

    def mask_for(self, window: int):
        """The BlockMask of a layer with ``window`` (0: none), or None off CUDA."""
        return self.window_mask if window else self.block_mask


def documents(ids_BS: torch.Tensor, window: int = 0) -> Documents:
    """Documents of rows whose positions carry the ids ``ids_BS`` (``[B, S]``, each
    document one run of equal ids); ``window``: the model's sliding window
    (``ModelConfig.sliding_window`` when a layer uses one, else 0)."""
    B, S = ids_BS.shape
    index = torch.arange(S, device=ids_BS.device).expand(B, S)
    first = torch.ones_like(ids_BS, dtype=torch.bool)
    first[:, 1:] = ids_BS[:, 1:] != ids_BS[:, :-1]
    starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    block_mask = _document_block_mask(ids_BS) if ids_BS.is_cuda else None
    window_mask = _document_block_mask(ids_BS, window) if ids_BS.is_cuda and window else None
    return Documents(ids_BS, index - starts, block_mask, window_mask)


def _document_block_mask(ids_BS: torch.Tensor, window: int = 0):
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        return (ids_BS[b, q] == ids_BS[b, kv]) & (kv <= q)

    def same_document_window(b, h, q, kv):
        return same_document_causal(b, h, q, kv) & (kv > q - window)

    B, S = ids_BS.shape
    mask_mod = same_document_window if window else same_document_causal
    # compiled, the mask is worked out without a [B, S, S] tensor: 7% of the coarse
    # shape's step faster than eager (benchmarks/packed_rows.py)
    return create_block_mask(mask_mod, B, None, S, S, device=ids_BS.device, _compile=True)


# FlexAttention's kernels need heads of at least 16 features; smaller ones take the
# masked SDPA path, the same attention
_FLEX_MIN_HEAD = 16

# FlexAttention's default sparse block (create_block_mask's BLOCK_SIZE): the row masks
# below are built on its grid
_BLOCK = 128

# the devices whose plain rows with a window or sinks take FlexAttention: CUDA's. CPU's
# compiled kernel has neither a backward nor the lse; tests add "cpu" to run the path
_FLEX_ROW_DEVICES = ("cuda",)



def _row_mask_mod(window: int):
    """FlexAttention's mask_mod of a plain row: key ``kv`` at or before query ``q``, and
    within ``window`` keys of it when ``window`` > 0."""
    if not window:
        return _causal_mask_mod

    def causal_window(b, h, q, kv):
        return (kv <= q) & (kv > q - window)

    return causal_window


def _causal_mask_mod(b, h, q, kv):
    return kv <= q


@functools.cache
def _row_mask_parts(S: int, window: int, device: torch.device) -> tuple:
    """The tensors of the BlockMask of plain causal rows of length ``S`` (``window``: 0
    or the sliding window), as ``create_block_mask`` would make them for
    ``_row_mask_mod(window)``, but from block arithmetic: no ``[S, S]`` mask is ever
    made (create_block_mask's eager path makes one; compiled, it is a graph per length
    and window, and past the recompile limit it would fall back to the eager one).

    A query block ``[q0, q1]`` and a key block ``[k0, k1]`` hold the distances
    ``q - kv`` from ``q0 - k1`` to ``q1 - k0``; the block is seen when some of them
    lie in ``[0, W)`` (``[0, inf)`` without window) and full when all do and neither
    block is cut short by the row's end (create_block_mask pads past ``S`` with False,
    so a cut block is never full).

    Returns:
        ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)``, each
        ``[1, 1, n(, n)]`` int32 for ``n = ceil(S / 128)`` blocks.
    """
    first_N = torch.arange(0, S, _BLOCK, device=device)
    last_N = (first_N + _BLOCK).clamp(max=S) - 1
    q_first, q_last, k_first, k_last = first_N[:, None], last_N[:, None], first_N[None, :], last_N[None, :]
    whole_N = last_N - first_N + 1 == _BLOCK  # not cut short by the row's end
    seen_NN = q_last - k_first >= 0
    full_NN = (q_first - k_last >= 0) & whole_N[:, None] & whole_N[None, :]
    if window:
        seen_NN = seen_NN & (q_first - k_last < window)
        full_NN = full_NN & (q_last - k_first < window)
    partial_NN = seen_NN & ~full_NN

    def ordered(blocks_NN):  # create_block_mask's order: each row's blocks first, ascending
        blocks_11NN = blocks_NN[None, None].to(torch.int32)
        indices = torch.argsort(blocks_11NN, dim=-1, descending=True, stable=True)
        return blocks_11NN.sum(-1).to(torch.int32), indices.to(torch.int32)

    mask = BlockMask.from_kv_blocks(*ordered(partial_NN), *ordered(full_NN), BLOCK_SIZE=_BLOCK,
                                    mask_mod=_row_mask_mod(window), seq_lengths=(S, S))
    return (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
            mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)


@torch.compiler.assume_constant_result
def _row_mask_constants(S: int, window: int, device: torch.device) -> tuple:
    # Compiled (Plan.compile's attention region), dynamo calls this while tracing and
    # takes the cached tensors as constants of the graph: the mask is neither traced
    # (it would be rebuilt on every call, in every layer) nor a graph break. Eager, a
    # plain call of the cache.
    return _row_mask_parts(S, window, device)


def _row_block_mask(S: int, window: int, device: torch.device):
    """FlexAttention's BlockMask of plain causal rows of length ``S`` (with ``window``
    > 0: only the last ``window`` keys), its tensors built once per (S, window, device)
    (``_row_mask_parts``)."""
    (kv_num, kv_indices, full_kv_num, full_kv_indices,
     q_num, q_indices, full_q_num, full_q_indices) = _row_mask_constants(S, window, device)
    return BlockMask(seq_lengths=(S, S), kv_num_blocks=kv_num, kv_indices=kv_indices,
                     full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_indices, q_num_blocks=q_num,
                     q_indices=q_indices, full_q_num_blocks=full_q_num, full_q_indices=full_q_indices,
                     BLOCK_SIZE=(_BLOCK, _BLOCK), mask_mod=_row_mask_mod(window))


@functools.cache
def _compiled_flex():
    # flex_attention runs its fused kernel only compiled (eager, it materialises the scores)
    return torch.compile(flex_attention, dynamic=False)


def apply_rope(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs ``(i, i + r/2)`` by the position's angle (the "rotate-half" form),
    in fp32 whatever x's dtype (on CUDA with Triton: one fused kernel, the same math).
    ``r = 2h`` (``h``: the tables' width) is ``d`` or, partial RoPE, fewer: the features
    from ``r`` on pass unchanged."""
    d, r = x_BHSd.shape[-1], 2 * cos_Sh.shape[-1]
    if r < d:  # the torch form on the rotated slice: the fused kernel is for whole heads
        x_BHSr, rest_BHSp = x_BHSd.split([r, d - r], dim=-1)
        return torch.cat([_rotate_half(x_BHSr, cos_Sh, sin_Sh), rest_BHSp], dim=-1)
    if cos_Sh.dim() == 2 and triton_kernels.rope_fusable(x_BHSd):
        return triton_kernels.rope_BHSd(x_BHSd, cos_Sh, sin_Sh)
    return _rotate_half(x_BHSd, cos_Sh, sin_Sh)


def _rotate_half(x_BHSd: torch.Tensor, cos_Sh: torch.Tensor, sin_Sh: torch.Tensor) -> torch.Tensor:
    x1, x2 = upcast(x_BHSd).chunk(2, dim=-1)
    cos_Sh, sin_Sh = cos_Sh.to(x1.dtype), sin_Sh.to(x1.dtype)
    out = torch.cat([x1 * cos_Sh - x2 * sin_Sh, x2 * cos_Sh + x1 * sin_Sh], dim=-1)
    return out.to(x_BHSd.dtype)


def project_qkv(p: dict, x_BSD: torch.Tensor, cfg: ModelConfig, start: int = 0, gemms: Gemms = PLAIN,
                positions_BS: torch.Tensor | None = None):
    """Queries, keys and values of normalised ``x`` at positions ``start..start+S-1``.

    Arguments:
        p: one layer's ``attn`` subtree.
        x_BSD: ``[B, S, D]`` normalised activations.
        cfg: the ModelConfig.
        start: position of the first row (a KV-cached decode continues a sequence).
        gemms: the product the projection runs (``fmoe.layers.fp8``).
        positions_BS: each token's own position (packed documents), instead of ``start..``.

    Returns:
        ``(q_BHSd, k_BKSd, v_BKSd)``: RoPE applied to q and k (to their first
        ``cfg.rope_dims`` features); ``K = num_kv_heads``.
    """
    qkv_BSN = gemms.linear(x_BSD, p["qkv"])  # N = Q + 2K columns: [q | k | v]
    if "qkv_bias" in p:
        qkv_BSN = qkv_BSN + p["qkv_bias"]
    q_BSQ, k_BSK, v_BSK = qkv_BSN.split([cfg.q_width, cfg.kv_width, cfg.kv_width], dim=-1)
    if cfg.qk_norm == "full":
        q_BSQ, k_BSK = rms_norm(q_BSQ, p["q_norm"], cfg.norm_eps), rms_norm(k_BSK, p["k_norm"], cfg.norm_eps)
    q_BSHd = rearrange(q_BSQ, "b s (h d) -> b s h d", h=cfg.heads)
    k_BSKd, v_BSKd = (rearrange(t, "b s (h d) -> b s h d", h=cfg.num_kv_heads) for t in (k_BSK, v_BSK))
    if cfg.qk_norm == "head":
        # before the transpose, in the projection's own layout: the compiled attention
        # fuses the norm with the split and transpose (2% faster at the qwen3 shape)
        q_BSHd, k_BSKd = rms_norm(q_BSHd, p["q_norm"], cfg.norm_eps), rms_norm(k_BSKd, p["k_norm"], cfg.norm_eps)
    q_BHSd, k_BKSd, v_BKSd = (rearrange(t, "b s h d -> b h s d") for t in (q_BSHd, k_BSKd, v_BSKd))
    cos_Sh, sin_Sh = rope_tables(x_BSD.shape[1], cfg.rope_dims, cfg.rope_theta, x_BSD.device, start, positions_BS,
                                 cfg.yarn)
    return apply_rope(q_BHSd, cos_Sh, sin_Sh), apply_rope(k_BKSd, cos_Sh, sin_Sh), v_BKSd


def project_latent(p: dict, x_BSD: torch.Tensor, cfg: ModelConfig, start: int = 0, gemms: Gemms = PLAIN,
                   positions_BS: torch.Tensor | None = None):
    """Multi-head latent attention's queries, keys and values (``cfg.latent``), as
    ``project_qkv``'s (the same arguments).

    The queries come from ``q`` (or the low-rank ``q_down``, its norm, ``q_up``); keys
    and values from a normalised latent: ``kv_down`` gives the latent and the rotated
    key features every head shares, ``kv_up`` each head's unrotated key and its value.

    Returns:
        ``(q_BHSd, k_BHSd, v_BHSv)``: ``d = head_dim`` with RoPE on its last
        ``rope_head_dim`` features, ``v = v_head_dim``; every head its own key.
    """
    H, r, eps = cfg.heads, cfg.rope_head_dim, cfg.norm_eps
    if "q" in p:
        q_BSQ = gemms.linear(x_BSD, p["q"])
    else:
        q_BSQ = gemms.linear(rms_norm(gemms.linear(x_BSD, p["q_down"]), p["q_down_norm"], eps), p["q_up"])
    latent_BSR, k_rope_BSr = gemms.linear(x_BSD, p["kv_down"]).split([cfg.kv_lora_rank, r], dim=-1)
    kv_BSN = gemms.linear(rms_norm(latent_BSR, p["kv_down_norm"], eps), p["kv_up"])
    nope = cfg.head_dim - r
    k_nope_BHSn, v_BHSv = rearrange(kv_BSN, "b s (h e) -> b h s e", h=H).split([nope, cfg.v_head_dim], dim=-1)
    q_nope_BHSn, q_rope_BHSr = rearrange(q_BSQ, "b s (h d) -> b h s d", h=H).split([nope, r], dim=-1)
    cos_Sh, sin_Sh = rope_tables(x_BSD.shape[1], r, cfg.rope_theta, x_BSD.device, start, positions_BS, cfg.yarn)
    q_rope_BHSr = apply_rope(_pairs_as_halves(q_rope_BHSr, cfg), cos_Sh, sin_Sh)
    k_rope_B1Sr = apply_rope(_pairs_as_halves(k_rope_BSr[:, None], cfg), cos_Sh, sin_Sh)
    q_BHSd = torch.cat([q_nope_BHSn, q_rope_BHSr], dim=-1)
    k_BHSd = torch.cat([k_nope_BHSn, k_rope_B1Sr.expand(-1, H, -1, -1)], dim=-1)
    return q_BHSd, k_BHSd, v_BHSv


def _pairs_as_halves(x_BHSr: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """With ``rope_interleave``, the rotated features regrouped from pairs ``(2i, 2i + 1)``
    into halves ``(i, i + r/2)``, the form ``apply_rope`` rotates: q and k are regrouped
    alike, so their products are unchanged (transformers' DeepSeek-V3 does the same)."""
    if not cfg.rope_interleave:
        return x_BHSr
    return rearrange(x_BHSr, "b h s (r two) -> b h s (two r)", two=2)


def attend(q_BHSd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLe: torch.Tensor, start: int = 0,
           docs: Documents | None = None, scale: float | None = None, window: int = 0,
           sinks_H: torch.Tensor | None = None, cached: bool = False) -> torch.Tensor:
    """Causal attention of queries at positions ``start..`` over keys at positions
    ``0..L-1`` (``docs``: only over the keys of the query's own document).

    Arguments:
        q_BHSd: ``[B, H, S, d]`` queries.
        k_BKLd: ``[B, K, L, d]`` keys; each group of ``H / K`` query heads shares one
            key/value head (grouped-query attention when ``K < H``).
        v_BKLe: ``[B, K, L, e]`` values; ``e`` may differ from ``d`` (multi-head latent
            attention's narrower value heads).
        start: the first query's position (a KV-cached decode continues a sequence).
        docs: packed documents (not with ``start > 0``).
        scale: the scores' factor (None: ``d ** -0.5``).
        window: a sliding window of that many keys (query i sees keys ``i - W < j <= i``;
            0: none).
        sinks_H: ``[H]`` attention sinks, one more softmax column per head with logit
            ``s_h`` and no value (None: none).
        cached: the keys are a KV cache's (decoding, the prompt included): the exact
            mask, as each call's lengths differ and a compiled kernel per length would
            recompile on every prompt.

    Returns:
        ``[B, S, H * e]``.
    """
    gqa = k_BKLd.shape[1] != q_BHSd.shape[1]
    S, L = q_BHSd.shape[2], k_BKLd.shape[2]
    flex_sized = q_BHSd.shape[-1] >= _FLEX_MIN_HEAD
    if docs is not None and docs.mask_for(window) is not None and flex_sized:
        o_BHSe, lse_BHS = _flex_attend(q_BHSd, k_BKLd, v_BKLe, docs.mask_for(window), gqa, scale, sinks_H)
    elif not cached and _plain_rows_flex(q_BHSd, S, L, start, docs, window, sinks_H):
        o_BHSe, lse_BHS = _flex_attend(q_BHSd, k_BKLd, v_BKLe, _row_block_mask(S, window, q_BHSd.device), gqa,
                                       scale, sinks_H)
    else:
        mask = _mask(S, L, start, docs, window, q_BHSd.device)
        if sinks_H is None:
            o_BHSe = _sdpa(q_BHSd, k_BKLd, v_BKLe, mask, gqa, scale)
        else:
            o_BHSe, lse_BHS = _explicit_attend(q_BHSd, k_BKLd, v_BKLe, mask, scale)
    if sinks_H is not None:
        o_BHSe = with_sinks(o_BHSe, lse_BHS, sinks_H)
    return rearrange(o_BHSe, "b h s e -> b s (h e)")


def _plain_rows_flex(q_BHSd: torch.Tensor, S: int, L: int, start: int, docs: Documents | None, window: int,
                     sinks_H: torch.Tensor | None) -> bool:
    """Whether rows without documents take FlexAttention under ``_row_block_mask``: on
    CUDA, for a window or sinks (SDPA has no window, nor a log-sum-exp for the sinks,
    so it would need the ``[S, S]`` mask or scores), when the whole row is attended at
    once (a decode over a KV cache, ``start > 0``, has few queries: the exact mask is
    small) and the heads are wide enough for Flex's kernels."""
    return (q_BHSd.device.type in _FLEX_ROW_DEVICES and docs is None and start == 0 and S == L
            and bool(window or sinks_H is not None) and q_BHSd.shape[-1] >= _FLEX_MIN_HEAD)


def _mask(S: int, L: int, start: int, docs: Documents | None, window: int, device):
    """The ``[B or 1, 1, S, L]`` boolean mask of which keys each query sees, or None for
    plain causal attention (SDPA's ``is_causal``, no mask tensor)."""
    if docs is not None:
        ids = docs.ids_BS
        mask = (ids[:, None, :, None] == ids[:, None, None, :]).tril()
    elif start == 0 and S == L and not window:
        return None
    else:  # queries continue a cached sequence: row s sees keys 0..start+s
        q_pos = torch.arange(start, start + S, device=device)
        mask = torch.arange(L, device=device)[None, :] <= q_pos[:, None]
    if window:  # the same absolute distance inside a document as in the row
        q_pos = torch.arange(start, start + S, device=device)
        mask = mask & (torch.arange(L, device=device)[None, :] > q_pos[:, None] - window)
    return mask


def _sdpa(q_BHSd, k_BKLd, v_BKLe, mask, gqa: bool, scale):
    """SDPA, causal (``mask`` None) or under ``mask``; ``[B, H, S, e]``.

    Narrower value heads (``e < d``, MLA's) go to SDPA as they are: it picks cuDNN or
    the memory-efficient kernel (flash takes only equal head sizes). Zero-padding v to
    ``d`` for flash, as transformers does, measured 1.44x slower on the H100 at
    ``d = 192, e = 128`` (``benchmarks/attention_paths.py``: 2.52 ms against 1.75 ms for
    forward and backward of 2 x 4096 positions, 16 heads).
    """
    extra = {"enable_gqa": True, "scale": scale} if gqa else {"scale": scale}
    if mask is None:
        return F.scaled_dot_product_attention(q_BHSd, k_BKLd, v_BKLe, is_causal=True, **extra)
    return F.scaled_dot_product_attention(q_BHSd, k_BKLd, v_BKLe, attn_mask=mask, **extra)


def _explicit_attend(q_BHSd, k_BKLd, v_BKLe, mask, scale):
    """Masked softmax attention written out, with each query's log-sum-exp (what the
    sinks need and SDPA does not return): the ``[B, H, S, L]`` scores exist, so this is
    the path of CPU sizes and of decoding over a KV cache with sinks.

    Returns:
        ``(o_BHSe, lse_BHS)``, the lse in at least fp32.
    """
    H, K, S, L = q_BHSd.shape[1], k_BKLd.shape[1], q_BHSd.shape[2], k_BKLd.shape[2]
    k_BHLd, v_BHLe = (t.repeat_interleave(H // K, dim=1) for t in (k_BKLd, v_BKLe))
    scale = q_BHSd.shape[-1] ** -0.5 if scale is None else scale
    scores_BHSL = upcast(q_BHSd @ k_BHLd.transpose(-1, -2)) * scale
    if mask is None:
        mask = torch.ones(S, L, dtype=torch.bool, device=q_BHSd.device).tril()
    scores_BHSL = scores_BHSL.masked_fill(~mask, float("-inf"))
    lse_BHS = scores_BHSL.logsumexp(-1)
    probs_BHSL = (scores_BHSL - lse_BHS[..., None]).exp().to(v_BHLe.dtype)
    return probs_BHSL @ v_BHLe, lse_BHS


def _flex_attend(q_BHSd, k_BKLd, v_BKLe, block_mask, gqa: bool, scale, sinks_H, flex=None):
    """FlexAttention under ``block_mask`` (compiled: no ``[S, S]`` scores); its lse only
    when the sinks need it. ``flex``: the function to call (None: the compiled
    ``flex_attention``; the tests pass the eager one, whose reference math runs on CPU
    in float64 and returns the lse, which CPU's compiled kernel does not).

    Returns:
        ``(o_BHSe, lse_BHS or None)``.
    """
    if flex is None:  # inside a compiled region dynamo traces flex_attention itself
        flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    if sinks_H is None:
        return flex(q_BHSd, k_BKLd, v_BKLe, block_mask=block_mask, enable_gqa=gqa, scale=scale), None
    if AuxRequest is None:
        return flex(q_BHSd, k_BKLd, v_BKLe, block_mask=block_mask, enable_gqa=gqa, scale=scale, return_lse=True)
    o_BHSe, aux = flex(q_BHSd, k_BKLd, v_BKLe, block_mask=block_mask, enable_gqa=gqa, scale=scale,
                       return_aux=AuxRequest(lse=True))
    return o_BHSe, aux.lse


def with_sinks(o_BHSe: torch.Tensor, lse_BHS: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """Attention without sinks ``o`` (``lse``: each query's log-sum-exp of its scores)
    turned into attention with them: the sink takes ``exp(s_h) / (exp(lse) + exp(s_h))``
    of the softmax and adds no value, so every weight, and ``o``, scale by
    ``sigmoid(lse - s_h)`` (exact, and stable for any lse, also -inf)."""
    keep_BHS = torch.sigmoid(upcast(lse_BHS) - upcast(sinks_H)[:, None])
    return (o_BHSe * keep_BHS[..., None]).to(o_BHSe.dtype)


class KVSlot(NamedTuple):
    """One layer's key/value cache for decoding: ``[B, K, max_len, d]`` key and
    ``[B, K, max_len, dv]`` value buffers and the position of the first token of this
    call (``start`` earlier ones are filled)."""

    keys_BKLd: torch.Tensor
    values_BKLd: torch.Tensor
    start: int

    def extend(self, k_BKSd: torch.Tensor, v_BKSd: torch.Tensor):
        """Write this call's keys and values at ``start..``; returns all of them so far."""
        end = self.start + k_BKSd.shape[2]
        self.keys_BKLd[:, :, self.start:end] = k_BKSd
        self.values_BKLd[:, :, self.start:end] = v_BKSd
        return self.keys_BKLd[:, :, :end], self.values_BKLd[:, :, :end]


def attention(p: dict, x_BSD: torch.Tensor, cfg: ModelConfig, kv: KVSlot | None = None,
              gemms: Gemms = PLAIN, docs: Documents | None = None, window: int = 0) -> torch.Tensor:
    """Causal self-attention of already-normalised ``x``; no residual.

    Arguments:
        p: one layer's ``attn`` subtree (``qkv [D, Q + 2K]``, ``out [Q, D]``, and
            ``qkv_bias``, ``out_bias``, ``q_norm``, ``k_norm``, ``sinks`` when the config
            has them; under multi-head latent attention its projections instead of ``qkv``:
            ``fmoe.params``).
        x_BSD: ``[B, S, D]`` normalised activations.
        cfg: the ModelConfig (heads, kv_heads, head size, qk_norm, RoPE and its scaling).
        kv: decoding: the layer's cache; ``x`` continues its positions, its keys and
            values are written into it and the queries attend over all of them.
        gemms: the products of the two projections (``fmoe.layers.fp8``).
        docs: packed documents: attention stays inside each, positions restart at
            each one's first token (not with ``kv``).
        window: the layer's sliding window (``ModelConfig.layer_window``; 0: none).

    Returns:
        ``[B, S, D]``, ``attention(x) @ out``.
    """
    start = 0 if kv is None else kv.start
    positions = None if docs is None else docs.positions_BS
    project = project_latent if cfg.latent else project_qkv
    q_BHSd, k_BKLd, v_BKLd = project(p, x_BSD, cfg, start, gemms, positions)
    if kv is not None:  # L: the keys so far
        k_BKLd, v_BKLd = kv.extend(k_BKLd, v_BKLd)
    # the scale as a number from the config: a compiled graph that went dynamic in the
    # head size would otherwise give FlexAttention's kernel a symbolic one, which
    # inductor cannot lower (and YaRN's DeepSeek-V3 correction changes it)
    o_BSQ = attend(q_BHSd, k_BKLd, v_BKLd, start, docs, cfg.attention_scale, window, p.get("sinks"),
                   cached=kv is not None)
    out_BSD = gemms.linear(o_BSQ, p["out"])
    return out_BSD + p["out_bias"] if "out_bias" in p else out_BSD


def attention_half(p: dict, h_BSD: torch.Tensor, cfg: ModelConfig, docs: Documents | None = None,
                   window: int = 0, kv: KVSlot | None = None, gemms: Gemms = PLAIN):
    """A layer's first half: ``h += attn(norm(h))``, then the input norm of its MoE (or
    of its dense MLP) (``docs``, ``window``, ``kv``, ``gemms``: see ``attention``;
    ``window`` comes before ``kv`` so that the Kernels' ``attn``, called positionally,
    passes it).

    Returns:
        ``(h_BSD, x_TD)``: the residual stream and the normalised tokens ``[B*S, D]``.
    """
    eps = cfg.norm_eps
    h_BSD = h_BSD + attention(p["attn"], rms_norm(h_BSD, p["attn"]["norm"], eps), cfg, kv, gemms, docs,
                              window)
    mlp = p["moe"] if "moe" in p else p["mlp"]
    return h_BSD, rms_norm(h_BSD, mlp["norm"], eps).flatten(0, 1)
