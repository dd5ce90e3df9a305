"""fmoe.save / fmoe.load on one process: round trip, validation, atomic writes."""

import json
import os
import pickle
import subprocess
import sys
import threading
import time

import optree
import pytest
import torch

import fmoe
from fmoe.checkpoint import api as checkpoint_api, files as checkpoint_files

from .reference import assert_trees_equal

CFG = fmoe.ModelConfig(vocab=16, dim=16, layers=2, heads=2, experts=4, topk=2, ffn=8)
PLAN = fmoe.Plan(model=CFG)


def trained(steps=2):
    params = fmoe.init(PLAN, seed=0)
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    state = opt.init(params)
    batch = {"tokens": torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(0))}
    for _ in range(steps):
        params, state = opt.update(fmoe.step(params, batch, PLAN).grads, state, params)
    return params, state, opt, batch


def test_round_trip_resumes_bitwise(tmp_path):
    params, state, opt, batch = trained()
    fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=2, extra={"pos": 17})
    ck = fmoe.load(tmp_path / "ck", PLAN)
    assert ck.step == 2 and ck.extra == {"pos": 17}
    assert_trees_equal(ck.params, params)
    assert optree.tree_structure(ck.opt_state) == optree.tree_structure(state)
    grads = fmoe.step(params, batch, PLAN).grads
    p1, _ = opt.update(grads, state, params)
    p2, _ = opt.update(grads, ck.opt_state, ck.params)
    assert_trees_equal(p1, p2)


def test_model_only_checkpoint(tmp_path):
    params, *_ = trained(1)
    fmoe.save(tmp_path / "m", PLAN, params)
    ck = fmoe.load(tmp_path / "m", PLAN)
    assert ck.opt_state is None and ck.step == 0
    assert torch.equal(ck.params["head"], params["head"])


def test_load_rejects_other_model_naming_field(tmp_path):
    params, *_ = trained(1)
    fmoe.save(tmp_path / "ck", PLAN, params)
    with pytest.raises(ValueError, match="ffn: checkpoint 8, plan 16"):
        fmoe.load(tmp_path / "ck", fmoe.Plan(model=CFG.replace(ffn=16)))
    with pytest.raises(FileNotFoundError):
        fmoe.load(tmp_path / "nothing", PLAN)


def test_save_rejects_bad_extra_before_writing(tmp_path):
    params, *_ = trained(1)
    with pytest.raises(ValueError, match="extra must be JSON"):
        fmoe.save(tmp_path / "ck", PLAN, params, extra={"x": object()})
    assert not any(tmp_path.iterdir())


def test_save_never_replaces_a_foreign_directory(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an fmoe checkpoint"):
        fmoe.save(tmp_path / "notes", PLAN, trained(1)[0])
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    params, state, *_ = trained(1)
    fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=1)
    newer, newer_state, *_ = trained(2)
    real_save = checkpoint_api.dcp.save

    def dies_midway(state_dict, **kw):
        real_save(state_dict, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_api.dcp, "save", dies_midway)
    with pytest.raises(OSError, match="disk full"):
        fmoe.save(tmp_path / "ck", PLAN, newer, opt_state=newer_state, step=2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    ck = fmoe.load(tmp_path / "ck", PLAN)
    assert ck.step == 1 and torch.equal(ck.params["embed"], params["embed"])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # a second writer thread's
def test_a_write_that_runs_out_of_disk_says_so_in_one_line(tmp_path, monkeypatch):
    # What torch.save raises when the disk fills mid-file, as DCP's writer calls it.
    params, state, *_ = trained(1)
    fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=1)

    def disk_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError) as caught:
        fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=2)
    message = str(caught.value)
    assert "\n" not in message
    assert f"save: writing {tmp_path / 'ck'} failed (RuntimeError: " in message
    assert "unexpected pos 704 vs 598" in message and "GiB free there: a full disk is the usual cause" in message
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert fmoe.load(tmp_path / "ck", PLAN).step == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failing threads' own
def test_a_writer_thread_that_fails_replaces_nothing(tmp_path, monkeypatch):
    # DCP writes a rank's files on several threads; one that fails drops its error and its
    # results, and the save would otherwise look complete
    params, state, *_ = trained(1)
    fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=1)
    real_save, failed, slowed = torch.save, [], []

    def fails_off_the_main_thread(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            if not slowed:  # its first piece: the other threads take their files meanwhile
                slowed.append(1)
                time.sleep(0.2)
            return real_save(*args, **kwargs)
        failed.append(1)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint_api, "io_threads", lambda: 4)
    monkeypatch.setattr(torch, "save", fails_off_the_main_thread)
    with pytest.raises(OSError, match=r"save to .* failed on rank 0: OSError: no file holds \d+ piece\(s\) "
                                      r"\(.*\): a writer thread failed"):
        fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=2)
    assert failed
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert fmoe.load(tmp_path / "ck", PLAN).step == 1
    # and with the threads whole, the same save writes several files a rank that load back
    monkeypatch.setattr(checkpoint_api, "io_threads", lambda: 4)
    fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=2)
    assert len([f for f in os.listdir(tmp_path / "ck") if f.endswith(".distcp")]) == 4
    ck = fmoe.load(tmp_path / "ck", PLAN)
    assert ck.step == 2 and all(torch.equal(a, b) for a, b in zip(fmoe.params.named_leaves(ck.params).values(),
                                                                   fmoe.params.named_leaves(params).values()))


def test_a_failure_that_is_not_a_write_keeps_its_own_error(tmp_path, monkeypatch):
    # A collective failing inside DCP's save must stay what it is: the main job
    # recognises it and tells the user another rank died.
    params, state, *_ = trained(1)

    def peer_gone(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    monkeypatch.setattr(checkpoint_api.dcp, "save", peer_gone)
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=1)


def test_crash_between_renames_leaves_previous_loadable(tmp_path, monkeypatch):
    params, *_ = trained(1)
    fmoe.save(tmp_path / "ck", PLAN, params, step=1)
    real_rename = os.rename

    def dies_before_new_is_in_place(src, dst):
        # The old checkpoint has been moved aside; the new one never arrives.
        if os.fspath(dst) == os.fspath(tmp_path / "ck"):
            raise OSError("killed")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint_files.os, "rename", dies_before_new_is_in_place)
    with pytest.raises(OSError, match="killed"):
        fmoe.save(tmp_path / "ck", PLAN, trained(2)[0], step=2)
    monkeypatch.undo()
    assert not (tmp_path / "ck").exists()
    ck = fmoe.load(tmp_path / "ck", PLAN)
    assert ck.step == 1 and torch.equal(ck.params["embed"], params["embed"])
    fmoe.save(tmp_path / "ck", PLAN, params, step=3)
    assert fmoe.load(tmp_path / "ck", PLAN).step == 3
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the crash's leftover is cleaned up


def saved(tmp_path):
    params, state, *_ = trained(1)
    return fmoe.save(tmp_path / "ck", PLAN, params, opt_state=state, step=1), params


def edit_meta(path, change):
    meta = json.loads((path / "fmoe.json").read_text())
    change(meta)
    (path / "fmoe.json").write_text(json.dumps(meta))


def data_file(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


CORRUPTIONS = {
    "missing key": (lambda p: edit_meta(p, lambda m: m["dcp"]["tensors"].pop("params.head")),
                    "missing tensor 'params.head'"),
    "wrong shape": (lambda p: edit_meta(p, lambda m: m["dcp"]["tensors"]["params.embed"].update(size=[8, 16])),
                    r"'params.embed' has shape \[8, 16\], Plan.model needs \[16, 16\]"),
    "other model": (lambda p: edit_meta(p, lambda m: m["model"].update(experts=8)),
                    "model config differs from Plan.model: experts: checkpoint 8, plan 4"),
    "truncated file": (lambda p: os.truncate(data_file(p), data_file(p).stat().st_size - 100), "is truncated"),
    "corrupted file": (lambda p: flip_byte(data_file(p)), r"is corrupted \(checksum mismatch\); it holds"),
    "garbage metadata": (lambda p: (p / "fmoe.json").write_text("{not json"), "fmoe.json is unreadable"),
    "missing data file": (lambda p: data_file(p).unlink(), "is missing"),
}


def flip_byte(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(data)


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_each_corruption_gives_its_error_before_reading(tmp_path, case):
    path, _ = saved(tmp_path)
    corrupt, message = CORRUPTIONS[case]
    corrupt(path)
    with pytest.raises(ValueError, match=message):
        fmoe.load(path, PLAN)


def test_loading_never_unpickles(tmp_path):
    path, params = saved(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(path / ".metadata", "wb") as f:  # DCP's own (pickled) metadata file
        pickle.dump(Evil(), f)
    ck = fmoe.load(path, PLAN)
    assert not marker.exists()
    assert torch.equal(ck.params["embed"], params["embed"])


KILLED_WRITER = """
import sys, torch, fmoe
plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=256, dim=256, layers=4, heads=4, experts=8, ffn=512))
params = fmoe.init(plan, seed=1)
state = fmoe.adamw().init(params)
print("ready", flush=True)
while True:
    fmoe.save(sys.argv[1], plan, params, opt_state=state, step=2)
"""


def test_a_save_killed_mid_write_leaves_the_last_good_checkpoint(tmp_path):
    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=256, dim=256, layers=4, heads=4, experts=8, ffn=512))
    fmoe.save(tmp_path / "ck", plan, fmoe.init(plan, seed=0), step=1)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "ck")], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".ck.tmp-") and any(p.iterdir()) for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline, "the writer never started a save"
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    ck = fmoe.load(tmp_path / "ck", plan)
    assert ck.step in (1, 2)  # the old checkpoint, or a complete new one: never a torn one
    if ck.step == 1:
        assert torch.equal(ck.params["embed"], fmoe.init(plan, seed=0)["embed"])
