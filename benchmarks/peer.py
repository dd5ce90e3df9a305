"""A plain PyTorch MoE language model: the independent peer fmoe is measured against.

Nothing here imports fmoe. It is the model an experienced PyTorch user writes from the
released models' reference code (torchtitan's, transformers'): ``nn.Module``s, pre-norm
blocks of causal attention with RoPE and a routed MoE (or, for the layers named in
``dense_layers``, a dense MLP), an untied head, mean cross-entropy,
``torch.optim.AdamW(fused=True)``. Optionally each block is compiled as torchtitan does
it: ``torch.compile(block, fullgraph=True)`` per transformer block, before FSDP2.

    model = build(cfg, "cuda")                  # one GPU (or CPU), no sharding, eager
    model = build(cfg, "cuda", compile=True)    # the same, each block torch.compile'd
    model = shard(build(cfg, "cuda", compile=True), mesh)   # FSDP2 over compiled blocks
    opt = optimizer(model, lr)
    loss = train_step(model, opt, tokens_BS1)   # forward, backward, AdamW step

``cfg`` is anything with the fields of ``PeerConfig`` (a ``fmoe.ModelConfig`` has them,
with the same meaning). The families it covers:

- Qwen3-MoE / Mixtral-like (the defaults): multi-head or grouped-query attention with an
  optional per-head RMSNorm of queries and keys, fp32 softmax router, top-k, optionally
  renormalised, SwiGLU experts.
- GLM-4.5 / DeepSeek-V3 routing: ``score_func="sigmoid"`` with a selection-only
  ``expert_bias`` buffer (aux-loss-free balancing: it changes which experts are chosen,
  never their weights, and takes no gradient), group-limited top-k (``expert_groups``,
  ``topk_groups``: a group scores the sum of its 2 best biased scores), ``routed_scaling``,
  a shared expert (``shared_ffn``), dense first layers (``dense_layers``, ``dense_ffn``);
  GLM's partial RoPE (``rope_fraction``: the first features of each head rotate) and
  q/k/v bias (``qkv_bias``).
- GPT-OSS: attention sinks (``attn_sinks``: a learned logit per head joining every
  query's softmax with no value), sliding-window layers (``sliding_window``,
  ``window_layers``), ``qkv_bias`` and ``out_bias``, a router bias, ``topk_softmax``
  routing (the top-k logits, softmax over those k), per-expert biases
  (``expert_biases``), the clamped SwiGLU (``activation="quick_geglu"``), YaRN RoPE.
  On CUDA, attention with sinks or a window runs through FlexAttention, compiled once
  at module level as torchtitan's ``FlexAttentionWrapper`` (so the eager peer has the
  fused kernel too), under a causal or sliding-window ``BlockMask`` built once per
  sequence length, the sink applied from the returned log-sum-exp (torchtitan's GPT-OSS:
  ``out * sigmoid(lse - sink)``, exactly the extra softmax column). FlexAttention has no
  backward on the CPU, so there it runs as transformers' eager GPT-OSS attention:
  explicit masked scores with the sink as one more column.
- DeepSeek-V3's multi-head latent attention (``kv_lora_rank > 0``): queries from one
  projection or through a low-rank ``q_down``/norm/``q_up``; keys and values from a
  shared latent (``kv_down``, norm, ``kv_up`` giving each head ``[k_nope | v]``) plus one
  rotary key shared by all heads; each q/k head ``[nope | rope]`` with RoPE on its last
  ``rope_head_dim`` features (``rope_interleave``: DeepSeek's released pairing (2i, 2i+1),
  de-interleaved then rotated as transformers' DeepseekV3 does); values of
  ``v_head_size`` features. Through SDPA as torchtitan's DeepSeek-V3 calls it: the value
  head size left as it is (not padded to the q/k size), under ``sdpa_kernel`` with cuDNN
  first, then flash, then memory-efficient attention (flash cannot take a different
  value size; cuDNN and memory-efficient can); or, ``mla_pad_values``, the values
  zero-padded to the q/k size so that flash runs (transformers' flash-attention path).

Compilation and the MoE's dynamic routing: the rows each expert gets change every
step, but no *shape* does. Every expert's segment is padded to a multiple of 16 rows,
so the padded total is at most ``T * K + E * 15``; the expert buffer always has that
static maximum (rounded up to 16) rows, the last expert's segment runs to its end, and
only the segment offsets (a tensor) change. So nothing is marked dynamic, there is no
host sync and no data-dependent shape, each block compiles to one full graph, and the
blocks of one kind (MoE or dense, windowed or not) share it (same shapes, parameters
are graph inputs): after the first step there are no recompiles. The price is at most
``E * 16`` rows of zeros per layer.

Precision: fp32 params and AdamW state. The plain model on CUDA runs under
``torch.autocast(bfloat16)`` (its residual stream stays fp32, as autocast leaves
it). Under FSDP2 the ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
hands every module bf16 weights, so there is no autocast: activations are bf16
throughout, the router and the loss upcast to fp32 by hand in both modes. On CPU
(smoke tests) everything is fp32 and the experts run as one dense product of every
row with every expert, each row keeping its own expert's (a toy's cost; no host sync).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

ALIGN = 16  # torch._grouped_mm wants each expert's row segment to start at a multiple of 16
QUICK_GELU_ALPHA = 1.702  # GPT-OSS's gate * sigmoid(1.702 * gate)

# Fields of a model config that change what the model computes but that the peer does
# not model, with the value the peer stands for: a config with another value is refused
# instead of silently measured as a different model.
UNMODELLED = {"tie_embeddings": False, "shared_gate": False, "glu_interleave": 0, "prob_placement": "output",
              "capacity_factor": 0.0, "z_loss_coef": 0.0}


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 8
    heads: int = 16
    kv_heads: int = 0       # key/value heads; 0 = heads (fewer: grouped-query attention)
    head_size: int = 0      # features per q/k head; 0 = dim // heads
    qk_norm: str = "none"   # "head": RMSNorm of each query and key head before RoPE (Qwen3)
    qkv_bias: bool = False  # a bias on the q/k/v projection (GLM-4.5, GPT-OSS)
    out_bias: bool = False  # a bias on attention's output projection (GPT-OSS)
    attn_sinks: bool = False    # a learned logit per head joining each query's softmax, no value
    sliding_window: int = 0     # query i sees keys i - W < j <= i in the layers of window_layers
    window_layers: tuple = ()
    # multi-head latent attention (DeepSeek-V3); kv_lora_rank > 0 turns it on
    q_lora_rank: int = 0    # 0: queries from one [D, H * head_size] projection
    kv_lora_rank: int = 0
    rope_head_dim: int = 0  # the rotary features at the end of each q/k head
    v_head_size: int = 0    # value features per head; 0 = head_size
    rope_interleave: bool = False  # rope features paired (2i, 2i+1), as DeepSeek's released weights
    # how MLA's values enter SDPA (not a model field, a choice of kernel): False as they are
    # (torchtitan: cuDNN or memory-efficient attention); True zero-padded to the q/k head
    # size and the output cut back (transformers' flash-attention path, vLLM): flash runs
    mla_pad_values: bool = False
    experts: int = 16
    topk: int = 4
    ffn: int = 1408
    activation: str = "swiglu"  # or "quick_geglu" (GPT-OSS's clamped SwiGLU)
    glu_limit: float = 7.0
    glu_offset: float = 1.0
    score_func: str = "softmax"  # "sigmoid" (with the selection-only expert_bias) or "topk_softmax"
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    routed_scaling: float = 1.0  # factor on the top-k probabilities
    expert_groups: int = 1       # group-limited top-k: a token picks inside its topk_groups best groups
    topk_groups: int = 1
    router_bias: bool = False    # a learned router bias that selects and weights (GPT-OSS)
    expert_biases: bool = False  # per-expert fc1/fc2 biases (GPT-OSS)
    shared_ffn: int = 0          # an always-on shared expert of this width (0: none)
    dense_layers: tuple = ()     # layers whose MLP is a dense MLP of dense_ffn
    dense_ffn: int = 0
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0   # share of each head's features RoPE rotates (GLM-4.5's partial RoPE)
    rope_scaling: str = "none"   # or "yarn" (transformers' rope_type="yarn"), with the fields below
    rope_factor: float = 1.0
    rope_original_max: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: float = 0.0
    yarn_truncate: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    aux_loss_coef: float = 0.0

    def __post_init__(self):
        for name, allowed in (("qk_norm", ("none", "head")), ("activation", ("swiglu", "quick_geglu")),
                              ("score_func", ("softmax", "sigmoid", "topk_softmax")),
                              ("rope_scaling", ("none", "yarn"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"PeerConfig.{name}={getattr(self, name)!r}: the peer has {allowed}")
        if self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"PeerConfig.kv_heads={self.kv_heads} must divide heads ({self.heads})")
        if self.kv_lora_rank and (self.attn_sinks or self.window_layers or self.qk_norm != "none"
                                  or self.qkv_bias or self.out_bias):
            raise ValueError("PeerConfig: latent attention (kv_lora_rank > 0) has no sinks, windows, "
                             "qk_norm or attention biases in the peer")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    @property
    def v_dim(self) -> int:
        return self.v_head_size or self.head_dim

    @property
    def rope_dims(self) -> int:
        """The rotated features of each q/k head."""
        return self.rope_head_dim if self.kv_lora_rank else int(self.head_dim * self.rope_fraction)

    @property
    def softmax_scale(self) -> float:
        """``head_dim ** -0.5``; with YaRN and ``yarn_mscale_all_dim``, times
        ``m(mscale_all_dim) ** 2`` (DeepSeek-V3's correction, transformers' ``scaling``)."""
        scale = self.head_dim ** -0.5
        if self.rope_scaling == "yarn" and self.yarn_mscale_all_dim:
            scale = scale * yarn_mscale(self.rope_factor, self.yarn_mscale_all_dim) ** 2
        return scale

    def window(self, layer: int) -> int:
        return self.sliding_window if layer in self.window_layers else 0

    @classmethod
    def of(cls, cfg) -> "PeerConfig":
        """The fields of any config object that has them (e.g. ``fmoe.ModelConfig``);
        ValueError if it sets something the peer does not model (``UNMODELLED``)."""
        for name, value in UNMODELLED.items():
            if getattr(cfg, name, value) != value:
                raise ValueError(f"the peer does not model {name}={getattr(cfg, name)!r}")
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)})


# --- rotary embeddings ----------------------------------------------------------------------

def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(cfg: PeerConfig, dims: int, device) -> tuple[torch.Tensor, float]:
    """RoPE's ``dims / 2`` inverse frequencies and the factor on cos/sin: plain
    ``theta ** (-2i / dims)`` and 1, or YaRN's (transformers' ``_compute_yarn_parameters``):
    fast-turning pairs keep their frequency, slow ones are divided by ``rope_factor``,
    a linear ramp between, and cos/sin scaled by the attention factor."""
    exponents = torch.arange(0, dims, 2, device=device, dtype=torch.float32) / dims
    inv_freq = cfg.rope_theta ** -exponents
    if cfg.rope_scaling != "yarn":
        return inv_freq, 1.0
    factor, theta = cfg.rope_factor, cfg.rope_theta

    def pair_turning(rotations):  # the pair index that turns `rotations` times over the original context
        return dims * math.log(cfg.rope_original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(cfg.yarn_beta_fast), pair_turning(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # an empty ramp would divide by zero
    ramp = ((torch.arange(dims // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    if cfg.yarn_attention_factor:
        cos_factor = cfg.yarn_attention_factor
    elif cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        cos_factor = yarn_mscale(factor, cfg.yarn_mscale) / yarn_mscale(factor, cfg.yarn_mscale_all_dim)
    else:
        cos_factor = yarn_mscale(factor)
    return inv_freq, cos_factor


def rope_tables(seq: int, cfg: PeerConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[S, rope_dims]`` (each frequency twice, for the rotate-half form)."""
    inv_freq, cos_factor = inverse_frequencies(cfg, cfg.rope_dims, device)
    angles_Sh = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles_Sd = torch.cat([angles_Sh, angles_Sh], dim=-1)
    if cos_factor == 1.0:
        return angles_Sd.cos(), angles_Sd.sin()
    return angles_Sd.cos() * cos_factor, angles_Sd.sin() * cos_factor


def apply_rope(x_BSHd, cos_Sr, sin_Sr):
    """Rotate-half RoPE in the activations' dtype (as Hugging Face's Llama does); with
    tables narrower than the head (partial RoPE, as GLM-4.5), its first ``r`` features
    rotate and the rest pass unchanged."""
    r = cos_Sr.shape[-1]
    if r < x_BSHd.shape[-1]:
        x_rot, x_pass = x_BSHd.split([r, x_BSHd.shape[-1] - r], dim=-1)
        return torch.cat([apply_rope(x_rot, cos_Sr, sin_Sr), x_pass], dim=-1)
    x1, x2 = x_BSHd.chunk(2, dim=-1)
    cos_S1d, sin_S1d = cos_Sr[:, None].to(x_BSHd.dtype), sin_Sr[:, None].to(x_BSHd.dtype)
    return x_BSHd * cos_S1d + torch.cat([-x2, x1], dim=-1) * sin_S1d


def deinterleave(x):
    """Features paired (2i, 2i+1) -> [evens | odds], the rotate-half pairing (i, i + r/2);
    the same permutation of queries and keys leaves their products unchanged."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def normed(norm: nn.RMSNorm, x):
    """``norm(x)`` in the weight's dtype (fp32 under autocast, bf16 under FSDP2), back in
    the activations' (as Hugging Face's Qwen3 and DeepSeek-V3 norms)."""
    return norm(x.to(norm.weight.dtype)).type_as(x)


# --- attention ------------------------------------------------------------------------------

# FlexAttention compiled once per process, as torchtitan's ``FlexAttentionWrapper`` (eager,
# flex_attention materialises the scores; inside a compiled block dynamo inlines it).
# torch.compile is lazy: nothing compiles before the first call on CUDA.
compiled_flex_attention = torch.compile(flex_attention)


@functools.lru_cache(maxsize=8)
def block_mask(seq: int, window: int, device: str):
    """FlexAttention's causal ``BlockMask`` (within ``window`` keys when > 0) for rows of
    ``seq`` tokens, shared by every batch and head."""
    def causal(b, h, q, kv):
        return kv <= q

    def sliding(b, h, q, kv):
        return (kv <= q) & (kv > q - window)

    return create_block_mask(sliding if window else causal, None, None, seq, seq, device=device)


def eager_attention(q_BHSd, k_BKSd, v_BKSd, scale: float, window: int, sinks_H):
    """Masked softmax attention written out, as transformers' eager GPT-OSS attention:
    causal (within ``window``), the sinks as one more softmax column that is dropped
    after the softmax. The CPU path of windows and sinks (FlexAttention has no CPU
    backward)."""
    H, K, S = q_BHSd.shape[1], k_BKSd.shape[1], q_BHSd.shape[2]
    k_BHSd, v_BHSd = (t.repeat_interleave(H // K, dim=1) for t in (k_BKSd, v_BKSd))
    scores_BHSS = (q_BHSd @ k_BHSd.transpose(-1, -2)) * scale
    pos = torch.arange(S, device=q_BHSd.device)
    visible_SS = pos[None, :] <= pos[:, None]
    if window:
        visible_SS &= pos[None, :] > pos[:, None] - window
    scores_BHSS = scores_BHSS.masked_fill(~visible_SS, float("-inf"))
    if sinks_H is not None:
        sink_BHS1 = sinks_H.to(scores_BHSS.dtype)[None, :, None, None].expand(*scores_BHSS.shape[:3], 1)
        probs = torch.cat([scores_BHSS, sink_BHS1], dim=-1).float().softmax(-1)[..., :-1]
    else:
        probs = scores_BHSS.float().softmax(-1)
    return probs.to(v_BHSd.dtype) @ v_BHSd


def attend(q_BHSd, k_BKSd, v_BKSd, scale: float, window: int, sinks_H, mask) -> torch.Tensor:
    """Causal attention ``[B, H, S, d]``: plain SDPA when there is neither a window nor a
    sink; FlexAttention under ``mask`` (CUDA), the sink from its log-sum-exp; else eager."""
    gqa = k_BKSd.shape[1] != q_BHSd.shape[1]
    if not window and sinks_H is None:
        return F.scaled_dot_product_attention(q_BHSd, k_BKSd, v_BKSd, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    if mask is None:
        return eager_attention(q_BHSd, k_BKSd, v_BKSd, scale, window, sinks_H)
    # on the CPU (forward only, the tests' check of this path) flex_attention's eager form
    flex = compiled_flex_attention if q_BHSd.is_cuda else flex_attention
    if sinks_H is None:
        return flex(q_BHSd, k_BKSd, v_BKSd, block_mask=mask, scale=scale, enable_gqa=gqa)
    o_BHSd, lse_BHS = flex(q_BHSd, k_BKSd, v_BKSd, block_mask=mask, scale=scale, enable_gqa=gqa, return_lse=True)
    # the sink's column takes exp(s) / (exp(lse) + exp(s)) of each softmax and adds no
    # value: every other weight, so the output, scales by sigmoid(lse - s)
    keep_BHS = torch.sigmoid(lse_BHS - sinks_H.float()[None, :, None])
    return o_BHSd * keep_BHS[..., None].to(o_BHSd.dtype)


class Attention(nn.Module):
    """Multi-head or grouped-query attention: one ``[q | k | v]`` projection, optional
    per-head q/k RMSNorm, (partial) RoPE, optional sinks and sliding window."""

    def __init__(self, cfg: PeerConfig, window: int = 0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads or cfg.heads, cfg.head_dim
        self.window, self.scale = window, cfg.softmax_scale
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.widths = (q_width, kv_width, kv_width)
        self.qkv = nn.Linear(cfg.dim, sum(self.widths), bias=cfg.qkv_bias)  # [q | k | v]
        self.out = nn.Linear(q_width, cfg.dim, bias=cfg.out_bias)
        per_head = cfg.qk_norm == "head"
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if per_head else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if per_head else None
        self.sinks = nn.Parameter(torch.empty(self.heads)) if cfg.attn_sinks else None

    def forward(self, x_BSD, cos_Sr, sin_Sr, mask=None):
        q, k, v = self.qkv(x_BSD).split(self.widths, dim=-1)
        q = q.unflatten(-1, (self.heads, self.head_dim))
        k, v = (t.unflatten(-1, (self.kv_heads, self.head_dim)) for t in (k, v))
        if self.q_norm is not None:  # per head, before RoPE
            q, k = normed(self.q_norm, q), normed(self.k_norm, k)
        q, k = apply_rope(q, cos_Sr, sin_Sr), apply_rope(k, cos_Sr, sin_Sr)
        o_BHSd = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale, self.window,
                        self.sinks, mask)
        return self.out(o_BHSd.transpose(1, 2).flatten(2))


# torchtitan's SDPA order (its ScaledDotProductAttentionWrapper): cuDNN first; flash takes
# no value head size other than the q/k one, cuDNN and memory-efficient attention do
MLA_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]


class LatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (MLA), as torchtitan's / transformers'
    DeepSeek-V3 write it, with fmoe's parameter names: ``q`` (or ``q_down``,
    ``q_down_norm``, ``q_up``), ``kv_down`` (columns ``[latent | k_rope]``),
    ``kv_down_norm``, ``kv_up`` (per head ``[k_nope | v]``), ``out``."""

    def __init__(self, cfg: PeerConfig):
        super().__init__()
        D, H = cfg.dim, cfg.heads
        self.heads, self.qk_dim, self.rope_dim, self.v_dim = H, cfg.head_dim, cfg.rope_head_dim, cfg.v_dim
        self.nope_dim, self.latent = self.qk_dim - self.rope_dim, cfg.kv_lora_rank
        self.interleaved, self.scale, self.q_lora_rank = cfg.rope_interleave, cfg.softmax_scale, cfg.q_lora_rank
        self.pad_values = cfg.mla_pad_values and self.v_dim < self.qk_dim
        if cfg.q_lora_rank:
            self.q_down = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_down_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.q_up = nn.Linear(cfg.q_lora_rank, H * self.qk_dim, bias=False)
        else:
            self.q = nn.Linear(D, H * self.qk_dim, bias=False)
        self.kv_down = nn.Linear(D, self.latent + self.rope_dim, bias=False)
        self.kv_down_norm = nn.RMSNorm(self.latent, eps=cfg.norm_eps)
        self.kv_up = nn.Linear(self.latent, H * (self.nope_dim + self.v_dim), bias=False)
        self.out = nn.Linear(H * self.v_dim, D, bias=False)

    def rope(self, x, cos_Sr, sin_Sr):
        return apply_rope(deinterleave(x) if self.interleaved else x, cos_Sr, sin_Sr)

    def forward(self, x_BSD, cos_Sr, sin_Sr, mask=None):
        B, S, _ = x_BSD.shape
        H = self.heads
        if not self.q_lora_rank:
            q = self.q(x_BSD)
        else:
            q = self.q_up(normed(self.q_down_norm, self.q_down(x_BSD)))
        q_nope, q_rope = q.view(B, S, H, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_down(x_BSD).split([self.latent, self.rope_dim], dim=-1)
        kv = self.kv_up(normed(self.kv_down_norm, latent)).view(B, S, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = self.rope(q_rope, cos_Sr, sin_Sr)
        k_rope = self.rope(k_rope[:, :, None, :], cos_Sr, sin_Sr)  # one rotary key for every head
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, S, H, self.rope_dim)], dim=-1)
        if self.pad_values:  # zero value features add nothing to the output's first v_dim
            v = F.pad(v, (0, self.qk_dim - self.v_dim))
        with sdpa_kernel(MLA_SDPA_BACKENDS, set_priority=True):
            o_BHSv = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    is_causal=True, scale=self.scale)
        if self.pad_values:
            o_BHSv = o_BHSv[..., :self.v_dim]
        return self.out(o_BHSv.transpose(1, 2).flatten(2))


# --- MLPs and the MoE -----------------------------------------------------------------------

def glu(h, cfg: PeerConfig):
    """``[gate | up]`` -> SwiGLU, or GPT-OSS's clamped form: gate clamped at most
    ``glu_limit``, up to ``[-limit, limit]``, ``gate * sigmoid(1.702 gate) * (up + offset)``."""
    gate, up = h.chunk(2, dim=-1)
    if cfg.activation == "swiglu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=cfg.glu_limit), up.clamp(-cfg.glu_limit, cfg.glu_limit)
    return gate * torch.sigmoid(QUICK_GELU_ALPHA * gate) * (up + cfg.glu_offset)


class MLP(nn.Module):
    """A dense GLU MLP (the shared expert, and the dense layers' MLP): ``fc1`` ``[gate | up]``."""

    def __init__(self, cfg: PeerConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.fc1 = nn.Linear(cfg.dim, 2 * hidden, bias=False)
        self.fc2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.fc2(glu(self.fc1(x), self.cfg))


def expert_matmul(x_RD, w_EDN, offs_E, expert_R):
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]`` (``offs[-1]`` = all rows): one
    grouped GEMM on CUDA. Elsewhere (CPU toys in fp32, which ``_grouped_mm``'s compiled
    form refuses): every row times every expert, each row keeping its own expert's
    (``expert_R``) product; no host sync either, so it compiles too."""
    if x_RD.is_cuda:
        return torch._grouped_mm(x_RD, w_EDN, offs=offs_E)
    y_ERN = torch.matmul(x_RD, w_EDN)
    return y_ERN.gather(0, expert_R[None, :, None].expand(1, -1, y_ERN.shape[-1]))[0]


class MoE(nn.Module):
    """Token-choice top-k over ``E`` GLU experts, dropless (and a shared expert)."""

    def __init__(self, cfg: PeerConfig):
        super().__init__()
        D, E, F_ = cfg.dim, cfg.experts, cfg.ffn
        self.cfg, self.topk = cfg, cfg.topk
        self.router = nn.Linear(D, E, bias=cfg.router_bias)
        if cfg.score_func == "sigmoid":  # aux-loss-free balancing's bias: selects, never weights
            self.register_buffer("expert_bias", torch.zeros(E))
        else:
            self.expert_bias = None
        self.w1 = nn.Parameter(torch.empty(E, D, 2 * F_))  # [gate | up]
        self.w2 = nn.Parameter(torch.empty(E, F_, D))
        self.b1 = nn.Parameter(torch.empty(E, 2 * F_)) if cfg.expert_biases else None
        self.b2 = nn.Parameter(torch.empty(E, D)) if cfg.expert_biases else None
        self.shared = MLP(cfg, cfg.shared_ffn) if cfg.shared_ffn else None

    def route(self, x_TD):
        """``(probs_TK, experts_TK, scores_TE)`` in fp32 (autocast would run the router in
        bf16; under FSDP2 its weight arrives rounded to bf16): the chosen experts, their
        weights, and every expert's probability (the load-balancing loss's)."""
        cfg, K = self.cfg, self.topk
        with torch.autocast(x_TD.device.type, enabled=False):
            bias = self.router.bias.float() if self.router.bias is not None else None
            logits_TE = F.linear(x_TD.float(), self.router.weight.float(), bias)
        if cfg.score_func == "softmax" and cfg.expert_groups == 1:  # Qwen3 / Mixtral: the plain form
            probs_TE = logits_TE.softmax(-1)
            top_probs_TK, experts_TK = probs_TE.topk(K, dim=-1)
        else:
            scores_TE = logits_TE.sigmoid() if cfg.score_func == "sigmoid" else logits_TE.softmax(-1)
            selection_TE = (logits_TE if cfg.score_func == "topk_softmax" else scores_TE).detach()
            if self.expert_bias is not None:
                selection_TE = selection_TE + self.expert_bias
            if cfg.expert_groups > 1:
                selection_TE = limit_to_groups(selection_TE, cfg.expert_groups, cfg.topk_groups)
            experts_TK = selection_TE.topk(K, dim=-1).indices
            if cfg.score_func == "topk_softmax":  # GPT-OSS: softmax over the k chosen logits
                top_probs_TK = logits_TE.gather(-1, experts_TK).softmax(-1)
            else:
                top_probs_TK = scores_TE.gather(-1, experts_TK)
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True) if cfg.score_func == "sigmoid" else scores_TE
        if cfg.norm_topk_prob:
            top_probs_TK = top_probs_TK / (top_probs_TK.sum(-1, keepdim=True) + 1e-20)
        if cfg.routed_scaling != 1.0:
            top_probs_TK = top_probs_TK * cfg.routed_scaling
        return top_probs_TK, experts_TK, probs_TE

    def forward(self, x_TD):
        T, D = x_TD.shape
        E, K = self.w1.shape[0], self.topk
        A = T * K  # assignments, in (token, k) order: a = t * K + k
        top_probs_TK, experts_TK, probs_TE = self.route(x_TD)

        # Each assignment's row in the expert-sorted, padded buffer. Counts with a
        # scatter-add (bincount would read min/max on the host), and a static row count
        # R (every expert padded by at most ALIGN - 1): no host sync, no dynamic shape.
        experts_A = experts_TK.flatten()
        counts_E = torch.zeros(E, dtype=torch.long, device=x_TD.device).scatter_add_(
            0, experts_A, torch.ones_like(experts_A))
        padded_E = (counts_E + ALIGN - 1) // ALIGN * ALIGN
        starts_E = padded_E.cumsum(0) - padded_E
        order_A = experts_A.argsort(stable=True)
        sorted_experts_A = experts_A[order_A]
        rank_in_expert_A = torch.arange(A, device=x_TD.device) - (counts_E.cumsum(0) - counts_E)[sorted_experts_A]
        rows_A = torch.empty_like(experts_A).scatter_(0, order_A, starts_E[sorted_experts_A] + rank_in_expert_A)
        R = math.ceil((A + E * (ALIGN - 1)) / ALIGN) * ALIGN
        # The last expert's segment runs to R, so the grouped GEMMs read and write every
        # row of the buffer (its tail rows are zeros, costing < E * ALIGN rows of work).
        offs_E = torch.cat([starts_E[1:], torch.full_like(starts_E[:1], R)]).to(torch.int32)
        # each buffer row's expert: what the CPU product and the per-expert biases read
        need_rows = not x_TD.is_cuda or self.b1 is not None
        expert_R = torch.searchsorted(offs_E.long(), torch.arange(R, device=x_TD.device), right=True) \
            if need_rows else None

        dtype = torch.get_autocast_dtype("cuda") if x_TD.is_cuda and torch.is_autocast_enabled("cuda") \
            else self.w1.dtype  # _grouped_mm is not an autocast op: cast by hand
        # expand, not repeat_interleave: its backward is a sum over K, not an index_add.
        x_AD = x_TD.to(dtype).unsqueeze(1).expand(T, K, D).reshape(A, D)
        x_RD = x_TD.new_zeros(R, D, dtype=dtype).index_copy(0, rows_A, x_AD)
        h_RN = expert_matmul(x_RD, self.w1.to(dtype), offs_E, expert_R)
        if self.b1 is not None:
            h_RN = h_RN + self.b1.to(dtype).index_select(0, expert_R)
        y_RD = expert_matmul(glu(h_RN, self.cfg), self.w2.to(dtype), offs_E, expert_R)
        if self.b2 is not None:
            y_RD = y_RD + self.b2.to(dtype).index_select(0, expert_R)
        # Gather each token's K outputs back and sum them weighted. index_select, not
        # y_RD[rows_A], whose backward (index_put_ with accumulate) sorts the indices.
        y_TKD = y_RD.index_select(0, rows_A).view(T, K, D)
        out_TD = (y_TKD * top_probs_TK.to(dtype).unsqueeze(-1)).sum(1)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)

        # Switch-style load balancing: E * sum_e (fraction of assignments to e) * (mean prob of e).
        aux = E * (counts_E.float() / A * probs_TE.mean(0)).sum()
        return out_TD, aux


def limit_to_groups(selection_TE, groups: int, kept: int):
    """DeepSeek-V3's group-limited routing: the experts outside each token's ``kept``
    best groups (a group scored by the sum of its 2 best selection scores) set to -inf."""
    T, E = selection_TE.shape
    selection_TGe = selection_TE.view(T, groups, E // groups)
    group_scores_TG = selection_TGe.topk(2, dim=-1).values.sum(-1)
    kept_TG = group_scores_TG.topk(kept, dim=-1).indices
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, kept_TG, True)
    return selection_TGe.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)


class Block(nn.Module):
    """Pre-norm attention + MoE (``moe_norm``, ``moe``), or + a dense MLP (``mlp_norm``,
    ``mlp``) for the layers in ``dense_layers``."""

    def __init__(self, cfg: PeerConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg, cfg.window(layer))
        self.dense = layer in cfg.dense_layers
        if self.dense:
            self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
            self.mlp = MLP(cfg, cfg.dense_ffn)
        else:
            self.moe_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
            self.moe = MoE(cfg)

    def forward(self, h_BSD, cos_Sr, sin_Sr, mask=None):
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD), cos_Sr, sin_Sr, mask)
        if self.dense:
            return h_BSD + self.mlp(self.mlp_norm(h_BSD)), h_BSD.new_zeros((), dtype=torch.float32)
        y_TD, aux = self.moe(self.moe_norm(h_BSD).flatten(0, 1))
        return h_BSD + y_TD.view_as(h_BSD), aux


class PeerLM(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.final_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.loss_fn = cross_entropy_loss  # compile_blocks compiles it
        # the layers whose attention runs through FlexAttention on CUDA, and their windows
        self.windows = [cfg.window(i) for i in range(cfg.layers)]
        self.flex = not cfg.kv_lora_rank and (cfg.attn_sinks or bool(cfg.window_layers))

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Normal(0, init_std) matrices and attention sinks; residual-branch outputs
        (attention out, the experts' w2, the MLPs' fc2) scaled by 1/sqrt(2 * layers),
        GPT-2 style; norms at 1, biases at 0."""
        g = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        out_std = self.cfg.init_std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("bias", "moe.b1", "moe.b2")):
                p.zero_()
            else:
                out = name.endswith(("attn.out.weight", "moe.w2", "fc2.weight"))
                p.normal_(0.0, out_std if out else self.cfg.init_std, generator=g)

    def forward(self, tokens_BS, flex: bool | None = None):
        """Logits and the summed aux loss. ``flex``: windows and sinks through
        FlexAttention (None: on CUDA, where it has a backward)."""
        S, device = tokens_BS.shape[1], tokens_BS.device
        cos_Sr, sin_Sr = rope_tables(S, self.cfg, device)
        use_flex = self.flex and (tokens_BS.is_cuda if flex is None else flex)
        h_BSD = self.embed(tokens_BS)
        aux = 0.0
        for block, window in zip(self.blocks, self.windows):
            mask = block_mask(S, window, str(device)) if use_flex else None
            h_BSD, layer_aux = block(h_BSD, cos_Sr, sin_Sr, mask)
            aux = aux + layer_aux
        return self.head(self.final_norm(h_BSD)), aux


def cross_entropy_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())


def build(cfg, device, seed: int = 0, compile: bool = False, **choices) -> PeerLM:
    """The model on ``device``, fp32, initialised (see ``PeerLM.init_weights``); with
    ``compile``, its blocks compiled (``compile_blocks``), ready for ``shard``.
    ``choices``: PeerConfig fields that are not the model's (``mla_pad_values``)."""
    model = PeerLM(dataclasses.replace(PeerConfig.of(cfg), **choices)).to(device)
    model.init_weights(seed)
    return compile_blocks(model) if compile else model


def compile_blocks(model: PeerLM) -> PeerLM:
    """``torch.compile(block, fullgraph=True)`` for each transformer block, in place, and
    ``torch.compile`` of the loss function, as torchtitan's default compile components
    (``model``: its ``apply_compile`` per block; ``loss``); call it before ``shard``, so
    FSDP2's hooks wrap the compiled blocks and run outside their graphs. Embedding,
    final norm and head stay eager. The first step compiles (one graph, shared by every
    block, and one for the loss)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True)
    model.loss_fn = torch.compile(cross_entropy_loss)
    return model


def shard(model: PeerLM, mesh) -> PeerLM:
    """FSDP2 over a 1-D DeviceMesh: each block, then the root (embed, final norm, head).
    Every parameter, experts included, is sharded on dim 0: pure data parallelism."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    on_cuda = mesh.device_type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_cuda else None, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def decays(name: str, p: nn.Parameter) -> bool:
    """AdamW's weight decay on weight matrices only: not on norms, biases (the experts'
    ``b1``/``b2`` included, 2-D as they are) or attention sinks."""
    return p.ndim >= 2 and not name.endswith(("moe.b1", "moe.b2"))


def optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """Fused AdamW, decay on weight matrices only (``decays``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def train_step(model, opt, tokens_BS1, microbatches: int = 1) -> torch.Tensor:
    """One optimizer step on ``tokens [B, S+1]`` (next-token targets); returns this
    rank's mean cross-entropy (detached). Gradients of several microbatches accumulate;
    under FSDP2 only the last one reduce-scatters."""
    sharded = hasattr(model, "set_requires_gradient_sync")
    # Autocast for the plain model only: under FSDP2 the blocks already get bf16 weights,
    # and autocast would hand nn.RMSNorm fp32 inputs with bf16 weights (no fused kernel).
    autocast = tokens_BS1.is_cuda and not sharded
    coef = model.cfg.aux_loss_coef
    total = tokens_BS1.new_zeros((), dtype=torch.float32)
    chunks = tokens_BS1.chunk(microbatches)
    for i, mb_BS1 in enumerate(chunks):
        if sharded:
            model.set_requires_gradient_sync(i == len(chunks) - 1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits_BSV, aux = model(mb_BS1[:, :-1])
            loss = model.loss_fn(logits_BSV, mb_BS1[:, 1:])
        objective = loss + coef * aux if coef else loss
        (objective / len(chunks)).backward()
        total += loss.detach() / len(chunks)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total
