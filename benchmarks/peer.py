"""A plain PyTorch MoE language model: the independent peer fmoe is measured against.

Nothing here imports fmoe. It is the model an experienced PyTorch user writes in an
afternoon: ``nn.Module``s, causal SDPA with RoPE (multi-head or grouped-query, an
optional per-head RMSNorm of queries and keys as Qwen3), pre-norm blocks whose MLP is
a routed MoE (fp32 softmax router, top-k, optionally renormalised; experts as
``[E, D, 2F]`` / ``[E, F, D]`` parameters through ``torch._grouped_mm`` on rows sorted
by expert and padded to 16 per expert; SwiGLU), an untied head, mean cross-entropy,
``torch.optim.AdamW(fused=True)``. Optionally each block is compiled as torchtitan
does it: ``torch.compile(block, fullgraph=True)`` per transformer block, before FSDP2.

    model = build(cfg, "cuda")                  # one GPU (or CPU), no sharding, eager
    model = build(cfg, "cuda", compile=True)    # the same, each block torch.compile'd
    model = shard(build(cfg, "cuda", compile=True), mesh)   # FSDP2 over compiled blocks
    opt = optimizer(model, lr)
    loss = train_step(model, opt, tokens_BS1)   # forward, backward, AdamW step

``cfg`` is anything with the fields of ``PeerConfig`` (a ``fmoe.ModelConfig`` has them,
with the same meaning: ``kv_heads`` 0 = ``heads``, ``head_size`` 0 = ``dim / heads``,
``qk_norm`` ``none | head``, ``norm_topk_prob``).

Compilation and the MoE's dynamic routing: the rows each expert gets change every
step, but no *shape* does. Every expert's segment is padded to a multiple of 16 rows,
so the padded total is at most ``T * K + E * 15``; the expert buffer always has that
static maximum (rounded up to 16) rows, the last expert's segment runs to its end, and
only the segment offsets (a tensor) change. So nothing is marked dynamic, there is no
host sync and no data-dependent shape, each block compiles to one full graph, and the
blocks share it (same shapes, parameters are graph inputs): after the first step there
are no recompiles. The price is at most ``E * 16`` rows of zeros per layer.

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
import math

import torch
import torch.nn.functional as F
from torch import nn

ALIGN = 16  # torch._grouped_mm wants each expert's row segment to start at a multiple of 16


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 8
    heads: int = 16
    kv_heads: int = 0       # key/value heads; 0 = heads (fewer: grouped-query attention)
    head_size: int = 0      # features per head; 0 = dim // heads
    qk_norm: str = "none"   # "head": RMSNorm of each query and key head before RoPE (Qwen3)
    experts: int = 16
    topk: int = 4
    ffn: int = 1408
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    aux_loss_coef: float = 0.0

    def __post_init__(self):
        if self.qk_norm not in ("none", "head"):
            raise ValueError(f"PeerConfig.qk_norm={self.qk_norm!r}: the peer has 'none' and 'head'")
        if self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"PeerConfig.kv_heads={self.kv_heads} must divide heads ({self.heads})")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    @classmethod
    def of(cls, cfg) -> "PeerConfig":
        """The fields of any config object that has them (e.g. ``fmoe.ModelConfig``)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)})


def rope_tables(seq: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[S, head_dim]`` (each frequency twice, for the rotate-half form)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles_Sh = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles_Sd = torch.cat([angles_Sh, angles_Sh], dim=-1)
    return angles_Sd.cos(), angles_Sd.sin()


def apply_rope(x_BSHd, cos_Sd, sin_Sd):
    """Rotate-half RoPE in the activations' dtype (as Hugging Face's Llama does)."""
    x1, x2 = x_BSHd.chunk(2, dim=-1)
    cos_S1d, sin_S1d = cos_Sd[:, None].to(x_BSHd.dtype), sin_Sd[:, None].to(x_BSHd.dtype)
    return x_BSHd * cos_S1d + torch.cat([-x2, x1], dim=-1) * sin_S1d


class Attention(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads or cfg.heads, cfg.head_dim
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.widths = (q_width, kv_width, kv_width)
        self.qkv = nn.Linear(cfg.dim, sum(self.widths), bias=False)  # [q | k | v]
        self.out = nn.Linear(q_width, cfg.dim, bias=False)
        per_head = cfg.qk_norm == "head"
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if per_head else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if per_head else None

    def forward(self, x_BSD, cos_Sd, sin_Sd):
        q, k, v = self.qkv(x_BSD).split(self.widths, dim=-1)
        q = q.unflatten(-1, (self.heads, self.head_dim))
        k, v = (t.unflatten(-1, (self.kv_heads, self.head_dim)) for t in (k, v))
        if self.q_norm is not None:  # per head, before RoPE; in the weight's dtype (fp32 under
            # autocast, as Hugging Face's Qwen3; bf16 under FSDP2), back to the activations'
            w = self.q_norm.weight.dtype
            q, k = self.q_norm(q.to(w)).type_as(q), self.k_norm(k.to(w)).type_as(k)
        q, k = apply_rope(q, cos_Sd, sin_Sd), apply_rope(k, cos_Sd, sin_Sd)
        o_BHSd = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.out(o_BHSd.transpose(1, 2).flatten(2))


def expert_matmul(x_RD, w_EDN, offs_E):
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]`` (``offs[-1]`` = all rows): one
    grouped GEMM on CUDA. Elsewhere (CPU toys in fp32, which ``_grouped_mm``'s compiled
    form refuses): every row times every expert, each row keeping its own expert's
    product; no host sync either, so it compiles too."""
    if x_RD.is_cuda:
        return torch._grouped_mm(x_RD, w_EDN, offs=offs_E)
    rows_R = torch.arange(x_RD.shape[0], device=x_RD.device)
    expert_R = torch.searchsorted(offs_E.long(), rows_R, right=True)
    y_ERN = torch.matmul(x_RD, w_EDN)
    return y_ERN.gather(0, expert_R[None, :, None].expand(1, -1, y_ERN.shape[-1]))[0]


class MoE(nn.Module):
    """Token-choice top-k over ``E`` SwiGLU experts, dropless."""

    def __init__(self, cfg: PeerConfig):
        super().__init__()
        D, E, F_ = cfg.dim, cfg.experts, cfg.ffn
        self.topk, self.norm_topk_prob = cfg.topk, cfg.norm_topk_prob
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, D, 2 * F_))  # [gate | up]
        self.w2 = nn.Parameter(torch.empty(E, F_, D))

    def forward(self, x_TD):
        T, D = x_TD.shape
        E, K = self.w1.shape[0], self.topk
        A = T * K  # assignments, in (token, k) order: a = t * K + k
        # Router in fp32 (autocast would run it in bf16; under FSDP2 its weight arrives
        # rounded to bf16): softmax, top-k, renormalise over the top k.
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.router.weight.float())
        probs_TE = logits_TE.softmax(-1)
        top_probs_TK, experts_TK = probs_TE.topk(K, dim=-1)
        if self.norm_topk_prob:
            top_probs_TK = top_probs_TK / top_probs_TK.sum(-1, keepdim=True)

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

        dtype = torch.get_autocast_dtype("cuda") if x_TD.is_cuda and torch.is_autocast_enabled("cuda") \
            else self.w1.dtype  # _grouped_mm is not an autocast op: cast by hand
        # expand, not repeat_interleave: its backward is a sum over K, not an index_add.
        x_AD = x_TD.to(dtype).unsqueeze(1).expand(T, K, D).reshape(A, D)
        x_RD = x_TD.new_zeros(R, D, dtype=dtype).index_copy(0, rows_A, x_AD)
        gate_RF, up_RF = expert_matmul(x_RD, self.w1.to(dtype), offs_E).chunk(2, dim=-1)
        y_RD = expert_matmul(F.silu(gate_RF) * up_RF, self.w2.to(dtype), offs_E)
        # Gather each token's K outputs back and sum them weighted. index_select, not
        # y_RD[rows_A], whose backward (index_put_ with accumulate) sorts the indices.
        y_TKD = y_RD.index_select(0, rows_A).view(T, K, D)
        out_TD = (y_TKD * top_probs_TK.to(dtype).unsqueeze(-1)).sum(1)

        # Switch-style load balancing: E * sum_e (fraction of assignments to e) * (mean prob of e).
        aux = E * (counts_E.float() / A * probs_TE.mean(0)).sum()
        return out_TD, aux


class Block(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, h_BSD, cos_Sd, sin_Sd):
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD), cos_Sd, sin_Sd)
        y_TD, aux = self.moe(self.moe_norm(h_BSD).flatten(0, 1))
        return h_BSD + y_TD.view_as(h_BSD), aux


class PeerLM(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.loss_fn = cross_entropy_loss  # compile_blocks compiles it

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Normal(0, init_std) matrices; residual-branch outputs (attention out, w2)
        scaled by 1/sqrt(2 * layers), GPT-2 style; norms at 1."""
        g = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        out_std = self.cfg.init_std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, out_std if name.endswith(("attn.out.weight", "moe.w2")) else self.cfg.init_std,
                          generator=g)

    def forward(self, tokens_BS):
        cos_Sd, sin_Sd = rope_tables(tokens_BS.shape[1], self.cfg.head_dim, self.cfg.rope_theta, tokens_BS.device)
        h_BSD = self.embed(tokens_BS)
        aux = 0.0
        for block in self.blocks:
            h_BSD, layer_aux = block(h_BSD, cos_Sd, sin_Sd)
            aux = aux + layer_aux
        return self.head(self.final_norm(h_BSD)), aux


def cross_entropy_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())


def build(cfg, device, seed: int = 0, compile: bool = False) -> PeerLM:
    """The model on ``device``, fp32, initialised (see ``PeerLM.init_weights``); with
    ``compile``, its blocks compiled (``compile_blocks``), ready for ``shard``."""
    model = PeerLM(PeerConfig.of(cfg)).to(device)
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


def optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """Fused AdamW, decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
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
