"""The parameter pytree: its canonical layout, ``init`` and layout converters.

Layout (``y = x @ W`` everywhere, fp32)::

    embed [V, D]
    layers[i].attn.{norm [D], qkv [D, Q + 2K], out [Q, D]}  (+ qkv_bias [Q + 2K], q_norm, k_norm)
    layers[i].moe.{norm [D], router [D, E], expert_bias [E]}
    layers[i].moe.experts.{fc1 [E, D, 2F], fc2 [E, F, D]}  (+ fc1_bias [E, 2F], fc2_bias [E, D])
    layers[i].moe.shared.{fc1 [D, 2Fs], fc2 [Fs, D]}       (when shared_ffn > 0)
    final_norm [D]
    head [D, V]                                             (absent with tie_embeddings)

``Q = heads * head_dim`` and ``K = kv_heads * head_dim`` (``Q = K = D`` by default).
``qkv`` columns are ``[q | k | v]``, each head-major (``h * head_dim + j``); ``q_norm``
/ ``k_norm`` are ``[head_dim]`` (``qk_norm="head"``) or ``[Q]`` / ``[K]`` (``"full"``).
``moe.shared.gate [D, 1]`` exists with ``shared_gate``. GLU fc1
columns are ``[gate | up]``, or blocks of ``glu_interleave`` columns alternating
gate/up; with ``relu2`` (non-GLU) fc1 is ``[.., F]`` instead of ``[.., 2F]``.
"""

from __future__ import annotations

import math
import zlib

import optree
import torch

from .config import ModelConfig


def param_specs(cfg: ModelConfig) -> dict:
    """The layout as a pytree of ``(shape, init)`` leaves.

    ``init`` is ``"normal"``, ``"normal_out"`` (residual outputs, std scaled by
    ``1/sqrt(2 * layers)``), ``"ones"`` or ``"zeros"``.
    """
    D, E, F, V = cfg.dim, cfg.experts, cfg.ffn, cfg.vocab

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
        if cfg.shared_ffn:
            Fs = cfg.shared_ffn
            moe["shared"] = {"fc1": ((D, cfg.fc1_width(Fs)), "normal"), "fc2": ((Fs, D), "normal_out")}
            if cfg.shared_gate:
                moe["shared"]["gate"] = ((D, 1), "normal")
        return {"attn": attention_specs(cfg), "moe": moe}

    specs = {
        "embed": ((V, D), "normal"),
        "layers": [layer() for _ in range(cfg.layers)],
        "final_norm": ((D,), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["head"] = ((D, V), "normal")
    return specs


def attention_specs(cfg: ModelConfig) -> dict:
    """One layer's ``attn`` subtree as ``(shape, init)`` leaves."""
    Q, K = cfg.q_width, cfg.kv_width
    attn = {"norm": ((cfg.dim,), "ones"), "qkv": ((cfg.dim, Q + 2 * K), "normal"),
            "out": ((Q, cfg.dim), "normal_out")}
    if cfg.qkv_bias:
        attn["qkv_bias"] = ((Q + 2 * K,), "zeros")
    if cfg.qk_norm != "none":
        per_head = cfg.qk_norm == "head"
        attn["q_norm"] = ((cfg.head_dim if per_head else Q,), "ones")
        attn["k_norm"] = ((cfg.head_dim if per_head else K,), "ones")
    return attn


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


def param_shapes(cfg: ModelConfig) -> dict:
    """The layout as a pytree of shape tuples (flatten with ``is_leaf`` on tuples)."""
    return optree.tree_map(lambda spec: spec[0], param_specs(cfg), is_leaf=_is_spec)


def _dotted(path) -> str:
    return ".".join(str(k) for k in path)


def flat_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """``{"layers.0.attn.qkv": (D, 3D), ...}`` in ``optree`` flatten order."""
    paths, specs, _ = optree.tree_flatten_with_path(param_specs(cfg), is_leaf=_is_spec)
    return {_dotted(p): spec[0] for p, spec in zip(paths, specs)}


def named_leaves(tree) -> dict:
    """``{dotted path: leaf}`` of a pytree, in ``optree`` flatten order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return {_dotted(p): leaf for p, leaf in zip(paths, leaves)}


def _leaf_seed(seed: int, path: str) -> int:
    # One generator per leaf, keyed by its path: a leaf's values do not depend on
    # how many other leaves exist or on the order anything is built in.
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def _full_leaves(cfg: ModelConfig, seed: int):
    """``(path, fp32 CPU tensor)`` for every leaf, drawn one at a time."""
    paths, specs, _ = optree.tree_flatten_with_path(param_specs(cfg), is_leaf=_is_spec)
    out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
    for path, (shape, how) in zip(paths, specs):
        if how == "ones":
            yield _dotted(path), torch.ones(shape)
        elif how == "zeros":
            yield _dotted(path), torch.zeros(shape)
        else:
            g = torch.Generator().manual_seed(_leaf_seed(seed, _dotted(path)))
            std = out_std if how == "normal_out" else cfg.init_std
            yield _dotted(path), torch.randn(shape, generator=g) * std


def _treedef(cfg: ModelConfig):
    return optree.tree_structure(param_specs(cfg), is_leaf=_is_spec)


def init_full(cfg: ModelConfig, seed: int, device="cpu") -> dict:
    """The full fp32 parameter pytree for ``seed`` (drawn on CPU, then moved)."""
    return optree.tree_unflatten(_treedef(cfg), [t.to(device) for _, t in _full_leaves(cfg, seed)])


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
    for path, shape in flat_shapes(cfg).items():
        if len(shape) < 2 or (path == "embed" and not cfg.tie_embeddings):
            continue
        n = math.prod(shape)
        total += n * cfg.topk // cfg.experts if ".moe.experts." in path else n
    return total


def train_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: ``6 x`` the active parameters (forward + backward
    matmuls) plus causal attention's ``QK^T`` and ``AV`` (``6 * layers * seq * q_width``)."""
    return 6.0 * active_param_count(cfg) + 6.0 * cfg.layers * seq * cfg.q_width
