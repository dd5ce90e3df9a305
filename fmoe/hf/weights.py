"""Where each fmoe parameter lives in a Hugging Face checkpoint, and moving it there and back.

A ``Recipe`` says how one fmoe leaf is made of released tensors: the ``Part``s
concatenated along its last axis, each a Hugging Face tensor, transposed when the
file stores ``y = x @ W.T`` (every ``nn.Linear``); expert leaves take one set of parts
per expert (the ``{e}`` in the key). Reading asks the file for a row range only, so
each rank reads what it holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpoint.convert import safetensors_torch
from ..config import ModelConfig
from ..params import glu_from_interleaved, glu_to_interleaved
from .families import WITH_EXPERT_BIAS
from ..shard.layout import rows_cols


# the module holding a family's shared expert (the families that have one)
SHARED_EXPERT = {"qwen2_moe": "shared_expert", "glm4_moe": "shared_experts", "deepseek_v3": "shared_experts"}


class Part(NamedTuple):
    key: str            # the tensor's name in the file; ``{e}`` stands for the expert index
    width: int          # columns it gives the fmoe leaf
    transposed: bool    # stored as ``[width, rows]`` (a Linear's weight) rather than ``[rows, width]``


class Recipe(NamedTuple):
    parts: tuple
    per_expert: bool = False
    glu: bool = False    # fc1 of a GLU: ``[gate | up]``, re-laid to the config's interleave


def recipes(cfg: ModelConfig, family: str) -> dict:
    """``{fmoe path: Recipe}`` for every leaf of ``cfg`` laid out as ``family``
    (``expert_bias`` has none outside the families with a selection bias, ``WITH_EXPERT_BIAS``)."""
    Q, K, F, D = cfg.q_width, cfg.kv_width, cfg.ffn, cfg.dim
    lin = lambda key, width: Part(key + ".weight", width, True)  # noqa: E731
    vec = lambda key, width: Part(key + ".weight", width, False)  # noqa: E731
    out = {"embed": Recipe((vec("model.embed_tokens", D),)), "final_norm": Recipe((vec("model.norm", D),))}
    if not cfg.tie_embeddings:
        out["head"] = Recipe((lin("lm_head", cfg.vocab),))
    moe, names = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    for i in range(cfg.layers):
        at, L, m = f"model.layers.{i}.self_attn", f"layers.{i}", f"model.layers.{i}.{moe}"
        out[f"{L}.attn.norm"] = Recipe((vec(f"model.layers.{i}.input_layernorm", D),))
        out[f"{L}.attn.out"] = Recipe((lin(f"{at}.o_proj", D),))
        if cfg.latent:
            out.update(_latent_attention(f"{L}.attn", at, cfg))
        else:
            out[f"{L}.attn.qkv"] = Recipe((lin(f"{at}.q_proj", Q), lin(f"{at}.k_proj", K), lin(f"{at}.v_proj", K)))
        if cfg.qkv_bias:
            out[f"{L}.attn.qkv_bias"] = Recipe(tuple(Part(f"{at}.{x}_proj.bias", w, False)
                                                     for x, w in (("q", Q), ("k", K), ("v", K))))
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            out[f"{L}.attn.q_norm"] = Recipe((vec(f"{at}.q_norm", cfg.head_dim if per_head else Q),))
            out[f"{L}.attn.k_norm"] = Recipe((vec(f"{at}.k_norm", cfg.head_dim if per_head else K),))
        if cfg.is_dense(i):
            out.update(_dense_mlp(f"{L}.mlp", f"model.layers.{i}", cfg.dense_ffn, D))
            continue
        out[f"{L}.moe.norm"] = Recipe((vec(f"model.layers.{i}.post_attention_layernorm", D),))
        out[f"{L}.moe.router"] = Recipe((lin(f"{m}.gate", cfg.experts),))
        if family in WITH_EXPERT_BIAS:
            out[f"{L}.moe.expert_bias"] = Recipe((Part(f"{m}.gate.e_score_correction_bias", cfg.experts, False),))
        gate, up, down = (f"{m}.experts.{{e}}.{n}" for n in names)
        out[f"{L}.moe.experts.fc1"] = Recipe((lin(gate, F), lin(up, F)), per_expert=True, glu=True)
        out[f"{L}.moe.experts.fc2"] = Recipe((lin(down, D),), per_expert=True)
        if cfg.shared_ffn:
            s, Fs = f"{m}.{SHARED_EXPERT[family]}", cfg.shared_ffn
            out[f"{L}.moe.shared.fc1"] = Recipe((lin(f"{s}.gate_proj", Fs), lin(f"{s}.up_proj", Fs)), glu=True)
            out[f"{L}.moe.shared.fc2"] = Recipe((lin(f"{s}.down_proj", D),))
            if cfg.shared_gate:
                out[f"{L}.moe.shared.gate"] = Recipe((lin(f"{m}.shared_expert_gate", 1),))
    return out


def _latent_attention(path: str, prefix: str, cfg: ModelConfig) -> dict:
    """Multi-head latent attention's projections as DeepSeek-V3 releases them (the same
    columns per head as fmoe's: nothing is reordered, ``rope_interleave`` included)."""
    lin = lambda key, w: Recipe((Part(f"{prefix}.{key}.weight", w, True),))  # noqa: E731
    vec = lambda key, w: Recipe((Part(f"{prefix}.{key}.weight", w, False),))  # noqa: E731
    out = {f"{path}.kv_down": lin("kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.rope_head_dim),
           f"{path}.kv_down_norm": vec("kv_a_layernorm", cfg.kv_lora_rank),
           f"{path}.kv_up": lin("kv_b_proj", cfg.heads * (cfg.head_dim - cfg.rope_head_dim + cfg.v_head_dim))}
    if cfg.q_lora_rank:
        out.update({f"{path}.q_down": lin("q_a_proj", cfg.q_lora_rank),
                    f"{path}.q_down_norm": vec("q_a_layernorm", cfg.q_lora_rank),
                    f"{path}.q_up": lin("q_b_proj", cfg.q_width)})
    else:
        out[f"{path}.q"] = lin("q_proj", cfg.q_width)
    return out


def _dense_mlp(path: str, prefix: str, width: int, D: int) -> dict:
    """A dense layer's ``mlp``: its norm and the released ``gate_proj``, ``up_proj``,
    ``down_proj`` (the layout every family with dense layers shares)."""
    lin = lambda key, w: Part(f"{prefix}.mlp.{key}.weight", w, True)  # noqa: E731
    return {f"{path}.norm": Recipe((Part(f"{prefix}.post_attention_layernorm.weight", D, False),)),
            f"{path}.fc1": Recipe((lin("gate_proj", width), lin("up_proj", width)), glu=True),
            f"{path}.fc2": Recipe((lin("down_proj", D),))}


def prediction_layer_keys(keys, hf: dict) -> list[str]:
    """The keys of the multi-token-prediction layers a checkpoint carries past its
    decoder layers (DeepSeek-V3's and GLM-4.5's ``num_nextn_predict_layers``, stored as
    ``model.layers.<num_hidden_layers + k>.*``): fmoe neither computes nor trains them."""
    extra = int(hf.get("num_nextn_predict_layers") or 0)
    layers = int(hf.get("num_hidden_layers") or 0)
    ids = {str(i) for i in range(layers, layers + extra)}
    return sorted(k for k in keys if k.startswith("model.layers.") and k.split(".")[2] in ids)


def file_keys(recipe: Recipe, experts: int) -> list[str]:
    """Every tensor name ``recipe`` reads."""
    keys = [p.key for p in recipe.parts]
    return [k.format(e=e) for e in range(experts) for k in keys] if recipe.per_expert else keys


SCALE_SUFFIX = "_scale_inv"  # ``x.weight`` in FP8 has its scales in ``x.weight_scale_inv``


class BlockFp8:
    """A released FP8 (E4M3) weight read as fp32 values: each ``block`` rows x columns
    of it times its entry of ``weight_scale_inv`` (DeepSeek-V3's layout, 128 x 128; the
    last blocks of a side may be partial). Sliced as the file's tensor is."""

    def __init__(self, weight, scales_RC: torch.Tensor, block: tuple[int, int]):
        self.weight, self.scales_RC, self.block = weight, scales_RC.float(), block

    def get_shape(self):
        return self.weight.get_shape()

    def __getitem__(self, index):
        rows, cols = self.get_shape()
        index = index if isinstance(index, tuple) else (index,)
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(index + (slice(None),) * 2, (rows, cols)))
        block_r = torch.arange(r0, r1) // self.block[0]  # each row's and column's block: only
        block_c = torch.arange(c0, c1) // self.block[1]  # the slice's scales, not the whole grid's
        return self.weight[r0:r1, c0:c1].float() * self.scales_RC[block_r][:, block_c]


class SafetensorsDir:
    """The tensors of a Hugging Face directory's safetensors files, opened lazily.

    Reads ``model.safetensors.index.json`` (sharded) or ``model.safetensors``;
    a tensor is read (or row-sliced) from its file only when asked for. With
    ``fp8_block`` (a checkpoint released in FP8 with block scales), a weight stored in
    FP8 reads as its fp32 values (``BlockFp8``).
    """

    def __init__(self, directory: Path, fp8_block: tuple[int, int] | None = None):
        self.directory, self.fp8_block = directory, fp8_block
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                self.file_of = dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index ({err})") from None
        elif (directory / "model.safetensors").exists():
            self.file_of = dict.fromkeys(self._open("model.safetensors").keys(), "model.safetensors")
        else:
            found = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
            raise ValueError(f"{directory}: no model.safetensors or model.safetensors.index.json"
                             + (f" (found {found[:3]}: fmoe reads safetensors only, never pickles)" if found else ""))
        self._handles: dict = {}

    def _open(self, name: str):
        path = self.directory / name
        if not path.exists():
            raise ValueError(f"{self.directory}: safetensors file {name} (named by the index) is missing")
        try:
            return safetensors_torch("hf").safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors' own error type: truncated or not a safetensors file
            raise ValueError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None

    def slice(self, key: str):
        if key not in self.file_of:
            raise ValueError(f"{self.directory}: the checkpoint has no tensor {key!r}")
        found = self._raw(key)
        if not found.get_dtype().startswith("F8"):
            return found
        scale_key = key + SCALE_SUFFIX
        if self.fp8_block is None or scale_key not in self.file_of:
            raise ValueError(f"{self.directory}: {key!r} is stored in FP8 ({found.get_dtype()}) without its block "
                             f"scales {scale_key!r} (and a config.json quantization_config 'fp8' with "
                             "weight_block_size): fmoe cannot read its values")
        scales, (rows, cols) = self._raw(scale_key)[:], found.get_shape()
        grid = (-(-rows // self.fp8_block[0]), -(-cols // self.fp8_block[1]))
        if tuple(scales.shape) != grid:
            raise ValueError(f"{self.directory}: {scale_key!r} has shape {list(scales.shape)}; {key!r} "
                             f"[{rows}, {cols}] in blocks of {list(self.fp8_block)} needs {list(grid)}")
        return BlockFp8(found, scales, self.fp8_block)

    def _raw(self, key: str):
        name = self.file_of[key]
        if name not in self._handles:
            self._handles[name] = self._open(name)
        return self._handles[name].get_slice(key)


def _read_rows(files: SafetensorsDir, recipe: Recipe, expert: int | None, first: int, last: int,
               shape: tuple, out_RC: torch.Tensor) -> None:
    """Rows ``[first, last)`` of one leaf (one expert's, for expert leaves) into the fp32
    ``out_RC`` ``[last - first, cols]`` (``[1, cols]`` for a vector), part by part."""
    col = 0
    for part in recipe.parts:
        key = part.key.format(e=expert)
        src = files.slice(key)
        if len(shape) == 1:
            want = (part.width,)
        else:
            want = (part.width, shape[0]) if part.transposed else (shape[0], part.width)
        if tuple(src.get_shape()) != want:
            raise ValueError(f"{files.directory}: {key!r} has shape {list(src.get_shape())}, "
                             f"the config needs {list(want)}")
        dst = out_RC[:, col:col + part.width]
        if len(shape) == 1:
            dst.copy_(src[:][None])
        elif part.transposed:
            copy_transposed(dst, src[:, first:last])
        else:
            dst.copy_(src[first:last])
        col += part.width


TRANSPOSE_ROWS = 64


def copy_transposed(dst_CR: torch.Tensor, src_RC: torch.Tensor) -> None:
    """``dst = src.t()`` (casting as ``copy_`` does), ``TRANSPOSE_ROWS`` of src's rows at
    a time: one whole transposing copy walks one side with a stride of a full row, and
    measured several times slower on a [768, 2048] weight (``benchmarks/hf_io.py``)."""
    for r in range(0, src_RC.shape[0], TRANSPOSE_ROWS):
        dst_CR[:, r:r + TRANSPOSE_ROWS].copy_(src_RC[r:r + TRANSPOSE_ROWS].t())


def read_local_leaf(files: SafetensorsDir, recipe: Recipe, cfg: ModelConfig, local_shape: tuple,
                    experts: tuple | None, first: int, last: int, sharded: bool) -> torch.Tensor:
    """What one rank holds of a leaf (see ``fmoe.shard.spec.leaf_piece``), read from ``files``.

    Arguments:
        local_shape: the leaf cut to this rank's experts; ``experts`` their global range.
        first, last: rows of that leaf (as ``[rows, cols]``) to read; ``sharded``: return
            them as ``[last - first, cols]`` rather than in ``local_shape``.
    """
    rows, cols = rows_cols(local_shape)
    block = torch.empty(max(last - first, 0), cols)
    if not recipe.per_expert:
        if last > first:
            _read_rows(files, recipe, None, first, last, local_shape, block)
    else:
        per = rows // local_shape[0]  # rows of one expert
        base = experts[0] if experts else 0
        for e in range(first // per, -(-last // per)):
            lo, hi = max(first - e * per, 0), min(last - e * per, per)
            at = e * per + lo - first
            _read_rows(files, recipe, base + e, lo, hi, local_shape[1:], block[at:at + hi - lo])
    if recipe.glu and cfg.glu_interleave:
        block = glu_to_interleaved(block, cfg.glu_interleave)
    return block if sharded else block.reshape(local_shape)


def to_file_tensors(path: str, full: torch.Tensor, recipe: Recipe, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """``{file key: tensor}`` of one full fmoe leaf, in the released layout."""
    if recipe.glu and cfg.glu_interleave:
        full = glu_from_interleaved(full, cfg.glu_interleave)
    out = {}
    for e in range(full.shape[0]) if recipe.per_expert else (None,):
        leaf = full[e] if e is not None else full
        for part, piece in zip(recipe.parts, leaf.split([p.width for p in recipe.parts], dim=-1)):
            piece = piece.cpu()
            if part.transposed:
                tensor = torch.empty(piece.shape[::-1], dtype=dtype)
                copy_transposed(tensor, piece)
            else:
                tensor = piece.to(dtype).contiguous()
            out[part.key.format(e=e)] = tensor
    return out
