"""The stall watchdog: a host that stays past a mark is reported with its stack, and
the main job marks its steps."""

import io
import signal
import sys
import time

import pytest

import fmoe.trainer.loop as loop
from fmoe.train import main as train_main
from fmoe.trainer.stall import Watchdog

from .procs import run_at_once
from .test_trainer import SMALL


def _a_slow_step(seconds):
    time.sleep(seconds)


def test_a_mark_held_past_its_limit_is_reported_with_the_main_threads_stack():
    out = io.StringIO()
    watchdog = Watchdog(0.2, rank=5, device="cpu", out=out)
    try:
        watchdog.mark("step 3")
        _a_slow_step(0.9)
        watchdog.mark(None)  # nothing watched: no report while it stands
        reported = out.getvalue()
        time.sleep(0.5)
        assert out.getvalue() == reported
    finally:
        watchdog.close()
    reports = reported.count("[rank 5] step 3 has run")
    assert 2 <= reports <= 4, reported  # at 0.2 s and every 0.2 s after, while the mark stood
    assert "in _a_slow_step" in reported and "time.sleep(seconds)" in reported


def test_a_mark_moved_on_in_time_is_not_reported():
    out = io.StringIO()
    watchdog = Watchdog(0.5, rank=0, device="cpu", out=out)
    try:
        for n in range(6):
            watchdog.mark(f"step {n}")
            time.sleep(0.1)
    finally:
        watchdog.close()
    assert out.getvalue() == ""
    assert Watchdog(0, rank=0, device="cpu")._thread is None  # 0: no thread at all


def test_the_main_job_reports_a_step_that_stalls(tmp_path, capsys, monkeypatch):
    real = loop.step

    def step_two_stalls(params, batch, plan, kernels=None, base=None):
        calls.append(1)
        if len(calls) == 2:
            _a_slow_step(2.5)
        return real(params, batch, plan, kernels, base=base)
    calls = []
    monkeypatch.setattr(loop, "step", step_two_stalls)
    train_main(list(map(str, SMALL + ["--stall-report", 1, "--out", tmp_path])))
    err = capsys.readouterr().err
    assert "[rank 0] step 2 has run" in err and "in _a_slow_step" in err, err
    for bad in (-1, 0.5, "nan"):
        with pytest.raises(SystemExit, match=rf"--stall-report={float(bad)!r} is invalid: must be 0 \(never\) or"):
            train_main(list(map(str, SMALL + ["--stall-report", bad, "--out", tmp_path / "b"])))


def test_sigusr1_dumps_every_threads_stack_while_a_watchdog_runs():
    # from C (faulthandler): it needs no GIL, so it reaches a host stuck in a call that holds it
    script = """if True:
        import os, signal, time
        from fmoe.trainer.stall import Watchdog
        def waiting_here():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.5)
        watchdog = Watchdog(60, rank=0, device="cpu")
        waiting_here()
        watchdog.close()
        print("closed")
    """
    no_thread = script.replace("Watchdog(60", "Watchdog(0")
    done, quiet = run_at_once([sys.executable, "-c", script], [sys.executable, "-c", no_thread], timeout=120)
    assert done.returncode == 0 and done.stdout == "closed\n", done
    assert "most recent call first" in done.stderr and "in waiting_here" in done.stderr, done.stderr
    # closed, the signal is no longer the watchdog's: a watchdog with no thread never takes it
    assert quiet.returncode == -signal.SIGUSR1 and "waiting_here" not in quiet.stderr, quiet
