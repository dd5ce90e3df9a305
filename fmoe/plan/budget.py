"""How much memory a planned rank may hold, and what to say when a plan needs more.

The budget is ``--memory`` when given; else the memory of the GPU the calibration was
measured on (its ``source`` names the device: ``NVIDIA H100 80GB HBM3``), or of this
machine's GPU when it has one; else 80 GiB, an H100's, the GPU the default links and
calibration assume.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..runtime import device_memory
from .memory import estimate_memory
from .report import GIB

# The total memory nvidia-smi shows, in MiB, of the GPUs the shipped calibrations name
# (H100 80GB HBM3 and H200 SXM)
KNOWN_GPUS_MIB = {"H100": 81559, "H200": 143771}
ASSUMED_GIB = 80.0
# What the estimate leaves free by default, as a share of the budget. Measured on 4 x H200
# (2026-11-28), Qwen3-30B-A3B at full depth (pp=4, remat full): the estimate was 6.2% under
# the measured peak (104.9 against 111.8 GiB), the allocator held 2.1 GiB more than that
# peak, and torch can allocate 139.8 of the 140.4 GiB nvidia-smi shows, before NCCL's buffers.
RESERVE = 0.10


@dataclass(frozen=True)
class Budget:
    """GiB a rank's GPU holds, where that number comes from (``--memory 80 GiB``,
    ``the calibration's NVIDIA H200 (140.4 GiB)``), and the share of it a plan leaves free."""

    gib: float
    source: str
    reserve: float = RESERVE
    reserve_flag: bool = True  # the planner's line names --reserve; the main job's cannot

    @property
    def usable(self) -> float:
        """GiB a plan's estimate may reach."""
        return self.gib * (1 - self.reserve)

    def __str__(self) -> str:
        if not self.reserve:
            return self.source
        usable = f"{self.usable:,.2f}".rstrip("0").rstrip(".") if self.usable >= 1 else f"{self.usable:.2g}"
        kept = f"the {self.reserve:.0%} --reserve" if self.reserve_flag else f"a {self.reserve:.0%} reserve"
        return f"{usable} GiB ({self.source} less {kept})"


def _named_gpu(source: str) -> tuple[str, float] | None:
    """The GPU a calibration's ``source`` names and its memory in GiB, if known."""
    for name, mib in KNOWN_GPUS_MIB.items():
        if re.search(rf"\b{re.escape(name)}\b", source):
            return name, mib / 1024
    return None


def budget(memory: float | None, calibration_source: str, reserve: float = RESERVE) -> Budget:
    """The memory a rank may hold.

    Arguments:
        memory: ``--memory`` (GiB), or None when not given.
        calibration_source: the calibration's ``source`` (a device and date).
        reserve: ``--reserve``, the share of it a plan leaves free.

    Returns:
        A Budget.
    """
    if memory is not None:
        return Budget(memory, f"--memory {memory:g} GiB", reserve)
    named = _named_gpu(calibration_source)
    if named is not None:
        return Budget(named[1], f"the calibration's {named[0]} ({named[1]:.1f} GiB; --memory to change)", reserve)
    if torch.cuda.is_available():
        gib = device_memory("cuda") / GIB
        return Budget(gib, f"this machine's {torch.cuda.get_device_name(0)} ({gib:.1f} GiB; --memory to change)",
                      reserve)
    return Budget(ASSUMED_GIB, f"an assumed H100's {ASSUMED_GIB:g} GiB (--memory to change)", reserve)


# what a rank holds, in the groups the remedies act on
_GROUPS = {"params, grads and optimizer state": ("params", "grads", "optimizer", "step copy"),
           "gathered weights and gradient buffers": ("gathered", "grad buffers"),
           "activations": ("activations",)}


def _remedies(group: str, plan, moments: str, rows: int) -> list[str]:
    """What shrinks ``group`` of what a rank of ``plan`` holds (``rows``: the global batch's)."""
    if group == "activations":
        rows_each = rows // (plan.dp * plan.ep * plan.microbatches)
        return ([] if plan.remat_mode.whole_layers else ["--remat full"]) + (
            ["more --microbatches (fewer rows each)"] if rows_each > 1 else []) + ["more --tp / --cp"]
    zero3 = [] if plan.sharding == "optim_grads_params" else ["--sharding optim_grads_params (ZeRO-3)"]
    if group.startswith("gathered"):  # whole units at once: split the layers themselves
        return zero3 + ["more --ep / --tp (a part of each layer a rank)", "--pp"]
    return zero3 + (["--moments bfloat16"] if moments == "float32" else []) + [
        "more GPUs to shard over (--gpus, --ep, --pp)"]


def over_budget(plan, memory: list[dict], limit: Budget, moments: str, rows: int,
                search: str = "--search") -> str | None:
    """One line when a stage of ``plan`` needs more than ``limit`` allows (``memory``: each
    stage's ``estimate_memory`` on a global batch of ``rows``): what it holds, by group,
    what would shrink the largest, and ``search`` (the command that ranks the plans that
    fit); None when every stage fits."""
    stage = max(range(len(memory)), key=lambda s: memory[s]["total"])
    parts = memory[stage]
    need = parts["total"] / GIB
    if need <= limit.usable:
        return None
    sizes = {group: sum(parts[p] for p in members) / GIB for group, members in _GROUPS.items()}
    largest = max(sizes, key=sizes.get)
    held = ", ".join(f"{group} {gib:,.1f} GiB" for group, gib in sizes.items())
    where = f" (stage {stage})" if len(memory) > 1 else ""
    return (f"memory: needs {need:,.1f} GiB a GPU{where}, over {limit}: {held}; for the {largest} try "
            f"{', '.join(_remedies(largest, plan, moments, rows))}, or {search} to rank the plans that fit")


def device_warning(plan, rows: int, seq: int, moments: str) -> str | None:
    """One line when the planner's estimate for ``plan`` (a global batch of ``rows`` x
    ``seq``, balanced routing) leaves less than ``RESERVE`` of its GPU free: what the main
    job says before it draws a parameter. None on a CPU, under ``Plan.lora``, or when the plan fits."""
    device = torch.device(plan.device)
    # the estimate sizes full training (every parameter's gradient and moments): adapters on a
    # frozen base hold a fraction of that, so it would warn of a plan that fits
    if device.type != "cuda" or plan.lora is not None:
        return None
    gib = device_memory(device) / GIB
    limit = Budget(gib, f"this {torch.cuda.get_device_name(device)}'s {gib:.1f} GiB", reserve_flag=False)
    try:
        stages = [estimate_memory(plan, rows, seq, s, moments) for s in range(plan.pp)]
    except ValueError:  # PlanError too: a plan the planner cannot size goes unwarned (the job's checks passed)
        return None
    over = over_budget(plan, stages, limit, moments, rows, "python -m fmoe.plan --search (with this job's flags)")
    if over is None:
        return None
    return (f"warning: by the planner's estimate this plan {over.removeprefix('memory: ')}. A GPU this full may "
            "stall rather than run out of memory (BENCHMARKS.md, \"Qwen3-30B-A3B at full depth\"; the planner's "
            "--reserve sets the share kept free)")
