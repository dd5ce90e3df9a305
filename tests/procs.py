"""Subprocesses started at once. A job the tests start is mostly its start-up (a new
Python importing torch and fmoe, one core's work): on the 2 cores the suite runs on,
independent jobs started together take about the time of the longest instead of the
sum."""

from __future__ import annotations

import subprocess


def start(command: list, **kwargs) -> subprocess.Popen:
    """``command`` started with its output captured as text (``subprocess.Popen``'s ``kwargs``)."""
    return subprocess.Popen([str(a) for a in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def finish(*procs: subprocess.Popen, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """What ``subprocess.run`` returns for each of ``procs`` once all have ended (each
    waited for up to ``timeout`` seconds); all are killed if one overruns."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def run_at_once(*commands: list, timeout: float = 240, **kwargs) -> list[subprocess.CompletedProcess]:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)`` for each of
    ``commands``, all started together."""
    return finish(*[start(command, **kwargs) for command in commands], timeout=timeout)


def start_for_tests(request, jobs: dict) -> dict[str, list[subprocess.Popen]]:
    """Start, all at once, the jobs of the tests of ``request``'s module selected in this
    session: ``jobs`` is ``{test name (with its parameters' id): [(command, Popen's
    kwargs), ...]}``; ``request`` is a module-scoped fixture's. A test then waits for its
    own with ``results``; ``stop`` kills any left."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    started = {}
    try:
        for name, commands in jobs.items():
            if name in selected:
                started[name] = [start(command, **kwargs) for command, kwargs in commands]
    except BaseException:
        stop(started)
        raise
    return started


def results(started: dict, request, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """What ``subprocess.run`` returns for each job ``start_for_tests`` started for the test asking."""
    return finish(*started[request.node.name], timeout=timeout)


def stop(started: dict) -> None:
    """Kill the jobs of ``start_for_tests`` that are still running."""
    for procs in started.values():
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
