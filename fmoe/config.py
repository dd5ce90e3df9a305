"""ModelConfig and Plan: frozen dataclasses, validated when they are built.

A bad value raises ``ValueError`` naming the field and what is allowed, before any
tensor exists; everything downstream may trust these objects.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from .backends import expert_backend_names
from .checks import check_bool, check_choice, check_int, check_positive, fail, is_int, is_number
from .units import check_units

ACTIVATIONS = ("swiglu", "geglu", "quick_geglu", "relu2")
GLU_ACTIVATIONS = ("swiglu", "geglu", "quick_geglu")
SCORE_FUNCS = ("softmax", "sigmoid", "topk_softmax")
PROB_PLACEMENTS = ("output", "activation")
PAD_MULTIPLES = (0, 8, 16, 32, 64, 128, 256)
SHARDINGS = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SCHEDULES = ("standard", "1f1b_overlap")
DTYPES = ("float32", "bfloat16")
GATHER_BUFFERS = ("dynamic", "double", "persistent")
QK_NORMS = ("none", "head", "full")
REMATS = ("none", "selective", "full")
FP8S = ("none", "rowwise", "tensorwise")
ROPE_SCALINGS = ("none", "yarn")
# The fields with a fixed set of values (with expert_backend's names: ``choices``, what the
# main job's --help lists).
CHOICES = {"activation": ACTIVATIONS, "score_func": SCORE_FUNCS, "prob_placement": PROB_PLACEMENTS,
           "pad_multiple": PAD_MULTIPLES, "qk_norm": QK_NORMS, "sharding": SHARDINGS, "schedule": SCHEDULES,
           "dtype": DTYPES, "gather_buffers": GATHER_BUFFERS,
           "remat": REMATS, "fp8": FP8S, "rope_scaling": ROPE_SCALINGS}


def choices(field: str) -> tuple | None:
    """The values a config field may hold, or None for a field without a fixed set:
    ``CHOICES``, and for ``expert_backend`` the names known now (``fmoe.backends``)."""
    if field == "expert_backend":
        return expert_backend_names()
    return CHOICES.get(field)


def _check_layer_indices(cfg, own: str, name: str) -> tuple:
    """``cfg.<name>``, a tuple of distinct layer indices in order, or a ValueError naming it."""
    layers = getattr(cfg, name)
    ok = isinstance(layers, tuple) and all(is_int(i, builtin=True) and 0 <= i < cfg.layers for i in layers)
    if not ok or tuple(sorted(set(layers))) != layers:
        fail(f"{own}.{name}", layers, f"must be distinct layer indices in 0..{cfg.layers - 1}, in order")
    return layers


def _check_dense_layers(cfg, own: str) -> None:
    layers = _check_layer_indices(cfg, own, "dense_layers")
    if len(layers) == cfg.layers:
        fail(f"{own}.dense_layers", layers, f"must leave at least one of the {cfg.layers} layers MoE")
    check_int(f"{own}.dense_ffn", cfg.dense_ffn, 0, builtin=True)
    if bool(layers) != bool(cfg.dense_ffn):
        fail(f"{own}.dense_ffn", cfg.dense_ffn, "must be > 0 exactly when dense_layers names a layer "
             f"(dense_layers={list(layers)})")
    if cfg.glu_interleave and cfg.dense_ffn % cfg.glu_interleave:
        fail(f"{own}.glu_interleave", cfg.glu_interleave, f"must divide dense_ffn ({cfg.dense_ffn})")


def _check_window(cfg, own: str) -> None:
    layers = _check_layer_indices(cfg, own, "window_layers")
    check_int(f"{own}.sliding_window", cfg.sliding_window, 0, builtin=True)
    if bool(layers) != bool(cfg.sliding_window):
        fail(f"{own}.sliding_window", cfg.sliding_window, "must be > 0 exactly when window_layers names a layer "
             f"(window_layers={list(layers)})")


def _check_choices(config, own: str) -> None:
    """Every field of ``config`` with a set of values (``choices``) holds one of them."""
    for field in dataclasses.fields(config):
        allowed = choices(field.name)
        if allowed is not None:
            check_choice(f"{own}.{field.name}", getattr(config, field.name), allowed)


def field_docs(cls) -> dict:
    """``{field: its text}`` from the ``Arguments:`` section of a config class's
    docstring (entries ``name, other: text`` with indented continuation lines), so
    that the command line's help is the docstring, not a second copy."""
    docs, names = {}, []
    lines = (cls.__doc__ or "").split("Arguments:", 1)[-1].splitlines()
    for line in lines[1:]:
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(stripped)
        head, sep, text = stripped.partition(": ")
        if sep and indent <= 8 and all(n.isidentifier() for n in head.split(", ")):
            names = head.split(", ")
            for n in names:
                docs[n] = text
        elif names:
            for n in names:
                docs[n] += " " + stripped
    return {n: t.replace("``", "") for n, t in docs.items()}


_YARN_FIELDS = ("rope_factor", "rope_original_max", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
                "yarn_mscale_all_dim", "yarn_attention_factor", "yarn_truncate")


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

    def __post_init__(self):
        own = "ModelConfig"
        for name in ("dense_layers", "window_layers"):
            if isinstance(getattr(self, name), list):  # as JSON and TOML hold it
                object.__setattr__(self, name, tuple(sorted(getattr(self, name))))
        for name in ("vocab", "dim", "layers", "heads", "experts", "topk", "ffn"):
            check_int(f"{own}.{name}", getattr(self, name), 1, builtin=True)
        check_int(f"{own}.shared_ffn", self.shared_ffn, 0, builtin=True)
        check_int(f"{own}.glu_interleave", self.glu_interleave, 0, builtin=True)
        check_int(f"{own}.kv_heads", self.kv_heads, 0, builtin=True)
        check_int(f"{own}.head_size", self.head_size, 0, builtin=True)
        check_int(f"{own}.expert_groups", self.expert_groups, 1, builtin=True)
        check_int(f"{own}.topk_groups", self.topk_groups, 1, builtin=True)
        _check_choices(self, own)
        for name in ("qkv_bias", "tie_embeddings", "shared_gate", "norm_topk_prob", "expert_biases", "router_bias",
                     "attn_sinks"):
            check_bool(f"{own}.{name}", getattr(self, name))
        check_positive(f"{own}.glu_limit", self.glu_limit, allow_inf=True)  # inf: no clamp
        for name in ("rope_theta", "norm_eps", "init_std", "routed_scaling", "rope_fraction"):
            check_positive(f"{own}.{name}", getattr(self, name))
        for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate", "capacity_factor"):
            check_positive(f"{own}.{name}", getattr(self, name), allow_zero=True)
        if not is_number(self.glu_offset, builtin=True) or not math.isfinite(self.glu_offset):
            fail(f"{own}.glu_offset", self.glu_offset, "must be a finite number")
        if self.topk > self.experts:
            fail(f"{own}.topk", self.topk, f"must be <= experts ({self.experts})")
        if self.head_size == 0 and self.dim % self.heads:
            fail(f"{own}.dim", self.dim, f"must be divisible by heads ({self.heads}) unless head_size is set")
        if self.head_dim % 2:
            what = "head_size" if self.head_size else "heads"
            fail(f"{own}.{what}", getattr(self, what), f"the head size must be even for RoPE (got {self.head_dim})")
        self._check_groups()
        self._check_rope_fraction()
        self._check_rope_scaling()
        if self.kv_heads and self.heads % self.kv_heads:
            fail(f"{own}.kv_heads", self.kv_heads, f"must divide heads ({self.heads}), or be 0 for kv_heads = heads")
        _check_dense_layers(self, own)
        _check_window(self, own)
        if self.shared_gate and not self.shared_ffn:
            fail(f"{own}.shared_gate", self.shared_gate, "needs a shared expert (shared_ffn > 0)")
        if self.glu_interleave:
            if not self.is_glu:
                fail(f"{own}.glu_interleave", self.glu_interleave,
                      f"must be 0 for the non-GLU activation {self.activation!r}")
            for name in ("ffn", "shared_ffn"):
                width = getattr(self, name)
                if width % self.glu_interleave:
                    fail(f"{own}.glu_interleave", self.glu_interleave,
                          f"must divide {name} ({width})")

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

    def _check_groups(self) -> None:
        own, groups = "ModelConfig", self.expert_groups
        if self.experts % groups:
            fail(f"{own}.expert_groups", groups, f"must divide experts ({self.experts})")
        if self.topk_groups > groups:
            fail(f"{own}.topk_groups", self.topk_groups, f"must be <= expert_groups ({groups})")
        if groups == 1:
            return
        per_group = self.experts // groups
        if per_group < 2:  # a group's score is the sum of its 2 best experts'
            fail(f"{own}.expert_groups", groups, f"must leave at least 2 experts a group (experts={self.experts})")
        if self.topk > self.topk_groups * per_group:
            fail(f"{own}.topk_groups", self.topk_groups,
                 f"keeps {self.topk_groups * per_group} experts ({per_group} a group), fewer than topk ({self.topk})")

    def _check_rope_fraction(self) -> None:
        own = "ModelConfig.rope_fraction"
        if self.rope_fraction > 1:
            fail(own, self.rope_fraction, "must be in (0, 1]")
        if self.rope_dims == 0 or self.rope_dims % 2:
            fail(own, self.rope_fraction, f"must give an even, nonzero rope_dims = int(head_dim * rope_fraction) "
                                          f"(head_dim {self.head_dim}: {self.rope_dims})")

    def _check_rope_scaling(self) -> None:
        own = "ModelConfig"
        check_bool(f"{own}.yarn_truncate", self.yarn_truncate)
        check_int(f"{own}.rope_original_max", self.rope_original_max, 0, builtin=True)
        for name in ("yarn_beta_fast", "yarn_beta_slow"):
            check_positive(f"{own}.{name}", getattr(self, name))
        for name in ("yarn_mscale", "yarn_mscale_all_dim", "yarn_attention_factor"):
            check_positive(f"{own}.{name}", getattr(self, name), allow_zero=True)
        check_positive(f"{own}.rope_factor", self.rope_factor)
        if self.rope_scaling == "none":
            # a YaRN setting without rope_scaling='yarn' would be silently ignored
            for field in dataclasses.fields(self):
                if field.name in _YARN_FIELDS and getattr(self, field.name) != field.default:
                    fail(f"{own}.{field.name}", getattr(self, field.name),
                         f"is read only with rope_scaling='yarn' (is 'none'): leave it at {field.default!r}")
            return
        if self.rope_factor < 1:
            fail(f"{own}.rope_factor", self.rope_factor, "must be >= 1 with rope_scaling='yarn'")
        if self.rope_original_max < 1:
            fail(f"{own}.rope_original_max", self.rope_original_max,
                 "must be an int >= 1 with rope_scaling='yarn' (original_max_position_embeddings)")
        if self.yarn_beta_fast < self.yarn_beta_slow:
            fail(f"{own}.yarn_beta_fast", self.yarn_beta_fast, f"must be >= yarn_beta_slow ({self.yarn_beta_slow})")

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
    def is_glu(self) -> bool:
        return self.activation in GLU_ACTIVATIONS

    @property
    def head_dim(self) -> int:
        """Features per attention head: ``head_size``, or ``dim / heads`` when it is 0."""
        return self.head_size or self.dim // self.heads

    @property
    def rope_dims(self) -> int:
        """Features of each q/k head that RoPE rotates: ``int(head_dim * rope_fraction)``."""
        return int(self.head_dim * self.rope_fraction)

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

    def fc1_width(self, hidden: int) -> int:
        """Columns of an fc1 whose activation yields ``hidden`` features."""
        return 2 * hidden if self.is_glu else hidden

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Plan:
    """How to run a model: parallelism, sharding, schedule, precision, device.

    Arguments:
        model: the ModelConfig.
        dp, ep: data- and expert-parallel sizes; the world is ``dp * ep`` ranks.
        sharding: ``no_shard | optim | optim_grads | optim_grads_params``.
        schedule: ``standard`` (each microbatch forward, then backward) or
            ``1f1b_overlap`` (the forward of microbatch i+1 woven into the backward of
            microbatch i so one microbatch's all-to-alls run under the other's compute).
        microbatches: gradient-accumulation steps per ``fmoe.step`` (must divide each
            rank's batch rows).
        dtype: compute dtype, ``float32 | bfloat16``; params, grads and optimizer
            state stay fp32.
        delay_wgrad: the experts' backward computes input gradients only; their
            weight-gradient GEMMs run later, under the dispatch's backward all-to-all.
        expert_backend: ``torch`` (``torch._grouped_mm`` where shapes allow, an exact
            per-expert loop otherwise), ``loop`` (always the loop), or a backend
            registered or declared by name (``fmoe.backends``), such as ``te``
            (TransformerEngine's grouped GEMMs and scaled GLU kernels on CUDA; provided
            by ``interop.te``, which must be imported before the first step).
        device: where params live and compute runs (``cpu``, ``cuda``, ``cuda:1``...).
        units: FSDP units as groups of members (``embed``, ``layers.<i>``, ``head``),
            e.g. ``(("embed", "head"), ("layers.0", "layers.1"))``; None: one unit per
            member.
        prefetch: how many unit spans ahead ``optim_grads_params`` gathers while computing.
        gather_buffers: memory for gathered units: ``dynamic`` (allocated per gather,
            freed on release), ``double`` (two slots reused alternately; needs
            ``prefetch <= 1``) or ``persistent`` (one fixed buffer per unit).
        compile: run the layer nodes' compute (attention half, router, head and loss,
            the experts' torch-code activation) through ``torch.compile``
            (``fmoe/schedule/compiled.py``); the first step compiles. Same results as
            eager up to the reassociation of fused floating-point sums.
        remat: activation recomputation, ``none | selective | full``. ``selective``:
            the attention, router and expert kernels keep their GEMM (and SDPA)
            outputs and recompute the elementwise work around them (norms, RoPE, the
            GLU activation with its probability scaling, the router's fp32 copy) in
            their node's backward (``fmoe/schedule/remat.py``); meant for
            ``compile=True``, where it costs ~3% (eager, torch runs the policy per op
            from Python, ~20% slower: use ``full`` there). ``full``: a layer's forward
            keeps only its input (and what routing decided; under expert parallelism
            also the rows that crossed ranks, so no all-to-all runs twice) and a
            ``recompute`` action re-runs the layer right before its backward. Same
            results, bitwise; less activation memory for about a third more compute.
        loss_chunk: tokens per piece of the head's loss (0: all of a microbatch at
            once). Each piece's logits are computed, used and dropped, in the forward
            and again in the backward, so the ``[tokens, vocab]`` logits never exist
            whole.
        fp8: ``none | rowwise | tensorwise``. ``rowwise``: the GEMMs of attention's
            projections, the shared expert and the routed experts run in FP8 E4M3 with
            one scale per row of each operand, computed on the fly
            (``fmoe/layers/fp8.py``); the head stays bf16. ``tensorwise``: the same
            products and the head's, the dense ones with one scale per operand and
            their output gradients in E5M2 (the experts' as ``rowwise``). Either way
            master params, gradients and optimizer state stay fp32, router, norms,
            softmax and the loss as without. Under ``tensorwise`` with the dense
            weights sharded, those products' weights are gathered already in FP8
            (half the bytes; the same FP8 weights bit for bit) from a buffer group of
            their own, so each rank holds other rows of the dense params than under
            ``none`` or ``rowwise``: to switch ``fp8`` under a sharded plan, ``fmoe.load``
            a checkpoint with the new plan. Needs ``dtype='bfloat16'``, the
            ``torch`` expert backend, GEMM widths that are multiples of 16 (the
            vocabulary too under ``tensorwise``) and a Hopper GPU (compute capability
            9.x); refused elsewhere.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    dp: int = 1
    ep: int = 1
    sharding: str = "no_shard"
    schedule: str = "standard"
    microbatches: int = 1
    dtype: str = "float32"
    delay_wgrad: bool = False
    expert_backend: str = "torch"
    device: str = "cpu"
    units: tuple | None = None
    prefetch: int = 1
    gather_buffers: str = "dynamic"
    compile: bool = False
    remat: str = "none"
    loss_chunk: int = 0
    fp8: str = "none"

    def __post_init__(self):
        own = "Plan"
        if not isinstance(self.model, ModelConfig):
            fail(f"{own}.model", type(self.model).__name__, "must be a fmoe.ModelConfig")
        for name in ("dp", "ep", "microbatches"):
            check_int(f"{own}.{name}", getattr(self, name), 1, builtin=True)
        _check_choices(self, own)
        check_bool(f"{own}.delay_wgrad", self.delay_wgrad)
        check_bool(f"{own}.compile", self.compile)
        check_int(f"{own}.loss_chunk", self.loss_chunk, 0, builtin=True)
        check_int(f"{own}.prefetch", self.prefetch, 0, builtin=True)
        if self.gather_buffers == "double" and self.prefetch > 1:
            fail(f"{own}.prefetch", self.prefetch,
                  "gather_buffers='double' holds 2 units, so prefetch must be 0 or 1 "
                  "(or use gather_buffers 'dynamic' / 'persistent')")
        if self.fp8 != "none":
            self._check_fp8()
        if self.units is not None:
            object.__setattr__(self, "units", check_units(self.units, self.model))
        if self.model.experts % self.ep:
            fail(f"{own}.ep", self.ep, f"must divide model.experts ({self.model.experts})")
        if not isinstance(self.device, str):
            fail(f"{own}.device", self.device, "must be a device string such as 'cpu' or 'cuda'")
        try:
            import torch

            torch.device(self.device)
        except RuntimeError:
            fail(f"{own}.device", self.device, "must be a device string such as 'cpu' or 'cuda'")

    def _check_fp8(self) -> None:
        # What is known without touching a GPU; the device's capability is checked
        # before the first step (fmoe.runtime).
        own = "Plan.fp8"
        if not str(self.device).startswith("cuda"):
            fail(own, self.fp8, f"needs a CUDA device with FP8 GEMMs, but Plan.device={self.device!r} has none "
                                "(allowed here: 'none')")
        if self.dtype != "bfloat16":
            fail(own, self.fp8, f"computes with bfloat16 around its FP8 GEMMs: set Plan.dtype='bfloat16' "
                                f"(is {self.dtype!r}) or fp8='none'")
        if self.expert_backend != "torch":
            fail(own, self.fp8, f"runs the routed experts through torch's FP8 grouped GEMM: set "
                                f"Plan.expert_backend='torch' (is {self.expert_backend!r}) or fp8='none'")
        cfg = self.model  # the K and N of every FP8 product
        widths = {"dim": cfg.dim, "ffn": cfg.ffn, "q_width": cfg.q_width, "kv_width": cfg.kv_width}
        if cfg.shared_ffn:
            widths["shared_ffn"] = cfg.shared_ffn
        if self.fp8 == "tensorwise":  # its head's product is FP8 too
            widths["vocab"] = cfg.vocab
        odd = {k: v for k, v in widths.items() if v % 16}
        if odd:
            fail(own, self.fp8, f"FP8 GEMMs need every width a multiple of 16; the model has "
                                f"{', '.join(f'{k}={v}' for k, v in odd.items())} (or use fp8='none')")

    @property
    def world(self) -> int:
        return self.dp * self.ep

    @property
    def unit_groups(self) -> tuple:
        """The FSDP units: ``units`` if given, else one unit per member."""
        return check_units(self.units, self.model)

    @property
    def compute_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)
