"""The Triton kernels (fmoe/layers/triton_kernels.py) against the pure-torch path.

Kernel tests are marked ``gpu``: they run on a CUDA device with Triton, or on CPU
under Triton's interpreter with ``FMOE_TRITON_INTERPRET=1`` (Triton installed):

    FMOE_TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_kernels.py

The reference is the torch path in float64 (fp64 tensors never take the kernels), and
the torch path in the kernels' dtype. Tolerances against float64: a kernel computes in
fp32 and rounds its output once, so a bf16 output is within half an ulp (rtol 2^-8,
+1e-5 for fp32 math: the GPU's exp is approximate); an fp32 one within rtol 2e-5, atol
1e-6 (elementwise), 1e-5 (sums over K) or 1e-4 (sums over D = 1000 for the weights' and
probabilities' gradients). The rows' gradient of unpermute is the same product as the
torch path's and must match it bitwise.
"""

import importlib
import types

import optree
import pytest
import torch
import torch.nn.functional as F

import fmoe
from fmoe.layers import triton_kernels as tk
from fmoe.layers.experts import activation, expert_mlp, glu_halves

from . import reference as ref

dispatch = importlib.import_module("fmoe.layers.dispatch")  # fmoe.layers.dispatch is also a function's name

INTERPRETED = tk.INTERPRET and tk.triton is not None
DEVICE = "cpu" if INTERPRETED else "cuda"
F64, BF16, F32 = torch.float64, torch.bfloat16, torch.float32
HALF_ULP = {BF16: 2.0 ** -8, F32: 1e-5}  # rtol of one rounding from fp32 (fp32: summation order)


def rtol(dtype, ulps=1):
    """``ulps`` roundings to ``dtype``, plus room for fp32 math (the GPU's exp is approximate)."""
    return ulps * HALF_ULP[dtype] + 1e-5


def kernel_test(fn):
    """A CUDA test with Triton; under the interpreter, a CPU test."""
    if INTERPRETED:
        return fn
    return pytest.mark.gpu(pytest.mark.skipif(tk.triton is None, reason="needs Triton")(fn))


@pytest.fixture
def torch_path(monkeypatch):
    """Call it to run the pure-torch path (``FMOE_FUSED_KERNELS=0``) inside a ``with``."""
    class Off:
        def __enter__(self):
            monkeypatch.setenv("FMOE_FUSED_KERNELS", "0")

        def __exit__(self, *exc):
            monkeypatch.delenv("FMOE_FUSED_KERNELS")

    return Off


@pytest.fixture
def calls(monkeypatch):
    """Counts of the kernel launchers' calls, by name."""
    counts = {}
    for name in ("swiglu_fwd_RF", "swiglu_bwd_RN", "unpermute_fwd_TD", "unpermute_bwd"):
        real = getattr(tk, name)

        def spy(*a, _real=real, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*a, **k)

        monkeypatch.setattr(tk, name, spy)
    return counts


def rand(*shape, dtype=F32, low=None):
    """Fresh random values (never zeros) on the test device."""
    t = torch.randn(*shape, dtype=F64) if low is None else torch.rand(*shape, dtype=F64) + low
    return t.to(DEVICE, dtype)


def assert_near(a, b, rel, what=""):
    """``|a - b| <= rel |b|`` in the 2-norm: for bf16 results that went through GEMMs and
    sums after the kernels, where elementwise tolerances trip on cancellation."""
    err, size = (a.double() - b.double()).norm().item(), b.double().norm().item()
    assert err <= rel * size, f"{what}: |a - b| = {err:.3g} > {rel} x |b| = {rel * size:.3g}"


def with_grads(fn, inputs, upstream):
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(upstream.to(out.dtype))
    return out.detach(), [None if t is None else t.grad for t in leaves]


# --- SwiGLU -------------------------------------------------------------------------


def swiglu_ref(h, prob, interleave):
    # The torch path in float64 (activation() on fp64 tensors never takes the kernel).
    cfg = fmoe.ModelConfig(dim=8, heads=1, ffn=h.shape[-1] // 2, glu_interleave=interleave)
    a = activation(h, cfg)
    return a if prob is None else a * prob[:, None]


@kernel_test
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("interleave", [0, 2, 3])
@pytest.mark.parametrize("with_prob", [False, True], ids=["", "prob"])
@pytest.mark.parametrize("R,F", [(0, 24), (1, 24), (37, 24), (300, 600)])
def test_swiglu_kernel_matches_torch_path(dtype, interleave, with_prob, R, F, torch_path):
    h, ga = rand(R, 2 * F, dtype=dtype), rand(R, F, dtype=dtype)
    prob = rand(R, low=0.1) if with_prob else None
    a, (gh, gp) = with_grads(lambda h, p: tk.swiglu_RF(h, interleave, p), [h, prob], ga)
    assert a.dtype == dtype and gh.dtype == dtype and a.shape == (R, F) and gh.shape == (R, 2 * F)
    a64, (gh64, gp64) = with_grads(lambda h, p: swiglu_ref(h, p, interleave),
                                   [h.double(), None if prob is None else prob.double()], ga.double())
    torch.testing.assert_close(a.double(), a64, rtol=rtol(dtype), atol=1e-6)
    torch.testing.assert_close(gh.double(), gh64, rtol=rtol(dtype), atol=1e-6)
    if with_prob:  # a row sum over F in fp32
        assert gp.dtype == prob.dtype
        torch.testing.assert_close(gp.double(), gp64, rtol=1e-5, atol=1e-4)
    # and the torch path in the same dtype (it rounds silu(gate) and the product: a few ulps)
    with torch_path():
        a_t, (gh_t, _) = with_grads(lambda h, p: swiglu_ref(h, None if p is None else p.to(dtype), interleave),
                                    [h, prob], ga)
    torch.testing.assert_close(a, a_t, rtol=rtol(dtype, 4), atol=1e-5)
    torch.testing.assert_close(gh, gh_t, rtol=rtol(dtype, 4), atol=1e-5)


@kernel_test
def test_swiglu_kernel_takes_leading_dims_and_strided_input():
    h = rand(3, 5, 40, dtype=BF16)
    a = tk.swiglu_RF(h.transpose(0, 1), 0)  # not contiguous: copied
    gate, up = glu_halves(h.transpose(0, 1).double(), 0)
    torch.testing.assert_close(a.double(), F.silu(gate) * up, rtol=rtol(BF16), atol=1e-6)


@kernel_test
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", [dict(), dict(prob_placement="activation", expert_biases=True),
                                  dict(prob_placement="activation", glu_interleave=4, pad_multiple=16)],
                         ids=["output", "activation-bias", "activation-interleave-pad"])
def test_expert_mlp_routes_swiglu_and_prob_to_the_kernel(dtype, case, calls, torch_path):
    cfg = fmoe.ModelConfig(**{**dict(dim=32, heads=2, experts=4, topk=2, ffn=32), **case})
    T, E = 50, cfg.experts
    d = dispatch.make_dispatch(torch.rand(T, E).topk(2).indices.to(DEVICE), E, cfg.pad_multiple)
    p = {"fc1": rand(E, 32, 64, dtype=dtype) / 6, "fc2": rand(E, 32, 32, dtype=dtype) / 6}
    if cfg.expert_biases:
        p.update(fc1_bias=rand(E, 64), fc2_bias=rand(E, 32))
    x, up = rand(d.num_rows, 32, dtype=dtype), rand(d.num_rows, 32, dtype=dtype)
    probs = rand(d.num_rows, low=0.1) if cfg.prob_placement == "activation" else None
    names = ["x", "probs", *p]

    def run(x, probs, *weights):
        return expert_mlp(dict(zip(p, weights)), x, d, cfg, probs)

    y, grads = with_grads(run, [x, probs, *p.values()], up)
    assert calls == {"swiglu_fwd_RF": 1, "swiglu_bwd_RN": 1}
    with torch_path():
        y_t, grads_t = with_grads(run, [x, probs, *p.values()], up)
    assert calls == {"swiglu_fwd_RF": 1, "swiglu_bwd_RN": 1}  # FMOE_FUSED_KERNELS=0: the torch path
    rel = 1e-2 if dtype == BF16 else 1e-5  # bf16: the torch path rounds silu(gate) and silu * up
    assert_near(y, y_t, rel, "y")
    for name, g, g_t in zip(names, grads, grads_t):
        if g is not None:
            assert_near(g, g_t, rel, f"grad of {name}")


# --- unpermute ----------------------------------------------------------------------

MODES = {  # (pad_multiple, capacity_factor)
    "dropless": (0, None),
    "padded": (16, None),
    "capacity": (8, 1.0),  # drops and padding rows (the routing is skewed)
}


def make_case(T, K, mode, E=8):
    pad, factor = MODES[mode]
    skew = torch.linspace(0, 1, E)  # K distinct experts per token, the last ones preferred
    idx = (torch.rand(T, E) + skew).topk(K, dim=1).indices.to(DEVICE)
    capacity = dispatch.capacity_rows(T, K, E, factor, pad) if factor else None
    return dispatch.make_dispatch(idx, E, 0 if capacity else pad, capacity)


@kernel_test
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("w_dtype", [None, F32, BF16], ids=["no_w", "w32", "w16"])
@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("T,D", [(0, 40), (1, 40), (37, 40), (150, 1000)])
def test_unpermute_kernels_match_torch_path(dtype, w_dtype, K, mode, T, D, torch_path):
    d = make_case(T, K, mode)
    R = d.num_rows
    padding = d.row_source_R == T * K
    dropped = d.pos_TK == R
    if mode == "capacity" and T == 150 and K < 8:  # (K = E: every expert gets every token)
        assert dropped.any() and padding.any()
    if mode == "padded" and T:
        assert padding.any()
    y = rand(R, D, dtype=dtype)
    y[padding] = float("nan")  # never read
    w = None if w_dtype is None else rand(T, K, dtype=w_dtype, low=0.1)
    up = rand(T, D, dtype=dtype)

    def run(y, w):
        return dispatch.unpermute(y, d, w)

    out, (gy, gw) = with_grads(run, [y, w], up)
    assert out.dtype == dtype and out.shape == (T, D) and gy.shape == (R, D)
    assert torch.isfinite(out).all() and (gy[padding] == 0).all()
    if w is not None:
        assert gw.dtype == w_dtype and (gw[dropped] == 0).all() and torch.isfinite(gw).all()
    with torch_path():
        out_t, (gy_t, gw_t) = with_grads(run, [y, w], up)
        out64, (_, gw64) = with_grads(run, [y.double(), None if w is None else w.double()], up.double())
    # the sum over k runs in fp32 in k order either way; rounded once to y's dtype
    torch.testing.assert_close(out.double(), out64, rtol=rtol(dtype), atol=1e-5)
    torch.testing.assert_close(out, out_t, rtol=rtol(dtype, 2), atol=1e-5)
    assert torch.equal(gy, gy_t)  # grad * w in fp32, rounded once: the same product
    if w is not None:  # a dot over D in fp32, rounded once to w's dtype
        torch.testing.assert_close(gw.double(), gw64, rtol=rtol(w_dtype), atol=1e-4)
        torch.testing.assert_close(gw, gw_t, rtol=rtol(w_dtype, 2), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available() or tk.triton is None,
                    reason="needs CUDA and Triton (the interpreter compiles nothing)")
def test_new_row_counts_compile_no_new_kernels():
    # Routing changes the row and token counts every step; a kernel specialised on a count
    # (divisible by 16 or not) compiled a variant mid-run, a stall of ~0.3 s on an
    # expert rank that every other rank waited for (benchmarks/ep_trace.py).
    def variants():
        caches = [getattr(k, "device_caches", None) for k in
                  (tk._swiglu_fwd_kernel, tk._swiglu_bwd_kernel, tk._unpermute_fwd_kernel, tk._unpermute_bwd_kernel)]
        if any(c is None for c in caches):
            pytest.skip("this Triton keeps no per-device kernel cache to count")
        return [sum(len(entry[0]) for entry in c.values()) for c in caches]

    def run(T):  # T tokens, 4 experts each: R = 4T rows
        d = make_case(T, 4, "dropless")
        h = rand(d.num_rows, 2 * 96, dtype=BF16).requires_grad_()
        a = tk.swiglu_RF(h)
        y = torch.cat([a, a], 1)
        w = rand(T, 4, low=0.1).requires_grad_()
        out = dispatch.unpermute(y, d, w)
        torch.autograd.grad(out, [h, w], rand(T, 2 * 96, dtype=BF16))

    run(256)
    compiled = variants()
    for T in (257, 260, 272, 1000):  # counts and row counts off and on multiples of 16
        run(T)
    torch.cuda.synchronize()
    assert variants() == compiled


@kernel_test
@pytest.mark.parametrize("need", ["rows", "weights"])
def test_unpermute_backward_computes_only_what_is_needed(need, calls, torch_path):
    d = make_case(20, 4, "capacity")
    y, w, up = rand(d.num_rows, 64, dtype=BF16), rand(20, 4, low=0.1), rand(20, 64, dtype=BF16)
    y.requires_grad_(need == "rows")
    w.requires_grad_(need == "weights")
    out = dispatch.unpermute(y, d, w)
    (g,) = torch.autograd.grad(out, [y if need == "rows" else w], up)
    with torch_path():
        (g_t,) = torch.autograd.grad(dispatch.unpermute(y, d, w), [y if need == "rows" else w], up)
    torch.testing.assert_close(g, g_t, rtol=1e-5, atol=1e-4)
    assert calls == {"unpermute_fwd_TD": 1, "unpermute_bwd": 1}


@kernel_test
@pytest.mark.parametrize("case", [dict(), dict(prob_placement="activation"), dict(capacity_factor=0.5),
                                  dict(pad_multiple=16, glu_interleave=2)],
                         ids=["output", "activation", "capacity", "pad-interleave"])
def test_moe_layer_with_kernels_matches_torch_path(case, calls, torch_path):
    cfg = fmoe.ModelConfig(**{**dict(dim=64, heads=2, experts=8, topk=2, ffn=48, shared_ffn=16), **case})
    p = optree.tree_map(lambda t: t.float().to(DEVICE), ref.random_params(cfg, seed=4)["layers"][0]["moe"])
    p["experts"] = optree.tree_map(lambda t: t.bfloat16(), p["experts"])
    p["shared"] = optree.tree_map(lambda t: t.bfloat16(), p["shared"])
    x, up = rand(96, 64, dtype=BF16), rand(96, 64, dtype=BF16)
    leaves, treedef = optree.tree_flatten(p)

    def run(x, *lv):
        return fmoe.layers.moe(optree.tree_unflatten(treedef, list(lv)), x, cfg)[0]

    y, grads = with_grads(run, [x, *leaves], up)
    # the routed experts' and the shared expert's SwiGLU, the unpermute, and the permute's
    # backward (the unpermute's forward kernel without weights)
    assert calls == {"swiglu_fwd_RF": 2, "swiglu_bwd_RN": 2, "unpermute_fwd_TD": 2, "unpermute_bwd": 1}
    with torch_path():
        y_t, grads_t = with_grads(run, [x, *leaves], up)
    assert_near(y, y_t, 1e-2, "y")
    for path, g, g_t in zip(["x", *map(str, optree.tree_paths(p))], grads, grads_t):
        if g is not None:
            assert_near(g, g_t, 1e-2, f"grad of {path}")


# --- where the kernels run ----------------------------------------------------------


def test_availability_needs_cuda_triton_and_the_switch(monkeypatch):
    fake_cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    monkeypatch.setattr(tk, "triton", object())  # as if importable
    monkeypatch.delenv("FMOE_FUSED_KERNELS", raising=False)
    assert tk.fused_kernels_available(fake_cuda)
    assert tk.fused_kernels_available(torch.ones(1)) == tk.INTERPRET  # CPU: only under the interpreter
    monkeypatch.setenv("FMOE_FUSED_KERNELS", "0")
    assert not tk.fused_kernels_available(fake_cuda)
    monkeypatch.setenv("FMOE_FUSED_KERNELS", "1")
    monkeypatch.setattr(tk, "triton", None)
    assert not tk.fused_kernels_available(fake_cuda)


@pytest.mark.skipif(INTERPRETED, reason="FMOE_TRITON_INTERPRET=1 sends CPU tensors to the kernels on purpose")
def test_cpu_tensors_take_the_torch_path(monkeypatch):
    def no_kernel(*a, **k):
        raise AssertionError("a Triton kernel was called for CPU tensors")

    for name in ("swiglu_fwd_RF", "swiglu_bwd_RN", "unpermute_fwd_TD", "unpermute_bwd", "rope_BHSd"):
        monkeypatch.setattr(tk, name, no_kernel)
    monkeypatch.setattr(tk, "triton", object())  # even where Triton imports
    cfg = fmoe.ModelConfig(dim=16, heads=2, experts=4, topk=2, ffn=12)
    h = torch.randn(10, 24, dtype=BF16, requires_grad=True)
    assert not tk.fused_kernels_available(h) and not tk.swiglu_fusable(h, 0)
    a = activation(h, cfg)
    gate, up = h.detach().chunk(2, -1)
    assert torch.equal(a, F.silu(gate) * up)  # the torch path's bf16 roundings, bitwise
    a.sum().backward()
    d = dispatch.make_dispatch(torch.rand(6, 4).topk(2).indices, 4, capacity=2)
    y = torch.randn(d.num_rows, 8, dtype=BF16, requires_grad=True)
    w = torch.rand(6, 2, requires_grad=True)
    out = dispatch.unpermute(y, d, w)
    out.sum().backward()
    expected = sum(dispatch._gather_rows_with_zero_pad(y.detach(), d.pos_TK[:, k]).float() * w.detach()[:, k:k + 1]
                   for k in range(2))
    torch.testing.assert_close(out, expected.bfloat16())
    from fmoe.layers.rope import apply_rope, rope_tables

    q = torch.randn(1, 2, 5, 8, dtype=BF16)
    cos, sin = rope_tables(5, 8, 10000.0)
    assert not tk.rope_fusable(q, cos)
    x1, x2 = q.float().chunk(2, -1)
    c, s_ = cos.float(), sin.float()
    assert torch.equal(apply_rope(q, cos, sin), torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1).bfloat16())


# --- RoPE ---------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B,H,S,d,r,start", [(2, 3, 37, 64, 64, 0), (1, 2, 5, 128, 128, 11), (1, 1, 0, 8, 8, 0),
                                               (2, 3, 37, 128, 64, 3), (1, 2, 9, 48, 16, 0)],
                         ids=["whole", "whole-offset", "empty", "partial-half", "partial-third"])
def test_rope_kernel_on_a_strided_view_matches_torch_path(dtype, B, H, S, d, r, start, monkeypatch):
    # r < d: partial RoPE (GLM-4.5's half heads), the features past r pass through the kernel
    from fmoe.layers.rope import apply_rope, rope_tables

    launched = []
    real = tk.rope_BHSd
    monkeypatch.setattr(tk, "rope_BHSd", lambda *a: launched.append(1) or real(*a))
    qkv = rand(B, S, 3 * H * d, dtype=dtype)
    # q and k as project_qkv makes them: strided views of the projection, not copies
    view = lambda t: t.unflatten(-1, (H, d)).transpose(1, 2)  # noqa: E731
    q = view(qkv[..., H * d:2 * H * d])
    assert S == 0 or not q.is_contiguous()
    cos, sin = rope_tables(S, r, 10000.0, DEVICE, start)
    grad = rand(B, H, S, d, dtype=dtype)
    out, (g,) = with_grads(lambda x: apply_rope(x, cos, sin), [q], grad)
    assert launched and out.dtype == dtype and g.dtype == dtype and out.shape == (B, H, S, d)
    assert torch.equal(out[..., r:], q[..., r:]) and torch.equal(g[..., r:], grad[..., r:])
    out64, (g64,) = with_grads(lambda x: apply_rope(x, cos, sin), [q.double()], grad.double())
    # two fp32 products and a sum, one rounding to dtype
    torch.testing.assert_close(out.double(), out64, rtol=rtol(dtype), atol=1e-6)
    torch.testing.assert_close(g.double(), g64, rtol=rtol(dtype), atol=1e-6)
