"""The GPU presets' main jobs with ``--cuda-graph step``, as a user runs them: one GPU
(``python -m interop.train``) and under torchrun (ZeRO-3 over every GPU, up to four),
8 x 2048 tokens a GPU, 30 steps, each job a fresh process on the embedded corpus.

A job must capture (nothing compiles inside the capture), train (finite losses that
fall) and exit (a graph holding NCCL's collectives is freed before the process group,
or the process hangs at exit). Minutes a job: marked ``presets`` beside ``gpu`` and run
by ``benchmarks/run_graphed_presets_device.sh``, not by the GPU suite's parts."""

import json
import math
import subprocess
import sys
import threading
import time

import pytest
import torch

from .conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.presets]

PRESETS = ("qwen3-moe-medium", "deepseek-v3-medium", "gpt-oss-medium")
STEPS = 30
COMMON = ["--steps", str(STEPS), "--eval-every", str(STEPS), "--eval-batches", "1", "--save-every", "0",
          "--sample-tokens", "0", "--no-progress", "--no-tensorboard", "--cuda-graph", "step"]
TIMEOUT_S = 480  # a job takes about two minutes, most of it compiling and its last checkpoint
EXIT_S = 60  # from its summary line to its exit: the graphs and the process group freed


def run_job(command: list, out, what: str) -> str:
    """Run the job to its end; its summary line ("done in ..."), after checking that it
    exited on its own soon after that line, with status 0, and trained."""
    proc = subprocess.Popen(command + COMMON + ["--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    stamped = []  # (when it was read, the line)

    def read():  # stderr too: one pipe, read to its end, cannot fill
        for line in proc.stdout:
            stamped.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{what} did not exit within {TIMEOUT_S} s; its output ended: {[line for _, line in stamped[-20:]]}")
    reader.join()
    ended = time.monotonic()
    done_at, done = next(((t, line) for t, line in stamped if line.startswith("done in")), (None, None))
    text = "\n".join(line for _, line in stamped[-60:])
    assert code == 0 and done is not None, f"{what}: exit {code}\n{text}"
    exit_s = ended - done_at
    assert exit_s < EXIT_S, f"{what} took {exit_s:.0f} s to exit after its summary line"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == [10, 20, 30], records
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    print(f"\n{what}: {done} [exited {exit_s:.1f} s after this line]")
    return done


@pytest.mark.parametrize("preset", PRESETS)
def test_a_graphed_preset_trains_on_one_gpu(tmp_path, preset):
    run_job([sys.executable, "-m", "interop.train", "--config", preset, "--batch", "8", "--dp", "1", "--sharding",
             "no_shard"], tmp_path / "run", f"{preset}, 1 GPU")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("preset", PRESETS)
def test_a_graphed_preset_trains_under_torchrun_and_exits(tmp_path, preset):
    gpus = min(torch.cuda.device_count(), 4)
    run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), "-m",
             "interop.train", "--config", preset, "--batch", str(8 * gpus)], tmp_path / "run",
            f"{preset}, torchrun over {gpus} GPUs (ZeRO-3)")
