"""The TransformerEngine expert backend: refusals everywhere, equivalence on a GPU with TE.

Equivalence tolerance: TE's GLU kernel computes ``act(gate) * up * scale`` in fp32 and
rounds once, where the torch backend rounds to bf16 after each op, so the two differ
by bf16 rounding. Both are compared with a float64 reference: TE's relative error
(Frobenius norm) must stay within twice the torch backend's, or one bf16 unit
(2^-8) where the torch backend is more exact than that.
"""

import optree
import pytest
import torch

import fmoe
import interop.te as te
from fmoe.layers.dispatch import make_dispatch
import fmoe.backends as backends
from fmoe.layers import DeferredWgrad, ExpertBackend, expert_mlp

from .reference import assert_same_structure, assert_trees_equal, rel_err

needs_te = pytest.mark.skipif(te.IMPORT_ERROR is not None, reason="needs TransformerEngine")


def test_plan_names_te_and_step_refuses_it_without_the_module(monkeypatch):
    plan = fmoe.Plan(model=fmoe.ModelConfig(), expert_backend="te")
    monkeypatch.delitem(backends._registered, "te")
    with pytest.raises(ValueError, match=r"expert_backend='te' is provided by interop.te.*import the module interop.te before the first step"):
        fmoe.step(fmoe.init(plan.replace(expert_backend="torch")), {"tokens": torch.zeros(2, 5, dtype=torch.long)},
                  plan)


@pytest.mark.skipif(te.IMPORT_ERROR is None, reason="TransformerEngine is installed here")
def test_te_backend_refuses_when_te_is_missing():
    plan = fmoe.Plan(model=fmoe.ModelConfig(), expert_backend="te")
    with pytest.raises(ValueError, match=r"needs TransformerEngine, which failed to import.*fmoe\[te\]"):
        fmoe.step(fmoe.init(plan.replace(expert_backend="torch")), {"tokens": torch.zeros(2, 5, dtype=torch.long)},
                  plan)


@pytest.mark.parametrize("model,device,match", [
    (fmoe.ModelConfig(), "cpu", r"runs on CUDA only.*Plan.device='cpu'"),
    (fmoe.ModelConfig(activation="relu2"), "cuda", r"activation in 'swiglu', 'quick_geglu', got 'relu2'"),
    (fmoe.ModelConfig(activation="geglu"), "cuda", r"got 'geglu'"),
])
def test_te_backend_refuses_what_it_cannot_run(monkeypatch, model, device, match):
    monkeypatch.setattr(te, "IMPORT_ERROR", None)  # as if TE were installed
    with pytest.raises(ValueError, match=match):
        te.check(fmoe.Plan(model=model, expert_backend="te", device=device))


def _run(cfg, leaves, grad_out, d, backend, dtype, with_probs, deferred=None):
    """Output and gradients of ``expert_mlp`` with ``leaves`` cast to ``dtype``."""
    inputs = {k: v.detach().to(dtype).requires_grad_() for k, v in leaves.items()}
    p = {k: v for k, v in inputs.items() if k not in ("x", "probs")}
    y = expert_mlp(p, inputs["x"], d, cfg, inputs["probs"] if with_probs else None, backend, deferred)
    y.backward(grad_out.to(dtype))
    grads = {f"d{k}": v.grad for k, v in inputs.items() if v.grad is not None}
    if deferred is not None:
        done = {id(w): g for w, g in deferred.run()}
        grads.update({f"d{k}": done[id(inputs[k])] for k in ("fc1", "fc2")})
    return {"y": y.detach(), **grads}


def _expert_case(activation, interleave, biases, seed=0):
    E, D, F, T, K = 8, 256, 128, 384, 2
    cfg = fmoe.ModelConfig(dim=D, experts=E, topk=K, ffn=F, activation=activation, glu_interleave=interleave,
                           expert_biases=biases)
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Expert 3 gets no rows: its weight gradients must come back zero.
    scores = torch.rand(T, E, generator=g, device="cuda")
    scores[:, 3] = -1
    d = make_dispatch(scores.topk(K, dim=1).indices, E)
    R = d.num_rows
    leaves = {"x": torch.randn(R, D, generator=g, device="cuda"),
              "probs": torch.rand(R, generator=g, device="cuda"),
              "fc1": torch.randn(E, D, 2 * F, generator=g, device="cuda") / D ** 0.5,
              "fc2": torch.randn(E, F, D, generator=g, device="cuda") / F ** 0.5}
    if biases:
        leaves["fc1_bias"] = 0.1 * torch.randn(E, 2 * F, generator=g, device="cuda")
        leaves["fc2_bias"] = 0.1 * torch.randn(E, D, generator=g, device="cuda")
    return cfg, leaves, torch.randn(R, D, generator=g, device="cuda"), d


@pytest.mark.parametrize("with_probs", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("biases", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("interleave", [0, 32], ids=["halves", "interleave32"])
@pytest.mark.parametrize("activation", ["swiglu", "quick_geglu"])
@pytest.mark.gpu
@needs_te
def test_te_expert_mlp_matches_torch_backend_bf16(activation, interleave, biases, with_probs):
    cfg, leaves, grad_out, d = _expert_case(activation, interleave, biases)
    ref = _run(cfg, leaves, grad_out, d, "loop", torch.float64, with_probs)
    got = _run(cfg, leaves, grad_out, d, "te", torch.bfloat16, with_probs)
    base = _run(cfg, leaves, grad_out, d, "torch", torch.bfloat16, with_probs)
    assert set(got) == set(ref) == set(base)
    assert not got["dfc1"][3].any() and not got["dfc2"][3].any()
    for name in ref:
        err, base_err = rel_err(got[name], ref[name]), rel_err(base[name], ref[name])
        print(f"{activation} il={interleave} bias={biases} probs={with_probs} {name}: te {err:.2e} torch {base_err:.2e}")
        assert err <= max(2 * base_err, 2 ** -8), (name, err, base_err)


@pytest.mark.parametrize("activation", ["swiglu", "quick_geglu"])
@pytest.mark.gpu
@needs_te
def test_te_deferred_wgrad_is_bitwise_the_immediate_one(activation):
    cfg, leaves, grad_out, d = _expert_case(activation, 0, True, seed=1)
    now = _run(cfg, leaves, grad_out, d, "te", torch.bfloat16, True)
    later = _run(cfg, leaves, grad_out, d, "te", torch.bfloat16, True, DeferredWgrad())
    assert set(now) == set(later)
    for name in now:
        assert torch.equal(now[name], later[name]), name


def test_registered_backend_runs_the_experts_of_every_layer_and_microbatch(monkeypatch):
    # The registry is how interop.te plugs in: a backend registered under a Plan name
    # gets every expert MLP call of the step (here one that counts and delegates).
    calls = []

    def counting_mlp(p, x_RD, segs, cfg, row_probs_R=None, deferred=None):
        calls.append(x_RD.shape)
        return expert_mlp(p, x_RD, segs, cfg, row_probs_R, "torch", deferred)

    checked = []
    monkeypatch.setitem(backends._registered, "te", ExpertBackend(counting_mlp, checked.append))
    model = fmoe.ModelConfig(vocab=32, dim=32, layers=3, heads=2, experts=4, topk=2, ffn=16)
    plan = fmoe.Plan(model=model, microbatches=2, expert_backend="te")
    params, batch = fmoe.init(plan, seed=0), {"tokens": torch.randint(0, 32, (4, 9))}
    got = fmoe.step(params, batch, plan)
    want = fmoe.step(params, batch, plan.replace(expert_backend="torch"))
    assert checked and all(c == plan for c in checked)  # before the compute: at init and at step
    assert len(calls) == 3 * 2, calls
    assert torch.equal(got.loss, want.loss)


@pytest.mark.gpu
@needs_te
def test_te_static_capacity_step_matches_torch_and_captures_bitwise():
    # A static capacity fixes TE's row splits (no host read), so the whole step also
    # captures; the graphed TE step replays bitwise the eager TE step.
    from interop.cuda_graph import capture_step

    model = fmoe.ModelConfig(vocab=64, dim=64, layers=2, heads=2, experts=4, topk=2, ffn=32, capacity_factor=1.25,
                             expert_biases=True, prob_placement="activation")
    plan = fmoe.Plan(model=model, microbatches=2, dtype="bfloat16", device="cuda", expert_backend="te")
    params = fmoe.init(plan, seed=0)
    batch = {"tokens": torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0)).cuda()}
    te_out = fmoe.step(params, batch, plan)
    base = fmoe.step(params, batch, plan.replace(expert_backend="torch"))
    ref = fmoe.step(params, batch, plan.replace(expert_backend="torch", dtype="float32"))
    for name in ("loss", "grads"):
        assert_same_structure(getattr(te_out, name), getattr(base, name), name)
        assert_same_structure(getattr(te_out, name), getattr(ref, name), name)
        for a, b, r in zip(optree.tree_leaves(getattr(te_out, name)), optree.tree_leaves(getattr(base, name)),
                           optree.tree_leaves(getattr(ref, name))):
            err, base_err = rel_err(a, r.double()), rel_err(b, r.double())
            assert err <= max(2 * base_err, 2 ** -8), (name, err, base_err)
    graphed = capture_step(params, batch, plan)
    replay = graphed(params, batch)
    assert torch.equal(replay.loss, te_out.loss)
    assert_trees_equal(replay.grads, te_out.grads)
