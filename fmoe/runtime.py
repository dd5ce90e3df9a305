"""Checks that a plan fits the process it runs in, made before any compute."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from .config import Plan
from .backends import BUILT_IN, declared_backends, registered_backend
from .comm.mesh import separate_world_group_supported


def world_size() -> int:
    """Ranks in the default process group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def device_memory(device) -> int:
    """Bytes of memory ``device`` has in all: a GPU's, or for the CPU the machine's RAM
    (or the container's limit, when cgroups set a lower one). For the checks that refuse
    sizes no machine of this kind could hold, before anything is allocated."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_runtime(plan: Plan) -> None:
    """Raise ValueError if ``plan`` cannot run here; nothing is computed before this."""
    if plan.pp > 1 and plan.virtual_stages > 1 and not separate_world_group_supported():
        raise ValueError(f"Plan.virtual_stages={plan.virtual_stages} needs torch >= 2.9 (a DeviceMesh group of "
                         f"every rank apart from the default one, for the stream's gradients); this is torch "
                         f"{torch.__version__} (allowed here: 1)")
    world = world_size()
    if plan.world != world:
        d = plan.dims
        raise ValueError(
            f"Plan.dp * Plan.ep * Plan.cp * Plan.tp = {d.dp} * {d.ep} * {d.cp} * {d.tp} = {plan.world} ranks "
            f"(Plan.world), but this process sees a world of {world}: launch {plan.world} processes "
            f"(torchrun --nproc-per-node {plan.world}) or set dp * ep * cp * tp = {world}"
        )
    check_device_and_backend(plan)


def check_device_and_backend(plan: Plan) -> None:
    """The part of ``check_runtime`` that needs no process group: the device exists and
    the expert backend is loaded and can run the plan."""
    device = torch.device(plan.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Plan.device={plan.device!r}, but CUDA is not available here (allowed: 'cpu')")
    # torch's FP8 grouped GEMM with rowwise scales (the routed experts') runs on sm_90
    # only: Ada has FP8 GEMMs but not that one, Blackwell's grouped FP8 is MXFP8
    if plan.fp8 != "none" and (capability := torch.cuda.get_device_capability(device))[0] != 9:
        raise ValueError(f"Plan.fp8={plan.fp8!r} needs a Hopper GPU (compute capability 9.x: torch's rowwise "
                         f"FP8 grouped GEMM runs there only), but {torch.cuda.get_device_name(device)} is "
                         f"{capability[0]}.{capability[1]} (allowed here: 'none')")
    if plan.expert_backend not in BUILT_IN:
        backend = registered_backend(plan.expert_backend)
        if backend is None:
            module = declared_backends().get(plan.expert_backend)
            where = (f"is provided by {module}, which is not loaded: import the module {module}" if module else
                     "is not registered in this process: import the module that registers it")
            raise ValueError(f"Plan.expert_backend={plan.expert_backend!r} {where} before the first step "
                             f"(or use {' or '.join(map(repr, BUILT_IN))})")
        backend.check(plan)
