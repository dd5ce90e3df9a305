"""Where each fmoe parameter lives in a Hugging Face checkpoint, and moving it there and back.

A ``Recipe`` says how one fmoe leaf is made of released tensors: the ``Part``s
concatenated along its last axis, each a Hugging Face tensor, transposed when the
file stores ``y = x @ W.T`` (every ``nn.Linear``); expert leaves take one set of parts
per expert (the ``{e}`` in the key, ``Experts.SEPARATE``) or one tensor holding every
expert on a leading axis (GPT-OSS's, ``Experts.STACKED``). Reading asks the file for a
row range only, so each rank reads what it holds. Weights released quantised read as
their fp32 values: FP8 with block scales (``BlockFp8``) and MXFP4 (``Mxfp4``).
"""

from __future__ import annotations

import enum
import functools
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


class Experts(enum.Enum):
    """How a file stores the experts of an expert leaf."""

    SEPARATE = "separate"  # one tensor per expert, ``{e}`` in the key (Mixtral, Qwen, OLMoE, GLM)
    STACKED = "stacked"    # one tensor ``[E, ...]`` with every expert (GPT-OSS)


class Recipe(NamedTuple):
    parts: tuple
    experts: Experts | None = None  # None: not an expert leaf
    glu: bool = False    # fc1 (or its bias) of a GLU, re-laid from ``file_interleave`` to the config's
    file_interleave: int = 0  # the file's GLU layout: 0 ``[gate | up]``, n blocks of n columns alternating
    #                           gate, up (GPT-OSS's ``gate_up_proj``: 1, gate = ``[..., ::2]``)


def recipes(cfg: ModelConfig, family: str) -> dict:
    """``{fmoe path: Recipe}`` for every leaf of ``cfg`` laid out as ``family``
    (``expert_bias`` has none outside the families with a selection bias, ``WITH_EXPERT_BIAS``).

    Arguments:
        cfg: the ModelConfig.
        family: a name of ``fmoe.hf.families.FAMILIES``.

    Returns:
        ``{path: Recipe}`` in the params' order.
    """
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
        if cfg.out_bias:
            out[f"{L}.attn.out_bias"] = Recipe((Part(f"{at}.o_proj.bias", D, False),))
        if cfg.attn_sinks:
            out[f"{L}.attn.sinks"] = Recipe((Part(f"{at}.sinks", cfg.heads, False),))
        if (widths := cfg.qk_norm_widths) is not None:
            out[f"{L}.attn.q_norm"] = Recipe((vec(f"{at}.q_norm", widths[0]),))
            out[f"{L}.attn.k_norm"] = Recipe((vec(f"{at}.k_norm", widths[1]),))
        if family == "gpt_oss":
            out.update(_gpt_oss_moe(L, f"model.layers.{i}", cfg))
            continue
        if cfg.is_dense(i):
            out.update(_dense_mlp(f"{L}.mlp", f"model.layers.{i}", cfg.dense_ffn, D))
            continue
        out[f"{L}.moe.norm"] = Recipe((vec(f"model.layers.{i}.post_attention_layernorm", D),))
        out[f"{L}.moe.router"] = Recipe((lin(f"{m}.gate", cfg.experts),))
        if family in WITH_EXPERT_BIAS:
            out[f"{L}.moe.expert_bias"] = Recipe((Part(f"{m}.gate.e_score_correction_bias", cfg.experts, False),))
        gate, up, down = (f"{m}.experts.{{e}}.{n}" for n in names)
        out[f"{L}.moe.experts.fc1"] = Recipe((lin(gate, F), lin(up, F)), Experts.SEPARATE, glu=True)
        out[f"{L}.moe.experts.fc2"] = Recipe((lin(down, D),), Experts.SEPARATE)
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


def _gpt_oss_moe(path: str, prefix: str, cfg: ModelConfig) -> dict:
    """A GPT-OSS layer's MoE: the router with its bias, and the experts' tensors stacked
    (``[E, ...]``, not per expert) in ``x @ W`` form: ``gate_up_proj [E, D, 2F]`` (gate and
    up alternating column by column) with ``gate_up_proj_bias [E, 2F]``, ``down_proj
    [E, F, D]`` with ``down_proj_bias [E, D]``; released in MXFP4, the two weights are
    ``*_blocks`` and ``*_scales`` read as these (``Mxfp4``)."""
    D, F2, m = cfg.dim, cfg.fc1_width(cfg.ffn), f"{prefix}.mlp"
    stacked = lambda key, width, **glu: Recipe((Part(key, width, False),), Experts.STACKED, **glu)  # noqa: E731
    glu = dict(glu=True, file_interleave=1)
    return {f"{path}.moe.norm": Recipe((Part(f"{prefix}.post_attention_layernorm.weight", D, False),)),
            f"{path}.moe.router": Recipe((Part(f"{m}.router.weight", cfg.experts, True),)),
            f"{path}.moe.router_bias": Recipe((Part(f"{m}.router.bias", cfg.experts, False),)),
            f"{path}.moe.experts.fc1": stacked(f"{m}.experts.gate_up_proj", F2, **glu),
            f"{path}.moe.experts.fc1_bias": stacked(f"{m}.experts.gate_up_proj_bias", F2, **glu),
            f"{path}.moe.experts.fc2": stacked(f"{m}.experts.down_proj", D),
            f"{path}.moe.experts.fc2_bias": stacked(f"{m}.experts.down_proj_bias", D)}


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
    return [k.format(e=e) for e in range(experts) for k in keys] if recipe.experts == Experts.SEPARATE else keys


SCALE_SUFFIX = "_scale_inv"  # ``x.weight`` in FP8 has its scales in ``x.weight_scale_inv``
# an MXFP4 tensor ``x`` is stored as ``x_blocks`` (values) and ``x_scales`` (exponents)
MXFP4_SUFFIXES = ("_blocks", "_scales")


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
        block_r = torch.arange(r0, r1) // self.block[0]  # each row's block: only the slice's scales
        values = self.weight[r0:r1, c0:c1].float()
        width = self.block[1]
        if c0 % width == 0 and (c1 - c0) % width == 0:  # whole column blocks: scale them in place
            scales = self.scales_RC[block_r][:, c0 // width:c1 // width]
            values.view(r1 - r0, -1, width).mul_(scales[..., None])
            return values
        block_c = torch.arange(c0, c1) // width
        return values * self.scales_RC[block_r][:, block_c]


# The 16 FP4 (E2M1) values by code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values sharing one scale


@functools.cache
def _byte_values() -> torch.Tensor:
    """``[256, 2]``: the two FP4 values of each byte, the low nibble first."""
    lut = torch.tensor(FP4_E2M1)
    codes = torch.arange(256)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1)


class Mxfp4:
    """GPT-OSS's experts released in MXFP4, read as the fp32 tensor ``[E, in, out]``
    (``x @ W`` form, as transformers' ``convert_moe_packed_tensors`` returns it).

    The file holds ``blocks [E, out, in / 32, 16]`` (uint8: two FP4 E2M1 codes a byte,
    the low nibble first) and ``scales [E, out, in / 32]`` (uint8 E8M0: each group of 32
    values times ``2 ** (scale - 127)``). Sliced as that tensor; a slice of ``in`` reads
    only the groups it covers.
    """

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales
        experts, out, groups, _ = blocks.get_shape()
        self.shape = (experts, groups * MXFP4_GROUP, out)

    def get_shape(self):
        return list(self.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        (e0, e1, _), (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(index + (slice(None),) * 3, self.shape))
        g0, g1 = r0 // MXFP4_GROUP, -(-r1 // MXFP4_GROUP)
        codes = self.blocks[e0:e1, c0:c1, g0:g1]  # [e, out, g, 16]
        values = _byte_values()[codes.long()].flatten(-3)  # [e, out, g * 32]: both nibbles of a byte at once
        # times 2 ** (scale - 127): a power of two, exact in fp32 (transformers' ldexp)
        factors = torch.exp2(self.scales[e0:e1, c0:c1, g0:g1].float() - 127)
        values = (values.unflatten(-1, (g1 - g0, MXFP4_GROUP)) * factors[..., None]).flatten(-2)
        values = values[..., r0 - g0 * MXFP4_GROUP:r1 - g0 * MXFP4_GROUP]  # [e, out, in]
        out = torch.empty(*values.shape[:-2], values.shape[-1], values.shape[-2])
        for e in range(values.shape[0]):
            copy_transposed(out[e], values[e])
        return out


class SafetensorsDir:
    """The tensors of a Hugging Face directory's safetensors files, opened lazily.

    Reads ``model.safetensors.index.json`` (sharded) or ``model.safetensors``;
    a tensor is read (or row-sliced) from its file only when asked for. With
    ``fp8_block`` (a checkpoint released in FP8 with block scales), a weight stored in
    FP8 reads as its fp32 values (``BlockFp8``); with ``mxfp4`` (GPT-OSS's experts
    released in MXFP4), a tensor stored as ``x_blocks`` and ``x_scales`` reads as ``x``
    (``Mxfp4``).
    """

    def __init__(self, directory: Path, fp8_block: tuple[int, int] | None = None, mxfp4: bool = False):
        self.directory, self.fp8_block, self.mxfp4 = directory, fp8_block, mxfp4
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
        blocks, scales = (key + suffix for suffix in MXFP4_SUFFIXES)
        if key not in self.file_of and (blocks in self.file_of or scales in self.file_of):
            return self._mxfp4(key, blocks, scales)
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
        if len(found.get_shape()) != 2:  # block scales are a grid over a matrix (a Linear's weight)
            raise ValueError(f"{self.directory}: {key!r} is stored in FP8 with shape {found.get_shape()}; fmoe reads "
                             "FP8 block scales of 2-D weights only")
        scales, (rows, cols) = self._raw(scale_key)[:], found.get_shape()
        grid = (-(-rows // self.fp8_block[0]), -(-cols // self.fp8_block[1]))
        if tuple(scales.shape) != grid:
            raise ValueError(f"{self.directory}: {scale_key!r} has shape {list(scales.shape)}; {key!r} "
                             f"[{rows}, {cols}] in blocks of {list(self.fp8_block)} needs {list(grid)}")
        return BlockFp8(found, scales, self.fp8_block)

    def _mxfp4(self, key: str, blocks: str, scales: str) -> Mxfp4:
        """``key`` released in MXFP4 as ``blocks`` and ``scales``, both checked."""
        if blocks not in self.file_of or scales not in self.file_of:
            have, lack = (blocks, scales) if blocks in self.file_of else (scales, blocks)
            raise ValueError(f"{self.directory}: {key!r} is stored in MXFP4 as {have!r} without {lack!r} "
                             f"(MXFP4 needs both {blocks!r} and {scales!r}): fmoe cannot read its values")
        if not self.mxfp4:
            raise ValueError(f"{self.directory}: {key!r} is stored in MXFP4 ({blocks!r}, {scales!r}), but config.json "
                             "has no quantization_config with quant_method 'mxfp4'")
        b, s = self._raw(blocks), self._raw(scales)
        shape, scale_shape = list(b.get_shape()), list(s.get_shape())
        if len(shape) != 4 or shape[-1] != MXFP4_GROUP // 2 or scale_shape != shape[:-1] \
                or b.get_dtype() != "U8" or s.get_dtype() != "U8":
            raise ValueError(f"{self.directory}: {blocks!r} ({b.get_dtype()} {shape}) and {scales!r} "
                             f"({s.get_dtype()} {scale_shape}) are not MXFP4 experts: uint8 [E, rows, groups, 16] "
                             "and uint8 [E, rows, groups]")
        return Mxfp4(b, s)

    def _raw(self, key: str):
        name = self.file_of[key]
        if name not in self._handles:
            self._handles[name] = self._open(name)
        return self._handles[name].get_slice(key)


def _read_rows(files: SafetensorsDir, recipe: Recipe, expert: int | None, first: int, last: int,
               shape: tuple, experts: int, out_RC: torch.Tensor) -> None:
    """Rows ``[first, last)`` of one leaf (one expert's, for expert leaves) into the fp32
    ``out_RC`` ``[last - first, cols]`` (``[1, cols]`` for a vector), part by part.

    ``shape``: the leaf's (one expert's) shape; ``experts``: how many a stacked file tensor holds.
    """
    stacked = recipe.experts == Experts.STACKED
    col = 0
    for part in recipe.parts:
        key = part.key.format(e=expert)
        src = files.slice(key)
        if len(shape) == 1:
            want = (part.width,)
        else:
            want = (part.width, shape[0]) if part.transposed else (shape[0], part.width)
        want = (experts, *want) if stacked else want
        if tuple(src.get_shape()) != want:
            raise ValueError(f"{files.directory}: {key!r} has shape {list(src.get_shape())}, "
                             f"the config needs {list(want)}")
        lead = (slice(expert, expert + 1),) if stacked else ()  # this expert's, of the stacked tensor
        dst = out_RC[:, col:col + part.width]
        if len(shape) == 1:
            dst.copy_(src[lead + (slice(None),)].reshape(1, part.width))
        elif part.transposed:
            copy_transposed(dst, src[lead + (slice(None), slice(first, last))].flatten(0, -2))
        else:
            dst.copy_(src[lead + (slice(first, last),)].flatten(0, -2))
        col += part.width


TRANSPOSE_ROWS = 64


def copy_transposed(dst_CR: torch.Tensor, src_RC: torch.Tensor) -> None:
    """``dst = src.t()`` (casting as ``copy_`` does), ``TRANSPOSE_ROWS`` of src's rows at
    a time: one whole transposing copy walks one side with a stride of a full row, and
    measured several times slower on a [768, 2048] weight (``benchmarks/hf_io.py``)."""
    for r in range(0, src_RC.shape[0], TRANSPOSE_ROWS):
        dst_CR[:, r:r + TRANSPOSE_ROWS].copy_(src_RC[r:r + TRANSPOSE_ROWS].t())


def relayout_glu(w: torch.Tensor, from_block: int, to_block: int) -> torch.Tensor:
    """GLU halves along the last axis, from one interleave to another (0: ``[gate | up]``)."""
    if from_block == to_block:
        return w
    halves = glu_from_interleaved(w, from_block) if from_block else w
    return glu_to_interleaved(halves, to_block) if to_block else halves


def read_local_leaf(files: SafetensorsDir, recipe: Recipe, cfg: ModelConfig, local_shape: tuple,
                    experts: tuple | None, first: int, last: int, sharded: bool) -> torch.Tensor:
    """What one rank holds of a leaf (see ``fmoe.shard.spec.leaf_piece``), read from ``files``.

    Arguments:
        files: the checkpoint's tensors.
        recipe: the leaf's Recipe.
        cfg: the ModelConfig (its ``glu_interleave`` is the layout returned).
        local_shape: the leaf cut to this rank's experts; ``experts`` their global range.
        first, last: rows of that leaf (as ``[rows, cols]``) to read; ``sharded``: return
            them as ``[last - first, cols]`` rather than in ``local_shape``.

    Returns:
        The fp32 tensor.
    """
    rows, cols = rows_cols(local_shape)
    block = torch.empty(max(last - first, 0), cols)
    if recipe.experts is None:
        if last > first:
            _read_rows(files, recipe, None, first, last, local_shape, cfg.experts, block)
    else:
        per = rows // local_shape[0]  # rows of one expert
        base = experts[0] if experts else 0
        for e in range(first // per, -(-last // per)):
            lo, hi = max(first - e * per, 0), min(last - e * per, per)
            at = e * per + lo - first
            _read_rows(files, recipe, base + e, lo, hi, local_shape[1:], cfg.experts, block[at:at + hi - lo])
    if recipe.glu:
        block = relayout_glu(block, recipe.file_interleave, cfg.glu_interleave)
    return block if sharded else block.reshape(local_shape)


def to_file_tensors(path: str, full: torch.Tensor, recipe: Recipe, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """``{file key: tensor}`` of one full fmoe leaf, in the released layout.

    Arguments:
        path: the leaf's path (for the caller's messages).
        full: the whole leaf, every expert.
        recipe: its Recipe.
        cfg: the ModelConfig (``glu_interleave``: the layout of ``full``).
        dtype: the file's dtype.

    Returns:
        The tensors to write, on the CPU, contiguous.
    """
    if recipe.glu:
        full = relayout_glu(full, cfg.glu_interleave, recipe.file_interleave)
    out = {}
    for e in range(full.shape[0]) if recipe.experts == Experts.SEPARATE else (None,):
        leaf = full[e] if e is not None else full
        for part, piece in zip(recipe.parts, leaf.split([p.width for p in recipe.parts], dim=-1)):
            piece = piece.cpu()
            if part.transposed and piece.dim() == 2:
                tensor = torch.empty(piece.shape[::-1], dtype=dtype)
                copy_transposed(tensor, piece)
            else:
                tensor = (piece.transpose(-1, -2) if part.transposed else piece).to(dtype).contiguous()
            out[part.key.format(e=e)] = tensor
    return out
