"""Run a function on several gloo ranks (processes on loopback) and collect results.

Workers use one intra-op thread each (bitwise-repeatable CPU kernels), send their
results as bytes (tensors in shared memory vanish when a worker exits), and a
worker that dies without reporting fails the run at once. gloo ranks stay alive
between runs of one world size (see ``run_ranks``).
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import queue
import socket
import sys
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


def _report(rank, world, fn, args, results) -> None:
    """Run ``fn`` and put ``(rank, ok, bytes or traceback)`` on ``results``."""
    try:
        value = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _worker(rank, world, port, backend, fn, args, results, started_from):
    _as_started_from(*started_from)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            torch.use_deterministic_algorithms(True)
        dist.init_process_group(backend, rank=rank, world_size=world)
        _report(rank, world, fn, args, results)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _as_started_from(environ: dict, cwd: str) -> None:
    """Take the starting process's environment and folder, as a spawned process would
    (a forked rank has the fork server's, from when it started)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def _pool_worker(rank, world, port, tasks, results, started_from):
    # A gloo rank that runs one function after another, each from the state a fresh
    # process starts a run in: its environment, no compiled code, and a seed drawn anew
    # (torch seeds a new process at random: a run must not depend on the last one's).
    _as_started_from(*started_from)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    environ = dict(os.environ)
    try:
        for fn, args in iter(tasks.get, None):
            torch.seed()
            _report(rank, world, fn, args, results)
            os.environ.clear()
            os.environ.update(environ)
            if "torch._dynamo" in sys.modules:
                torch._dynamo.reset()
            gc.collect()
    finally:
        dist.destroy_process_group()


def _collect(procs, results, world: int, timeout: float) -> list:
    """Each rank's result from ``results``; raises at the first failure, a rank that died
    or ``timeout`` seconds."""
    got, deadline = {}, time.monotonic() + timeout
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
    return [got[r] for r in range(world)]


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


def _context(backend: str):
    """How ranks start. gloo ranks: forked from a server process that imported torch and
    fmoe once (``forkserver``), so a rank costs a fork instead of a new Python importing
    them (~2.5 s of a core each: ~7 s for eight ranks on 2 cores); each starts from the
    state a fresh process has after those imports (nothing run or compiled), with this
    process's environment and folder (``_as_started_from``). nccl ranks are spawned."""
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "fmoe"])
    return ctx


class _Pool:
    """``world`` gloo ranks kept between runs. Starting ranks costs a fork each (the
    fork server's imports once, ``_context``), but a run's first use of each rank's
    modules still costs a little; the suite starts ranks dozens of times."""

    def __init__(self, world: int):
        ctx = _context("gloo")
        self.world, self.results = world, ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port, started_from = free_port(), (dict(os.environ), os.getcwd())
        self.procs = [ctx.Process(target=_pool_worker,
                                  args=(r, world, port, self.tasks[r], self.results, started_from), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout: float) -> list:
        for tasks in self.tasks:
            tasks.put((fn, args))
        return _collect(self.procs, self.results, self.world, timeout)

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        _stop(self.procs)


_POOLS: dict[int, _Pool] = {}
FRESH_RANKS = os.environ.get("FMOE_TEST_FRESH_RANKS") == "1"  # every run in new processes (to rule the pool out)


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_ranks(world: int, fn, *args, backend: str = "gloo", timeout: float = 600.0) -> list:
    """``[fn(rank, world, *args) for each rank]``, each rank in its own process.

    gloo ranks are kept between runs of the same ``world`` (``_Pool``), each run starting
    from a fresh process's environment and a new random seed; a run that fails or times
    out ends its ranks, so the next one starts new processes (``FMOE_TEST_FRESH_RANKS=1``:
    every run).
    ``backend="nccl"`` starts new processes per run and gives rank r GPU r, with
    deterministic algorithms on (the caller sets ``CUBLAS_WORKSPACE_CONFIG`` and
    ``NCCL_ALGO`` for bitwise runs).
    """
    if backend == "gloo" and not FRESH_RANKS:
        pool = _POOLS.get(world) or _POOLS.setdefault(world, _Pool(world))
        try:
            return pool.run(fn, args, timeout)
        except BaseException:
            _POOLS.pop(world).close()
            raise
    ctx = _context(backend)
    results = ctx.Queue()
    port, started_from = free_port(), (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, results, started_from),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world, timeout)
    finally:
        _stop(procs)


def _each_case(rank, world, fn, cases):
    return {case: fn(rank, world, *case) for case in cases}


def run_cases(world: int, fn, cases, backend: str = "gloo") -> list:
    """``[{case: fn(rank, world, *case) for case in cases} for each rank]``: every case in
    one run (one start of the ranks where they start anew: nccl, or after a failure).
    Each ``case`` is a tuple of ``fn``'s further arguments."""
    return run_ranks(world, _each_case, fn, tuple(cases), backend=backend)
