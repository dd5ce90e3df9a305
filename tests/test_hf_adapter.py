"""fmoe.hf.save_adapter against PEFT: adapters trained in fmoe, saved in PEFT's layout and
loaded with ``peft.PeftModel.from_pretrained`` onto the transformers model, compute fmoe's
logits; the loss, the adapters' gradients and one SGD step are PEFT's."""

import json

import optree
import pytest
import torch

import fmoe
from fmoe.hf.adapter import CONFIG_FILE, WEIGHTS_FILE, peft_tensors
from fmoe.layers import forward

from .test_hf import FAMILIES, LOGIT_TOL, hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if int(transformers.__version__.split(".")[0]) < 5:  # the experts as one fused parameter, as PEFT's format has them
    pytest.skip(f"fmoe.hf.save_adapter writes transformers 5's fused experts (target_parameters); transformers "
                f"{transformers.__version__} holds them as separate modules, which PEFT adapts otherwise",
                allow_module_level=True)

# every target each family holds that PEFT loads: its attention's projections, the experts, a shared
# expert (Qwen2-MoE's; GLM-4.5's and DeepSeek-V3's shared and dense modules are refused, see below)
ATTENTION = ("q", "k", "v", "out")
LATENT = ("q_down", "q_up", "kv_down", "kv_up", "out")
TARGETS = {"mixtral": ATTENTION + ("experts",), "qwen3_moe": ATTENTION + ("experts",),
           "olmoe": ATTENTION + ("experts",), "qwen2_moe": ATTENTION + ("experts", "shared"),
           "glm4_moe": ATTENTION + ("experts",), "deepseek_v3": LATENT + ("experts",),
           "gpt_oss": ATTENTION + ("experts",)}
# fp32 on both sides: summation order (PEFT adds (x @ A.T) @ B.T to the base's product,
# fmoe's reference path multiplies by the merged weight) moves the gradients' last bits
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


def trained_adapters(plan, seed):
    """Adapters as after training: ``b`` random too (a fresh one is zero, which would leave
    every ``b``-side mapping untested)."""
    adapters = fmoe.lora.init(plan, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return optree.tree_map_with_path(
        lambda path, t: torch.randn(t.shape, generator=g) * 0.2 if path[-1] == "b" else t, adapters)


def setup(family, tmp_path, rank=4, alpha=8.0, targets=None):
    model = hf_model(family)
    model.save_pretrained(tmp_path / "base")
    cfg = fmoe.hf.config(tmp_path / "base")
    plan = fmoe.Plan(model=cfg, lora=fmoe.LoRA(rank=rank, alpha=alpha, targets=targets or TARGETS[family]))
    base = fmoe.hf.load(tmp_path / "base", fmoe.Plan(model=cfg))
    return model, plan, base


def peft_model(family, tmp_path, adapter_dir):
    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "base").eval()
    return peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True).eval()


def lora_grads(model) -> dict:
    """PEFT's adapter gradients, named as in its saved file."""
    return {name.replace(".default", ""): p.grad for name, p in model.named_parameters() if "lora_" in name}


def tokens_for(seed):
    return torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_loads_the_adapter_onto_transformers_with_fmoes_logits(family, tmp_path):
    model, plan, base = setup(family, tmp_path)
    adapters = trained_adapters(plan, seed=3)
    fmoe.hf.save_adapter(tmp_path / "adapter", adapters, plan, source=tmp_path / "base")
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_parameters"] == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                           for p in ("down_proj", "gate_up_proj") if not plan.model.is_dense(i)]
    tokens = tokens_for(1)
    theirs = peft_model(family, tmp_path, tmp_path / "adapter")
    with torch.no_grad():
        mine = forward(fmoe.lora.merge(base, adapters, plan), tokens, plan.model)[0]
        plain = model(tokens).logits
        torch.testing.assert_close(mine, theirs(tokens).logits, **LOGIT_TOL)
    assert (mine - plain).abs().max() > 1e-2  # the adapter moved the logits: the comparison saw it


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_the_loss_gradients_and_an_sgd_step_are_peft_s(family, tmp_path):
    """One training step on both sides from the same adapters: the same loss, PEFT's
    gradient for each of its tensors, and after ``a -= lr * grad`` the same logits."""
    _, plan, base = setup(family, tmp_path)
    adapters = trained_adapters(plan, seed=5)
    fmoe.hf.save_adapter(tmp_path / "adapter", adapters, plan)
    tokens, lr = tokens_for(2), 0.5
    out = fmoe.step(adapters, {"tokens": tokens}, plan, base=base)
    theirs = peft_model(family, tmp_path, tmp_path / "adapter")
    loss = theirs(tokens, labels=tokens).loss
    loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), **LOGIT_TOL)
    mine_grads, _, _ = peft_tensors(out.grads, plan)
    their_grads = lora_grads(theirs)
    assert mine_grads.keys() == their_grads.keys()
    for key, grad in their_grads.items():
        torch.testing.assert_close(mine_grads[key], grad, **GRAD_TOL, msg=key)

    stepped = optree.tree_map(lambda t, g: t - lr * g, adapters, out.grads)
    fmoe.hf.save_adapter(tmp_path / "stepped", stepped, plan)
    with torch.no_grad():
        for p in theirs.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
        probe = tokens[:, :-1].flip(0)
        after = peft_model(family, tmp_path, tmp_path / "stepped")
        torch.testing.assert_close(after(probe).logits, theirs(probe).logits, **LOGIT_TOL)


def test_save_adapter_replaces_only_an_adapter_folder_and_checks_the_adapters_first(tmp_path):
    _, plan, base = setup("qwen3_moe", tmp_path)
    adapters = trained_adapters(plan, seed=0)
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        fmoe.hf.save_adapter(tmp_path / "base", adapters, plan)
    assert (tmp_path / "base" / "config.json").is_file()
    out = fmoe.hf.save_adapter(tmp_path / "adapter", adapters, plan)
    first = (out / WEIGHTS_FILE).read_bytes()
    fmoe.hf.save_adapter(out, trained_adapters(plan, seed=1), plan)  # an adapter folder is replaced
    assert (out / WEIGHTS_FILE).read_bytes() != first
    del adapters["layers"][0]["attn"]["q"]
    with pytest.raises(ValueError, match=r"no adapter at layers\.0\.attn\.q"):
        fmoe.hf.save_adapter(tmp_path / "other", adapters, plan)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("target", ["shared", "mlp"])
def test_adapters_peft_would_load_onto_the_experts_are_refused_before_writing(family, target, tmp_path):
    """PEFT moves these families' gate_proj / up_proj / down_proj targets onto the routed
    experts (reading them as Qwen2-MoE's v4 layout), so a shared expert's or a dense layer's
    adapter would silently be lost on load: refused, naming LoRA.targets and the way out."""
    _, plan, _ = setup(family, tmp_path, targets=("experts", target))
    with pytest.raises(ValueError, match=r"LoRA\.targets.*fmoe\.lora\.merge"):
        fmoe.hf.save_adapter(tmp_path / "adapter", fmoe.lora.init(plan), plan)
    assert not (tmp_path / "adapter").exists()


def test_the_families_peft_remaps_are_transformers_own():
    """fmoe's list of the families whose mlp modules PEFT remaps is transformers' (a newer
    transformers that adds or drops one fails here, not in a user's load)."""
    mapping = pytest.importorskip("transformers.conversion_mapping")
    from fmoe.hf.adapter import PEFT_MOVES_MLP_MODULES
    remapped = {f for f in FAMILIES if mapping._MODEL_TO_CONVERSION_PATTERN.get(f) == "qwen2_moe"}
    assert remapped == set(PEFT_MOVES_MLP_MODULES)
