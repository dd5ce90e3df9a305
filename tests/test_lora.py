"""Low-rank adapters (``fmoe.lora``, ``Plan.lora``): their layout, the merged weights against
the formula, the adapter step's loss and gradients against a float64 reference of the adapted
model, and every refusal naming its field."""

import math
from types import SimpleNamespace

import optree
import pytest
import torch

import fmoe
from fmoe.layers.adapted import Adapted
from fmoe.layers.experts import grouped_matmul
from fmoe.params import named_leaves
from fmoe.resolve import resolve
from fmoe.schedule import execute
from fmoe.step import check_batch, prepare_step
from interop.capturable import check_capturable
from interop.module import FMoEModule

from . import reference as ref
from .test_schedule import assert_same_step

F64 = torch.float64
# every kind of adapted matrix at once: fused qkv columns, out, per-expert fc1/fc2, the shared
# expert, and a dense layer's MLP
CFG = fmoe.ModelConfig(vocab=40, dim=32, layers=3, heads=4, kv_heads=2, experts=4, topk=2, ffn=16, shared_ffn=8,
                       dense_layers=(0,), dense_ffn=24)
EVERY = fmoe.LoRA(rank=3, alpha=6.0, targets=("q", "k", "v", "out", "experts", "shared", "mlp"))
MLA = fmoe.ModelConfig(vocab=40, dim=32, layers=2, heads=4, head_size=12, kv_lora_rank=16, q_lora_rank=8,
                       rope_head_dim=4, v_head_size=6, experts=4, topk=2, ffn=16)


def lora_batch():
    """A global batch of 4 rows with packed documents, the same in every process."""
    g = torch.Generator().manual_seed(12)
    tokens = torch.randint(0, CFG.vocab, (4, 9), generator=g)  # 8 positions: tp=4 splits them
    return {"tokens": tokens, "segments": (torch.rand(4, 9, generator=g) < 0.2).long().cumsum(1)}


def random_adapters(plan, seed: int, dtype=torch.float32):
    """``fmoe.lora.init``'s layout with every ``a`` and ``b`` random (a fresh ``b`` is zero)."""
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=dtype) * 0.3,
                           fmoe.lora.init(plan, seed=seed))


def merged_by_formula(base, adapters, plan):
    """Each adapted matrix ``W + (alpha / r) a @ b`` written out per target, in float64."""
    lora, out = plan.lora, optree.tree_map(lambda t: t.clone(), base)
    qkv_sizes = {"q": CFG.heads * CFG.head_dim, "k": CFG.num_kv_heads * CFG.head_dim}
    for i, layer in enumerate(adapters["layers"]):
        p = out["layers"][i]
        for name, ad in layer.get("attn", {}).items():
            delta = lora.scale * ad["a"] @ ad["b"]
            if name in ("q", "k", "v"):
                start = {"q": 0, "k": qkv_sizes["q"], "v": qkv_sizes["q"] + qkv_sizes["k"]}[name]
                p["attn"]["qkv"][:, start:start + delta.shape[1]] += delta
            else:
                p["attn"][name] += delta
        for group in ("experts", "shared"):
            for fc, ad in layer.get("moe", {}).get(group, {}).items():
                p["moe"][group][fc] += lora.scale * torch.einsum("...ir,...ro->...io", ad["a"], ad["b"])
        for fc, ad in layer.get("mlp", {}).items():
            p["mlp"][fc] += lora.scale * ad["a"] @ ad["b"]
    return out


def test_the_adapters_are_laid_out_as_the_design_says():
    plan = fmoe.Plan(model=CFG, lora=EVERY)
    adapters = fmoe.lora.init(plan, seed=0)
    shapes = {path: tuple(t.shape) for path, t in named_leaves(adapters).items()}
    D, r, qd, kvd = 32, 3, 4 * 8, 2 * 8
    assert shapes["layers.0.mlp.fc1.a"] == (D, r) and shapes["layers.0.mlp.fc1.b"] == (r, 2 * 24)
    assert shapes["layers.0.mlp.fc2.a"] == (24, r) and shapes["layers.0.mlp.fc2.b"] == (r, D)
    assert "layers.0.moe" not in "".join(shapes)  # a dense layer has no experts to adapt
    assert shapes["layers.1.attn.q.b"] == (r, qd) and shapes["layers.1.attn.k.b"] == (r, kvd)
    assert shapes["layers.1.attn.v.a"] == (D, r) and shapes["layers.1.attn.out.a"] == (qd, r)
    assert shapes["layers.2.moe.experts.fc1.a"] == (4, D, r) and shapes["layers.2.moe.experts.fc1.b"] == (4, r, 32)
    assert shapes["layers.2.moe.experts.fc2.a"] == (4, 16, r) and shapes["layers.2.moe.experts.fc2.b"] == (4, r, D)
    assert shapes["layers.2.moe.shared.fc1.b"] == (r, 16) and shapes["layers.2.moe.shared.fc2.a"] == (8, r)
    leaves = named_leaves(adapters)
    assert all(not t.any() for p, t in leaves.items() if p.endswith(".b"))
    assert all(t.abs().max() <= 1 / math.sqrt(t.shape[-2]) and t.std() > 0 for p, t in leaves.items()
               if p.endswith(".a"))
    again = fmoe.lora.init(plan, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(adapters), optree.tree_leaves(again)))
    other = fmoe.lora.init(plan, seed=1)
    assert not torch.equal(other["layers"][1]["attn"]["q"]["a"], adapters["layers"][1]["attn"]["q"]["a"])


def test_latent_attention_adapts_its_projections_by_their_names():
    latent = fmoe.LoRA(rank=2, alpha=2.0, targets=("q_down", "q_up", "kv_down", "kv_up", "out"))
    plan = fmoe.Plan(model=MLA, lora=latent)
    shapes = {p: tuple(t.shape) for p, t in named_leaves(fmoe.lora.init(plan)).items()}
    assert shapes["layers.0.attn.q_down.a"] == (32, 2) and shapes["layers.0.attn.q_up.b"] == (2, 48)
    assert shapes["layers.1.attn.kv_down.b"] == (2, 20) and shapes["layers.1.attn.kv_up.a"] == (16, 2)


def test_merge_is_the_formula_and_fresh_adapters_change_nothing():
    plan = fmoe.Plan(model=CFG, lora=EVERY)
    base = ref.random_params(CFG, seed=ref.seed_of_this_test())
    adapters = random_adapters(plan, seed=1, dtype=F64)
    merged = fmoe.lora.merge(base, adapters, plan)
    ref.assert_trees_close(merged, merged_by_formula(base, adapters, plan), rtol=1e-12, atol=1e-12)
    fresh = optree.tree_map(lambda t: t.double(), fmoe.lora.init(plan, seed=2))
    ref.assert_trees_equal(fmoe.lora.merge(base, fresh, plan), base)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_adapter_step_matches_the_float64_adapted_model(packed):
    plan = fmoe.Plan(model=CFG, lora=EVERY, microbatches=2)
    base = ref.random_params(CFG, seed=ref.seed_of_this_test(), dtype=torch.float32)
    adapters = random_adapters(plan, seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, CFG.vocab, (4, 10), generator=g)
    batch = {"tokens": tokens}
    seg = None
    if packed:
        seg = (torch.rand(4, 10, generator=g) < 0.2).long().cumsum(1)
        batch["segments"] = seg
    before = optree.tree_map(torch.clone, base)
    out = fmoe.step(adapters, batch, plan, base=base)
    ref.assert_trees_equal(base, before)  # the base is never written

    base64 = optree.tree_map(lambda t: t.double(), base)
    leaves, treedef = optree.tree_flatten(optree.tree_map(lambda t: t.double().requires_grad_(True), adapters))
    merged = merged_by_formula(base64, optree.tree_unflatten(treedef, leaves), plan)
    counted = tokens[:, 1:].numel() if seg is None else int((seg[:, :-1] == seg[:, 1:]).sum())
    loss = ref.lm_loss_sum(merged, tokens, CFG, segments_BS1=seg)[0] / counted
    want = optree.tree_unflatten(treedef, list(torch.autograd.grad(loss, leaves)))
    torch.testing.assert_close(out.loss.double(), loss.detach(), rtol=1e-5, atol=1e-6)
    assert optree.tree_structure(out.grads) == optree.tree_structure(adapters)
    ref.assert_trees_close(out.grads, optree.tree_map(torch.Tensor.float, want), rtol=1e-4, atol=1e-5)


def test_the_adapter_step_is_bitwise_the_same_under_the_overlap_schedule_and_remat():
    plan = fmoe.Plan(model=CFG, lora=EVERY, microbatches=2)
    base = ref.random_params(CFG, seed=5, dtype=torch.float32)
    adapters = random_adapters(plan, seed=6)
    batch = {"tokens": torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(7))}
    want = fmoe.step(adapters, batch, plan, base=base)
    for changes in (dict(schedule="1f1b_overlap", remat="full"), dict(schedule="1f1b_overlap", delay_wgrad=True)):
        assert_same_step(fmoe.step(adapters, batch, plan.replace(**changes), base=base), want)


@pytest.mark.parametrize("rank", [4, 3], ids=["grouped_gemm", "per_expert_loop"])
def test_an_adapted_grouped_product_is_the_per_expert_formula(rank):
    """``grouped_matmul`` of an ``Adapted`` weight: ``x_e @ w_e + s (x_e @ a_e) @ b_e`` per
    expert segment (an empty one among them), forward and every gradient, against float64;
    rank 4 runs ``torch._grouped_mm``, rank 3 (widths it does not take) one product per expert."""
    g = torch.Generator().manual_seed(22)
    E, D, N, rows, scale = 3, 32, 24, torch.tensor([5, 0, 7]), 1.5
    x, w = torch.randn(12, D, generator=g), torch.randn(E, D, N, generator=g)
    a, b = torch.randn(E, D, rank, generator=g), torch.randn(E, rank, N, generator=g)
    seed = torch.randn(12, N, generator=g)
    segs = SimpleNamespace(rows_E=rows, offsets_E=rows.cumsum(0).int(), row_expert_R=torch.repeat_interleave(
        torch.arange(E), rows))
    x_, a_, b_ = (t.clone().requires_grad_(True) for t in (x, a, b))
    y = grouped_matmul(x_, Adapted(w, a_, b_, scale), segs)
    got = torch.autograd.grad(y, (x_, a_, b_), seed)
    x64, a64, b64 = (t.double().requires_grad_(True) for t in (x, a, b))
    want_y = torch.cat([xe @ w[e].double() + scale * (xe @ a64[e]) @ b64[e]
                        for e, xe in enumerate(x64.split(rows.tolist()))])
    want = torch.autograd.grad(want_y, (x64, a64, b64), seed.double())
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-4)
    for name, u, v in zip("xab", got, want):
        torch.testing.assert_close(u.double(), v, rtol=1e-5, atol=1e-4, msg=lambda m, name=name: f"grad {name}: {m}")


def test_the_products_inside_the_layers_match_the_merged_weights_and_the_base_takes_no_gradient():
    """The step runs ``x @ W + s (x @ a) @ b`` inside the layers; ``fmoe.lora.adapter_grads``
    runs it through the merged weights and the chain rule (the reference path). The same
    model, two orders of fp32 additions. The frozen base's lifecycle holds no gradient
    buffer and sums nothing."""
    plan = fmoe.Plan(model=CFG, lora=EVERY, microbatches=2)
    base = ref.random_params(CFG, seed=ref.seed_of_this_test(), dtype=torch.float32)
    adapters = random_adapters(plan, seed=14)
    batch = lora_batch()
    out = fmoe.step(adapters, batch, plan, base=base)
    merged, want = fmoe.lora.adapter_grads(base, adapters, plan,
                                           lambda params: fmoe.step(params, batch, plan.replace(lora=None)))
    torch.testing.assert_close(out.loss, merged.loss, rtol=1e-6, atol=1e-7)
    ref.assert_trees_close(out.grads, want, rtol=1e-4, atol_of_scale=2e-5)

    setup = resolve(plan)
    run = execute(setup, named_leaves(base), check_batch(batch, plan), 32, adapters=named_leaves(adapters))
    assert set(run.grads) == set(named_leaves(adapters))
    assert all(u.grad_full is None and u.grad_shard is None for u in run.state.units.values())


def test_a_base_held_in_the_compute_dtype_is_taken_and_anything_else_named():
    plan = fmoe.Plan(model=CFG, lora=EVERY, dtype="bfloat16")
    base = ref.random_params(CFG, seed=15, dtype=torch.float32)
    adapters = random_adapters(plan, seed=16)
    batch = lora_batch()
    half = optree.tree_map(lambda t: t.to(torch.bfloat16), base)
    out = fmoe.step(adapters, batch, plan, base=half)
    # the bf16 step reads bf16 weights either way; the fp32 base is cast at the step's start
    assert_same_step(out, fmoe.step(adapters, batch, plan, base=optree.tree_map(torch.Tensor.float, half)))
    with pytest.raises(ValueError, match=r"dtype torch.float16; params are float32 or the compute dtype"):
        fmoe.step(adapters, batch, plan, base=optree.tree_map(lambda t: t.half(), base))
    with pytest.raises(ValueError, match=r"adapters layers.0.attn.q.a is torch.float64 on cpu: adapters are float32"):
        fmoe.step(optree.tree_map(torch.Tensor.double, adapters), batch, plan, base=half)


def test_a_frozen_base_laid_out_once_gives_the_same_steps():
    plan = fmoe.Plan(model=CFG, lora=EVERY, microbatches=2)
    base = ref.random_params(CFG, seed=20, dtype=torch.float32)
    adapters = random_adapters(plan, seed=21)
    batch = lora_batch()
    frozen = fmoe.lora.freeze(base, plan)
    for _ in range(2):  # the shards are read, never written: the second step reads the same
        assert_same_step(fmoe.step(adapters, batch, plan, base=frozen), fmoe.step(adapters, batch, plan, base=base))
    assert torch.equal(fmoe.eval_loss(adapters, batch, plan, base=frozen),
                       fmoe.eval_loss(adapters, batch, plan, base=base))
    with pytest.raises(ValueError, match="FrozenBase laid out for another plan"):
        fmoe.step(adapters, batch, plan.replace(microbatches=1), base=frozen)
    with pytest.raises(ValueError, match="Plan.lora=None"):
        fmoe.lora.freeze(base, plan.replace(lora=None))


def test_sgd_on_the_adapters_lowers_the_loss_and_leaves_the_base():
    plan = fmoe.Plan(model=CFG, lora=EVERY)
    base = ref.random_params(CFG, seed=8, dtype=torch.float32)
    adapters = fmoe.lora.init(plan, seed=9)
    batch = {"tokens": torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(10))}
    first = fmoe.step(adapters, batch, plan, base=base)
    for _ in range(5):
        out = fmoe.step(adapters, batch, plan, base=base)
        adapters = optree.tree_map(lambda w, g: w - 0.5 * g, adapters, out.grads)
    assert fmoe.step(adapters, batch, plan, base=base).loss < first.loss
    plain = fmoe.step(base, batch, plan.replace(lora=None))
    assert torch.equal(first.loss, plain.loss)  # fresh adapters: b is zero, the base model's loss
    merged = fmoe.lora.merge(base, adapters, plan)
    assert torch.equal(fmoe.eval_loss(adapters, batch, plan, base=base),
                       fmoe.eval_loss(merged, batch, plan.replace(lora=None)))
    with pytest.raises(ValueError, match="pass them as base="):
        fmoe.eval_loss(adapters, batch, plan)


@pytest.mark.parametrize("changes, field", [
    (dict(rank=0), "LoRA.rank"), (dict(rank=2.0), "LoRA.rank"), (dict(rank=True), "LoRA.rank"),
    (dict(alpha=0.0), "LoRA.alpha"), (dict(alpha=math.inf), "LoRA.alpha"), (dict(alpha="8"), "LoRA.alpha"),
    (dict(targets=("q", "wq")), "LoRA.targets"), (dict(targets=("q", "q")), "LoRA.targets"),
    (dict(targets=()), "LoRA.targets"), (dict(targets="q"), "LoRA.targets"),
])
def test_bad_adapter_settings_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"{field}="):
        fmoe.LoRA(**changes)


@pytest.mark.parametrize("cfg, targets, missing", [
    (CFG.replace(shared_ffn=0), ("q", "shared"), "'shared'"),
    (CFG.replace(dense_layers=(), dense_ffn=0), ("mlp",), "'mlp'"),
    (CFG, ("q_down",), "'q_down'"),
    (MLA, ("k", "v"), "'k', 'v'"),
])
def test_a_target_the_model_does_not_have_is_refused_before_any_compute(cfg, targets, missing):
    plan = fmoe.Plan(model=cfg, lora=fmoe.LoRA(rank=2, targets=targets))
    with pytest.raises(ValueError, match=f"LoRA.targets=.*has no {missing}"):
        fmoe.lora.init(plan)


def test_the_step_refuses_what_it_cannot_run_naming_the_field():
    plan = fmoe.Plan(model=CFG, lora=EVERY)
    base = ref.random_params(CFG, seed=0, dtype=torch.float32)
    adapters = fmoe.lora.init(plan)
    batch = {"tokens": torch.randint(0, CFG.vocab, (2, 9))}
    with pytest.raises(ValueError, match="pass them as base="):
        fmoe.step(adapters, batch, plan)
    with pytest.raises(ValueError, match="Plan.lora is None"):
        fmoe.step(adapters, batch, plan.replace(lora=None), base=base)
    with pytest.raises(ValueError, match="Plan.lora="):
        fmoe.Plan(model=CFG, lora={"rank": 4})
    with pytest.raises(ValueError, match="pass them as base="):
        prepare_step(adapters, batch, plan)  # what interop's graphed step runs
    with pytest.raises(ValueError, match=r"scopes=\['attn'\] is invalid under Plan.lora: .*allowed: 'step'"):
        check_capturable(plan, ("attn",))
    check_capturable(plan.replace(dtype="bfloat16", device="cuda"), ("step",))  # the whole step is capturable
    with pytest.raises(ValueError, match="Plan.expert_backend='te' is invalid under Plan.lora"):
        fmoe.step(adapters, batch, plan.replace(expert_backend="te"), base=base)
    with pytest.raises(ValueError, match="Plan.lora is invalid for FMoEModule"):
        FMoEModule(plan, params=base)
    missing = optree.tree_map(lambda t: t, adapters)
    del missing["layers"][1]["attn"]["k"]
    with pytest.raises(ValueError, match="no adapter at layers.1.attn.k"):
        fmoe.step(missing, batch, plan, base=base)
    cut = optree.tree_map(lambda t: t, base)
    cut["layers"][1]["attn"]["qkv"] = cut["layers"][1]["attn"]["qkv"][:16]
    with pytest.raises(ValueError, match=r"base layers.1.attn.qkv is \(16, 64\): this rank holds \(32, 64\)"):
        fmoe.lora.merge(cut, adapters, plan)
    wrong = optree.tree_map(lambda t: t, adapters)
    wrong["layers"][1]["attn"]["q"]["a"] = torch.zeros(32, 5)
    with pytest.raises(ValueError, match=r"layers.1.attn.q.a is \(32, 5\): expected \(32, 3\)"):
        fmoe.step(wrong, batch, plan, base=base)


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimizer_state_of_the_full_model_is_refused_for_adapters(fused):
    """The optimizer's state must mirror the tree it updates: the model's state handed the
    adapters (or the reverse) is refused before any update, not an optree error deep inside."""
    plan = fmoe.Plan(model=CFG, lora=EVERY)
    base = ref.random_params(CFG, seed=0, dtype=torch.float32)
    adapters = fmoe.lora.init(plan)
    out = fmoe.step(adapters, lora_batch(), plan, base=base)
    opt = fmoe.adamw(1e-3, fused=fused)
    with pytest.raises(ValueError, match=r"opt_state's moments mirror a tree of \d+ leaves, but the params updated "
                                         r"have \d+ .*opt\.init\(params\)"):
        opt.update(out.grads, opt.init(base), adapters)
    opt.update(out.grads, opt.init(adapters), adapters)  # the adapters' own state is fine


def _cuda_case(dtype: str, changes: dict):
    """A step of the adapters on CUDA and the merged weights' step of the same model, with a
    base drawn as ``fmoe.init`` draws it and adapters of the same scale."""
    cfg = CFG.replace(dim=64, ffn=32, shared_ffn=16, dense_ffn=48)  # widths torch's grouped GEMM takes
    plan = fmoe.Plan(model=cfg, lora=fmoe.LoRA(rank=8, alpha=16.0, targets=EVERY.targets), microbatches=2,
                     dtype=dtype, device="cuda")
    base = fmoe.init(plan, seed=17)
    g = torch.Generator().manual_seed(18)
    adapters = optree.tree_map(lambda t: (torch.randn(t.shape, generator=g) * 0.05).cuda(), fmoe.lora.init(plan))
    batch = {"tokens": torch.randint(0, cfg.vocab, (4, 65), generator=g).cuda()}
    merged, want = fmoe.lora.adapter_grads(base, adapters, plan,
                                           lambda params: fmoe.step(params, batch, plan.replace(lora=None)))
    held = base if dtype == "float32" else optree.tree_map(lambda t: t.to(torch.bfloat16), base)
    return fmoe.step(adapters, batch, plan.replace(**changes), base=held), merged._replace(grads=want)


def _worst(a, b) -> float:
    """The largest difference of two trees' leaves as a fraction of each leaf's largest magnitude in ``b``."""
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


@pytest.mark.gpu
@pytest.mark.parametrize("changes", [dict(), dict(compile=True)], ids=["eager", "compiled"])
def test_the_fp32_adapter_step_on_the_gpu_matches_the_merged_weights(changes):
    """CUDA's kernels (SDPA, the Triton RoPE and SwiGLU, torch's grouped GEMM) in fp32: the
    products inside the layers against the merged weights, to fp32 reassociation."""
    out, merged = _cuda_case("float32", changes)
    torch.testing.assert_close(out.loss, merged.loss, rtol=1e-5, atol=0)
    ref.assert_trees_close(out.grads, merged.grads, rtol=0, atol_of_scale=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("changes", [dict(), dict(compile=True), dict(fp8="rowwise"), dict(compile=True, remat="full")],
                         ids=["eager", "compiled", "fp8", "compiled_remat"])
def test_the_bf16_adapter_step_on_the_gpu_is_as_close_to_fp32_as_the_merged_weights(changes):
    """bf16 rounds each product to 8 bits of mantissa, and the two paths round different sums,
    so neither is bit for bit the fp32 step: the adapter step (a bf16 base; eager, compiled,
    FP8 base products, remat) must be as close to the fp32 step as the merged weights' bf16
    step is, within twice its error (FP8: three bits of mantissa in the base's products,
    four times)."""
    exact, _ = _cuda_case("float32", {})
    out, merged = _cuda_case("bfloat16", changes)
    bound = (4 if "fp8" in changes else 2) * _worst(merged.grads, exact.grads) + 1e-3
    assert _worst(out.grads, exact.grads) <= bound, (_worst(out.grads, exact.grads), bound)
    torch.testing.assert_close(out.loss, exact.loss, rtol=2e-2, atol=0)
