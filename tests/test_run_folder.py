"""A run folder is one run's: its lock against a second live run, settings that
round-trip, the tokenizer it recorded, and interruptions that end in one line."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import fmoe
from fmoe.generate import checkpoint_tokenizer, main as generate_main
from fmoe.hf.export import main as export_main
from fmoe.train import main as train_main
from fmoe.trainer import run_lock, setup
from tests.procs import run_at_once
from tests.test_data import bpe_tokenizer
from tests.test_trainer import SMALL, env, records

ROOT = Path(__file__).resolve().parents[1]
# a job that runs until it is stopped, saving every step
ENDLESS = ["--steps", 100000, "--batch", 4, "--seq", 64, "--dim", 64, "--ffn", 128, "--save-every", 1,
           "--eval-every", 100000, "--eval-batches", 1, "--no-progress", "--threads", 1, "--sample-tokens", 0]


def run_job(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fmoe.train", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env(), timeout=timeout)


def wait_for(predicate, proc, limit=120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError("the first job did not get that far")


def test_a_second_job_into_a_live_runs_folder_is_refused_until_that_run_is_gone(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "fmoe.train", *map(str, ENDLESS + ["--out", out])], cwd=ROOT,
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "checkpoint").exists(), first)
        settings = (out / "settings.toml").read_bytes()
        holder = json.loads((out / run_lock.LOCK_NAME).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        # the duplicated scheduler job, and every way of asking for the folder: started at once (their start-up
        # is the test's time), the live run at the lowest priority while they run
        os.setpriority(os.PRIO_PROCESS, first.pid, 19)
        hows = (["--auto-resume"], ["--resume"], ["--overwrite"], [], ["--auto-resume", "--lr", 1e-4])
        for second in run_at_once(*[[sys.executable, "-m", "fmoe.train", *ENDLESS, "--out", out, *how] for how in hows],
                                  timeout=120, cwd=ROOT, env=env()):
            assert second.returncode == 1 and second.stdout == "", second
            assert second.stderr == (f"fmoe.train: --out={str(out)!r} is in use by a live run: pid {first.pid} on host "
                                     f"{holder['host']} (started {holder['started']}, args: {holder['args']}); "
                                     "wait for it to end or name another --out\n")
        assert (out / "settings.toml").read_bytes() == settings and first.poll() is None
        assert json.loads((out / run_lock.LOCK_NAME).read_text()) == holder  # no refused job took the lock over
        steps = len(records(out))
        first.send_signal(signal.SIGKILL)  # the kernel drops a killed run's lock: nothing to clean up
        first.wait(timeout=30)
        resumed = run_job(*ENDLESS[:1], len(records(out)) + 1, *ENDLESS[2:], "--out", out, "--auto-resume")
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed from" in resumed.stdout and len(records(out)) > steps
        assert not (out / run_lock.LOCK_NAME).exists()  # released when the job ended
    finally:
        first.kill()
        first.communicate()


def test_the_lock_refuses_a_second_holder_in_one_process_and_cleans_up_what_it_made(tmp_path):
    out = tmp_path / "new" / "run"
    held = run_lock.acquire(out)
    with pytest.raises(run_lock.FolderInUse, match=f"pid {os.getpid()} on host"):
        run_lock.acquire(out)  # flock is per open file: a second open of the file is refused too
    run_lock.release(held)
    assert not (tmp_path / "new").exists()  # the folders the lock made, left empty, are gone
    again = run_lock.acquire(out)
    (out / "settings.toml").write_text("")
    run_lock.release(again)
    assert sorted(p.name for p in out.iterdir()) == ["settings.toml"]  # a run's files stay


def test_where_the_filesystem_has_no_flock_the_lock_file_names_its_holder(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    out = tmp_path / "run"
    held = run_lock.acquire(out)
    assert held.fd is None and json.loads((out / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(run_lock.FolderInUse, match=r"if that run is gone, remove .*\.fmoe-lock"):
        run_lock.acquire(out)  # this process is alive
    run_lock.release(held)
    assert not (out / run_lock.LOCK_NAME).exists()

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out.mkdir()
    stale = {"host": socket.gethostname(), "pid": gone.pid, "start_ticks": None, "started": "then", "args": ""}
    (out / run_lock.LOCK_NAME).write_text(json.dumps(stale))
    held = run_lock.acquire(out)  # its holder is gone: taken over
    assert json.loads((out / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    run_lock.release(held)

    (out / run_lock.LOCK_NAME).write_text(json.dumps(dict(stale, host="another-host")))
    with pytest.raises(run_lock.FolderInUse, match="pid .* on host another-host"):
        run_lock.acquire(out)  # cannot be checked from here: left to the user


def test_two_takers_of_a_stale_lock_file_never_both_hold_it(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    out = tmp_path / "run"
    out.mkdir()
    path = out / run_lock.LOCK_NAME
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "start_ticks": None, "args": ""}))
    live = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": None, "args": "the other taker",
            "mode": "file"}
    is_gone = run_lock._is_gone

    def other_taker_wins(holder):  # between this taker's check and its rename, the other one took over
        assert is_gone(holder)
        newer = out / "newer"
        newer.write_text(json.dumps(live))
        os.replace(newer, path)
        return True

    monkeypatch.setattr(run_lock, "_is_gone", other_taker_wins)
    with pytest.raises(run_lock.FolderInUse, match="the other taker"):
        run_lock.acquire(out)
    assert json.loads(path.read_text()) == live  # the live holder's file is back in place
    assert sorted(p.name for p in out.iterdir()) == [run_lock.LOCK_NAME]


def test_a_flock_does_not_take_over_a_live_lock_file(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": run_lock._start_ticks(os.getpid()),
              "args": "held without flock", "mode": "file"}
    (out / run_lock.LOCK_NAME).write_text(json.dumps(holder))
    with pytest.raises(run_lock.FolderInUse, match="held without flock"):
        run_lock.acquire(out)


def test_settings_round_trip_through_print_config_and_settings_toml(tmp_path, capsys):
    data = tmp_path / "tokens"
    fmoe.data.prepare.prepare([ROOT / "README.md"], data, quiet=True, tokenizer=None)
    bpe = tmp_path / "bpe"
    bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)
    fmoe.data.prepare.prepare([ROOT / "README.md"], bpe, tokenizer=tmp_path / "tokenizer.json", quiet=True)
    vocab = json.loads((bpe / "meta.json").read_text())["vocab"]
    with pytest.raises(SystemExit) as done:
        train_main(list(map(str, SMALL + ["--data", bpe, "--print-config"])))
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert tomllib.loads(printed)["vocab"] == vocab != 256  # what the corpus decides
    assert "# dp = 1  (from the number of processes / (pp * ep * cp * tp) when left out)" in printed
    (tmp_path / "printed.toml").write_text(printed)
    summary = train_main(["--config", str(tmp_path / "printed.toml"), "--out", str(tmp_path / "a")])
    assert summary["steps"] == 3
    # a resumed run's settings.toml holds no folder action: it starts a new --out as it is
    train_main(list(map(str, SMALL + ["--data", data, "--steps", 4, "--out", tmp_path / "b", "--stop-after", 2])))
    train_main(list(map(str, SMALL + ["--data", data, "--steps", 4, "--out", tmp_path / "b", "--resume"])))
    saved = (tmp_path / "b" / "settings.toml").read_text()
    assert not {"resume", "auto_resume", "overwrite"} & set(tomllib.loads(saved))
    train_main(["--config", str(tmp_path / "b" / "settings.toml"), "--steps", "5", "--out", str(tmp_path / "c")])
    # --no-resume undoes a settings file's resume = true
    (tmp_path / "resume.toml").write_text(saved + "resume = true\n")
    with pytest.raises(SystemExit, match="--resume, but there is no checkpoint"):
        train_main(["--config", str(tmp_path / "resume.toml"), "--out", str(tmp_path / "d")])
    assert train_main(["--config", str(tmp_path / "resume.toml"), "--no-resume", "--out", str(tmp_path / "d")])


def test_reading_a_checkpoint_takes_the_tokenizer_its_run_recorded_and_no_other(tmp_path):
    # a byte-level run, its folder beside an unrelated tokenizer.json
    bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)
    train_main(list(map(str, SMALL + ["--out", tmp_path / "bytes"])))
    (tmp_path / "bytes" / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    assert checkpoint_tokenizer(tmp_path / "bytes" / "checkpoint") is None
    text = generate_main(["--checkpoint", str(tmp_path / "bytes" / "checkpoint"), "--prompt", "def ",
                          "--max-new-tokens", "4"])
    assert text.startswith("def ")
    # a run on a tokenized corpus keeps its tokenizer, checked by content
    fmoe.data.prepare.prepare([ROOT / "README.md"], tmp_path / "bpe", tokenizer=tmp_path / "tokenizer.json",
                              quiet=True)
    run = tmp_path / "run"
    train_main(list(map(str, SMALL + ["--data", tmp_path / "bpe", "--out", run])))
    assert checkpoint_tokenizer(run / "checkpoint") == (run / "tokenizer.json").resolve()
    bpe_tokenizer(run / "tokenizer.json", vocab=280)  # replaced by another tokenizer
    with pytest.raises(ValueError, match=r"which is another tokenizer \(its BLAKE2b differs\): name that"):
        checkpoint_tokenizer(run / "checkpoint")
    with pytest.raises(SystemExit, match="fmoe.generate: .* which is another tokenizer"):
        generate_main(["--checkpoint", str(run / "checkpoint"), "--prompt", "x"])
    (run / "tokenizer.json").unlink()
    with pytest.raises(SystemExit, match="fmoe.hf export: .* which is missing"):
        export_main(["export", str(run / "checkpoint"), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()  # refused before writing
    assert generate_main(["--checkpoint", str(run / "checkpoint"), "--prompt", "x", "--max-new-tokens", "2",
                          "--tokenizer", str(tmp_path / "tokenizer.json")])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="--threads 2 needs two cores")
def test_resuming_with_other_threads_says_it_is_not_bit_for_bit(tmp_path, capsys):
    args = list(map(str, SMALL + ["--steps", 4, "--out", tmp_path]))
    train_main(args + ["--stop-after", "2"])
    capsys.readouterr()
    train_main(args + ["--resume", "--threads", "2"])
    assert ("warning: resuming with 2 CPU thread(s) per process where the run used 1 (--threads)"
            in capsys.readouterr().out)


def sigint_as_at_a_terminal():
    # A shell without job control starts background commands with SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler: a test run so (CI, nohup-like
    # launches) would see the child shrug off the signal it sends.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_prepare_ends_in_one_line_and_writes_nothing(tmp_path):
    bpe_tokenizer(tmp_path / "tokenizer.json", vocab=300)
    with open(tmp_path / "big.jsonl", "w") as f:  # seconds of tokenizing
        line = json.dumps({"text": (ROOT / "README.md").read_text()}) + "\n"
        f.writelines(line for _ in range(1500))
    proc = subprocess.Popen([sys.executable, "-m", "fmoe.data", "prepare", str(tmp_path / "big.jsonl"), "--out",
                             str(tmp_path / "corpus"), "--tokenizer", str(tmp_path / "tokenizer.json")], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_at_a_terminal)
    said = ""
    while "tokenize" not in said or not said.endswith("]"):  # the progress bar drawn: prepare is writing
        char = proc.stderr.read(1)
        assert char, (said, proc.communicate())
        said += char
    time.sleep(0.2)  # past the bar's constructor, whose first drawing this read
    proc.send_signal(signal.SIGINT)
    said += proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    assert "Traceback" not in said
    assert said.strip().splitlines()[-1] == f"fmoe.data: interrupted; --out {tmp_path / 'corpus'}: nothing was " \
                                            "written there"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "tokenizer.json"]


def test_ctrl_c_to_torchrun_ends_with_what_the_workers_saved_and_no_traceback(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fmoe.torchrun", "--nproc-per-node", "2", "-m", "fmoe.train",
                             *map(str, ENDLESS + ["--save-every", 0, "--log-every", 2, "--out", out])],
                            cwd=ROOT, env=env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (out / "metrics.jsonl").exists(), proc)  # both ranks are in the loop
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == ("fmoe.torchrun: SIGINT: the workers were asked to stop; their last "
                                               "lines above say what they saved")
    step = fmoe.checkpoint.read_meta(out / "checkpoint")[1]["step"]
    assert f"fmoe.train: stopped by SIGINT after step {step}; checkpoint {out / 'checkpoint'}" in stdout


def test_only_the_main_rank_judges_what_the_run_folder_holds(tmp_path, monkeypatch):
    # The main rank starts writing the folder (settings.toml, metrics.jsonl) while other
    # ranks may still be checking theirs: they must not take its files for another run's.
    out = tmp_path / "run"
    out.mkdir()
    (out / "settings.toml").write_text("")
    (out / "metrics.jsonl").write_text("")
    argv = ["--out", str(out), "--steps", "2", "--batch", "4", "--seq", "16", "--dim", "32", "--layers", "1",
            "--experts", "4", "--ffn", "32"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    run = setup.prepare(argv)
    assert run.world.rank == 1 and run.plan.dp == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"holds a run \(metrics.jsonl, settings.toml\): add --resume"):
        setup.prepare(argv)
