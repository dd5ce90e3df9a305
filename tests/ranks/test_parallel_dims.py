"""Tensor (with sequence), expert-tensor and context parallelism on gloo ranks against
one process: the loss (1e-4), the first step's gradients and the params after three
AdamW steps (1e-3 relative), every rank the same global loss; the overlap schedule
bitwise the standard one under tp; a checkpoint saved at one layout loaded at another.

The tolerances: a tensor-parallel rank sums its heads' (or hidden units') partial
outputs in another order than one process's whole product does, and the vocabulary-
parallel loss sums the exponentials per slice first, so results agree to fp32 rounding,
not bitwise. "Relative" is to each tensor's largest magnitude: AdamW's first steps move
an element by about ``lr`` whatever its gradient's size, so an element whose gradient is
rounding-small may move another way, which an elementwise relative bound would flag."""

import optree
import pytest
import torch

import fmoe

from ..reference import assert_trees_equal
from .harness import run_ranks
from .parallel_workloads import CFG, PLANS, global_batch, parallel_plans, plan_of, train


@pytest.fixture(scope="module")
def single():
    return train(plan_of({}), global_batch())


@pytest.fixture(scope="module")
def two():
    return run_ranks(2, parallel_plans)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "dp2_tp2_zero3"
    return run_ranks(4, parallel_plans, path), path


def _matches_one_process(ranks: list, name: str, single: dict) -> None:
    for res in ranks:
        got = res[name]
        assert got["tokens"] == single["tokens"]
        torch.testing.assert_close(got["losses"], single["losses"], rtol=1e-4, atol=1e-5)
        _close_to_scale(got["grads"], single["grads"], 1e-3)
        _close_to_scale(got["params"], single["params"], 1e-3)


def _close_to_scale(a, b, rel: float) -> None:
    """Same structure, and each leaf within ``rel`` times the leaf's largest magnitude."""
    assert optree.tree_structure(a) == optree.tree_structure(b)
    for path, x, y in zip(optree.tree_paths(a), optree.tree_leaves(a), optree.tree_leaves(b)):
        err, scale = float((x - y).abs().max()), float(y.abs().max())
        assert err <= rel * scale, f"{path}: max difference {err:.3g}, {rel} x largest magnitude {scale:.3g}"


def test_interleaving_sends_the_gradients_on_one_group_of_their_own(two):
    for res in two:
        assert res["gradients_group"] == {"once": True, "own": True, "ranks": (0, 1)}


@pytest.mark.parametrize("name", list(PLANS[2]))
def test_two_ranks_match_one_process(two, single, name):
    _matches_one_process(two, name, single)


@pytest.mark.parametrize("name", list(PLANS[4]))
def test_four_ranks_match_one_process(four, single, name):
    _matches_one_process(four[0], name, single)


@pytest.mark.parametrize("overlap, standard", [("tp2_overlap", "tp2_standard"),
                                               ("pp2_overlap", "pp2_overlap_standard")])
def test_overlap_schedule_is_bitwise_the_standard_one(two, overlap, standard):
    for res in two:
        a, b = res[overlap], res[standard]
        assert torch.equal(a["losses"], b["losses"])
        assert_trees_equal(a["grads"], b["grads"])
        assert_trees_equal(a["params"], b["params"])


@pytest.mark.parametrize("name", ["pp2", "pp2_v2"])
def test_a_pipeline_computes_the_single_process_bitwise(two, single, name):
    """Each stage (or chunk of interleaved stages) runs its nodes on the microbatches in
    the single process's order, with its arithmetic: the loss and the gradients are the
    same bits (the params after the optimizer differ by the rounding of the gradient
    norm summed over the stages)."""
    for res in two:
        assert torch.equal(res[name]["losses"][0], single["losses"][0])
        assert_trees_equal(res[name]["grads"], single["grads"])


def test_interleaved_overlap_is_bitwise_the_plain_pipeline(two):
    """Interleaved stages under the overlap schedule against two plain stages under the
    standard one: the same first loss and gradients (4 microbatches, delayed wgrad)."""
    for res in two:
        a, b = res["pp2_v2_overlap"], res["pp2_overlap_standard"]
        assert torch.equal(a["losses"][0], b["losses"][0])
        assert_trees_equal(a["grads"], b["grads"])


@pytest.mark.parametrize("world", [2, 4])
def test_the_mesh_groups_are_the_layouts(two, four, world):
    ranks = two if world == 2 else four[0]
    dims = plan_of(dict(ep=2, tp=2, etp=2) if world == 4 else dict(cp=2)).dims
    for rank, res in enumerate(ranks):
        for name, got in res["mesh"].items():
            assert got == next(g for g in dims.groups(name) if rank in g), (rank, name)


def test_tokens_cross_as_tokens_under_tp_and_etp(four):
    for res in four[0]:
        assert "slots" in res["ep2_tp2_etp2_tokens"]["purposes"]
        assert "slots" not in res["ep2_tp2_etp2"]["purposes"]


@pytest.mark.parametrize("world", [2, 4])
def test_graph_scopes_take_the_tensor_parallel_groups(two, four, world):
    # Before capture the CUDA-graph scopes run the kernels through the flat arguments
    # their graphs are made from, with tp's and etp's groups: bitwise the plain step.
    for rank in (two if world == 2 else four[0]):
        (loss, grads), (want_loss, want_grads) = rank["scopes"]["scoped"], rank["scopes"]["plain"]
        assert torch.equal(loss, want_loss)
        assert_trees_equal(grads, want_grads)


def test_the_trace_shows_each_dimension_on_its_own_row(two):
    for res in two:
        assert "tp" in res["tp2"]["purposes"] and "cp" in res["cp2"]["purposes"]
        assert "etp" in res["dp2_etp2"]["purposes"]
        assert not {"tp", "cp", "etp"} & set(res["tp2_compiled_selective"]["purposes"])  # compiled: none recorded


def test_checkpoint_moves_between_layouts(four, single):
    ranks, path = four
    saved = ranks[0]["dp2_tp2_zero3"]["params"]
    for res in ranks:  # saved under dp2 x tp2 (ZeRO-3), loaded under ep2 x tp2 x etp2 and pp2 x dp2
        assert_trees_equal(res["resumed"]["loaded"], saved)
        assert_trees_equal(res["resumed_pp"]["loaded"], saved)
        assert torch.isfinite(res["resumed"]["losses"]).all()
    ck = fmoe.load(path, fmoe.Plan(model=CFG))  # and by one process
    assert_trees_equal(ck.params, saved)
    assert ck.step == 3
    from_stages = fmoe.load(f"{path}_pp", fmoe.Plan(model=CFG))  # a pipeline's save, read whole
    assert_trees_equal(from_stages.params, ranks[0]["pp2_dp2_zero3"]["params"])


def test_each_rank_holds_its_slice():
    """Under tp the tensor-parallel leaves are cut (attention by heads, the MLPs by hidden
    units, the vocabulary), the rest whole; ``init`` gives every layout the same model."""
    from fmoe.resolve import resolve

    spec = resolve(plan_of(dict(tp=2, ep=2, etp=2))).spec
    shapes = spec.local_shapes(0)
    assert shapes["embed"] == (32, 32) and shapes["head"] == (32, 32)
    assert shapes["layers.1.attn.qkv"] == (32, 32)  # q: 2 of 4 heads, k and v: 1 of 2, head size 8
    assert shapes["layers.1.attn.out"] == (16, 32)
    assert shapes["layers.1.attn.norm"] == (32,) and shapes["layers.1.moe.router"] == (32, 4)
    assert shapes["layers.0.mlp.fc1"] == (32, 16) and shapes["layers.0.mlp.fc2"] == (8, 32)
    assert shapes["layers.1.moe.experts.fc1"] == (2, 32, 16)  # 2 experts, 8 of 16 units each, gate and up
    assert shapes["layers.1.moe.experts.fc2_bias"] == (2, 32)
