"""What reading a Hugging Face ``config.json`` into a ModelConfig needs in every family:
the refusal naming a key, a required key, YaRN's settings as transformers reads them, a
check of ModelConfig fields against what a family can hold, and the ModelConfig built
with the file named in its errors."""

from __future__ import annotations

from ..checks import is_number
from ..config import ModelConfig


def fail(where: str, key: str, value, why: str):
    raise ValueError(f"{where}: {key}={value!r} is not supported: {why}")


def require(hf: dict, where: str, *keys: str):
    """The first of ``keys`` the config has (transformers renamed some over releases)."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ValueError(f"{where}: no {' or '.join(map(repr, keys))}")


def yarn_fields(params: dict, hf: dict, where: str, key: str, default_max: int | None = None) -> dict:
    """YaRN's ModelConfig fields from ``params`` (the config's ``key``: ``rope_scaling`` or
    ``rope_parameters``), as transformers reads them: a top-level
    ``original_max_position_embeddings`` wins over the one in ``params``, then
    ``max_position_embeddings`` (``default_max``: the family config's default for it); a
    missing ``factor`` is ``max_position_embeddings / original``; a null beta is its
    default; an mscale or attention factor missing or 0 is unset (fmoe's 0)."""
    longest = hf.get("max_position_embeddings", default_max)
    original = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings", longest))
    if not (is_number(original) and original == int(original) and original > 0):
        fail(where, f"{key}.original_max_position_embeddings", original, "YaRN needs the pretrained context "
              "length, an int > 0")
    factor = params.get("factor")
    if factor is None and is_number(longest):  # as transformers derives it
        factor = longest / original
    if not is_number(factor):
        fail(where, f"{key}.factor", factor, "must be a number >= 1")
    return dict(rope_scaling="yarn", rope_factor=float(factor), rope_original_max=int(original),
                yarn_beta_fast=float(params.get("beta_fast") or 32.0), yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                yarn_mscale=float(params.get("mscale") or 0.0),
                yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                yarn_attention_factor=float(params.get("attention_factor") or 0.0),
                yarn_truncate=bool(params.get("truncate", True)))


def model_config(fields: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def check_fields(cfg: ModelConfig, where: str, checks, whose: str = "the Hugging Face MoE families have") -> None:
    for name, value, ok in checks:
        if not ok:
            fail(where, f"ModelConfig.{name}", value, f"{whose} no such variant")
