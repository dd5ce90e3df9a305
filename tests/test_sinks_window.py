"""GPT-OSS's attention features: sinks (one learned logit per head, an extra softmax
column with no value) and sliding-window layers, against transformers' eager GPT-OSS
attention and the plain reference. Through the model, the schedules, decoding and compile
with the other features: ``test_model_features.py``."""

import dataclasses
import functools
import importlib
import types

import pytest
import torch

import fmoe
from fmoe.layers import attend, block_masks, documents
from fmoe.trainer.options import model_config, parse_layers, resolved

from . import reference as ref
from .test_model_features import FEATURES

F64 = torch.float64
CFG = FEATURES["sinks_window"]


def qkv(B=2, H=4, K=2, S=9, d=8, seed=None, e=None):
    """Queries, keys, values (``e`` features a value head, None: ``d``) and sinks."""
    g = torch.Generator().manual_seed(ref.seed_of_this_test() if seed is None else seed)
    q = torch.randn(B, H, S, d, generator=g, dtype=F64)
    k = torch.randn(B, K, S, d, generator=g, dtype=F64)
    v = torch.randn(B, K, S, d if e is None else e, generator=g, dtype=F64)
    return q, k, v, torch.randn(H, generator=g, dtype=F64)


def hf_attention(q, k, v, sinks, window=0):
    """transformers' GPT-OSS eager attention under its causal (or sliding-window) mask."""
    gpt_oss = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    S, H, K = q.shape[2], q.shape[1], k.shape[1]
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    seen = (j <= i) & ((j > i - window) if window else True)  # masking_utils' sliding_window_overlay
    mask = torch.zeros(S, S, dtype=q.dtype).masked_fill(~seen, torch.finfo(q.dtype).min)
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=H // K, training=False)
    out, _ = gpt_oss.eager_attention_forward(module, q, k, v, mask[None, None], scaling=q.shape[-1] ** -0.5)
    return out.flatten(2)  # [B, S, H * d]


def plain_attention(q, k, v, sinks, window=0, ids=None):
    """``reference.sink_softmax`` per row, head and query, with the reference's masks."""
    B, H, S, d = q.shape
    group = H // k.shape[1]
    out = torch.empty(B, S, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for s in range(S):
                seen = [j for j in range(s + 1) if (not window or j > s - window)
                        and (ids is None or ids[b, j] == ids[b, s])]
                logits = k[b, h // group, seen] @ q[b, h, s] / d ** 0.5
                out[b, s, h] = ref.sink_softmax(logits, None if sinks is None else sinks[h]) @ v[b, h // group, seen]
    return out.flatten(2)


@pytest.mark.parametrize("window", [0, 1, 3])
def test_sinks_match_transformers_gpt_oss_attention(window):
    q, k, v, sinks = qkv()
    want = hf_attention(q, k, v, sinks, window)
    torch.testing.assert_close(attend(q, k, v, window=window, sinks_H=sinks), want)
    torch.testing.assert_close(plain_attention(q, k, v, sinks, window), want)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_window_with_packed_documents_matches_the_reference(window, sinks):
    q, k, v, s_H = qkv(S=12)
    s_H = s_H if sinks else None
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2]])
    torch.testing.assert_close(attend(q, k, v, window=window, sinks_H=s_H), plain_attention(q, k, v, s_H, window))
    torch.testing.assert_close(attend(q, k, v, docs=documents(ids), window=window, sinks_H=s_H),
                               plain_attention(q, k, v, s_H, window, ids))


def test_cached_queries_see_the_same_window_and_sinks():
    q, k, v, sinks = qkv(S=10)
    whole = attend(q, k, v, window=3, sinks_H=sinks)
    rest = attend(q[:, :, 6:], k, v, start=6, window=3, sinks_H=sinks)  # queries 6..9 over all 10 keys
    torch.testing.assert_close(rest, whole[:, 6:])


def test_sink_gradients_match_transformers():
    q, k, v, sinks = (t.requires_grad_(True) for t in qkv(S=7))
    g = torch.randn(2, 7, 32, dtype=F64)
    mine = torch.autograd.grad((attend(q, k, v, window=2, sinks_H=sinks) * g).sum(), (q, k, v, sinks))
    theirs = torch.autograd.grad((hf_attention(q, k, v, sinks, 2) * g).sum(), (q, k, v, sinks))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)


attention_module = importlib.import_module("fmoe.layers.attention")  # also the name of a function in fmoe.layers
BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("window", [0, 1, 5, 127, 128, 129, 300])
@pytest.mark.parametrize("S", [1, 100, 128, 129, 384, 500])
def test_the_row_block_mask_is_create_block_masks(S, window):
    # worked out from block arithmetic, without the [S, S] mask create_block_mask makes:
    # the same partial and full blocks in the same order (rows cut short by S included)
    from torch.nn.attention.flex_attention import create_block_mask
    want = create_block_mask(block_masks.row_mask_mod(window), None, None, S, S, device="cpu")
    got = block_masks.row_block_mask(S, window, torch.device("cpu"))
    assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in BLOCK_MASK_TENSORS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.fixture
def rows_take_flex(monkeypatch):
    """Plain rows with a window or sinks take the FlexAttention path on the CPU too."""
    monkeypatch.setattr(attention_module, "_FLEX_ROW_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("e", [None, 12], ids=["e=d", "e<d"])
@pytest.mark.parametrize("K", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window, sinks", [(0, True), (3, False), (3, True), (140, True)],
                         ids=["sinks", "window", "both", "long-window"])
def test_plain_row_flex_matches_the_per_token_reference(rows_take_flex, monkeypatch, window, sinks, K, e):
    # the path CUDA's rows take, its mask, lse and sinks in float64 through the eager
    # flex_attention (CPU's compiled kernel has no lse; its reference math in float64
    # applies the mask_mod, the block mask's blocks are checked above and compiled
    # below). 150 positions: two blocks, the second cut short; a window of 140 spans both.
    from torch.nn.attention.flex_attention import flex_attention
    monkeypatch.setattr(attention_module, "_compiled_flex", lambda: flex_attention)
    q, k, v, s_H = qkv(H=4, K=K, S=150, d=16, e=e)
    s_H = s_H if sinks else None
    chosen = []
    monkeypatch.setattr(attention_module, "_flex_attend",
                        lambda *a, **kw: chosen.append(a[3]) or _flex_attend(*a, **kw))
    got = attend(q, k, v, window=window, sinks_H=s_H)
    assert len(chosen) == 1 and chosen[0].shape == (1, 1, 150, 150)
    torch.testing.assert_close(got, plain_attention(q, k, v, s_H, window), rtol=1e-12, atol=1e-12)


_flex_attend = attention_module._flex_attend


@pytest.mark.parametrize("window", [3, 200])
def test_the_compiled_plain_row_flex_matches_the_reference(rows_take_flex, window):
    # CPU's compiled FlexAttention kernel (float32, no sinks: no lse there) reads the
    # cached block mask's blocks: 300 positions, three blocks, the last cut short. The
    # mask is built once, while tracing, and is a constant of the graph afterwards.
    q, k, v, _ = qkv(H=4, K=2, S=300, d=16, e=8)
    block_masks.row_mask_parts.cache_clear()
    compiled = torch.compile(functools.partial(attend, window=window), fullgraph=True, dynamic=False)
    got = compiled(*(t.float() for t in (q, k, v)))
    compiled(*(t.float() for t in (q, k, v)))
    # dynamo called the cache while tracing (a traced mask would leave it empty), once
    assert block_masks.row_mask_parts.cache_info()[:2] == (0, 1)  # (hits, misses)
    # float32 against float64: sums over up to 300 keys, each product rounded to 2**-24
    torch.testing.assert_close(got, plain_attention(q, k, v, None, window).float(), rtol=1e-5, atol=1e-5)


def test_the_traced_plain_row_flex_with_sinks_is_one_graph(rows_take_flex):
    # what Plan.compile's attention region traces on CUDA (fullgraph: the cached mask
    # through assume_constant_result, the lse through AuxRequest, the sinks), run by
    # aot_eager: Flex's reference math in float64, which CPU's kernels cannot lower
    q, k, v, s_H = qkv(H=4, K=2, S=300, d=16, e=8)
    block_masks.row_mask_parts.cache_clear()
    traced = torch.compile(functools.partial(attend, window=7), fullgraph=True, dynamic=False, backend="aot_eager")
    got = traced(q, k, v, sinks_H=s_H)
    traced(q, k, v, sinks_H=s_H)
    assert block_masks.row_mask_parts.cache_info()[:2] == (0, 1)  # (hits, misses): built while tracing
    torch.testing.assert_close(got, plain_attention(q, k, v, s_H, 7), rtol=1e-12, atol=1e-12)


def test_selective_remat_recomputes_flex_attention():
    # kept, torch 2.11's compiled selective checkpointing changed packed rows' forward
    # (tests/test_gpu_sinks_window.py's selective test, on the GPU): recomputed instead
    from fmoe.schedule.remat import keeps
    assert not keeps(torch.ops.higher_order.flex_attention)


@pytest.mark.parametrize("window, sinks", [(0, False), (0, True), (3, False), (3, True)])
def test_value_heads_narrower_than_query_heads(window, sinks):
    # MLA's shape (q/k heads wider than v heads) through SDPA's causal and masked paths
    # and the written-out softmax: [B, S, H * e]
    q, k, v, s_H = qkv(S=9, d=8, e=4)
    s_H = s_H if sinks else None
    got = attend(q, k, v, window=window, sinks_H=s_H)
    assert got.shape == (2, 9, 4 * 4)
    torch.testing.assert_close(got, plain_attention(q, k, v, s_H, window))
    rest = attend(q[:, :, 6:], k, v, start=6, window=window, sinks_H=s_H)  # decoding over a cache
    torch.testing.assert_close(rest, got[:, 6:])


def test_the_window_and_the_sinks_change_the_loss():
    params = ref.random_params(CFG, dtype=torch.float32)
    tokens = torch.randint(0, 40, (2, 9))
    loss = fmoe.step(params, {"tokens": tokens}, fmoe.Plan(model=CFG)).loss
    no_window = CFG.replace(sliding_window=0, window_layers=())
    assert not torch.equal(fmoe.step(params, {"tokens": tokens}, fmoe.Plan(model=no_window)).loss, loss)
    plain = no_window.replace(attn_sinks=False)
    without = {**params, "layers": [dict(p, attn={n: w for n, w in p["attn"].items() if n != "sinks"})
                                    for p in params["layers"]]}
    assert not torch.equal(fmoe.step(without, {"tokens": tokens}, fmoe.Plan(model=plain)).loss, loss)


def test_sinks_are_a_head_vector_without_weight_decay():
    table = fmoe.params.param_table(CFG)
    leaf = table["layers.1.attn.sinks"]
    assert leaf.shape == (4,) and not leaf.decayed and leaf.trainable and not leaf.linear
    assert "sinks" not in fmoe.params.param_specs(CFG.replace(attn_sinks=False))["layers"][0]["attn"]
    assert [CFG.layer_window(i) for i in range(3)] == [3, 0, 3]


@pytest.mark.parametrize("changes, field", [
    (dict(sliding_window=4), "sliding_window"),
    (dict(window_layers=(1,)), "sliding_window"),
    (dict(sliding_window=-1, window_layers=(0,)), "sliding_window"),
    (dict(sliding_window=4, window_layers=(2,)), "window_layers"),
    (dict(sliding_window=4, window_layers=(1, 0)), "window_layers"),
    (dict(sliding_window=4, window_layers=(0, 0)), "window_layers"),
    (dict(sliding_window=True, window_layers=(0,)), "sliding_window"),
    (dict(attn_sinks=1), "attn_sinks"),
])
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        fmoe.ModelConfig(layers=2, **changes)


def test_window_layers_as_a_list_and_as_the_main_jobs_string():
    assert fmoe.ModelConfig(sliding_window=2, window_layers=[1, 0]).window_layers == (0, 1)
    assert parse_layers("0,2", "window_layers") == (0, 2)
    with pytest.raises(ValueError, match="window_layers="):
        parse_layers("0;2", "window_layers")
    fields = {f.name: getattr(CFG, f.name) for f in dataclasses.fields(CFG)}
    assert model_config({**fields, "window_layers": "0,2", "dense_layers": ""}) == CFG
    out = resolved({}, fmoe.Plan(model=CFG))
    assert out["window_layers"] == "0,2" and out["sliding_window"] == 3 and out["attn_sinks"] is True


def test_a_moe_layer_module_of_a_windowed_model_builds_and_runs():
    from interop import MoELayer
    layer = MoELayer(CFG, seed=0)  # one MoE layer: the windows of layers it is not are dropped
    assert layer(torch.randn(2, 3, 32)).shape == (2, 3, 32)
