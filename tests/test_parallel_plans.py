"""Plans with tensor, expert-tensor and context parallelism on one process: the rank
layout, how leaves are cut, the local batch, and every plan that cannot run refused
by name before anything runs (the multi-rank runs are in tests/ranks/test_parallel_dims.py)."""

import pytest
import torch

import fmoe
from fmoe.parallel_dims import ParallelDims
from fmoe.step import check_batch
from fmoe.tensor_split import Part, Split

CFG = fmoe.ModelConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, experts=4, topk=2, ffn=16, shared_ffn=8)


def test_tp_is_innermost_and_groups_partition_the_world():
    dims = ParallelDims(dp=2, ep=2, cp=2, tp=2, etp=2)
    assert dims.world == 16 and dims.coords(0) == (0, 0, 0, 0, 0)
    assert dims.coords(1).t == 1 and dims.coords(2).c == 1 and dims.coords(4).e == 1 and dims.coords(8).d == 1
    assert dims.groups("tp")[0] == (0, 1) and dims.groups("cp")[0] == (0, 2) and dims.groups("ep")[0] == (0, 4)
    assert dims.groups("etp")[0] == (0, 1)  # etp == tp: the tp group
    assert dims.groups("edp")[0] == (0, 2, 8, 10)  # same expert index, same etp index
    for name in ("tp", "cp", "ep", "tensor_data", "etp", "edp", "expert_model"):
        ranks = sorted(r for g in dims.groups(name) for r in g)
        assert ranks == list(range(16)), name
    assert [dims.row_block(r) for r in range(16)] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_a_split_cuts_and_assembles_whole_parts_and_copies(degree):
    split = Split(1, (Part(8, 4), Part(4, 2), Part(4, 2)))  # [q | k | v], 4 heads over 2 kv heads of 2
    full = torch.randn(3, 16)
    pieces = [split.cut(full, degree, i) for i in range(degree)]
    assert torch.equal(split.assemble(pieces, degree), full)
    assert all(p.shape == split.local_shape((3, 16), degree) for p in pieces)
    if degree == 4:  # each kv head held by two ranks: ranks 0, 1 read kv head 0
        assert torch.equal(pieces[0][:, 2:], pieces[1][:, 2:]) and torch.equal(pieces[0][:, 2:4], full[:, 8:10])


def test_init_gives_each_rank_its_slice_of_the_same_model():
    plan = fmoe.Plan(model=CFG, tp=2, etp=2)
    from fmoe.resolve import resolve

    spec, full = resolve(plan).spec, fmoe.init(fmoe.Plan(model=CFG), seed=0)
    pieces = [spec.shard_leaf(full["layers"][0]["attn"]["qkv"], "layers.0.attn.qkv", r) for r in range(2)]
    q, k, v = full["layers"][0]["attn"]["qkv"].split([32, 16, 16], dim=1)
    assert torch.equal(pieces[1], torch.cat([q[:, 16:], k[:, 8:], v[:, 8:]], dim=1))
    fc1 = spec.shard_leaf(full["layers"][0]["moe"]["experts"]["fc1"], "layers.0.moe.experts.fc1", 1)
    gate, up = full["layers"][0]["moe"]["experts"]["fc1"].chunk(2, dim=-1)
    assert torch.equal(fc1, torch.cat([gate[..., 8:], up[..., 8:]], dim=-1))


@pytest.mark.parametrize("kw, words", [
    (dict(tp=3), r"Plan\.tp=3 .*must divide model\.heads \(4\)"),
    (dict(tp=0), r"Plan\.tp=0 .*int >= 1"),
    (dict(cp=-1), r"Plan\.cp=-1 .*int >= 1"),
    (dict(etp=0), r"Plan\.etp=0 .*int >= 1"),
    (dict(etp=3), r"Plan\.etp=3 .*must divide model\.ffn"),
    (dict(etp=2), r"Plan\.etp=2 .*must divide dp \* cp \* tp = 1"),
])
def test_a_plan_that_cannot_cut_the_model_names_the_field(kw, words):
    with pytest.raises(ValueError, match=words):
        fmoe.Plan(model=CFG, **kw)


@pytest.mark.parametrize("changes, words", [
    (dict(heads=6, kv_heads=3, dim=48), r"Plan\.tp=2 .*model\.kv_heads \(3\)"),
    (dict(vocab=63), r"Plan\.tp=2 .*model\.vocab \(63\)"),
    (dict(shared_ffn=9), r"Plan\.tp=2 .*model\.shared_ffn"),
])
def test_tp_must_divide_what_it_cuts(changes, words):
    with pytest.raises(ValueError, match=words):
        fmoe.Plan(model=CFG.replace(**changes), tp=2)


def test_kv_heads_fewer_than_tp_are_copied_not_refused():
    assert fmoe.Plan(model=CFG, tp=4).world == 4


def test_the_world_is_every_dimension():
    plan = fmoe.Plan(model=CFG, dp=2, ep=2, tp=2, cp=2)
    assert plan.world == 16
    with pytest.raises(ValueError, match=r"dp \* Plan\.ep \* Plan\.cp \* Plan\.tp = 2 \* 2 \* 2 \* 2 = 16 ranks"):
        fmoe.init(plan)


def test_local_batch_under_cp_gives_each_rank_two_chunks_with_their_next_token():
    plan = fmoe.Plan(model=CFG, dp=2, cp=2)
    tokens = torch.arange(4 * 17).view(4, 17)
    mask = torch.arange(4 * 16).view(4, 16) % 3 > 0
    parts = [fmoe.local_batch({"tokens": tokens, "loss_mask": mask}, plan, r) for r in range(4)]
    # rank 1 (d=0, c=1): rows 0-1, chunks 1 and 2 of 4 (of 4 positions each)
    assert torch.equal(parts[1]["tokens"], torch.stack([tokens[0, 4:9], tokens[0, 8:13],
                                                        tokens[1, 4:9], tokens[1, 8:13]]))
    assert torch.equal(parts[1]["loss_mask"], torch.stack([mask[0, 4:8], mask[0, 8:12], mask[1, 4:8], mask[1, 8:12]]))
    # every target of rows 2-3 is some rank's, once
    targets = sorted(t for r in (2, 3) for row in parts[r]["tokens"] for t in row[1:].tolist())
    assert targets == sorted(tokens[2:, 1:].flatten().tolist())


def test_a_sequence_the_chunks_do_not_divide_names_cp_and_the_length():
    with pytest.raises(ValueError, match=r"Plan\.cp=2 .*4 chunks.*15 positions"):
        fmoe.local_batch({"tokens": torch.zeros(2, 16, dtype=torch.long)}, fmoe.Plan(model=CFG, cp=2), 0)


def test_the_step_refuses_batches_the_dimensions_cannot_split():
    tokens = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"15 positions per row, which Plan\.tp=2 does not divide"):
        check_batch({"tokens": tokens}, fmoe.Plan(model=CFG, tp=2))
    with pytest.raises(ValueError, match=r"under Plan\.cp=2 a rank.s rows come in pairs.*= 4\)"):
        check_batch({"tokens": torch.zeros(2, 9, dtype=torch.long)}, fmoe.Plan(model=CFG, cp=2, microbatches=2))
    with pytest.raises(ValueError, match=r"segments.*not supported under Plan\.cp=2"):
        check_batch({"tokens": tokens, "segments": torch.zeros(4, 16, dtype=torch.long)}, fmoe.Plan(model=CFG, cp=2))


def test_cuda_graphs_refuse_context_parallelism_by_name():
    from interop.cuda_graph import check_capturable

    with pytest.raises(ValueError, match=r"Plan\.cp=2.*allowed: cp = pp = 1"):
        check_capturable(fmoe.Plan(model=CFG, cp=2, device="cuda", dtype="bfloat16"), ("attn",))


@pytest.mark.parametrize("kw, words", [
    (dict(pp=3), r"Plan\.pp=3 .*3 stages, more than model\.layers \(2\)"),
    (dict(pp=0), r"Plan\.pp=0 .*int >= 1"),
    (dict(pp=2, pp_layout=(("embed", "layers.1"), ("layers.0", "head"))), r"Plan\.pp_layout must list every member once"),
    (dict(pp=2, pp_layout=(("embed", "layers.0", "layers.1", "head"),)), r"cut into 2 non-empty stages \(Plan\.pp=2\)"),
    (dict(pp=2, units=(("embed", "layers.0", "layers.1"), ("head",))), r"Plan\.units=.*spans pipeline stages"),
    (dict(virtual_stages=2), r"Plan\.virtual_stages=2 .*needs Plan\.pp > 1"),
    (dict(pp=2, virtual_stages=2, microbatches=2), r"Plan\.pp=2 x Plan\.virtual_stages=2 .*4 stages, more than model\.layers \(2\)"),
    (dict(pp=2, virtual_stages=2, microbatches=3, pp_layout=(("embed",), ("layers.0",), ("layers.1",), ("head",))),
     r"Plan\.microbatches=3 .*multiple of Plan\.pp=2 under Plan\.virtual_stages=2"),
    (dict(pp=2, virtual_stages=2, microbatches=2, pp_layout=(("embed", "layers.0"), ("layers.1", "head"))),
     r"cut into 4 non-empty stages \(Plan\.pp=2 x Plan\.virtual_stages=2\)"),
])
def test_a_pipeline_that_cannot_run_names_the_field(kw, words):
    with pytest.raises(ValueError, match=words):
        fmoe.Plan(model=CFG, **kw)


def test_interleaving_on_a_torch_without_separate_world_groups_names_the_field(monkeypatch):
    import fmoe.runtime

    plan = fmoe.Plan(model=CFG, pp=2, virtual_stages=2, microbatches=2,
                     pp_layout=(("embed",), ("layers.0",), ("layers.1",), ("head",)))
    monkeypatch.setattr(fmoe.runtime, "separate_world_group_supported", lambda: False)
    with pytest.raises(ValueError, match=r"Plan\.virtual_stages=2 needs torch >= 2\.9 .*allowed here: 1"):
        fmoe.init(plan, seed=0)


def test_tied_embeddings_cannot_be_split_over_stages():
    with pytest.raises(ValueError, match=r"Plan\.pp=2 .*tied embeddings"):
        fmoe.Plan(model=CFG.replace(tie_embeddings=True), pp=2)


def test_stages_default_to_even_layers_with_embed_first_and_head_last():
    cfg = CFG.replace(layers=5)
    assert fmoe.Plan(model=cfg, pp=2).stages == (("embed", "layers.0", "layers.1", "layers.2"),
                                                 ("layers.3", "layers.4", "head"))
    plan = fmoe.Plan(model=cfg, pp=2, dp=2)
    assert plan.world == 4 and [plan.dims.stage(r) for r in range(4)] == [0, 0, 1, 1]
    from fmoe.resolve import resolve

    spec = resolve(fmoe.Plan(model=cfg, pp=2)).spec  # rank 1's stage holds layers 3, 4 and the head
    shapes = spec.local_shapes(1)
    assert shapes["embed"] == (0, 32) and shapes["layers.0.attn.qkv"] == (0, 64)
    assert shapes["layers.4.attn.qkv"] == (32, 64) and shapes["head"] == (32, 64)


def test_interleaved_stages_go_round_the_ranks():
    cfg = CFG.replace(layers=4)
    plan = fmoe.Plan(model=cfg, pp=2, virtual_stages=2, microbatches=2)
    assert plan.stages == (("embed", "layers.0"), ("layers.1",), ("layers.2",), ("layers.3", "head"))
    assert plan.stage_chunks(0) == (("embed", "layers.0"), ("layers.2",))
    assert plan.stage_members(1) == ("layers.1", "layers.3", "head")
    from fmoe.resolve import resolve

    shapes = resolve(plan).spec.local_shapes(1)
    assert shapes["layers.0.attn.qkv"] == (0, 64) and shapes["layers.1.attn.qkv"] == (32, 64)
    assert shapes["layers.2.attn.qkv"] == (0, 64) and shapes["head"] == (32, 64)
