"""fmoe.step: gradients, microbatching, precision, init determinism, expert bias."""

import optree
import pytest
import torch

import fmoe
from fmoe.data import heldout_batches
from fmoe.layers import lm_loss_sum, stack_stats
from fmoe.params import initial_leaves, named_leaves, param_table

from . import reference as ref
from .reference import assert_trees_close

CFG = fmoe.ModelConfig(vocab=32, dim=32, layers=2, heads=2, experts=4, topk=2, ffn=16, shared_ffn=8,
                       expert_biases=True)


def random_batch(B=8, S=12, vocab=32, seed=0):
    return {"tokens": torch.randint(0, vocab, (B, S + 1), generator=torch.Generator().manual_seed(seed))}


def fp32_params(cfg, seed=1):
    return ref.random_params(cfg, seed=seed, dtype=torch.float32)


def autograd_reference(params, tokens, cfg):
    """Plain autograd on the whole batch: ``(ce + coefs * aux) .backward()``."""
    leaves = optree.tree_map(lambda t: t.detach().clone().requires_grad_(True), params)
    ce, stats = lm_loss_sum(leaves, tokens, cfg)
    s = stack_stats(stats)
    n = tokens.shape[0] * (tokens.shape[1] - 1)
    (ce / n + cfg.aux_loss_coef * s.aux_loss.sum() + cfg.z_loss_coef * s.z_loss.sum()).backward()
    grads = optree.tree_map(lambda t: t.grad if t.grad is not None else torch.zeros_like(t), leaves)
    return ce.detach() / n, grads


@pytest.mark.parametrize("coefs", [(0.0, 0.0), (0.1, 0.01)])
def test_step_grads_equal_autograd(coefs):
    cfg = CFG.replace(aux_loss_coef=coefs[0], z_loss_coef=coefs[1])
    plan = fmoe.Plan(model=cfg)
    params, batch = fp32_params(cfg), random_batch()
    out = fmoe.step(params, batch, plan)
    loss, grads = autograd_reference(params, batch["tokens"], cfg)
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=0)
    assert_trees_close(out.grads, grads, rtol=0, atol=0)
    assert optree.tree_structure(out.grads) == optree.tree_structure(params)
    if coefs[0]:
        assert out.metrics["objective"] > out.metrics["loss"]


HF_FEATURES = dict(kv_heads=1, head_size=8, qk_norm="head", qkv_bias=True, tie_embeddings=True, shared_gate=True)


@pytest.mark.parametrize("mb", [1, 2])
def test_step_with_gqa_qk_norm_tied_embeddings_and_shared_gate_equals_autograd(mb):
    cfg = CFG.replace(**HF_FEATURES)
    plan = fmoe.Plan(model=cfg, microbatches=mb)
    params, batch = fp32_params(cfg), random_batch()
    assert "head" not in params and params["layers"][0]["moe"]["shared"]["gate"].shape == (32, 1)
    out = fmoe.step(params, batch, plan)
    loss, grads = autograd_reference(params, batch["tokens"], cfg)
    tol = dict(rtol=0, atol=0) if mb == 1 else dict(rtol=1e-5, atol=1e-7)  # microbatches regroup the sums
    torch.testing.assert_close(out.loss, loss, **tol)
    assert_trees_close(out.grads, grads, **tol)
    assert out.grads["embed"].abs().sum() > 0


def test_step_leaves_params_untouched():
    plan = fmoe.Plan(model=CFG)
    params = fp32_params(CFG)
    before = optree.tree_map(torch.clone, params)
    fmoe.step(params, random_batch(), plan)
    assert_trees_close(params, before, rtol=0, atol=0)
    assert all(not t.requires_grad for t in optree.tree_leaves(params))


def test_microbatches_give_same_loss_and_grads():
    # Only the summation order of per-microbatch partial sums differs: fp32 rounding,
    # a few ulps of the largest gradient entries, hence rtol/atol of 1e-5 / 1e-6.
    params, batch = fp32_params(CFG), random_batch(B=8)
    one = fmoe.step(params, batch, fmoe.Plan(model=CFG, microbatches=1))
    four = fmoe.step(params, batch, fmoe.Plan(model=CFG, microbatches=4))
    torch.testing.assert_close(one.loss, four.loss, rtol=1e-6, atol=1e-6)
    assert_trees_close(one.grads, four.grads, rtol=1e-5, atol=1e-6)
    assert torch.equal(one.metrics["expert_counts"], four.metrics["expert_counts"])
    assert one.metrics["expert_counts"].sum() == 8 * 12 * CFG.topk * CFG.layers


def test_step_metrics_report_counts_and_padding():
    cfg = CFG.replace(pad_multiple=16)
    out = fmoe.step(fp32_params(cfg), random_batch(), fmoe.Plan(model=cfg))
    counts = out.metrics["expert_counts"]
    assert counts.shape == (cfg.layers, cfg.experts)
    assert counts.sum() == 8 * 12 * cfg.topk * cfg.layers
    assert out.metrics["padded_rows"] == ((counts + 15) // 16 * 16 - counts).sum() > 0
    assert out.metrics["dropped_tokens"] == 0
    assert out.metrics["tokens"] == 8 * 12


def test_padding_does_not_change_step():
    params, batch = fp32_params(CFG), random_batch()
    a = fmoe.step(params, batch, fmoe.Plan(model=CFG))
    b = fmoe.step(params, batch, fmoe.Plan(model=CFG.replace(pad_multiple=32)))
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-6)
    assert_trees_close(a.grads, b.grads, rtol=1e-5, atol=1e-6)


def test_bfloat16_compute_keeps_fp32_grads_and_tracks_fp32():
    params, batch = fp32_params(CFG), random_batch()
    f32 = fmoe.step(params, batch, fmoe.Plan(model=CFG))
    bf16 = fmoe.step(params, batch, fmoe.Plan(model=CFG, dtype="bfloat16"))
    assert all(g.dtype == torch.float32 for g in optree.tree_leaves(bf16.grads))
    # bf16 keeps 8 mantissa bits: the loss agrees to ~1e-2 relative.
    torch.testing.assert_close(bf16.loss, f32.loss, rtol=2e-2, atol=0)
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in optree.tree_leaves(bf16.grads)]),
        torch.cat([g.flatten() for g in optree.tree_leaves(f32.grads)]), dim=0)
    assert cos > 0.99


def test_eval_loss_equals_step_loss():
    params, batch = fp32_params(CFG), random_batch()
    plan = fmoe.Plan(model=CFG, microbatches=2)
    torch.testing.assert_close(fmoe.eval_loss(params, batch, plan), fmoe.step(params, batch, plan).loss,
                               rtol=1e-6, atol=1e-6)


def test_a_padded_heldout_batch_evaluates_to_the_loss_of_its_windows():
    # a held-out split of 3 windows against a batch of 4: the 4th row counts nothing, so
    # the loss is the 3 windows' own, on 2 microbatches (one of them half padding) too;
    # fp32, and the padded batch sums its rows in another order: 1e-6
    ids = torch.randint(0, CFG.vocab, (3 * 16 + 1,), generator=torch.Generator().manual_seed(0)).numpy()
    (padded,) = heldout_batches(ids, 4, 16, max_batches=1)
    plan = fmoe.Plan(model=CFG)
    params = fmoe.init(plan, seed=1)
    windows = fmoe.eval_loss(params, {"tokens": padded["tokens"][:3]}, plan)
    for microbatches in (1, 2):
        got = fmoe.eval_loss(params, padded, plan.replace(microbatches=microbatches))
        assert ref.rel_err(got, windows) < 1e-6, microbatches


def test_init_is_deterministic_and_plan_independent():
    plan = fmoe.Plan(model=CFG)
    a, b = fmoe.init(plan, seed=3), fmoe.init(plan, seed=3)
    assert_trees_close(a, b, rtol=0, atol=0)
    c = fmoe.init(plan.replace(sharding="optim_grads_params", microbatches=4, dtype="bfloat16"), seed=3)
    assert_trees_close(a, c, rtol=0, atol=0)
    d = fmoe.init(plan, seed=4)
    assert not torch.equal(a["layers"][0]["moe"]["experts"]["fc1"], d["layers"][0]["moe"]["experts"]["fc1"])
    assert all(t.dtype == torch.float32 for t in optree.tree_leaves(a))


def test_init_draws_the_same_leaves_on_any_number_of_threads(monkeypatch):
    # each leaf has a generator of its own: drawn on one thread or several at once, in
    # whatever order they finish, the values are the serial draw's, bit for bit
    plan = fmoe.Plan(model=CFG)
    serial = {path: value for path, value in initial_leaves(param_table(CFG), CFG, seed=5)}
    for threads in (1, 4):
        monkeypatch.setattr("fmoe.initialize.draw_threads", lambda: threads)
        drawn = named_leaves(fmoe.init(plan, seed=5))
        assert drawn.keys() == serial.keys() and all(torch.equal(drawn[k], serial[k]) for k in serial), threads


def test_init_layout_is_the_canonical_one():
    cfg = CFG
    p = fmoe.init(fmoe.Plan(model=cfg), seed=0)
    D, E, F, V = cfg.dim, cfg.experts, cfg.ffn, cfg.vocab
    assert p["embed"].shape == (V, D) and p["head"].shape == (D, V) and p["final_norm"].shape == (D,)
    layer = p["layers"][1]
    assert layer["attn"]["qkv"].shape == (D, 3 * D) and layer["attn"]["out"].shape == (D, D)
    assert layer["moe"]["router"].shape == (D, E) and layer["moe"]["expert_bias"].shape == (E,)
    ex = layer["moe"]["experts"]
    assert ex["fc1"].shape == (E, D, 2 * F) and ex["fc2"].shape == (E, F, D)
    assert ex["fc1_bias"].shape == (E, 2 * F) and ex["fc2_bias"].shape == (E, D)
    assert layer["moe"]["shared"]["fc1"].shape == (D, 2 * cfg.shared_ffn)
    assert abs(ex["fc1"].std().item() - cfg.init_std) < 0.1 * cfg.init_std
    relu2 = fmoe.init(fmoe.Plan(model=cfg.replace(activation="relu2")), seed=0)
    assert relu2["layers"][0]["moe"]["experts"]["fc1"].shape == (E, D, F)


def test_training_with_adamw_reduces_loss():
    cfg = fmoe.ModelConfig(vocab=16, dim=32, layers=1, heads=2, experts=4, topk=2, ffn=32)
    plan = fmoe.Plan(model=cfg)
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-2)
    state = opt.init(params)
    batch = {"tokens": torch.arange(16).repeat(4, 2)[:, :17]}  # a fixed, learnable sequence
    first = fmoe.step(params, batch, plan).loss
    for _ in range(30):
        out = fmoe.step(params, batch, plan)
        params, state = opt.update(out.grads, state, params)
    assert out.loss < 0.2 * first


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_repeated_steps_are_bitwise_identical_with_two_threads(tied):
    # B * S * D = 32768 elements per microbatch: large enough that autograd's rule for
    # the embedding gather (a parallel atomic index_put on CPU) varied from call to call.
    cfg = fmoe.ModelConfig(vocab=64, dim=128, layers=1, heads=2, experts=4, topk=2, ffn=32,
                           tie_embeddings=tied)
    plan = fmoe.Plan(model=cfg, microbatches=2)
    params, batch = fmoe.init(plan, seed=0), random_batch(B=8, S=64, vocab=64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [fmoe.step(params, batch, plan) for _ in range(6)]
    finally:
        torch.set_num_threads(threads)
    for out in runs[1:]:
        assert torch.equal(out.loss, runs[0].loss)
        for path, a, b in zip(optree.tree_paths(out.grads), optree.tree_leaves(out.grads),
                              optree.tree_leaves(runs[0].grads)):
            assert torch.equal(a, b), path


@pytest.mark.parametrize("sharding", ["no_shard", "optim_grads_params"])
def test_uninitialised_memory_never_reaches_the_gradients(monkeypatch, sharding):
    # The flat shards and fp32 gradient buffers start uninitialised: every value read
    # must be written by a param, a gradient or zeroed (leaves with no gradient such as
    # expert_bias). NaN-filled torch.empty stands in for whatever memory holds.
    plan = fmoe.Plan(model=CFG, microbatches=2, sharding=sharding)
    params, batch = fmoe.init(plan, seed=0), random_batch()
    clean = fmoe.step(params, batch, plan)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    dirty = fmoe.step(params, batch, plan)
    assert torch.equal(dirty.loss, clean.loss)
    for path, a, b in zip(optree.tree_paths(dirty.grads), optree.tree_leaves(dirty.grads),
                          optree.tree_leaves(clean.grads)):
        assert torch.equal(a, b), path
    assert not dirty.grads["layers"][0]["moe"]["expert_bias"].any()
