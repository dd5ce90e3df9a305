"""A resumed run keeps its own settings (its settings.toml), says what a command
changes, refuses model and data changes, and keeps its learning rate continuous when
--steps changes; a warm-up longer than the run is refused."""

import json
import shutil
import tomllib

import pytest
import torch

from fmoe.optim.transforms import cosine_from, warmup_cosine
from fmoe.train import main as train_main
from fmoe.trainer import options
from tests.test_trainer import records

# A run of 6 steps at lr 1e-4 with 2 warm-up steps, none of them the main job's defaults
RUN = ["--steps", 6, "--lr", 1e-4, "--warmup", 2, "--batch", 2, "--seq", 16, "--dim", 32, "--layers", 1,
       "--experts", 4, "--ffn", 32, "--eval-every", 3, "--eval-batches", 1, "--save-every", 3, "--sample-tokens", 0,
       "--no-progress", "--threads", 1]


def train(*args):
    return train_main(list(map(str, args)))


def lrs(out) -> dict:
    return {r["step"]: r["lr"] for r in records(out)}


def schedule_lrs(schedule, steps) -> dict:
    return {step: float(schedule(torch.tensor(step - 1))) for step in steps}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The run stopped after step 3 of 6 (its checkpoint at 3), and the same run
    uninterrupted."""
    root = tmp_path_factory.mktemp("runs")
    train(*RUN, "--stop-after", 3, "--out", root / "stopped")
    train(*RUN, "--out", root / "straight")
    return root


@pytest.fixture
def run(stopped, tmp_path):
    shutil.copytree(stopped / "stopped", tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def test_resume_without_flags_keeps_the_runs_settings_bit_for_bit(stopped, run, capsys):
    capsys.readouterr()
    train("--resume", "--out", run)
    out = capsys.readouterr().out
    saved = tomllib.loads((run / "settings.toml").read_text())
    assert (saved["lr"], saved["steps"], saved["warmup"], saved["dim"]) == (1e-4, 6, 2, 32)
    assert lrs(run) == schedule_lrs(warmup_cosine(1e-4, 2, 6, floor=0.1), range(1, 7)) == lrs(stopped / "straight")
    assert [r["loss"] for r in records(run)] == [r["loss"] for r in records(stopped / "straight")]
    assert "(the run had" not in out and "resumed from" in out
    # dp is still the world's, a comment: reading it back did not make it a setting given
    assert "# dp = 1  (from the number of processes" in (run / "settings.toml").read_text()


def test_a_training_flag_given_overrides_the_runs_and_is_said_once(run, capsys):
    capsys.readouterr()
    train("--auto-resume", "--out", run, "--lr", 2e-4, "--eval-every", 3)
    out = capsys.readouterr().out
    assert out.count("--lr 0.0002 (the run had 0.0001)") == 1
    assert "--eval-every" not in out  # given, but the run's value: nothing changes
    assert tomllib.loads((run / "settings.toml").read_text())["lr"] == 2e-4
    want = schedule_lrs(warmup_cosine(2e-4, 2, 6, floor=0.1), range(4, 7))
    assert {step: lr for step, lr in lrs(run).items() if step > 3} == want


@pytest.mark.parametrize("flags, message", [
    (["--dim", 64], r"cannot resume: --dim=64 contradicts the run's dim=32 \(.*settings\.toml\): a resumed run "
                    r"keeps its model and data settings \(leave those flags out\)$"),
    (["--seq", 32, "--experts", 8], r"cannot resume: --experts=8 contradicts the run's experts=4 \(.*settings\.toml\); "
                                    r"--seq=32, but the checkpoint was trained with 16: a resumed run"),
    (["--heldout-fraction", 0.1], r"cannot resume: --heldout-fraction=0.1, but the checkpoint was trained with 0.05"),
], ids=["model", "model_and_data", "data"])
def test_a_model_or_data_flag_against_the_run_is_refused_naming_it(run, flags, message):
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(SystemExit, match=message):
        train("--resume", "--out", run, *flags)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before




def test_a_run_resumes_with_its_own_model_settings_not_the_corpus_or_defaults(tmp_path):
    # --vocab (else the corpus's) is read from the run's settings, not taken from the corpus again
    out = tmp_path / "wide"
    train(*RUN, "--vocab", 300, "--stop-after", 3, "--out", out)
    train("--resume", "--out", out)
    assert tomllib.loads((out / "settings.toml").read_text())["vocab"] == 300
    assert [r["step"] for r in records(out)][-1] == 6

def test_a_plan_the_run_had_that_does_not_fit_this_world_names_where_it_came_from(run):
    settings = run / "settings.toml"
    settings.write_text(settings.read_text().replace("\nep = 1\n", "\nep = 2\n"))
    with pytest.raises(SystemExit, match=r"--ep=2 x --cp=1 x --tp=1 must equal the number of processes \(WORLD_SIZE=1\) "
                                         r"\(ep=2 from the resumed run's .*settings\.toml: pass the flag to change it"):
        train("--resume", "--out", run)
    train("--resume", "--out", run, "--ep", 1)  # given, the flag wins: the run goes on
    assert tomllib.loads(settings.read_text())["ep"] == 1


def test_a_longer_run_continues_the_lr_without_a_jump_and_records_it(run, capsys):
    capsys.readouterr()
    train("--resume", "--out", run, "--steps", 12, "--stop-after", 8)
    before = warmup_cosine(1e-4, 2, 6, floor=0.1)
    line = (f"--steps 12 (the run had 6): the cosine decay continues from lr {float(before(3)):.3g} at step 4 to "
            "1e-05 at step 12")
    assert capsys.readouterr().out.count(line) == 1
    ck = json.loads((run / "checkpoint" / "fmoe.json").read_text())
    assert ck["extra"]["lr_schedule"] == {"steps": 6, "restarts": [[3, 12]]}
    train("--resume", "--out", run)  # resumed again: the same schedule, from the checkpoint's record
    got = lrs(run)
    assert got == schedule_lrs(cosine_from(before, 3, 12, 1e-4 * 0.1), range(1, 13))
    assert got[4] == float(before(3))  # step 4 has the rate it had in the 6-step run: no jump
    assert all(got[s] > got[s + 1] for s in range(3, 12)) and got[12] > 1e-5
    assert tomllib.loads((run / "settings.toml").read_text())["steps"] == 12


def test_a_shorter_run_and_a_checkpoint_without_the_record_continue_too(run, capsys):
    meta = run / "checkpoint" / "fmoe.json"
    ck = json.loads(meta.read_text())
    del ck["extra"]["lr_schedule"]  # as an older fmoe saved it: the run's steps are its settings.toml's
    meta.write_text(json.dumps(ck))
    capsys.readouterr()
    train("--resume", "--out", run, "--steps", 5)
    before = warmup_cosine(1e-4, 2, 6, floor=0.1)
    assert (f"--steps 5 (the run had 6): the cosine decay continues from lr {float(before(3)):.3g} at step 4 to "
            "1e-05 at step 5") in capsys.readouterr().out
    assert lrs(run) == schedule_lrs(cosine_from(before, 3, 5, 1e-5), range(1, 6))


def test_a_warmup_longer_than_the_run_is_refused_and_the_default_one_is_cut(tmp_path):
    with pytest.raises(SystemExit, match=r"^fmoe.train: --warmup=7 is invalid: must be <= --steps \(6\): a longer "
                                         r"warm-up ends after the run, so the rate never reaches --lr$"):
        train(*RUN, "--warmup", 7, "--out", tmp_path / "a")
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"--warmup=31 is invalid: must be <= --steps \(30\)"):
        options.RunSettings(steps=30, warmup=31)
    assert options.resolve(["--steps", "4"])[0]["warmup"] == 4  # the default 30, cut to the run
    assert options.resolve(["--steps", "40"])[0]["warmup"] == 30
    notes = []
    assert options.resolve(["--config", "qwen3-moe-small", "--steps", "50"], notes=notes)[0]["warmup"] == 50
    assert notes == ["warm-up 100 steps (from --config) is longer than --steps 50: the rate warms up over all 50 and "
                     "reaches --lr at the last (--warmup to choose)"]  # the preset's 100, cut and said
    notes = []
    options.resolve(["--steps", "40"], notes=notes)
    assert notes == []


def test_a_folder_without_settings_toml_resumes_with_the_flags_given_and_says_so(run, capsys):
    (run / "settings.toml").unlink()  # as a run of an fmoe from before settings.toml
    capsys.readouterr()
    train(*RUN, "--resume", "--out", run)
    out = capsys.readouterr().out
    assert out.count(f"warning: {run} holds no settings.toml (a run of an older fmoe?): the resumed run has the "
                     "flags given and the defaults, not necessarily its own settings") == 1
    assert lrs(run) == schedule_lrs(warmup_cosine(1e-4, 2, 6, floor=0.1), range(1, 7))
