"""Run a function on several gloo ranks (processes on loopback) and collect results.

Workers use one intra-op thread each (bitwise-repeatable CPU kernels), send their
results as bytes (tensors in shared memory vanish when a worker exits), and a
worker that dies without reporting fails the run at once.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            torch.use_deterministic_algorithms(True)
        dist.init_process_group(backend, rank=rank, world_size=world)
        value = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, backend: str = "gloo", timeout: float = 600.0) -> list:
    """``[fn(rank, world, *args) for each rank]``, each in its own process.

    ``backend="nccl"`` gives rank r GPU r, with deterministic algorithms on (the
    caller sets ``CUBLAS_WORKSPACE_CONFIG`` and ``NCCL_ALGO`` for bitwise runs).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died without reporting (exit codes "
                                       f"{[procs[i].exitcode for i in dead]})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} did not report in {timeout}s")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def _each_case(rank, world, fn, cases):
    return {case: fn(rank, world, *case) for case in cases}


def run_cases(world: int, fn, cases, backend: str = "gloo") -> list:
    """``[{case: fn(rank, world, *case) for case in cases} for each rank]``: every case in
    one start of the ranks (a start costs ~3 s for 2 processes, ~12 s for 8 on 2 cores).
    Each ``case`` is a tuple of ``fn``'s further arguments."""
    return run_ranks(world, _each_case, fn, tuple(cases), backend=backend)
