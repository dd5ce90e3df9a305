"""The parameter pytree: its canonical layout, ``init`` and layout converters.

Layout (``y = x @ W`` everywhere, fp32)::

    embed [V, D]
    layers[i].attn.{norm [D], qkv [D, Q + 2K], out [Q, D]}  (+ qkv_bias [Q + 2K], out_bias [D], q_norm, k_norm, sinks [H])
    layers[i].attn.{norm, q [D, Q] | q_down [D, Rq], q_down_norm [Rq], q_up [Rq, Q],
                    kv_down [D, Rkv + r], kv_down_norm [Rkv], kv_up [Rkv, H (d - r + dv)], out [H dv, D]}
                                                            (multi-head latent attention, kv_lora_rank > 0)
    layers[i].moe.{norm [D], router [D, E], expert_bias [E]}
    layers[i].moe.experts.{fc1 [E, D, 2F], fc2 [E, F, D]}  (+ fc1_bias [E, 2F], fc2_bias [E, D])
    layers[i].moe.shared.{fc1 [D, 2Fs], fc2 [Fs, D]}       (when shared_ffn > 0)
    final_norm [D]
    head [D, V]                                             (absent with tie_embeddings)

``Q = heads * head_dim`` and ``K = kv_heads * head_dim`` (``Q = K = D`` by default).
``qkv`` columns are ``[q | k | v]``, each head-major (``h * head_dim + j``); ``q_norm``
/ ``k_norm`` are ``[head_dim]`` (``qk_norm="head"``) or ``[Q]`` / ``[K]`` (``"full"``).
Under MLA each q head's columns are ``[d - r`` without RoPE ``| r`` with it``]`` (``r``:
``rope_head_dim``), ``kv_down``'s are ``[latent | the keys' shared rotated r]`` and
each head's columns of ``kv_up`` are ``[its key's d - r | its value's dv]``.
``moe.shared.gate [D, 1]`` exists with ``shared_gate``. GLU fc1
columns are ``[gate | up]``, or blocks of ``glu_interleave`` columns alternating
gate/up; with ``relu2`` (non-GLU) fc1 is ``[.., F]`` instead of ``[.., 2F]``.

``param_table(cfg)`` describes every leaf once (a ``Leaf``: its place, shape, FSDP
member, node, domain, precision, decay, GLU layout, init); the rest of fmoe asks it
instead of reading meaning out of a parameter's name.
"""

from __future__ import annotations

import enum
import functools
import math
import zlib
from typing import NamedTuple

import optree
import torch

from .config import ModelConfig
from .parallel_dims import GroupName
from .tensor_split import Split, split_of


def param_specs(cfg: ModelConfig) -> dict:
    """The layout as a pytree of ``(shape, init)`` leaves.

    ``init`` is ``"normal"``, ``"normal_out"`` (residual outputs, std scaled by
    ``1/sqrt(2 * layers)``), ``"ones"`` or ``"zeros"``.
    """
    D, E, F, V = cfg.dim, cfg.experts, cfg.ffn, cfg.vocab

    def dense_layer():
        Fd = cfg.dense_ffn
        mlp = {"norm": ((D,), "ones"), "fc1": ((D, cfg.fc1_width(Fd)), "normal"), "fc2": ((Fd, D), "normal_out")}
        return {"attn": attention_specs(cfg), "mlp": mlp}

    def layer():
        experts = {"fc1": ((E, D, cfg.fc1_width(F)), "normal"), "fc2": ((E, F, D), "normal_out")}
        if cfg.expert_biases:
            experts["fc1_bias"] = ((E, cfg.fc1_width(F)), "zeros")
            experts["fc2_bias"] = ((E, D), "zeros")
        moe = {
            "norm": ((D,), "ones"),
            "router": ((D, E), "normal"),
            "expert_bias": ((E,), "zeros"),
            "experts": experts,
        }
        if cfg.router_bias:
            moe["router_bias"] = ((E,), "zeros")
        if cfg.shared_ffn:
            Fs = cfg.shared_ffn
            moe["shared"] = {"fc1": ((D, cfg.fc1_width(Fs)), "normal"), "fc2": ((Fs, D), "normal_out")}
            if cfg.shared_gate:
                moe["shared"]["gate"] = ((D, 1), "normal")
        return {"attn": attention_specs(cfg), "moe": moe}

    specs = {
        "embed": ((V, D), "normal"),
        "layers": [dense_layer() if cfg.is_dense(i) else layer() for i in range(cfg.layers)],
        "final_norm": ((D,), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["head"] = ((D, V), "normal")
    return specs


def attention_specs(cfg: ModelConfig) -> dict:
    """One layer's ``attn`` subtree as ``(shape, init)`` leaves."""
    attn = {"norm": ((cfg.dim,), "ones")}
    attn.update(_latent_projections(cfg) if cfg.latent else _qkv_projections(cfg))
    attn["out"] = ((cfg.attn_out_width, cfg.dim), "normal_out")
    if cfg.out_bias:
        attn["out_bias"] = ((cfg.dim,), "zeros")
    if cfg.attn_sinks:  # as transformers' GptOssAttention initialises them
        attn["sinks"] = ((cfg.heads,), "normal")
    return attn


def _qkv_projections(cfg: ModelConfig) -> dict:
    Q, K = cfg.q_width, cfg.kv_width
    attn = {"qkv": ((cfg.dim, Q + 2 * K), "normal")}
    if cfg.qkv_bias:
        attn["qkv_bias"] = ((Q + 2 * K,), "zeros")
    if (widths := cfg.qk_norm_widths) is not None:
        attn["q_norm"], attn["k_norm"] = (((width,), "ones") for width in widths)
    return attn


def _latent_projections(cfg: ModelConfig) -> dict:
    """Multi-head latent attention's projections (``cfg.latent``)."""
    D, H, Rkv = cfg.dim, cfg.heads, cfg.kv_lora_rank
    nope = cfg.head_dim - cfg.rope_head_dim
    if cfg.q_lora_rank:
        attn = {"q_down": ((D, cfg.q_lora_rank), "normal"), "q_down_norm": ((cfg.q_lora_rank,), "ones"),
                "q_up": ((cfg.q_lora_rank, cfg.q_width), "normal")}
    else:
        attn = {"q": ((D, cfg.q_width), "normal")}
    attn.update(kv_down=((D, Rkv + cfg.rope_head_dim), "normal"), kv_down_norm=((Rkv,), "ones"),
                kv_up=((Rkv, H * (nope + cfg.v_head_dim)), "normal"))
    return attn


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


def param_shapes(cfg: ModelConfig) -> dict:
    """The layout as a pytree of shape tuples (flatten with ``is_leaf`` on tuples)."""
    return optree.tree_map(lambda spec: spec[0], param_specs(cfg), is_leaf=_is_spec)


def _dotted(path) -> str:
    return ".".join(str(k) for k in path)


# Routing is decided in fp32 from fp32 weights whatever the compute dtype; expert
# biases stay fp32 so their row-summed gradients are accumulated in fp32.
FP32_LEAVES = ("router", "router_bias", "expert_bias", "fc1_bias", "fc2_bias")


def decays(name: str) -> bool:
    """Whether AdamW's weight decay applies to a leaf named ``name``: matrices, not norms,
    biases or attention sinks (by name, since a row shard of a vector is 2-D)."""
    return not (name.endswith("norm") or name.endswith("bias") or name == "sinks")


def trainable(name: str) -> bool:
    """Whether gradient steps change a leaf named ``name``: all but ``expert_bias``, which
    ``update_expert_bias`` balances from routing counts."""
    return name != "expert_bias"


class Domain(enum.StrEnum):
    """Where a parameter's buffers live: ``EXPERT`` (the routed experts, split over the
    EP ranks and cut by ``Plan.etp``, sharded over the expert-data-parallel group),
    ``DENSE`` (everything else, sharded over the world) or, under ``Plan.tp > 1``,
    ``TENSOR`` (the dense leaves tensor parallelism cuts, sharded over the ranks holding
    the same slice). A Leaf's ``domain`` is ``DENSE`` or ``EXPERT``; which buffers a plan
    puts it in is the ShardSpec's ``placement``."""

    DENSE = "dense"
    TENSOR = "tensor"
    EXPERT = "expert"

    @property
    def data_group(self) -> GroupName:
        """The ranks that sum this domain's gradients and share its shards: a stage's
        ranks (dense), those holding one tensor-parallel slice (tensor), those holding one
        expert slice (expert)."""
        return _DATA_GROUPS[self]


_DATA_GROUPS = {Domain.DENSE: GroupName.STAGE, Domain.TENSOR: GroupName.TENSOR_DATA, Domain.EXPERT: GroupName.EDP}


class Leaf(NamedTuple):
    """One parameter, as ``param_table`` describes it.

    Attributes:
        path: the dotted name (``layers.0.moe.experts.fc1``): checkpoint keys, messages.
        keys: its place in the pytree (``("layers", 0, "moe", "experts", "fc1")``),
            as ``optree`` paths spell it.
        shape: the full fp32 shape.
        init: ``normal``, ``normal_out`` (residual outputs), ``ones`` or ``zeros``.
        member: the FSDP member holding it: ``embed``, ``layers.<i>`` or ``head``.
        layer: the layer index, or None outside the layers.
        node: the kind of node computing with it: ``embed``, ``attn`` (a MoE layer's
            attention half, router and shared expert), ``experts``, ``dense`` (a dense
            layer's attention and MLP) or ``head``.
        domain: ``expert`` (the routed experts, split over EP ranks) or ``dense``.
        fp32: kept in fp32 whatever the compute dtype (``FP32_LEAVES``).
        decayed: AdamW's weight decay applies (matrices, not norms, biases or sinks:
            ``decays``, the rule the optimizer applies by leaf name to any pytree).
        trainable: changed by gradient steps (not ``expert_bias``, which
            ``update_expert_bias`` balances from routing counts: ``trainable``).
        glu: its last axis holds GLU halves (``fc1`` / ``fc1_bias`` of a GLU activation).
        linear: the weight of a dense product ``x @ w`` (``Gemms.linear`` or
            ``Gemms.head``): attention's ``qkv`` and ``out``, the shared expert's ``fc1``
            and ``fc2``, the ``head``. Under ``Plan.fp8='tensorwise'`` these are gathered
            already cast to FP8 (``fmoe.shard.spec.dtype_group``).
        split: how tensor parallelism cuts it (``fmoe.tensor_split``): ``Plan.tp`` a
            dense leaf, ``Plan.etp`` an expert leaf; None: every rank of that group
            holds all of it.
    """

    path: str
    keys: tuple
    shape: tuple
    init: str
    member: str
    layer: int | None
    node: str
    domain: Domain
    fp32: bool
    decayed: bool
    trainable: bool
    glu: bool
    linear: bool
    split: Split | None = None


# the dense products' weights, by the subtree that holds them (``Leaf.linear``)
LINEAR_WEIGHTS = {"attn": ("qkv", "out", "q", "q_down", "q_up", "kv_down", "kv_up"), "shared": ("fc1", "fc2"), "mlp": ("fc1", "fc2")}


class ParamTable(NamedTuple):
    """Every leaf of a model, in ``optree`` flatten order (``param_table``).

    Attributes:
        leaves: the Leafs.
        treedef: the params pytree's structure.
        by_path: ``{path: Leaf}``.
        by_keys: ``{keys: Leaf}``.
    """

    leaves: tuple
    treedef: optree.PyTreeSpec
    by_path: dict
    by_keys: dict

    def __getitem__(self, path: str) -> Leaf:
        """The leaf named ``path`` (``layers.0.attn.qkv``); KeyError if the model has none."""
        return self.by_path[path]

    def at(self, keys) -> Leaf:
        """The leaf at an ``optree`` path (``("layers", 0, "attn", "qkv")``)."""
        return self.by_keys[tuple(keys)]

    def mirrored_by(self, keys) -> Leaf | None:
        """The leaf a tensor at ``keys`` in another pytree (an optimizer state, a
        gradient tree) stands for: the one whose keys end ``keys``
        (``("adam", "mu", "layers", 0, "attn", "qkv")``) or whose dotted name is its
        last key (trees keyed by name); None if none does."""
        keys = tuple(keys)
        if keys and keys[-1] in self.by_path:
            return self.by_path[keys[-1]]
        return next((self.by_keys[keys[i:]] for i in range(len(keys)) if keys[i:] in self.by_keys), None)

    def shapes(self) -> dict:
        """``{path: full shape}``."""
        return {leaf.path: leaf.shape for leaf in self.leaves}

    def unflatten(self, values) -> dict:
        """The params pytree holding ``values`` (one per leaf, in table order)."""
        return optree.tree_unflatten(self.treedef, list(values))


def _describe(keys: tuple, shape: tuple, init: str, cfg: ModelConfig) -> Leaf:
    # The one place a leaf's meaning is read from where it sits in the pytree.
    name, layer = keys[-1], keys[1] if keys[0] == "layers" else None
    experts = keys[2:4] == ("moe", "experts")
    if layer is not None:
        member, node = f"layers.{layer}", "experts" if experts else "dense" if cfg.is_dense(layer) else "attn"
    else:
        member = node = "head" if keys[0] in ("head", "final_norm") else keys[0]
    return Leaf(path=_dotted(keys), keys=keys, shape=tuple(shape), init=init, member=member, layer=layer,
                node=node, domain=Domain.EXPERT if experts else Domain.DENSE, fp32=name in FP32_LEAVES,
                decayed=decays(name), trainable=trainable(name),
                glu=cfg.is_glu and name in ("fc1", "fc1_bias") and keys[-2] in ("experts", "shared", "mlp"),
                linear=keys == ("head",) or (len(keys) > 1 and name in LINEAR_WEIGHTS.get(keys[-2], ())),
                split=split_of(keys, cfg))


@functools.lru_cache(maxsize=64)
def param_table(cfg: ModelConfig) -> ParamTable:
    """Every leaf of ``cfg``'s params, described once (pure, cached per config)."""
    paths, specs, treedef = optree.tree_flatten_with_path(param_specs(cfg), is_leaf=_is_spec)
    leaves = tuple(_describe(tuple(p), shape, init, cfg) for p, (shape, init) in zip(paths, specs))
    return ParamTable(leaves, treedef, {leaf.path: leaf for leaf in leaves}, {leaf.keys: leaf for leaf in leaves})


def flat_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """``{"layers.0.attn.qkv": (D, 3D), ...}`` in ``optree`` flatten order."""
    return param_table(cfg).shapes()


def param_count(cfg: ModelConfig) -> int:
    """Elements of every leaf of ``cfg``'s params (all experts, embedding and head)."""
    return sum(math.prod(leaf.shape) for leaf in param_table(cfg).leaves)


def named_leaves(tree) -> dict:
    """``{dotted path: leaf}`` of a pytree, in ``optree`` flatten order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return {_dotted(p): leaf for p, leaf in zip(paths, leaves)}


def _leaf_seed(seed: int, path: str) -> int:
    # One generator per leaf, keyed by its path: a leaf's values do not depend on
    # how many other leaves exist or on the order anything is built in.
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def initial_leaves(table: ParamTable, cfg: ModelConfig, seed: int):
    """``(path, fp32 CPU tensor)`` of every leaf of ``table`` (``cfg``'s), its initial
    value, drawn one at a time (``fmoe.init`` lays them out for a plan)."""
    for leaf in table.leaves:
        yield leaf.path, initial_value(leaf, cfg, seed)


def initial_value(leaf: Leaf, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """One leaf's initial value, a fp32 CPU tensor: ones, zeros, or normal draws from a
    generator of its own (seeded by ``seed`` and its path), so leaves can be drawn in any
    order, or at once on several threads, and come out the same."""
    if leaf.init == "ones":
        return torch.ones(leaf.shape)
    if leaf.init == "zeros":
        return torch.zeros(leaf.shape)
    g = torch.Generator().manual_seed(_leaf_seed(seed, leaf.path))
    std = cfg.init_std / math.sqrt(2 * cfg.layers) if leaf.init == "normal_out" else cfg.init_std
    return torch.randn(leaf.shape, generator=g).mul_(std)


def glu_to_interleaved(w: torch.Tensor, block: int) -> torch.Tensor:
    """``[gate | up]`` along the last axis -> blocks of ``block`` columns alternating gate, up."""
    gate, up = w.chunk(2, dim=-1)
    n = gate.shape[-1] // block
    pairs = torch.stack([gate.unflatten(-1, (n, block)), up.unflatten(-1, (n, block))], dim=-2)
    return pairs.flatten(-3)


def glu_from_interleaved(w: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of ``glu_to_interleaved``: alternating blocks -> ``[gate | up]``."""
    pairs = w.unflatten(-1, (w.shape[-1] // (2 * block), 2, block))
    return torch.cat([pairs[..., 0, :].flatten(-2), pairs[..., 1, :].flatten(-2)], dim=-1)


def active_param_count(cfg: ModelConfig) -> int:
    """Matmul weights one token computes with: every dense matrix, ``topk / experts`` of
    the routed experts' and the head (the embedding lookup, norms and biases are not
    matmuls and are not counted)."""
    total = 0
    for leaf in param_table(cfg).leaves:
        if len(leaf.shape) < 2 or (leaf.path == "embed" and not cfg.tie_embeddings):
            continue
        n = math.prod(leaf.shape)
        total += n * cfg.topk // cfg.experts if leaf.domain == "expert" else n
    return total


def train_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: ``6 x`` the active parameters (forward + backward
    matmuls) plus causal attention's ``QK^T`` and ``AV``: per layer ``6 * heads *
    (head_dim + v_head_dim) / 2`` per key a query sees, on average ``seq / 2``, or about
    the window ``W`` (``W - W^2 / 2 seq``) in a sliding-window layer."""
    per_key = 6.0 * cfg.heads * (cfg.head_dim + cfg.v_head_dim) / 2
    keys = 0.0
    for layer in range(cfg.layers):
        window = cfg.layer_window(layer)
        keys += seq / 2 if not window or window >= seq else window - window * window / (2 * seq)
    return 6.0 * active_param_count(cfg) + per_key * keys


__all__ = ["FP32_LEAVES", "LINEAR_WEIGHTS", "Domain", "Leaf", "ParamTable", "active_param_count", "attention_specs", "decays",
           "flat_shapes", "param_count", "glu_from_interleaved", "glu_to_interleaved", "initial_leaves", "named_leaves",
           "param_shapes", "param_specs", "param_table", "train_flops_per_token", "trainable"]
