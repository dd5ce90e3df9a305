"""``python -m fmoe.torchrun``: a failed job ends with its one-line error, once, from the
rank that caused it, not with every rank's copy and torchrun's ``ChildFailedError``
report. The workers write their line into torchrun's error file for them
(``fmoe.trainer.launch``); plain runs print it as before. Three real 2-rank gloo jobs,
started together, each failing in setup; the choice of the rank is checked on torch's
own ``ProcessFailure`` and ``ChildFailedError`` in-process."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure

import fmoe.train
from fmoe.torchrun import describe, exit_status, reported_failure
from fmoe.trainer import launch, run_lock
from tests.test_trainer import env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", 1, "--batch", 2, "--seq", 16, "--dim", 32, "--layers", 1, "--experts", 4, "--ffn", 32,
        "--sample-tokens", 0, "--no-progress", "--threads", 1]
# torchrun's own log records ("W1128 08:00:15.569000 10190 torch/distributed/...") stay as they are
TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
JOBS = {
    "ep": (1, ["--ep", 3], "fmoe.train: --pp=1 x --dp=1 x --ep=3 x --cp=1 x --tp=1 must equal the number of "
                            "processes (WORLD_SIZE=2)"),
    "flag": (2, ["--stepz", 2], "python -m fmoe.train: error: unrecognized arguments: --stepz 2\n"
                                 "  --stepz: did you mean --steps or --tp or --ep?\n"
                                 "(see python -m fmoe.train --help)"),
    "locked": (1, [], "fmoe.train: --out={out!r} is in use by a live run: pid {pid} on host"),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The three jobs, run at once: ``{name: (out, returncode, stdout, stderr)}``."""
    root = tmp_path_factory.mktemp("torchrun")
    held = run_lock.acquire(root / "locked")  # this test process is the live run holding it
    try:
        procs = {name: subprocess.Popen([sys.executable, "-m", "fmoe.torchrun", "--nproc-per-node", "2", "-m",
                                         "fmoe.train", *map(str, TINY + flags + ["--out", root / name])],
                                        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, (_, flags, _) in JOBS.items()}
        done = {name: p.communicate(timeout=240) for name, p in procs.items()}
    finally:
        run_lock.release(held)
    return {name: (root / name, procs[name].returncode, *done[name]) for name in JOBS}


@pytest.mark.parametrize("name", list(JOBS))
def test_a_failed_job_ends_with_its_one_line_error_once(jobs, name):
    out, code, stdout, stderr = jobs[name]
    status, _, line = JOBS[name]
    line = line.format(out=str(out), pid=os.getpid())
    assert code == status, stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr and "FAILED" not in stderr
    ours = [s for s in stderr.splitlines() if not TORCHRUN_LOG.match(s) and s.strip()]
    assert "\n".join(ours).startswith(line), stderr  # exactly the error, once, nothing else of ours
    assert len(ours) == line.count("\n") + 1, stderr
    assert stderr.rstrip().endswith(ours[-1]) and line.splitlines()[0] not in stdout


def failure(tmp_path, local_rank, exitcode, message=None, consequence=False):
    """torch's ProcessFailure for a worker that wrote ``message`` (None: nothing)."""
    path = tmp_path / f"error{local_rank}.json"
    if message is not None:
        launch.write_error_file(str(path), message, consequence)
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=str(path))


def test_the_line_is_the_lowest_ranks_own_error_before_a_failed_collective_or_a_stopped_rank(tmp_path):
    stopped = failure(tmp_path, 0, -signal.SIGTERM)
    collective = failure(tmp_path, 1, 1, "fmoe.train: rank 1 of 4: a collective failed", consequence=True)
    own = [failure(tmp_path, 2, 1, "fmoe.train: rank 2 of 4: ValueError: bad file"),
           failure(tmp_path, 3, 1, "fmoe.train: rank 3 of 4: ValueError: bad file")]
    err = ChildFailedError("fmoe.train", {0: stopped, 1: collective, 2: own[0], 3: own[1]})
    assert reported_failure(err) == (2, own[0])
    assert describe(*reported_failure(err)) == "fmoe.train: rank 2 of 4: ValueError: bad file"
    # only a failed collective and a stopped rank: the collective's line
    assert reported_failure(ChildFailedError("x", {0: stopped, 1: collective})) == (1, collective)
    # a rank stopped by torchrun just after writing its error: the one that exited by itself, with its status
    written = failure(tmp_path, 4, -signal.SIGTERM, "python -m fmoe.train: error: unrecognized arguments: --x")
    exited = failure(tmp_path, 5, 2, "python -m fmoe.train: error: unrecognized arguments: --x")
    assert reported_failure(ChildFailedError("x", {0: written, 1: exited})) == (1, exited)
    assert exit_status(exited) == 2


def test_a_worker_that_dies_without_a_message_gets_a_line_naming_rank_signal_and_output(tmp_path):
    stopped, crashed = failure(tmp_path, 0, -signal.SIGTERM), failure(tmp_path, 1, -signal.SIGSEGV)
    rank, worst = reported_failure(ChildFailedError("fmoe.train", {0: stopped, 1: crashed}))
    assert describe(rank, worst, "its output is in /logs/1/stderr.log") == (
        "fmoe.torchrun: rank 1 (local rank 1, pid 1001) was killed by SIGSEGV without an error message; its output "
        "is in /logs/1/stderr.log")
    assert exit_status(worst) == 1
    exited = failure(tmp_path, 0, 3)
    assert describe(0, exited) == ("fmoe.torchrun: rank 0 (local rank 0, pid 1000) exited with code 3 without an "
                                   "error message; its output is above")
    assert exit_status(exited) == 3


def test_an_unexpected_errors_type_and_message_come_from_torchs_error_handler(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error0.json"))
    try:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    except RuntimeError as err:
        ErrorHandler().record_exception(err)
    got = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "error0.json"))
    assert describe(0, got).startswith("RuntimeError: CUDA error: an illegal memory access was encountered")


def test_under_fmoe_torchrun_a_worker_writes_its_line_to_the_error_file_and_prints_nothing(tmp_path, monkeypatch,
                                                                                            capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    args = [*map(str, TINY), "--ep", "3", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as plain:  # plain torchrun: printed, as before
        fmoe.train.main(args)
    assert str(plain.value.code).startswith("fmoe.train: --pp=1 x --dp=1 x --ep=3") and not error_file.exists()
    monkeypatch.setenv(launch.ERRORS_TO_FILE, "1")
    with pytest.raises(SystemExit) as quiet:
        fmoe.train.main(args)
    assert quiet.value.code == 1
    assert json.loads(error_file.read_text())["message"] == plain.value.code
    with pytest.raises(SystemExit) as mistyped:
        fmoe.train.main(["--stepz", "2", "--out", str(tmp_path / "run")])
    assert mistyped.value.code == 2
    assert json.loads(error_file.read_text())["message"].startswith(
        "python -m fmoe.train: error: unrecognized arguments: --stepz 2\n  --stepz: did you mean --steps")
    assert capsys.readouterr().err == ""
    # an attempt torchrun will restart (--max-restarts left) says its line as well: the file is read only at the end
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    with pytest.raises(SystemExit):
        fmoe.train.main(args)
    assert capsys.readouterr().err == plain.value.code + "\n"
    assert json.loads(error_file.read_text())["message"] == plain.value.code
    assert not (tmp_path / "run").exists()
