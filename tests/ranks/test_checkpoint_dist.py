"""Checkpoints across plans: saved at dp=2 ZeRO-3, loaded at other layouts and sizes."""

import functools
import shutil

import optree
import pytest
import torch

import fmoe

from ..reference import assert_trees_equal
from .harness import run_ranks
from .workloads import (CFG, checkpoint_load_error, checkpoint_reader, checkpoint_round_trip_on_threads,
                        checkpoint_writer, user_state_round_trip)

SAVED_AT = (2, 1, "optim_grads_params")
TARGETS = [(1, 1, "no_shard"), (4, 1, "optim"), (2, 2, "optim_grads_params"), SAVED_AT]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "step2"
    dp, ep, sharding = SAVED_AT
    return path, run_ranks(dp * ep, checkpoint_writer, str(path), dp, ep, sharding)


@functools.lru_cache(maxsize=None)
def read(path, dp, ep, sharding):
    return run_ranks(dp * ep, checkpoint_reader, path, dp, ep, sharding)


@pytest.mark.parametrize("target", TARGETS, ids=[f"dp{d}xep{e}-{s}" for d, e, s in TARGETS])
def test_any_plan_reads_identical_full_tensors(saved, target):
    path, writers = saved
    for res in read(str(path), *target):
        assert res["step"] == 2
        assert_trees_equal(res["full"], writers[0]["full"])


def test_resumed_training_is_bitwise_the_uninterrupted_one(saved):
    path, writers = saved
    for resumed, uninterrupted in zip(read(str(path), *SAVED_AT), writers):
        assert torch.equal(resumed["after"], uninterrupted["after"])


def test_bf16_moments_reshard_from_zero3_to_one_process_and_resume_bitwise(tmp_path):
    # adamw(moments="bfloat16"): the moments are saved, resharded and loaded as bf16
    path = str(tmp_path / "ck")
    writers = run_ranks(2, checkpoint_writer, path, 2, 1, "optim_grads_params", "cpu", "bfloat16")
    assert writers[0]["full"]["mu"]["head"].dtype == torch.bfloat16
    for res in run_ranks(1, checkpoint_reader, path, 1, 1, "no_shard", "cpu", "bfloat16"):
        assert_trees_equal(res["full"], writers[0]["full"])
    resumed = run_ranks(2, checkpoint_reader, path, 2, 1, "optim_grads_params", "cpu", "bfloat16")
    for got, uninterrupted in zip(resumed, writers):
        assert torch.equal(got["after"], uninterrupted["after"])


@pytest.mark.parametrize("kind", ["by_name", "subset"])
def test_a_state_the_user_built_comes_back_to_each_rank(tmp_path, kind):
    # Its tensors that mirror a parameter (found by their place in the state or their
    # dotted name) are saved in global shape like the parameter, not as one replicated
    # tensor: each ZeRO-3 rank gets its own shards back.
    n_params = len(optree.tree_leaves(fmoe.init(fmoe.Plan(model=CFG), seed=0)))
    n_layer_params = n_params - 3  # embed, final_norm, head
    for res in run_ranks(2, user_state_round_trip, str(tmp_path / "ck"), kind):
        assert res["same"]
        assert res["mirrored"] == (n_params if kind == "by_name" else n_layer_params)


def test_a_corrupted_file_stops_every_rank_though_one_hashes_it(saved, tmp_path):
    # each rank of a load hashes a share of the files; the one that finds the damage tells the rest
    path, _ = saved
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    last = sorted(f for f in damaged.iterdir() if f.suffix == ".distcp")[-1]
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(data)
    errors = run_ranks(2, checkpoint_load_error, str(damaged), *SAVED_AT)
    assert errors[0] == errors[1] and f"data file {last.name} is corrupted (checksum mismatch)" in errors[0], errors


def test_ranks_writing_on_several_threads_read_back_identical_tensors(tmp_path):
    # three files a rank, each rank hashing its own: what a rank with cores to spare does
    results = run_ranks(2, checkpoint_round_trip_on_threads, str(tmp_path / "ck"), 3)
    for rank, res in enumerate(results):
        assert res["files"] == [f"__{rank}_{n}.distcp" for n in range(3)], res["files"]
        assert_trees_equal(res["read"], res["written"])


def test_a_file_one_rank_cannot_read_back_stops_every_rank(saved):
    # that rank must not leave before the others hear it: they would wait for it in the gather
    path, _ = saved
    errors = run_ranks(2, checkpoint_load_error, str(path), *SAVED_AT, 1)
    assert errors[0] == errors[1] and "a data file could not be read ([Errno 13] Permission denied" in errors[0], errors
