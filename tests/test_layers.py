"""Each pure layer against the naive loops of tests/reference.py, in float64."""

import itertools

import optree
import pytest
import torch

import fmoe
from fmoe import layers

from . import reference as ref

F64 = torch.float64


def grads_of(fn, tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    (out * torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def assert_same_fwd_bwd(fast, slow, tensors, **tol):
    out_f, g_f = grads_of(fast, tensors)
    out_s, g_s = grads_of(slow, tensors)
    torch.testing.assert_close(out_f, out_s, **tol)
    for a, b in zip(g_f, g_s):
        torch.testing.assert_close(a, b, **tol)


def test_rms_norm_matches_formula():
    x, w = torch.randn(3, 5, 16, dtype=F64), torch.randn(16, dtype=F64)
    assert_same_fwd_bwd(lambda x, w: layers.rms_norm(x, w, 1e-5), lambda x, w: ref.rms_norm(x, w, 1e-5), [x, w])


def test_rms_norm_keeps_bf16_dtype():
    x = torch.randn(4, 32).bfloat16()
    y = layers.rms_norm(x, torch.ones(32).bfloat16(), 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.rms_norm(x.double(), torch.ones(32, dtype=F64), 1e-5).float(),
                               atol=2e-2, rtol=1e-2)


def test_attention_matches_loop():
    cfg = fmoe.ModelConfig(dim=16, heads=2, rope_theta=100.0)
    p = ref.random_params(cfg)["layers"][0]["attn"]
    x = torch.randn(2, 6, 16, dtype=F64)
    assert_same_fwd_bwd(lambda x, q, o: layers.attention({"qkv": q, "out": o}, x, cfg),
                        lambda x, q, o: ref.attention({"qkv": q, "out": o}, x, cfg),
                        [x, p["qkv"], p["out"]])


ATTENTION_VARIANTS = {
    "gqa": dict(heads=4, kv_heads=2),
    "mqa_head_size": dict(heads=4, kv_heads=1, head_size=6),
    "qk_norm_per_head": dict(heads=4, kv_heads=2, qk_norm="head"),
    "qk_norm_full_bias": dict(heads=2, qk_norm="full", qkv_bias=True, out_bias=True, head_size=10),
    "partial_rope": dict(heads=4, kv_heads=2, head_size=12, rope_fraction=0.5),
}


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS, ids=list(ATTENTION_VARIANTS))
def test_attention_variants_match_loop(variant):
    cfg = fmoe.ModelConfig(dim=16, rope_theta=100.0, **ATTENTION_VARIANTS[variant])
    p = ref.random_params(cfg, seed=3)["layers"][0]["attn"]
    assert p["qkv"].shape == (16, cfg.q_width + 2 * cfg.kv_width) and p["out"].shape == (cfg.q_width, 16)
    names = sorted(k for k in p if k != "norm")
    x = torch.randn(2, 6, 16, dtype=F64)
    assert_same_fwd_bwd(lambda x, *w: layers.attention(dict(zip(names, w)), x, cfg),
                        lambda x, *w: ref.attention(dict(zip(names, w)), x, cfg),
                        [x, *(p[n] for n in names)])


@pytest.mark.parametrize("extra", [{}, dict(rope_fraction=0.5)], ids=["rope", "partial_rope"])
def test_attention_with_a_cache_continues_the_sequence(extra):
    cfg = fmoe.ModelConfig(dim=16, heads=4, kv_heads=2, qk_norm="head", **extra)
    p = ref.random_params(cfg, seed=5)["layers"][0]["attn"]
    x = torch.randn(2, 7, 16, dtype=F64)
    whole = layers.attention(p, x, cfg)
    q, k, v = layers.project_qkv(p, x[:, :4], cfg)
    first = layers.attend(q, k, v) @ p["out"]
    q2, k2, v2 = layers.project_qkv(p, x[:, 4:], cfg, start=4)
    rest = layers.attend(q2, torch.cat([k, k2], 2), torch.cat([v, v2], 2), start=4) @ p["out"]
    torch.testing.assert_close(torch.cat([first, rest], 1), whole)


def test_attention_is_causal():
    cfg = fmoe.ModelConfig(dim=16, heads=2)
    p = ref.random_params(cfg)["layers"][0]["attn"]
    x = torch.randn(1, 8, 16, dtype=F64)
    x2 = x.clone()
    x2[0, 5:] = torch.randn(3, 16, dtype=F64)
    torch.testing.assert_close(layers.attention(p, x, cfg)[0, :5], layers.attention(p, x2, cfg)[0, :5])


@pytest.mark.parametrize("score_func,norm_topk", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_router_matches_per_token_loop(score_func, norm_topk):
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=6, topk=3, score_func=score_func, norm_topk_prob=norm_topk)
    p = ref.random_params(cfg)["layers"][0]["moe"]
    x = torch.randn(20, 16, dtype=F64)
    r = layers.route(p, x, cfg)
    counts = torch.zeros(6, dtype=torch.long)
    for t in range(20):
        chosen, probs, _ = ref.route_token(p, x[t], cfg)
        assert r.indices_TK[t].tolist() == chosen
        torch.testing.assert_close(r.probs_TK[t].double(), probs, atol=1e-6, rtol=1e-6)
        counts[chosen] += 1
    assert r.counts_E.tolist() == counts.tolist()
    _, _, aux, z = ref.moe(p, x, cfg)
    torch.testing.assert_close(r.aux_loss.double(), aux, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(r.z_loss.double(), z, atol=1e-5, rtol=1e-6)


def test_capacity_drops_assignments_beyond_the_first_c_in_token_order():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 0]])
    d = layers.make_dispatch(idx, 3, capacity=2)
    R = 6
    assert d.num_rows == R and d.rows_E.tolist() == [2, 2, 2] and d.offsets_E.tolist() == [2, 4, 6]
    # expert 0 keeps tokens 0, 1 and drops 2, 3, 4; expert 1 keeps 0, 2 and drops 3; expert 2 keeps 1, 4
    assert d.pos_TK.tolist() == [[0, 2], [1, 4], [R, 3], [R, R], [5, R]]
    assert d.dropped.item() == 4 and d.counts_E.tolist() == [5, 3, 2]
    assert int(d.padded_rows) == 0
    x = torch.randn(5, 4, dtype=F64, requires_grad=True)
    rows = layers.permute(x, d)
    y = layers.unpermute(rows, d)
    kept = torch.tensor([[1, 1], [1, 1], [0, 1], [0, 0], [1, 0]], dtype=F64)
    torch.testing.assert_close(y, x.detach() * kept.sum(1, keepdim=True))
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.sum(1, keepdim=True).expand(5, 4))


@pytest.mark.parametrize("factor", [0.5, 1.0, 100.0])
def test_capacity_moe_matches_loop_with_the_same_drops(factor):
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=4, topk=2, ffn=12, expert_biases=True, capacity_factor=factor)
    p = ref.random_params(cfg, seed=5)["layers"][0]["moe"]
    x = torch.randn(24, 16, dtype=F64)
    capacity = layers.capacity_rows(24, 2, 4, factor)
    leaves, treedef = optree.tree_flatten(p)

    def fast(x, *lv):
        return layers.moe(optree.tree_unflatten(treedef, lv), x, cfg)[0]

    def slow(x, *lv):
        return ref.moe(optree.tree_unflatten(treedef, lv), x, cfg, capacity)[0]

    assert_same_fwd_bwd(fast, slow, [x, *leaves])
    _, stats = layers.moe(p, x, cfg)
    overflow = sum(max(0, c - capacity) for c in stats.counts_E.tolist())
    assert stats.dropped_tokens.item() == overflow
    if factor == 100.0:
        torch.testing.assert_close(fast(x, *leaves), layers.moe(p, x, cfg.replace(capacity_factor=0.0))[0])


def test_expert_bias_selects_without_weighting():
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=4, topk=1, norm_topk_prob=False)
    p = ref.random_params(cfg)["layers"][0]["moe"]
    x = torch.randn(10, 16, dtype=F64)
    p = dict(p, expert_bias=torch.tensor([0.0, 0.0, 5.0, 0.0], dtype=F64))
    r = layers.route(p, x, cfg)
    assert (r.indices_TK == 2).all()
    scores = (x @ p["router"]).softmax(-1)[:, 2]
    torch.testing.assert_close(r.probs_TK[:, 0].double(), scores, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pad", [0, 8])
def test_dispatch_round_trip_and_grads(pad):
    T, K, E, D = 13, 3, 5, 8
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)])  # expert E-1 receives nothing
    d = layers.make_dispatch(idx, E, pad)
    assert d.counts_E.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    assert d.rows_E.sum().item() == d.num_rows
    if pad:
        assert all(r % pad == 0 for r in d.rows_E.tolist()) and d.padded_rows > 0
    x = torch.randn(T, D, dtype=F64)
    rows = layers.permute(x, d)
    for t, k in itertools.product(range(T), range(K)):
        row = d.pos_TK[t, k]
        torch.testing.assert_close(rows[row], x[t])
        assert d.row_expert_R[row] == idx[t, k]
    padding = d.row_source_R == T * K
    assert (rows[padding] == 0).all()
    w = torch.rand(T, K, dtype=F64)

    def fast(x, w):
        return layers.unpermute(layers.permute(x, d), d, w)

    assert_same_fwd_bwd(fast, lambda x, w: x * w.sum(1, keepdim=True), [x, w])


def test_dispatch_orders_tokens_within_expert():
    idx = torch.tensor([[2], [0], [2], [1], [0]])
    d = layers.make_dispatch(idx, 3)
    assert d.row_source_R.tolist() == [1, 4, 3, 0, 2]
    assert d.offsets_E.tolist() == [2, 3, 5]


MOE_CASES = [
    dict(activation="swiglu"),
    dict(activation="geglu"),
    dict(activation="quick_geglu", glu_limit=0.5, glu_offset=1.0),
    dict(activation="relu2"),
    dict(activation="swiglu", glu_interleave=2),
    dict(activation="quick_geglu", glu_interleave=1, expert_biases=True),
    dict(activation="swiglu", expert_biases=True, prob_placement="activation"),
    dict(activation="geglu", score_func="sigmoid", shared_ffn=8),
    dict(activation="swiglu", pad_multiple=16, expert_biases=True),
    dict(activation="swiglu", topk=1),
    dict(activation="swiglu", experts=1, topk=1),
]


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_moe_matches_per_token_loop(case):
    cfg = fmoe.ModelConfig(**{**dict(dim=16, heads=2, experts=4, topk=2, ffn=12), **case})
    p = ref.random_params(cfg, seed=3)["layers"][0]["moe"]
    x = torch.randn(24, 16, dtype=F64)
    leaves, treedef = optree.tree_flatten(p)

    def fast(x, *leaves):
        return layers.moe(optree.tree_unflatten(treedef, leaves), x, cfg)[0]

    def slow(x, *leaves):
        return ref.moe(optree.tree_unflatten(treedef, leaves), x, cfg)[0]

    assert_same_fwd_bwd(fast, slow, [x, *leaves])
    _, stats = layers.moe(p, x, cfg)
    assert stats.counts_E.tolist() == ref.moe(p, x, cfg)[1].tolist()
    assert stats.dropped_tokens.item() == 0


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["loop-fp64", "grouped_mm-fp32"])
def test_expert_without_tokens_gets_zero_grad(dtype):
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=4, topk=2, ffn=12, expert_biases=True)
    p = ref.random_params(cfg, dtype=dtype)["layers"][0]["moe"]
    p["expert_bias"] = torch.tensor([-100.0, 0, 0, 0], dtype=dtype)
    fc1 = p["experts"]["fc1"].clone().requires_grad_(True)
    b1 = p["experts"]["fc1_bias"].clone().requires_grad_(True)
    x = torch.randn(10, 16, dtype=dtype)
    y, stats = layers.moe(dict(p, experts=dict(p["experts"], fc1=fc1, fc1_bias=b1)), x, cfg)
    y.square().sum().backward()
    assert stats.counts_E[0] == 0
    assert (fc1.grad[0] == 0).all() and (b1.grad[0] == 0).all()
    assert (fc1.grad[1:].abs().sum((1, 2)) > 0).all()
    p64 = optree.tree_map(lambda t: t.double(), p)
    torch.testing.assert_close(y.double(), ref.moe(p64, x.double(), cfg)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pad", [0, 16])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_grouped_mm_path_matches_loop_path(pad, activation):
    # torch._grouped_mm runs in fp32 here; the loop is the exact fallback.
    cfg = fmoe.ModelConfig(dim=32, heads=2, experts=4, topk=2, ffn=16, activation=activation,
                           expert_biases=True, pad_multiple=pad)
    p = ref.random_params(cfg, dtype=torch.float32)["layers"][0]["moe"]
    x = torch.randn(40, 32)
    leaves, treedef = optree.tree_flatten(p)

    def run(backend):
        return lambda x, *lv: layers.moe(optree.tree_unflatten(treedef, lv), x, cfg, backend)[0]

    assert_same_fwd_bwd(run("torch"), run("loop"), [x, *leaves], atol=1e-5, rtol=1e-5)


def test_grouped_matmul_uses_grouped_mm_when_aligned(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    d = layers.make_dispatch(torch.tensor([[0], [1], [1]]), 2)
    layers.grouped_matmul(torch.randn(3, 8), torch.randn(2, 8, 4), d)
    assert calls, "aligned fp32 shapes should take torch._grouped_mm"
    calls.clear()
    layers.grouped_matmul(torch.randn(3, 6), torch.randn(2, 6, 4), d)
    assert not calls, "unaligned strides must take the loop"


def test_glu_layout_converters_round_trip():
    w = torch.randn(3, 5, 24)
    inter = fmoe.glu_to_interleaved(w, 4)
    gate_cols, up_cols = ref.glu_columns(24, 4)
    torch.testing.assert_close(inter[..., gate_cols], w[..., :12], rtol=0, atol=0)
    torch.testing.assert_close(inter[..., up_cols], w[..., 12:], rtol=0, atol=0)
    assert torch.equal(fmoe.glu_from_interleaved(inter, 4), w)


def test_interleaved_weights_give_same_layer_output():
    base = fmoe.ModelConfig(dim=16, heads=2, experts=4, topk=2, ffn=12, expert_biases=True)
    p = ref.random_params(base)["layers"][0]["moe"]
    ex = p["experts"]
    p_int = dict(p, experts=dict(ex, fc1=fmoe.glu_to_interleaved(ex["fc1"], 3),
                                 fc1_bias=fmoe.glu_to_interleaved(ex["fc1_bias"], 3)))
    x = torch.randn(9, 16, dtype=F64)
    torch.testing.assert_close(layers.moe(p, x, base)[0], layers.moe(p_int, x, base.replace(glu_interleave=3))[0])


@pytest.mark.parametrize("extra", [{}, dict(kv_heads=1, head_size=4, qk_norm="full", qkv_bias=True,
                                           tie_embeddings=True, shared_gate=True),
                                   dict(layers=3, dense_layers=(0, 2), dense_ffn=12, glu_interleave=2),
                                   dict(score_func="sigmoid", expert_groups=2, topk_groups=1, routed_scaling=2.5,
                                        rope_fraction=0.5),
                                   dict(score_func="topk_softmax", router_bias=True, norm_topk_prob=False,
                                        aux_loss_coef=0.01, z_loss_coef=0.001),
                                   dict(attn_sinks=True, sliding_window=3, window_layers=(0,))],
                         ids=["mha", "hf_features", "dense_layers", "glm_routing_partial_rope", "gpt_oss_routing",
                              "sinks_window"])
def test_model_loss_matches_reference(extra):
    cfg = fmoe.ModelConfig(**{**dict(vocab=11, dim=16, layers=2, heads=2, experts=4, topk=2, ffn=8, shared_ffn=4),
                              **extra})
    params = ref.random_params(cfg)
    tokens = torch.randint(0, 11, (2, 6))
    leaves, treedef = optree.tree_flatten(params)

    def fast(*lv):
        return layers.lm_loss_sum(optree.tree_unflatten(treedef, lv), tokens, cfg)[0]

    def slow(*lv):
        return ref.lm_loss_sum(optree.tree_unflatten(treedef, lv), tokens, cfg)[0]

    assert_same_fwd_bwd(fast, slow, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_embed_grad_sums_duplicate_ids_like_a_per_token_loop(dtype):
    V, D = 9, 6
    w = torch.randn(V, D).to(dtype)
    tokens = torch.randint(0, V - 2, (3, 50))  # many duplicates; ids V-2 and V-1 never occur
    tokens[0, :20] = 3  # one id many times over
    g = torch.randn(3, 50, D).to(dtype)
    leaf = w.clone().requires_grad_(True)
    h = layers.embed(leaf, tokens)
    assert h.dtype == dtype and torch.equal(h, w[tokens])
    h.backward(g)
    ref_grad = torch.zeros(V, D, dtype=F64)
    for t, row in zip(tokens.flatten().tolist(), g.reshape(-1, D).double()):
        ref_grad[t] += row
    assert leaf.grad.dtype == dtype  # as autograd returns it; the sum ran in (at least) fp32
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -8, atol=1e-2),
           F64: dict(rtol=1e-12, atol=1e-12)}[dtype]
    torch.testing.assert_close(leaf.grad.double(), ref_grad, **tol)
    assert not leaf.grad[V - 2:].any()


def test_embed_grad_does_not_depend_on_threads():
    w = torch.randn(64, 128, requires_grad=True)
    tokens = torch.randint(0, 64, (4096,))  # past the size where autograd's index_put goes parallel
    g = torch.randn(4096, 128)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 2, 2):
            torch.set_num_threads(n)
            results.append(torch.autograd.grad(layers.embed(w, tokens), w, g)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)
