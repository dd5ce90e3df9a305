"""``fmoe.load(path)`` with no plan: the saved config and the full params (and optimizer
state), read by one process without a process group (and without using one where there
is one); docs/checkpoints.md's lines that get logits from a checkpoint run as written."""

import re
from pathlib import Path

import optree
import torch
import torch.nn.functional as F

import fmoe

from .ranks.harness import run_ranks
from .reference import assert_trees_equal

ROOT = Path(__file__).resolve().parents[1]
CFG = fmoe.ModelConfig(vocab=64, dim=32, layers=2, heads=2, experts=4, topk=2, ffn=16)


def saved(path, plan=None, steps=1):
    """A checkpoint of a model trained ``steps`` steps at ``path``: its params and state."""
    plan = plan or fmoe.Plan(model=CFG, microbatches=1)
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-2, max_grad_norm=1.0)
    state = opt.init(params)
    for _ in range(steps):
        out = fmoe.step(params, {"tokens": torch.randint(0, CFG.vocab, (2, 9))}, plan)
        params, state = opt.update(out.grads, state, params)
    fmoe.save(path, plan, params, opt_state=state, step=steps, extra={"data": 7})
    return params, state


def test_load_without_a_plan_gives_the_config_and_the_full_params(tmp_path):
    params, state = saved(tmp_path / "ck")
    ck = fmoe.load(tmp_path / "ck")
    assert ck.config == CFG and isinstance(ck.config, fmoe.ModelConfig)
    assert_trees_equal(ck.params, params)
    assert_trees_equal(ck.opt_state, state)
    # the fields that were there keep their places; config is the new last one
    assert ck[:4] == (ck.params, ck.opt_state, 1, {"data": 7}) and ck._fields[-1] == "config"
    assert {t.device.type for t in optree.tree_leaves(ck.params)} == {"cpu"}
    # with a plan, config comes too
    assert fmoe.load(tmp_path / "ck", fmoe.Plan(model=CFG)).config == CFG


def _load_alone(rank, world, path):
    # rank 1 reads the checkpoint while rank 0 does nothing: a collective would wait for ever
    if rank == 0:
        return None
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == world
    ck = fmoe.load(path)
    return {k: t.clone() for k, t in fmoe.params.named_leaves(ck.params).items()}


def test_load_without_a_plan_uses_no_process_group_where_there_is_one(tmp_path):
    params, _ = saved(tmp_path / "ck")
    _, alone = run_ranks(2, _load_alone, str(tmp_path / "ck"), timeout=120)
    assert_trees_equal(alone, fmoe.params.named_leaves(params))


def readme_logits_snippet() -> str:
    section = (ROOT / "docs" / "checkpoints.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)\n```", section, flags=re.S) if "fmoe.load(" in b]
    assert len(blocks) == 1, "docs/checkpoints.md shows one block that loads a checkpoint"
    return blocks[0]


def test_readmes_lines_get_the_logits_of_a_checkpoint(tmp_path, monkeypatch):
    params, _ = saved(tmp_path / "ckpt", steps=2)
    monkeypatch.chdir(tmp_path)
    scope = {"fmoe": fmoe, "torch": torch}
    exec(readme_logits_snippet(), scope)
    tokens, logits = scope["tokens"], scope["logits"]
    assert logits.shape == (*tokens.shape, CFG.vocab) and not logits.requires_grad
    # they are the model's: their next-token cross-entropy is the loss fmoe.step reports
    plan = fmoe.Plan(model=CFG, microbatches=1)
    want = fmoe.step(params, {"tokens": tokens}, plan).loss
    got = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
