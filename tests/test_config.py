"""Bad configs, plans and batches raise ValueError naming the field and what is allowed."""

import pytest
import torch

import fmoe

BAD_MODELS = [
    (dict(activation="gelu"), "activation", "swiglu"),
    (dict(topk=9, experts=8), "topk", "<= experts"),
    (dict(dim=250, heads=4), "dim", "divisible by heads"),
    (dict(dim=12, heads=4), "heads", "even"),
    (dict(experts=0), "experts", ">= 1"),
    (dict(ffn=2.5), "ffn", "int"),
    (dict(layers=True), "layers", "int"),
    (dict(score_func="tanh"), "score_func", "sigmoid"),
    (dict(prob_placement="before"), "prob_placement", "activation"),
    (dict(pad_multiple=12), "pad_multiple", "256"),
    (dict(glu_interleave=3, ffn=512), "glu_interleave", "divide ffn"),
    (dict(glu_interleave=2, activation="relu2"), "glu_interleave", "non-GLU"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef", ">= 0"),
    (dict(glu_limit=0.0), "glu_limit", "> 0"),
    (dict(norm_topk_prob=1), "norm_topk_prob", "True or False"),
    (dict(expert_groups=3, experts=8), "expert_groups", "divide experts (8)"),
    (dict(expert_groups=0), "expert_groups", ">= 1"),
    (dict(expert_groups=8, experts=8), "expert_groups", "at least 2 experts a group"),
    (dict(topk_groups=2), "topk_groups", "<= expert_groups (1)"),
    (dict(topk_groups=0), "topk_groups", ">= 1"),
    (dict(expert_groups=4, topk_groups=1, topk=3, experts=8), "topk_groups", "fewer than topk (3)"),
    (dict(routed_scaling=0.0), "routed_scaling", "> 0"),
    (dict(routed_scaling=-1.0), "routed_scaling", "> 0"),
    (dict(rope_fraction=0.0), "rope_fraction", "> 0"),
    (dict(rope_fraction=1.5), "rope_fraction", "(0, 1]"),
    (dict(rope_fraction=0.3, dim=40, heads=4), "rope_fraction", "even, nonzero rope_dims"),
    (dict(rope_fraction=0.1, dim=32, heads=4), "rope_fraction", "even, nonzero rope_dims"),
]


@pytest.mark.parametrize("kwargs,field,allowed", BAD_MODELS, ids=[b[1] for b in BAD_MODELS])
def test_bad_model_config_names_field(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        fmoe.ModelConfig(**kwargs)
    assert f"ModelConfig.{field}=" in str(err.value) and allowed in str(err.value)


BAD_PLANS = [
    (dict(sharding="zero3"), "sharding", "optim_grads_params"),
    (dict(schedule="gpipe"), "schedule", "1f1b_overlap"),
    (dict(dtype="float16"), "dtype", "bfloat16"),
    (dict(microbatches=0), "microbatches", ">= 1"),
    (dict(dp=0), "dp", ">= 1"),
    (dict(ep=3), "ep", "divide model.experts"),
    (dict(expert_backend="cutlass"), "expert_backend", "loop"),
    (dict(delay_wgrad="yes"), "delay_wgrad", "True or False"),
    (dict(device="gpu0"), "device", "device string"),
    (dict(model={"dim": 8}), "model", "ModelConfig"),
    (dict(ep_exchange="experts"), "ep_exchange", "tokens"),
    (dict(ep_exchange="tokens", model=fmoe.ModelConfig(capacity_factor=1.5)), "ep_exchange", "capacity_factor=0"),
    (dict(ep_exchange="tokens", model=fmoe.ModelConfig(pad_multiple=16)), "ep_exchange", "pad_multiple=0"),
]


@pytest.mark.parametrize("kwargs,field,allowed", BAD_PLANS, ids=[b[1] for b in BAD_PLANS])
def test_bad_plan_names_field(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        fmoe.Plan(**kwargs)
    assert f"Plan.{field}=" in str(err.value) and allowed in str(err.value)


def test_contract_values_are_accepted():
    cfg = fmoe.ModelConfig(vocab=256, dim=256, layers=2, heads=4, experts=8, topk=2, ffn=512, activation="swiglu")
    for sharding in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        for schedule in ("standard", "1f1b_overlap"):
            fmoe.Plan(model=cfg, dp=1, ep=1, sharding=sharding, schedule=schedule, microbatches=2, dtype="float32",
                      delay_wgrad=True)


def small_plan(**kw):
    return fmoe.Plan(model=fmoe.ModelConfig(vocab=16, dim=16, heads=2, experts=4, ffn=8), **kw)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(dp=2), "world of 1"),
])
def test_plans_this_process_cannot_run_fail_before_compute(kwargs, needle):
    plan = small_plan(**kwargs)
    with pytest.raises(ValueError, match=needle):
        fmoe.init(plan, seed=0)
    params = fmoe.init(small_plan(), seed=0)
    with pytest.raises(ValueError, match=needle):
        fmoe.step(params, {"tokens": torch.zeros(2, 5, dtype=torch.long)}, plan)


@pytest.mark.parametrize("batch,needle", [
    ({"tokens": torch.zeros(3, 9, dtype=torch.long)}, "Plan.microbatches=2 does not divide"),
    ({"tokens": torch.zeros(4, 1, dtype=torch.long)}, "S\\+1 >= 2"),
    ({"tokens": torch.zeros(4, 9)}, "LongTensor"),
    ({"tokens": torch.full((4, 9), 16, dtype=torch.long)}, "allowed: 0..15"),
    ({"ids": torch.zeros(4, 9, dtype=torch.long)}, "'tokens'"),
])
def test_bad_batch_names_the_problem(batch, needle):
    plan = small_plan(microbatches=2)
    params = fmoe.init(plan, seed=0)
    with pytest.raises(ValueError, match=needle):
        fmoe.step(params, batch, plan)


def test_params_of_another_model_are_rejected():
    plan = small_plan()
    other = fmoe.init(fmoe.Plan(model=plan.model.replace(ffn=16)), seed=0)
    with pytest.raises(ValueError, match=r"layers.0.moe.experts.fc1.*shape"):
        fmoe.step(other, {"tokens": torch.zeros(2, 5, dtype=torch.long)}, plan)
    on_meta = dict(fmoe.init(plan, seed=0), head=torch.empty(16, 16, device="meta"))
    with pytest.raises(ValueError, match=r"params\['head'\] is on meta, but Plan.device='cpu'"):
        fmoe.step(on_meta, {"tokens": torch.zeros(2, 5, dtype=torch.long)}, plan)
    shared = fmoe.init(fmoe.Plan(model=plan.model.replace(shared_ffn=8)), seed=0)
    with pytest.raises(ValueError, match="differing leaves"):
        fmoe.step(shared, {"tokens": torch.zeros(2, 5, dtype=torch.long)}, plan)


FLOAT_FIELDS = [f.name for f in __import__("dataclasses").fields(fmoe.ModelConfig) if f.type == "float"]


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_float_field_refuses_nan_and_inf_by_name(name, value):
    if name == "glu_limit" and value == float("inf"):  # documented: no clamp
        assert fmoe.ModelConfig(glu_limit=value).glu_limit == value
        return
    with pytest.raises(ValueError, match=rf"ModelConfig\.{name}={value!r} is invalid: must be a finite number"):
        fmoe.ModelConfig(**{name: value})


def test_a_nan_expert_bias_rate_is_refused_by_update_expert_bias():
    params = fmoe.init(fmoe.Plan(model=fmoe.ModelConfig(vocab=32, dim=16, heads=2, experts=4, ffn=16)), seed=0)
    with pytest.raises(ValueError, match="update_expert_bias rate=nan is invalid: must be a finite number"):
        fmoe.update_expert_bias(params, torch.ones(2, 4, dtype=torch.long), float("nan"))
