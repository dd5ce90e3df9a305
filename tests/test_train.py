"""The main job and the examples, run for real on small settings."""

import json
import os
import sys
from pathlib import Path

import pytest

import fmoe
from fmoe import train

from .procs import results, start_for_tests, stop

ROOT = Path(__file__).resolve().parents[1]


def test_main_job_beats_unigram_and_writes_outputs(tmp_path):
    summary = train.main(["--steps", "60", "--eval-every", "30", "--eval-batches", "2", "--batch", "8",
                          "--seq", "64", "--out", str(tmp_path), "--no-progress"])
    assert summary["heldout_loss"] < 0.85 * summary["unigram"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 61))
    assert [r["step"] for r in records if "heldout_loss" in r] == [30, 60]
    ck = fmoe.load(tmp_path / "checkpoint", train.parse_args(["--batch", "8", "--out", str(tmp_path), "--resume"]).plan)
    assert ck.step == 60 and ck.extra["samples_seen"] == 480


FSDP = {"dp2": [], "ep2_1f1b_delay_wgrad": ["--ep", "2", "--schedule", "1f1b_overlap", "--delay-wgrad"]}


def example_env():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def jobs(root: Path) -> dict:
    """The subprocess each test below reads, by its test's name (``procs.start_for_tests``);
    ``root``: a folder for their files."""
    example = dict(cwd=ROOT, env=example_env())
    py = sys.executable
    return {
        "test_main_job_rejects_bad_flags_before_work": [
            ([py, "-m", "fmoe.train", "--activation", "tanh", "--out", root / "bad_flags"], {})],
        "test_example_train_loop_runs": [([py, "examples/train_loop.py", "--steps", "3"], example)],
        "test_example_layer_test_passes": [([py, "examples/layer_test.py"], example)],
        **{f"test_example_fsdp_train_runs_on_two_gloo_ranks[{name}]": [
            ([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/fsdp_train.py", "--steps", "3",
              "--trace", root / f"{name}.json", *extra], example)]
           for name, extra in FSDP.items()},
    }


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The jobs of the tests selected here, all started when the first of them runs (each
    mostly a new Python's start-up: 2 cores run them side by side): ``(root, jobs)``."""
    root = tmp_path_factory.mktemp("jobs")
    (root / "bad_flags").mkdir()  # its test's own tmp_path, as it were
    procs = start_for_tests(request, jobs(root))
    yield root, procs
    stop(procs)


def result(started, request) -> tuple:
    """``(root, CompletedProcess)`` of the test asking, once its job has ended."""
    root, procs = started
    return root, results(procs, request, timeout=300)[0]


def test_main_job_rejects_bad_flags_before_work(started, request):
    root, proc = result(started, request)
    assert proc.returncode != 0 and "ModelConfig.activation='tanh'" in proc.stderr
    assert not (root / "bad_flags" / "metrics.jsonl").exists()


def test_example_train_loop_runs(started, request):
    _, proc = result(started, request)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("loss") == 2


def test_example_layer_test_passes(started, request):
    _, proc = result(started, request)
    assert proc.returncode == 0, proc.stderr
    assert "layer tests passed" in proc.stdout


@pytest.mark.parametrize("name", list(FSDP))
def test_example_fsdp_train_runs_on_two_gloo_ranks(started, request, name):
    root, proc = result(started, request)
    assert proc.returncode == 0, proc.stderr
    assert "full embed: (256, 128) this rank's rows: (128, 128)" in proc.stdout
    assert (root / f"{name}.json").exists()


def test_resume_continues_bit_for_bit(tmp_path):
    common = ["--steps", "12", "--eval-every", "6", "--eval-batches", "1", "--batch", "4", "--seq", "32",
              "--threads", "1", "--no-progress", "--save-every", "5"]
    straight = train.main(common + ["--out", str(tmp_path / "a")])
    train.main(common + ["--out", str(tmp_path / "b"), "--stop-after", "7"])
    assert fmoe.load(tmp_path / "b" / "checkpoint", train.parse_args(common + ["--out", str(tmp_path / "b"), "--resume"]).plan).step == 7
    resumed = train.main(common + ["--out", str(tmp_path / "b"), "--resume"])
    a = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, 13))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert resumed["heldout_loss"] == straight["heldout_loss"]


def test_resume_without_checkpoint_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint"):
        train.main(["--resume", "--out", str(tmp_path), "--no-progress"])
