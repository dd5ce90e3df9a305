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
  (``row_block_mask``); the sinks from its log-sum-exp (``with_sinks``);
- packed documents (``Documents``): a query sees only the keys of its own document
  at or before it, and positions restart at 0 at each document's first token. On
  CUDA that runs through FlexAttention with a document block mask (compiled: only the
  blocks a document touches are computed);
- elsewhere (CPU, heads under 16 features, decoding over a KV cache): SDPA with the
  exact ``[B or 1, 1, S, L]`` boolean mask, or with sinks the softmax written out
  (``_explicit_attend``).
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

try:  # torch 2.9 on asks FlexAttention for the lse this way (return_lse is deprecated)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # an older torch: return_lse
    AuxRequest = None

from ..config import ModelConfig
from ..config_fields import QkNorm
from .block_masks import Documents, row_block_mask
from .context_parallel import ContextParallel, attend_chunks
from .fp8 import PLAIN, Gemms
from .norm import rms_norm
from .precision import upcast
from .rope import apply_rope, pairs_as_halves, rope_tables
from .tensor_parallel import TensorParallel


# FlexAttention's kernels need heads of at least 16 features; smaller ones take the
# masked SDPA path, the same attention
_FLEX_MIN_HEAD = 16

# the devices whose plain rows with a window or sinks take FlexAttention: CUDA's. CPU's
# compiled kernel has neither a backward nor the lse; tests add "cpu" to run the path
_FLEX_ROW_DEVICES = ("cuda",)



@functools.cache
def _compiled_flex():
    # flex_attention runs its fused kernel only compiled (eager, it materialises the scores)
    return torch.compile(flex_attention, dynamic=False)


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
    if cfg.qk_norm_mode is QkNorm.FULL:
        q_BSQ, k_BSK = rms_norm(q_BSQ, p["q_norm"], cfg.norm_eps), rms_norm(k_BSK, p["k_norm"], cfg.norm_eps)
    q_BSHd = rearrange(q_BSQ, "b s (h d) -> b s h d", h=cfg.heads)
    k_BSKd, v_BSKd = (rearrange(t, "b s (h d) -> b s h d", h=cfg.num_kv_heads) for t in (k_BSK, v_BSK))
    if cfg.qk_norm_mode is QkNorm.HEAD:
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
    q_rope_BHSr = apply_rope(pairs_as_halves(q_rope_BHSr, cfg), cos_Sh, sin_Sh)
    k_rope_B1Sr = apply_rope(pairs_as_halves(k_rope_BSr[:, None], cfg), cos_Sh, sin_Sh)
    q_BHSd = torch.cat([q_nope_BHSn, q_rope_BHSr], dim=-1)
    k_BHSd = torch.cat([k_nope_BHSn, k_rope_B1Sr.expand(-1, H, -1, -1)], dim=-1)
    return q_BHSd, k_BHSd, v_BHSv


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
        o_BHSe, lse_BHS = _flex_attend(q_BHSd, k_BKLd, v_BKLe, row_block_mask(S, window, q_BHSd.device), gqa,
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
    """Whether rows without documents take FlexAttention under ``row_block_mask``: on
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


_NARROW_VALUE_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q_BHSd, k_BKLd, v_BKLe, mask, gqa: bool, scale):
    """SDPA, causal (``mask`` None) or under ``mask``; ``[B, H, S, e]``.

    Narrower value heads (``e < d``, MLA's) go to SDPA as they are, cuDNN first (flash
    takes only equal head sizes). Left to its own order, a step of deepseek-v3-medium
    on an H200 ran the memory-efficient kernel instead: 150 against 21 GPU ms for the
    16 layers' attention. Zero-padding v to ``d`` for flash, as transformers does,
    measured 1.44x slower on the H100 at ``d = 192, e = 128``
    (``benchmarks/attention_paths.py``: 2.52 ms against 1.75 ms for forward and
    backward of 2 x 4096 positions, 16 heads).
    """
    extra = {"enable_gqa": True, "scale": scale} if gqa else {"scale": scale}
    if q_BHSd.is_cuda and v_BKLe.shape[-1] != q_BHSd.shape[-1]:
        with sdpa_kernel(_NARROW_VALUE_BACKENDS, set_priority=True):
            return _sdpa_call(q_BHSd, k_BKLd, v_BKLe, mask, extra)
    return _sdpa_call(q_BHSd, k_BKLd, v_BKLe, mask, extra)


def _sdpa_call(q_BHSd, k_BKLd, v_BKLe, mask, extra: dict):
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


def _chunk_attend(q_BHLd, k_BKSd, v_BKSe, causal, q_start: int, scale, window: int, sinks_H):
    """One context-parallel query chunk starting at position ``q_start`` over the keys
    before its end (``attend_chunks``): SDPA under the bottom-right ``causal`` bias, or
    with a window or sinks under the exact mask."""
    gqa = k_BKSd.shape[1] != q_BHLd.shape[1]
    if not window and sinks_H is None:
        return _sdpa(q_BHLd, k_BKSd, v_BKSe, causal, gqa, scale)
    mask = _mask(q_BHLd.shape[2], k_BKSd.shape[2], q_start, None, window, q_BHLd.device)
    if sinks_H is None:
        return _sdpa(q_BHLd, k_BKSd, v_BKSe, mask, gqa, scale)
    return with_sinks(*_explicit_attend(q_BHLd, k_BKSd, v_BKSe, mask, scale), sinks_H)


def attention(p: dict, x_BSD: torch.Tensor, cfg: ModelConfig, kv: KVSlot | None = None,
              gemms: Gemms = PLAIN, docs: Documents | None = None, window: int = 0,
              cp: ContextParallel | None = None) -> torch.Tensor:
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
        cp: context parallelism: ``x``'s rows are pairs of chunks of sequences
            (``fmoe.layers.context_parallel``), rotated at their positions in the
            sequence and attending over every rank's keys (not with ``docs`` or ``kv``).

    Returns:
        ``[B, S, D]``, ``attention(x) @ out``.
    """
    start = 0 if kv is None else kv.start
    positions = None if docs is None else docs.positions_BS
    if cp is not None:
        positions = cp.positions(x_BSD.shape[0], x_BSD.shape[1], x_BSD.device)
    project = project_latent if cfg.latent else project_qkv
    q_BHSd, k_BKLd, v_BKLd = project(p, x_BSD, cfg, start, gemms, positions)
    if kv is not None:  # L: the keys so far
        k_BKLd, v_BKLd = kv.extend(k_BKLd, v_BKLd)
    # the scale as a number from the config: a compiled graph that went dynamic in the
    # head size would otherwise give FlexAttention's kernel a symbolic one, which
    # inductor cannot lower (and YaRN's DeepSeek-V3 correction changes it)
    if cp is not None:
        o_BSQ = attend_chunks(q_BHSd, cp.sequence_keys(k_BKLd), cp.sequence_keys(v_BKLd), cp,
                              functools.partial(_chunk_attend, scale=cfg.attention_scale, window=window,
                                                sinks_H=p.get("sinks")))
    else:
        o_BSQ = attend(q_BHSd, k_BKLd, v_BKLd, start, docs, cfg.attention_scale, window, p.get("sinks"),
                       cached=kv is not None)
    out_BSD = gemms.linear(o_BSQ, p["out"])
    return out_BSD + p["out_bias"] if "out_bias" in p else out_BSD


def attention_half(p: dict, h_BSD: torch.Tensor, cfg: ModelConfig, docs: Documents | None = None,
                   window: int = 0, kv: KVSlot | None = None, gemms: Gemms = PLAIN,
                   tp: TensorParallel | None = None, cp: ContextParallel | None = None):
    """A layer's first half: ``h += attn(norm(h))``, then the input norm of its MoE (or
    of its dense MLP) (``docs``, ``window``, ``kv``, ``gemms``: see ``attention``;
    ``window`` comes before ``kv`` so that the Kernels' ``attn``, called positionally,
    passes it).

    ``tp``: tensor parallelism (``fmoe.layers.tensor_parallel``): ``h`` holds this rank's
    positions, ``p`` its heads' slice and ``cfg`` its heads (``local_model``); the
    normalised positions are gathered, the heads' partial outputs summed back into each
    rank's positions, the output bias added once. ``cp``: context parallelism (see
    ``attention``).

    Returns:
        ``(h_BSD, x_TD)``: the residual stream and the normalised tokens ``[B*S, D]``.
    """
    eps = cfg.norm_eps
    x_BSD = rms_norm(h_BSD, p["attn"]["norm"], eps)
    if tp is None:
        h_BSD = h_BSD + attention(p["attn"], x_BSD, cfg, kv, gemms, docs, window, cp)
    else:
        heads = {name: w for name, w in p["attn"].items() if name != "out_bias"}
        out_BSD = tp.scatter(attention(heads, tp.gather(x_BSD, 1), cfg, kv, gemms, docs, window, cp), 1)
        h_BSD = h_BSD + (out_BSD + p["attn"]["out_bias"] if "out_bias" in p["attn"] else out_BSD)
    mlp = p["moe"] if "moe" in p else p["mlp"]
    return h_BSD, rms_norm(h_BSD, mlp["norm"], eps).flatten(0, 1)
