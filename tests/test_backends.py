"""Expert backends by name: the core knows ``torch`` and ``loop``; ``Plan.expert_backend``
takes any name registered in this process or declared by an installed package."""

import pytest
import torch

import fmoe
import fmoe.backends as backends
from fmoe.layers import ExpertBackend, expert_mlp

MODEL = fmoe.ModelConfig(vocab=32, dim=32, layers=2, heads=2, experts=4, topk=2, ffn=16)


def delegating(calls):
    def mlp(p, x_RD, segs, cfg, row_probs_R=None, deferred=None):
        calls.append(x_RD.shape)
        return expert_mlp(p, x_RD, segs, cfg, row_probs_R, "loop", deferred)
    return ExpertBackend(mlp, lambda plan: None)


def test_a_name_is_refused_until_registered_then_its_backend_runs_every_expert_mlp(monkeypatch):
    monkeypatch.setattr(backends, "_registered", dict(backends._registered))
    with pytest.raises(ValueError, match=r"Plan.expert_backend='mine' is invalid: allowed: 'torch', 'loop'"):
        fmoe.Plan(model=MODEL, expert_backend="mine")
    calls = []
    backends.register_expert_backend("mine", delegating(calls))
    assert "mine" in backends.expert_backend_names()
    plan = fmoe.Plan(model=MODEL, microbatches=2, expert_backend="mine")
    params, batch = fmoe.init(plan, seed=0), {"tokens": torch.randint(0, 32, (4, 9))}
    got = fmoe.step(params, batch, plan)
    assert len(calls) == MODEL.layers * 2
    assert torch.equal(got.loss, fmoe.step(params, batch, plan.replace(expert_backend="loop")).loss)


@pytest.mark.parametrize("name", ["torch", "loop", "", 3])
def test_the_built_in_names_cannot_be_registered_over(name):
    with pytest.raises(ValueError, match=r"register_expert_backend name=.* must be a non-empty string other than 'torch' and 'loop'"):
        backends.register_expert_backend(name, delegating([]))


def test_the_core_lists_only_its_own_backends_and_te_comes_from_the_entry_point(monkeypatch):
    from importlib.metadata import entry_points

    assert backends.BUILT_IN == ("torch", "loop")
    # pyproject.toml's entry point (the test command installs fmoe, so its metadata is there)
    assert {ep.name: ep.value for ep in entry_points(group=backends.ENTRY_POINT_GROUP)} == {"te": "interop.te"}
    monkeypatch.setattr(backends, "_registered", {})
    monkeypatch.setattr(backends, "_declared", {})  # a process where no package declares te
    with pytest.raises(ValueError, match=r"Plan.expert_backend='te' is invalid: allowed: 'torch', 'loop'$"):
        fmoe.Plan(model=MODEL, expert_backend="te")


def test_a_declared_backend_not_yet_imported_is_named_by_its_module_before_any_compute(monkeypatch):
    monkeypatch.setattr(backends, "_registered", {})
    monkeypatch.setattr(backends, "_declared", {"fast": "somepkg.fast_experts"})
    plan = fmoe.Plan(model=MODEL, expert_backend="fast")
    with pytest.raises(ValueError, match=r"expert_backend='fast' is provided by somepkg.fast_experts, which is not "
                                         r"loaded: import the module somepkg.fast_experts before the first step"):
        fmoe.step(fmoe.init(plan.replace(expert_backend="torch")), {"tokens": torch.zeros(2, 5, dtype=torch.long)},
                  plan)


def test_declaring_a_name_lets_a_plan_use_it_before_its_module_registers_it(monkeypatch):
    monkeypatch.setattr(backends, "_registered", {})
    monkeypatch.setattr(backends, "_declared", {})
    with pytest.raises(ValueError, match=r"Plan.expert_backend='later' is invalid"):
        fmoe.Plan(model=MODEL, expert_backend="later")
    backends.declare_expert_backend("later", "somepkg.later")
    assert fmoe.Plan(model=MODEL, expert_backend="later").expert_backend == "later"
    with pytest.raises(ValueError, match=r"declare_expert_backend name='loop' is invalid"):
        backends.declare_expert_backend("loop", "somepkg.loop")


def test_importing_the_adapters_declares_te(monkeypatch):
    import importlib

    import interop

    monkeypatch.setattr(backends, "_declared", {})  # a source tree: no installed entry points
    importlib.reload(interop)
    assert backends.declared_backends() == {"te": "interop.te"}


def test_a_declaration_needs_a_module_name():
    with pytest.raises(ValueError, match=r"declare_expert_backend module='' is invalid: must be a dotted module name"):
        backends.declare_expert_backend("x", "")


def test_the_main_jobs_name_a_mistyped_backend_and_import_a_declared_one(monkeypatch, tmp_path):
    import sys

    from fmoe.trainer.setup import load_expert_backend

    with pytest.raises(ValueError, match=r"--expert-backend='tee' is invalid: allowed: 'torch', 'loop', .*'te'"):
        load_expert_backend("tee", None)
    # a backend another package declares is imported by both main jobs, adapters or not
    (tmp_path / "outside_backend.py").write_text(
        "import fmoe.backends as b\n"
        "b.register_expert_backend('outside', b.ExpertBackend(None, lambda plan: None))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backends, "_registered", dict(backends._registered))
    monkeypatch.setattr(backends, "_declared", dict(backends._declarations(), outside="outside_backend"))
    load_expert_backend("outside", None)
    assert backends.registered_backend("outside") is not None and "outside_backend" in sys.modules
    monkeypatch.delitem(sys.modules, "outside_backend")
