"""A step that runs far past what it should says where it is.

A first step at a large shape can spend minutes compiling, waiting for another rank, or
freeing and retrying allocations on a device that is nearly full, and each looks the same
from outside: a job that prints nothing. ``Watchdog`` is one thread per process: once the
host has spent ``after_s`` seconds since the loop's last ``mark`` (a step begun, an
evaluation, a checkpoint), it prints, to this rank's stderr, what it was doing, the
loop thread's innermost frames and the device's memory (what the allocator holds, its
peak, and how often it had to free its cache and try again); then again every
``after_s`` seconds while the same mark stands.

A host stuck inside a call that holds the GIL starves that thread too; for it, ``SIGUSR1``
dumps every thread's Python stack from C (``faulthandler``), GIL or not.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
import traceback

import torch

_FRAMES = 8  # the innermost frames of the main thread's stack a report shows
_GIB = 2**30


def memory_line(device: torch.device, total: int) -> str:
    """What the CUDA allocator holds on ``device``: allocated, reserved, the peak, the
    device's ``total`` bytes, and the retries (a retry frees every cached block and
    allocates again: near a full device each one synchronises it)."""
    stats = torch.cuda.memory_stats(device)
    return (f"device memory {stats.get('allocated_bytes.all.current', 0) / _GIB:.1f} GiB allocated, "
            f"{stats.get('reserved_bytes.all.current', 0) / _GIB:.1f} reserved, peak "
            f"{stats.get('allocated_bytes.all.peak', 0) / _GIB:.1f}, of {total / _GIB:.1f}; "
            f"{stats.get('num_alloc_retries', 0)} allocation retries, {stats.get('num_ooms', 0)} out of memory")


def _dumps_on_usr1(out) -> bool:
    """Whether a watchdog reporting to ``out`` takes SIGUSR1: it reports to a real stderr
    (faulthandler writes to a file descriptor) from the main thread (signals' own)."""
    if out is not None or not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return False
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    return True


class Watchdog:
    """Reports a host that has not moved past a mark for ``after_s`` seconds.

    Arguments:
        after_s: seconds past a mark before the first report, and between reports
            (0: no thread, ``mark`` and ``close`` do nothing).
        rank: this process's rank, to tell the ranks' reports apart.
        device: the plan's device (its memory goes into each report when it is CUDA).
        out: where reports go (default ``sys.stderr``).

    The stack reported is that of the thread that built the Watchdog (the loop's).
    """

    def __init__(self, after_s: float, rank: int, device: torch.device, out=None):
        self.after_s, self.rank, self.device, self.out = after_s, rank, torch.device(device), out
        self._total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        self._watched = threading.get_ident()
        self._lock = threading.Lock()
        self._what, self._since, self._reports = None, 0.0, 0
        self._stop = threading.Event()
        self._thread, self._usr1 = None, False
        if after_s > 0:
            self._usr1 = _dumps_on_usr1(out)
            if self._usr1:
                faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
            self._thread = threading.Thread(target=self._watch, name="fmoe-stall-watchdog", daemon=True)
            self._thread.start()

    def mark(self, what: str | None) -> None:
        """The host begins ``what`` (``"step 12"``); None: nothing is watched until the next mark."""
        with self._lock:
            self._what, self._since, self._reports = what, time.monotonic(), 0

    def close(self) -> None:
        """Stop the thread (the loop's end)."""
        self._stop.set()
        if self._thread is not None:
            if self._usr1:
                faulthandler.unregister(signal.SIGUSR1)
            self._thread.join(timeout=10)  # a report in flight may wait on the allocator: never hold the exit

    def _watch(self) -> None:
        poll = max(0.05, min(1.0, self.after_s / 4))
        while not self._stop.wait(poll):
            with self._lock:  # the stack under the same lock as the mark: never another mark's
                what, waited, due = self._what, time.monotonic() - self._since, (self._reports + 1) * self.after_s
                if what is None or waited < due:
                    continue
                self._reports += 1
                frame = sys._current_frames().get(self._watched)
                stack = traceback.format_stack(frame)[-_FRAMES:] if frame is not None else []
            self._report(what, waited, stack)

    def _report(self, what: str, waited: float, stack: list[str]) -> None:
        out = self.out or sys.stderr
        out.write(f"[rank {self.rank}] {what} has run {waited:.0f} s on the host; the main thread is in:\n"
                  + "".join(stack))
        out.flush()
        if self.device.type != "cuda":
            return
        try:  # last: the allocator's lock may be held by the very call that is stuck
            out.write(f"[rank {self.rank}] {memory_line(self.device, self._total)}\n")
        except Exception as err:  # a report never ends the watch
            out.write(f"[rank {self.rank}] device memory unreadable: {err}\n")
        out.flush()
