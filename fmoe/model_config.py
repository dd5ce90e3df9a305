"""ModelConfig: what a model computes, a frozen dataclass validated when it is built
(a bad value raises ``ValueError`` naming the field and what is allowed)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from .config_fields import Activation, QkNorm, ScoreFunc
from .model_checks import check_model_config

def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``m(s) = 0.1 s ln(factor) + 1`` (1 for ``factor <= 1``), transformers'
    ``get_mscale`` / ``yarn_get_mscale``."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


class Yarn(NamedTuple):
    """YaRN's settings (``ModelConfig.yarn``): ``factor``, ``original_max``, ``beta_fast``,
    ``beta_slow``, ``truncate`` as the ModelConfig fields, ``cos_factor`` the factor on
    cos/sin."""

    factor: float
    original_max: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    cos_factor: float


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only MoE transformer: every layer is attention + a routed MoE MLP, or
    attention + a dense MLP for the layers named in ``dense_layers``.

    Arguments:
        vocab, dim, layers, heads: token vocabulary, model width, depth, attention heads
            (``dim`` divisible by ``heads``; the head size must be even for RoPE).
        experts, topk, ffn: routed experts, experts per token, expert hidden width F.
        activation: ``swiglu | geglu | quick_geglu`` (GLU: fc1 is ``[D, 2F]``) or
            ``relu2`` (squared ReLU, non-GLU: fc1 is ``[D, F]``).
        glu_interleave: 0 keeps fc1's GLU halves as ``[gate | up]``; n > 0 stores them as
            blocks of n columns alternating gate, up (``ffn`` divisible by n).
        glu_limit, glu_offset: quick_geglu clamps gate to ``<= limit`` and up to
            ``[-limit, limit]`` and computes ``gate * sigmoid(1.702 gate) * (up + offset)``
            (``glu_limit = inf``: no clamp; every other float field must be finite).
        score_func: router scores (computed in fp32): ``softmax`` or ``sigmoid`` of the
            logits, or ``topk_softmax`` (GPT-OSS): the experts with the top-k logits, weighted
            by the softmax of those k logits alone (aux and z losses from the full softmax).
        norm_topk_prob: renormalise the top-k probabilities to sum to 1.
        prob_placement: ``output`` scales each expert's output by its probability;
            ``activation`` scales the activation before fc2 (differs only with fc2 bias).
        expert_biases: grouped biases ``fc1_bias [E, 2F]`` and ``fc2_bias [E, D]``.
        shared_ffn: hidden width of an always-on shared expert (0: none).
        pad_multiple: pad each expert's token segment to a multiple of this many rows
            (for quantized kernels); 0 turns padding off. Padding never reaches results.
        capacity_factor: 0 for dropless routing; f > 0 gives every expert a static
            ``ceil(f * T * K / E)`` rows per rank (T: the rank's tokens of a microbatch),
            dropping the assignments beyond that in token order (no host sync).
        aux_loss_coef, z_loss_coef: load-balancing and router z-loss coefficients.
        expert_bias_rate: step of the aux-loss-free expert-bias update (see
            ``fmoe.update_expert_bias``).
        rope_theta, norm_eps, init_std: RoPE base, RMSNorm epsilon, init scale.
        kv_heads: key/value heads; 0 means ``heads`` (multi-head attention), fewer is
            grouped-query attention (``heads`` divisible by ``kv_heads``).
        head_size: features per attention head; 0 means ``dim / heads``. Any other even
            value decouples the attention width ``heads * head_size`` from ``dim``.
        qk_norm: RMSNorm on queries and keys before RoPE: ``none``, ``head`` (one
            ``[head_size]`` weight shared by every head, as Qwen3) or ``full`` (over the
            whole projection, ``[heads * head_size]`` / ``[kv_heads * head_size]``, as OLMoE).
        qkv_bias: a bias on the q/k/v projection (as Qwen2).
        out_bias: a bias ``attn.out_bias [dim]`` on attention's output projection (as GPT-OSS).
        tie_embeddings: the head reuses ``embed`` (logits ``= h @ embed.T``; no ``head`` leaf).
        shared_gate: scale the shared expert's output by ``sigmoid(x @ gate)`` per token
            (as Qwen2-MoE); needs ``shared_ffn > 0``.
        router_bias: a learned bias ``router_bias [E]`` on the router logits (GPT-OSS), which
            selects and weights (unlike ``expert_bias``, which only selects).
        dense_layers: indices of the layers whose MLP is dense (``layers[i].mlp``) instead
            of a routed MoE (DeepSeek-V3's and GLM-4.5's first layers); at least one layer
            stays MoE. A list is taken as the sorted tuple.
        dense_ffn: hidden width of the dense layers' MLP (with ``activation``); > 0 exactly
            when ``dense_layers`` names a layer.
        expert_groups, topk_groups: group-limited selection (as DeepSeek-V3 / GLM-4.5's
            ``n_group`` / ``topk_group``): the experts form ``expert_groups`` equal groups,
            each scored by the sum of its 2 best selection scores, and a token picks its
            ``topk`` experts inside its ``topk_groups`` best groups only (``experts``
            divisible by ``expert_groups``, at least 2 experts a group, ``topk`` at most
            the experts of the kept groups). ``1, 1``: no groups.
        routed_scaling: factor on the top-k probabilities, after ``norm_topk_prob``'s
            renormalisation (``routed_scaling_factor``).
        rope_fraction: share of each q/k head's features that RoPE rotates (the first
            ``rope_dims = int(head_dim * rope_fraction)``, which must be even; the rest
            pass unchanged), in ``(0, 1]`` (``partial_rotary_factor``).
        rope_scaling: ``none`` or ``yarn`` (YaRN context extension, as DeepSeek-V3 and
            GPT-OSS, computed as transformers' ``rope_type="yarn"``): the rotated pairs'
            frequencies blend ``theta ** (-2i / rope_dims)`` (fast pairs, kept) with it
            divided by ``rope_factor`` (slow pairs, interpolated), and cos/sin are
            multiplied by an attention factor. The ``rope_factor`` and ``yarn_*`` fields
            below are read only with ``yarn`` and must keep their defaults under ``none``.
        rope_factor: YaRN's context extension ``factor``, >= 1.
        rope_original_max: the context length pretrained before the extension
            (``original_max_position_embeddings``), > 0 with ``yarn``.
        yarn_beta_fast, yarn_beta_slow: rotations over ``rope_original_max`` positions
            above which a pair keeps its frequency (``beta_fast``) and below which it is
            fully interpolated (``beta_slow``), with a linear ramp between; > 0, fast >= slow.
        yarn_mscale, yarn_mscale_all_dim: the attention factor is
            ``m(mscale) / m(mscale_all_dim)`` with ``m(s) = 0.1 s ln(rope_factor) + 1``
            when both are > 0, else ``m(1)`` (0: unset in transformers' config, as
            GPT-OSS). ``yarn_mscale_all_dim > 0`` also multiplies the softmax scale by
            ``m(mscale_all_dim) ** 2`` (DeepSeek-V3's ``attention_scale``).
        yarn_attention_factor: the factor on cos/sin given explicitly
            (``attention_factor``); 0 derives it from the mscales as above.
        yarn_truncate: round the ramp's ends to whole pairs (floor, ceil) as
            transformers' ``truncate`` (its default, True); False keeps them fractional.
        attn_sinks: attention sinks (as GPT-OSS): a learned logit per head
            (``layers[i].attn.sinks [heads]``) that joins every query's softmax as one
            more column with no value, so a query may attend to nothing.
        sliding_window: the window of the layers in ``window_layers`` (as GPT-OSS's
            ``sliding_attention`` layers): a query at position i sees the keys j with
            ``i - sliding_window < j <= i``; > 0 exactly when ``window_layers`` names a layer.
        window_layers: indices of the layers with the sliding window; the others attend
            to every earlier position. A list is taken as the sorted tuple.
        kv_lora_rank: > 0 turns attention into multi-head latent attention (MLA, as
            DeepSeek-V3): keys and values come up from a ``kv_lora_rank``-wide latent
            (``attn.kv_down``, its RMSNorm ``kv_down_norm``, ``attn.kv_up``), every head
            has its own key and value (``kv_heads`` must be 0), and each q/k head of
            ``head_size`` features is ``[head_size - rope_head_dim`` without RoPE ``|
            rope_head_dim`` with it``]``, the keys' rotated part one for all heads. 0: the
            ``qkv`` projection.
        q_lora_rank: MLA's queries through a ``q_lora_rank``-wide low-rank projection
            (``attn.q_down``, its RMSNorm ``q_down_norm``, ``attn.q_up``); 0: one
            projection ``attn.q``. Only with ``kv_lora_rank > 0``.
        rope_head_dim: MLA's rotated features per q/k head (``qk_rope_head_dim``), even,
            fewer than ``head_size``; > 0 exactly with ``kv_lora_rank > 0``
            (``rope_fraction`` stays 1).
        v_head_size: MLA's value features per head (``v_head_dim``); 0 means
            ``head_size``. Attention's output is ``heads * v_head_size`` wide.
        rope_interleave: the rotated features pair as ``(2i, 2i + 1)`` (DeepSeek-V3's
            released layout, transformers' ``rope_interleave``) rather than ``(i, i + r/2)``.
    """

    vocab: int = 256
    dim: int = 256
    layers: int = 2
    heads: int = 4
    experts: int = 8
    topk: int = 2
    ffn: int = 512
    activation: str = "swiglu"
    glu_interleave: int = 0
    glu_limit: float = 7.0
    glu_offset: float = 1.0
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    prob_placement: str = "output"
    expert_biases: bool = False
    shared_ffn: int = 0
    pad_multiple: int = 0
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias_rate: float = 1e-3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    kv_heads: int = 0
    head_size: int = 0
    qk_norm: str = "none"
    qkv_bias: bool = False
    out_bias: bool = False
    tie_embeddings: bool = False
    shared_gate: bool = False
    router_bias: bool = False
    dense_layers: tuple = ()
    dense_ffn: int = 0
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    rope_fraction: float = 1.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: float = 0.0
    yarn_truncate: bool = True
    attn_sinks: bool = False
    sliding_window: int = 0
    window_layers: tuple = ()
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_size: int = 0
    rope_interleave: bool = False

    def __post_init__(self):
        for name in ("dense_layers", "window_layers"):
            if isinstance(getattr(self, name), list):  # as JSON and TOML hold it
                object.__setattr__(self, name, tuple(sorted(getattr(self, name))))
        check_model_config(self)

    def is_dense(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is dense (``dense_layers``), not a routed MoE."""
        return layer in self.dense_layers

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window: ``sliding_window`` if ``window_layers`` names
        it, else 0 (it attends to every earlier position)."""
        return self.sliding_window if layer in self.window_layers else 0

    @property
    def any_window(self) -> int:
        """``sliding_window`` if some layer uses it, else 0 (what packed documents'
        masks are built for)."""
        return self.sliding_window if self.window_layers else 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the MoE layers, in order (what ``MoEStats`` and
        ``expert_counts`` have a row for)."""
        return tuple(i for i in range(self.layers) if i not in self.dense_layers)

    @property
    def yarn(self) -> "Yarn | None":
        """YaRN's settings as one hashable value (None without ``rope_scaling='yarn'``),
        what the attention's RoPE tables are computed from."""
        if self.rope_scaling != "yarn":
            return None
        return Yarn(self.rope_factor, self.rope_original_max, self.yarn_beta_fast, self.yarn_beta_slow,
                    self.yarn_truncate, self.yarn_cos_factor)

    @property
    def yarn_cos_factor(self) -> float:
        """The factor on YaRN's cos/sin (transformers' ``attention_scaling``):
        ``yarn_attention_factor``, or derived from ``rope_factor`` and the mscales."""
        if self.yarn_attention_factor:
            return self.yarn_attention_factor
        factor = self.rope_factor
        if self.yarn_mscale and self.yarn_mscale_all_dim:
            return float(yarn_get_mscale(factor, self.yarn_mscale)
                         / yarn_get_mscale(factor, self.yarn_mscale_all_dim))
        return yarn_get_mscale(factor)

    @property
    def attention_scale(self) -> float:
        """The softmax's factor on ``q . k``: ``head_dim ** -0.5``, and with YaRN and
        ``yarn_mscale_all_dim > 0`` times ``m(mscale_all_dim) ** 2`` (DeepSeek-V3's
        correction, which keeps the scores' temperature under the longer context)."""
        if self.rope_scaling == "yarn" and self.yarn_mscale_all_dim:
            m = yarn_get_mscale(self.rope_factor, self.yarn_mscale_all_dim)
            return self.head_dim ** (-0.5) * m * m  # in DeepseekV3Attention's order of operations
        return 1.0 / math.sqrt(self.head_dim)  # as SDPA works out its default

    @property
    def activation_mode(self) -> Activation:
        """``activation`` as an Activation."""
        return Activation(self.activation)

    @property
    def is_glu(self) -> bool:
        return self.activation_mode.gated

    @property
    def head_dim(self) -> int:
        """Features per attention head: ``head_size``, or ``dim / heads`` when it is 0."""
        return self.head_size or self.dim // self.heads

    @property
    def rope_dims(self) -> int:
        """Features of each q/k head that RoPE rotates: ``int(head_dim * rope_fraction)``,
        or ``rope_head_dim`` under MLA."""
        return self.rope_head_dim or int(self.head_dim * self.rope_fraction)

    @property
    def latent(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def v_head_dim(self) -> int:
        """Features per value head: ``v_head_size``, or ``head_dim`` when it is 0."""
        return self.v_head_size or self.head_dim

    @property
    def attn_out_width(self) -> int:
        """Rows of attention's output projection: ``heads * v_head_dim``."""
        return self.heads * self.v_head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def q_width(self) -> int:
        """Columns of the query projection: ``heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Columns of the key (and of the value) projection: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def score_func_mode(self) -> ScoreFunc:
        """``score_func`` as a ScoreFunc."""
        return ScoreFunc(self.score_func)

    @property
    def qk_norm_mode(self) -> QkNorm:
        """``qk_norm`` as a QkNorm."""
        return QkNorm(self.qk_norm)

    @property
    def qk_norm_widths(self) -> tuple[int, int] | None:
        """The widths of the ``q_norm`` and ``k_norm`` weights (None: ``qk_norm='none'``)."""
        match self.qk_norm_mode:
            case QkNorm.HEAD:
                return self.head_dim, self.head_dim
            case QkNorm.FULL:
                return self.q_width, self.kv_width
        return None

    def fc1_width(self, hidden: int) -> int:
        """Columns of an fc1 whose activation yields ``hidden`` features."""
        return 2 * hidden if self.is_glu else hidden

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
