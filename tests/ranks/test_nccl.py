"""The dp=2 FSDP cases on NCCL with two GPUs (run on the GPU machine; skipped elsewhere)."""

import functools
import importlib.util
import os

import optree
import pytest
import torch

import fmoe

from ..reference import assert_same_structure, assert_trees_close, assert_trees_equal, rel_err
from .harness import run_ranks
from .workloads import (
    CFG,
    COMPILE_CASES,
    GRAPH_MESHES,
    SCALE_MESHES,
    SCHEDULE_CASES,
    STRATEGIES,
    VARIANTS,
    checkpoint_reader,
    checkpoint_writer,
    compiled_configs,
    ep_configs,
    fsdp_configs,
    global_batch,
    graph_configs,
    init_devices,
    scale_config,
    scale_plan,
    schedule_configs,
    te_seed_scenario,
    train,
    zero3_variants,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@functools.lru_cache(maxsize=None)
def nccl(fn, *args):
    """``fn(rank, 2, *args, "cuda")`` on two GPUs with bitwise-repeatable settings."""
    return _nccl_ranks(2, fn, *args)


def _nccl_ranks(world, fn, *args):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    return run_ranks(world, fn, *args, "cuda", backend="nccl")


@functools.lru_cache(maxsize=None)
def single(sharding, mb):
    return train(fmoe.Plan(model=CFG, sharding=sharding, microbatches=mb, device="cuda"), global_batch().cuda())


@pytest.mark.parametrize("mb", [1, 4])
@pytest.mark.parametrize("sharding", STRATEGIES)
def test_nccl_matches_single_gpu(sharding, mb):
    # As on gloo: per-rank partial sums reorder fp32 additions (tolerance, not bitwise).
    ref = single(sharding, mb)
    for res in nccl(fsdp_configs):
        got = res[(sharding, mb)]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6)
        assert_trees_close(got["params"], ref["params"], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "dynamic"])
def test_nccl_zero3_variants_are_bitwise_identical(name):
    # Deterministic kernels, a fixed NCCL algorithm and two ranks (a + b commutes).
    for res in nccl(zero3_variants):
        assert torch.equal(res[name]["losses"], res["dynamic"]["losses"])
        assert_trees_equal(res[name]["grads"], res["dynamic"]["grads"])


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_nccl_ep2_matches_single_gpu(sharding):
    ref = train(fmoe.Plan(model=CFG, sharding=sharding, microbatches=2, device="cuda"), global_batch().cuda())
    for res in nccl(ep_configs, 1, 2):
        got = res[sharding]
        assert got["metrics"]["a2a_bytes"] > 0
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6)
        assert_trees_close(got["params"], ref["params"], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("placement", fmoe.config.PROB_PLACEMENTS)
def test_nccl_ep2_tokens_match_single_gpu(placement):
    # tokens cross once per rank; their expert outputs summed per rank first (tolerance)
    plan = fmoe.Plan(model=CFG.replace(prob_placement=placement), sharding="optim_grads_params", microbatches=2,
                     device="cuda")
    ref = train(plan, global_batch().cuda())
    for res in nccl(ep_configs, 1, 2):
        got = res[f"tokens_{placement}"]
        assert 0 < got["metrics"]["a2a_bytes"] < res["no_shard"]["metrics"]["a2a_bytes"]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6)
        assert_trees_close(got["params"], ref["params"], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("target", [(2, 1, "optim"), (1, 2, "no_shard")], ids=["dp2-zero1", "ep2"])
def test_nccl_checkpoint_reshards_and_resumes(tmp_path_factory, target):
    path = str(tmp_path_factory.mktemp("nccl_ck") / "ck")
    writers = nccl(checkpoint_writer, path, 2, 1, "optim_grads_params")
    for res in nccl(checkpoint_reader, path, *target):
        assert_trees_equal(res["full"], writers[0]["full"])
    for resumed, uninterrupted in zip(nccl(checkpoint_reader, path, 2, 1, "optim_grads_params"), writers):
        assert torch.equal(resumed["after"], uninterrupted["after"])


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_nccl_1f1b_overlap_is_bitwise_the_standard_schedule(case):
    # Deterministic kernels and a fixed NCCL algorithm: reordering the nodes of two
    # microbatches (and running wgrad later) must not change a bit on GPU either.
    for res in nccl(schedule_configs, 1, 2, tuple(SCHEDULE_CASES)):
        for key in ("losses",):
            assert torch.equal(res[(case, "1f1b_overlap")][key], res[(case, "standard")][key])
        for key in ("grads", "params"):
            for a, b in zip(optree.tree_leaves(res[(case, "1f1b_overlap")][key]),
                            optree.tree_leaves(res[(case, "standard")][key])):
                assert torch.equal(a, b), key


NCCL_MESHES = [(2, 1), (1, 2)] + SCALE_MESHES


@pytest.mark.parametrize("dp,ep", NCCL_MESHES, ids=[f"dp{d}xep{e}" for d, e in NCCL_MESHES])
def test_nccl_meshes_match_single_gpu(dp, ep):
    # ZeRO-3 + 1F1B overlap + delayed wgrad at every mesh the machine can hold; the
    # 4- and 8-GPU meshes need the larger machines (they also run on gloo in CI).
    if torch.cuda.device_count() < dp * ep:
        pytest.skip(f"needs {dp * ep} GPUs")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ref = train(scale_plan(device="cuda"), global_batch().cuda(), steps=2)
    for res in run_ranks(dp * ep, scale_config, dp, ep, "cuda", backend="nccl"):
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert_trees_close(res["grads"], ref["grads"], rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not importlib.util.find_spec("transformer_engine"), reason="needs TransformerEngine")
def test_nccl_te_experts_with_zero3_delayed_wgrad_ep2():
    # bf16 rounds at different points in TE's kernels and torch's ops, so both bf16
    # runs are measured against the fp32 run: TE's error within twice torch's (or
    # one bf16 unit, 2^-8, where torch's is smaller).
    for res in nccl(te_seed_scenario):
        te, base, ref = res["te"], res["torch"], res["fp32"]
        assert torch.isfinite(te["losses"]).all()
        loss_err, base_loss_err = rel_err(te["losses"], ref["losses"]), rel_err(base["losses"], ref["losses"])
        assert loss_err <= max(2 * base_loss_err, 2 ** -8), (loss_err, base_loss_err)
        paths, te_grads, _ = optree.tree_flatten_with_path(te["grads"])
        for path, a, b, r in zip(paths, te_grads, optree.tree_leaves(base["grads"]), optree.tree_leaves(ref["grads"])):
            err, base_err = rel_err(a, r), rel_err(b, r)
            print(f"te seed {path}: te {err:.2e} torch {base_err:.2e}")
            assert err <= max(2 * base_err, 2 ** -8), (path, err, base_err)


@pytest.mark.parametrize("mesh", list(GRAPH_MESHES))
def test_nccl_cuda_graphs_are_bitwise_eager(mesh):
    # Graphs replay the eager kernels on the same inputs: 5 training steps (AdamW and
    # expert-bias updates between them) give the same loss bits. Under tp the graphed
    # attention holds its all-gather and reduce-scatter; under etp the graphed experts
    # run between the group's exchanges.
    _, world, modes = GRAPH_MESHES[mesh]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    for res in (nccl(graph_configs, mesh) if world == 2 else _nccl_ranks(world, graph_configs, mesh)):
        assert set(res) == set(modes)
        for mode in modes:
            assert torch.equal(res[mode], res["eager"]), (mesh, mode, res[mode], res["eager"])


@functools.lru_cache(maxsize=None)
def _compiled_ep2():
    return nccl(compiled_configs, 1, 2)


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_nccl_compiled_matches_eager_with_triton_kernels(case):
    # ZeRO-1, ZeRO-3 + 1F1B + delayed wgrad, and tokens sent once per rank, on dp1 x ep2,
    # each eager and compiled with fmoe's Triton kernels inside the compiled graphs (the
    # CPU test, tests/ranks/test_compiled.py, runs no Triton). fp32; two eager runs here are
    # bitwise (deterministic settings), so the tolerance is the compiled kernels' own: fused
    # reductions and cuBLAS sum in another order (rtol 1e-4 on the gradients and the
    # parameters after two AdamW steps, as tests/test_compile.py's GPU test; the same
    # routing, so the same collectives).
    from fmoe.layers import triton_kernels

    assert triton_kernels.fused_kernels_available(torch.empty(0, device="cuda"))
    for res in _compiled_ep2():
        eager, compiled = res[(case, False)], res[(case, True)]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
        assert compiled["counts"] == eager["counts"]
        for key in ("grads", "params"):
            assert_same_structure(compiled[key], eager[key], key)
            paths, leaves, _ = optree.tree_flatten_with_path(compiled[key])
            errors = {path: rel_err(a.double(), b.double()) for path, a, b in
                      zip(paths, leaves, optree.tree_leaves(eager[key]))}
            worst = max(errors.items(), key=lambda kv: kv[1])
            print(f"compiled vs eager, {case} {key}: worst leaf {worst}")
            assert worst[1] < 1e-4, (case, key, worst)


def test_init_puts_each_ranks_leaves_on_its_own_gpu():
    # fmoe.init draws on worker threads, whose CUDA device is not the one
    # torch.cuda.set_device chose for the rank: the leaves must land on the rank's
    for rank, (devices, here) in enumerate(nccl(init_devices, 1, 2)):
        assert devices == [here] == [f"cuda:{rank}"], (rank, devices, here)
