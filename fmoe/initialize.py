"""``init``: this rank's parameters for a plan."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .config import Plan
from .comm.collectives import Group
from .params import initial_value
from .resolve import resolve
from .runtime import check_runtime


def init(plan: Plan, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """This rank's parameter pytree for ``plan``, deterministic per ``seed``.

    Arguments:
        plan: the Plan (its model, device and parallel layout).
        seed: the same seed gives the same full model whatever the plan.
        dtype: the leaves' dtype: float32 (what ``fmoe.step`` trains), or the plan's compute
            dtype for a frozen LoRA base (each leaf drawn in fp32 and cast on its own, so a
            base too large for fp32 on the device never is).

    Returns:
        A nested dict of ``dtype`` tensors in the canonical layout (``fmoe.params``): full
        tensors, or, when the plan shards parameters over several ranks, this rank's
        rows of each as ``[local_rows, last_dim]``. Each leaf is its own contiguous
        tensor on ``plan.device``.
    """
    check_runtime(plan)
    if dtype not in (torch.float32, plan.compute_dtype):
        raise ValueError(f"fmoe.init: dtype={dtype} (allowed: torch.float32, or the plan's compute dtype "
                         f"{plan.compute_dtype} for a frozen LoRA base)")
    rank, spec = Group.world().rank, resolve(plan).spec
    shapes = spec.local_shapes(rank)

    def drawn(leaf) -> torch.Tensor:  # on a worker thread: CPU work only
        piece = spec.shard_leaf(initial_value(leaf, plan.model, seed), leaf.path, rank).reshape(shapes[leaf.path])
        # a row block is a view that would keep the whole leaf alive until it is moved
        return piece.clone() if piece.untyped_storage().nbytes() > piece.nbytes else piece

    # Every rank draws every leaf whole (its rows are a view of the one full model), one
    # CPU core a leaf: a 30B model is ~30G draws, minutes on one core, so the leaves
    # are drawn on this process's share of the cores, as many at once as it has threads.
    # They move to the device here, on this thread: a CUDA device chosen with
    # torch.cuda.set_device is this thread's, not the workers'.
    with ThreadPoolExecutor(draw_threads()) as pool:
        local = {leaf.path: piece.to(device=plan.device, dtype=dtype).contiguous()
                 for leaf, piece in zip(spec.table.leaves, pool.map(drawn, spec.table.leaves))}
    return spec.table.unflatten(local[leaf.path] for leaf in spec.table.leaves)


def draw_threads() -> int:
    """Threads that draw initial values: this process's CPU cores over the processes of
    the machine (torchrun's ``LOCAL_WORLD_SIZE``), at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
