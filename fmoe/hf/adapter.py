"""``fmoe.hf.save_adapter``: trained adapters as a PEFT LoRA adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the transformers model.

PEFT keeps ``lora_A [r, in]`` and ``lora_B [out, r]`` per adapted ``nn.Linear``
(``target_modules``) and scales their product by ``lora_alpha / r``, as fmoe does. fmoe's
adapters map onto them exactly:

- ``q``, ``k``, ``v``, ``out`` and latent attention's projections: one module each
  (``self_attn.q_proj``, ...), ``A = a.T``, ``B = b.T``.
- A fused fmoe matrix that the model holds as several modules (a shared expert's or a
  dense layer's ``fc1``, ``gate_proj`` beside ``up_proj``): the same ``A`` for each, and
  ``B`` the module's columns of ``b``. ``(x @ a) @ b`` restricted to those columns is the
  module's own rank-``r`` product, so nothing is approximated.
- The routed experts: transformers (>= 5) holds every expert in one parameter
  (``mlp.experts.gate_up_proj``, ``down_proj``), which PEFT adapts through
  ``target_parameters``: ``lora_A [E * r, in]`` expert by expert, ``lora_B [out, r * E]``
  with the expert varying fastest along its columns (``ParamWrapper.get_delta_weight``).
  The two parameters of one module nest: ``gate_up_proj``, wrapped first, is saved under
  ``experts.base_layer``.

``fc1``'s columns are re-laid from the config's GLU layout (``glu_interleave``) to the
module's: ``[gate | up]``, or GPT-OSS's gate and up alternating.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.convert import safetensors_torch
from ..checkpoint.files import chmod_as_umask, staged_directory, write_atomically
from ..comm.collectives import Group
from ..config import Plan
from ..lora import pairs, plan_lora
from ..checks import fail
from ..runtime import check_runtime
from .families import family_of
from .weights import Experts, relayout_glu, recipes

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's name for the wrapped transformers model
_FUSED_EXPERTS = {"fc1": "gate_up_proj", "fc2": "down_proj"}  # in the order PEFT wraps them
# The families whose transformers model PEFT (0.21, with transformers >= 5) reads as Qwen2-MoE's v4 layout
# (transformers.conversion_mapping's _MODEL_TO_CONVERSION_PATTERN): every target module named gate_proj,
# up_proj or down_proj is moved onto the routed experts' fused parameters with twice the rank, so a dense
# layer's or a shared expert's adapter would be dropped (peft.utils.transformers_weight_conversion).
PEFT_MOVES_MLP_MODULES = ("qwen3_moe", "olmoe", "glm4_moe", "deepseek_v3")


def peft_tensors(adapters: dict, plan: Plan) -> tuple[dict, list, list]:
    """fmoe's adapters as PEFT's tensors.

    Arguments:
        adapters: the full adapters (every rank holds them whole in this version).
        plan: the Plan whose ``lora`` they follow.

    Returns:
        ``({safetensors key: fp32 tensor on the CPU}, target_modules, target_parameters)``,
        the modules and parameters as full names in the transformers model.
    """
    cfg = plan.model
    family = family_of(cfg, "fmoe.hf.save_adapter")
    _check_peft_reads(plan, family)
    by_path = recipes(cfg, family)
    tensors, modules, params = {}, [], []
    for site, a, b in pairs(adapters, plan):
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        recipe = by_path[site.param]
        if recipe.experts is not None:
            layer, fc = site.adapter[1], site.adapter[-1]
            experts = f"model.layers.{layer}.mlp.experts"
            if recipe.glu:  # the module's own GLU layout (GPT-OSS stores its experts as released)
                b = relayout_glu(b, cfg.glu_interleave, recipe.file_interleave if recipe.experts is Experts.STACKED
                                  else 0)
            nested = ".base_layer" if fc == "fc1" else ""
            tensors[f"{_PREFIX}{experts}{nested}.lora_A.weight"] = a.transpose(-1, -2).flatten(0, 1)
            tensors[f"{_PREFIX}{experts}{nested}.lora_B.weight"] = b.permute(2, 1, 0).flatten(1, 2)
            params.append(f"{experts}.{_FUSED_EXPERTS[fc]}")
            continue
        parts = recipe.parts
        if site.columns is not None:  # q, k or v: the one part of qkv at these columns
            parts = [p for p, start in zip(parts, _starts(parts)) if start == site.columns.start]
        elif recipe.glu:
            b = relayout_glu(b, cfg.glu_interleave, 0)
        for part, piece in zip(parts, b.split([p.width for p in parts], dim=-1)):
            module = part.key.removesuffix(".weight")
            tensors[f"{_PREFIX}{module}.lora_A.weight"] = a.t()
            tensors[f"{_PREFIX}{module}.lora_B.weight"] = piece.t()
            modules.append(module)
    return {k: t.contiguous() for k, t in tensors.items()}, modules, params


def _check_peft_reads(plan: Plan, family: str) -> None:
    """ValueError naming ``LoRA.targets`` for adapters PEFT would load onto other modules."""
    lora = plan_lora(plan)
    moved = [t for t in lora.targets if t in ("shared", "mlp")]
    if moved and family in PEFT_MOVES_MLP_MODULES:
        fail("LoRA.targets", lora.targets, f"PEFT loads a {family} adapter's gate_proj / up_proj / down_proj modules "
             f"onto the routed experts, so its {' and '.join(map(repr, moved))} adapters would be lost: save "
             "fmoe.lora.merge(base, adapters, plan) with fmoe.hf.save instead, or train without those targets")


def _starts(parts) -> list[int]:
    starts, at = [], 0
    for part in parts:
        starts.append(at)
        at += part.width
    return starts


def adapter_config(plan: Plan, modules: list, params: list, source=None) -> dict:
    """PEFT's ``adapter_config.json`` for ``plan.lora`` on the named modules and params."""
    lora = plan_lora(plan)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": sorted(modules) or None, "target_parameters": sorted(params) or None,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": str(source) if source is not None else None}


def save_adapter(directory, adapters: dict, plan: Plan, source=None) -> Path:
    """Write ``adapters`` as a PEFT LoRA adapter folder.

    Collective: every rank calls it with its adapters (each holds them whole); rank 0
    writes. Atomic: the files go to a temporary sibling renamed into place.

    Arguments:
        directory: the folder (created; an existing one is replaced only if it holds an
            ``adapter_config.json``).
        adapters: the adapters under ``plan.lora`` (``fmoe.lora.init``'s structure).
        plan: the Plan.
        source: the Hugging Face folder of the base model, recorded as
            ``base_model_name_or_path``.

    Returns:
        The folder's Path.

    Raises:
        ValueError: before anything is written, for adapters that do not match
            ``plan.lora`` or a model no transformers family holds (naming the field).
    """
    check_runtime(plan)
    tensors, modules, params = peft_tensors(adapters, plan)
    safetensors_torch("hf")  # before the collective, so a missing package fails every rank alike
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not (directory / CONFIG_FILE).exists():
        raise ValueError(f"fmoe.hf.save_adapter: {directory} exists and is not a PEFT adapter folder (no "
                         f"{CONFIG_FILE}); refusing to replace it")
    config = adapter_config(plan, modules, params, source)
    world = Group.world()
    with staged_directory(directory, world, plan.device, "fmoe.hf.save_adapter") as (tmp, publish):
        def finish():
            tmp.mkdir(parents=True)
            safetensors_torch("hf").save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            chmod_as_umask(tmp / WEIGHTS_FILE)
            write_atomically(json.dumps(config, indent=2), tmp / CONFIG_FILE)

        publish(finish)
    return directory
