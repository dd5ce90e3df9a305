"""What a CUDA graph cannot capture, decided from the plan alone: ``check_capturable``
refuses a plan whose step would read a device value on the host or change shape inside
a captured region, naming the setting that makes it capturable, before any CUDA work."""

from __future__ import annotations

import torch

from fmoe import Plan

SCOPES = ("attn", "router", "dispatch", "experts")


def _expert_host_reads(plan: Plan) -> list[str]:
    """Why the expert MLP would read a device value on the host or change shape."""
    cfg, reasons = plan.model, []
    dropless = not cfg.capacity_factor
    if dropless and plan.ep > 1:
        reasons.append(f"dropless routing over Plan.ep={plan.ep} reads the all-to-all split sizes on the host "
                       "and gives the experts a different row count every step (set ModelConfig.capacity_factor "
                       "> 0 for a static capacity)")
    if dropless and cfg.pad_multiple:
        reasons.append(f"padded dropless routing (ModelConfig.pad_multiple={cfg.pad_multiple}) reads the "
                       "permuted row count on the host (set pad_multiple=0 or capacity_factor > 0)")
    if plan.expert_backend == "loop":
        reasons.append("Plan.expert_backend='loop' reads each expert's row count on the host (use 'torch')")
    if plan.expert_backend == "te" and dropless:
        reasons.append("Plan.expert_backend='te' hands dropless row counts to TE's grouped GEMM on the host "
                       "(set ModelConfig.capacity_factor > 0, or use expert_backend 'torch')")
    if plan.expert_backend == "torch" and plan.dtype == "float32":
        reasons.append("torch._grouped_mm has no float32 CUDA kernel: its fallback copies between host and "
                       "device (use Plan.dtype='bfloat16')")
    per_16_bytes = 16 // torch.empty((), dtype=plan.compute_dtype).element_size()
    ffn = cfg.ffn // plan.etp  # the hidden units one rank's expert weights hold
    if plan.expert_backend == "torch" and any(n % per_16_bytes for n in (cfg.dim, ffn, cfg.fc1_width(ffn))):
        held = f" (ffn / Plan.etp={plan.etp} = {ffn} a rank)" if plan.etp > 1 else ""
        reasons.append(f"ModelConfig.dim={cfg.dim} / ffn={cfg.ffn}{held} are not multiples of 16 bytes in "
                       f"{plan.dtype}, so the torch backend falls back to a per-expert loop that reads row "
                       "counts on the host (use multiples of 8 for bfloat16, 4 for float32)")
    return reasons


def check_capturable(plan: Plan, scopes) -> None:
    """Raise ValueError unless every scope in ``scopes`` (``attn``, ``router``,
    ``dispatch``, ``experts`` or ``step``, the whole step) can be captured under ``plan``.

    Checks only the plan: it runs on any machine, before any CUDA work.
    """
    unknown = [s for s in scopes if s not in (*SCOPES, "step")]
    if unknown or not scopes:
        raise ValueError(f"scopes={list(scopes)!r} is invalid: allowed scopes are "
                         f"{', '.join(map(repr, (*SCOPES, 'step')))} (at least one)")
    parallel = {name: getattr(plan, name) for name in ("cp", "pp") if getattr(plan, name) > 1}
    if parallel:
        raise ValueError("cannot capture CUDA graphs under " + ", ".join(f"Plan.{k}={v}" for k, v in parallel.items())
                         + ": the graphed scopes do not take the context-parallel chunks or the pipeline's "
                         "transfers yet (allowed: cp = pp = 1, or no CUDA graph)")
    reasons = {}  # where -> why
    if plan.lora is not None and tuple(scopes) != ("step",):
        raise ValueError(f"scopes={list(scopes)!r} is invalid under Plan.lora: adapters are graphed with the whole "
                         "step only (allowed: 'step'; GraphedTrainStep(plan, update, base=...) or capture_step)")
    if "step" in scopes:
        reasons["a whole step"] = _expert_host_reads(plan)
        if plan.etp > 1:
            reasons["a whole step"].append(f"Plan.etp={plan.etp} reads its group's row counts on the host before "
                                           "the experts (allowed: etp = 1; or graph the scopes instead: 'experts' "
                                           "runs between those exchanges)")
    elif "experts" in scopes:
        reasons["scope 'experts'"] = _expert_host_reads(plan)
        if plan.delay_wgrad:
            reasons["scope 'experts'"].append("Plan.delay_wgrad=True defers the experts' weight GEMMs out of "
                                              "their backward, which a graphed 'experts' scope runs whole (set "
                                              "delay_wgrad=False or leave 'experts' out)")
    cfg = plan.model
    if "dispatch" in scopes and cfg.pad_multiple and not cfg.capacity_factor:
        reasons["scope 'dispatch'"] = [f"padded dropless routing (ModelConfig.pad_multiple={cfg.pad_multiple}) "
                                       "reads the permuted row count on the host (set pad_multiple=0 or "
                                       "capacity_factor > 0, or leave 'dispatch' out)"]
    refused = [f"cannot capture {where} in a CUDA graph: " + "; ".join(why) for where, why in reasons.items() if why]
    if refused:
        raise ValueError("; ".join(refused))
    if torch.device(plan.device).type != "cuda":
        raise ValueError(f"CUDA graphs need Plan.device='cuda' (or 'cuda:N'), got {plan.device!r}")


__all__ = ["SCOPES", "check_capturable"]
