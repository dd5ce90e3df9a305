"""Fine-tuning batches: ``loss_mask`` and ``segments`` (packed documents) through the step."""

import optree
import pytest
import torch
import torch.nn.functional as F

import fmoe
from fmoe.layers import forward, lm_loss_sum, stack_stats
from fmoe.params import named_leaves

from . import reference as ref
from .reference import assert_trees_close

CFG = fmoe.ModelConfig(vocab=32, dim=32, layers=2, heads=2, experts=4, topk=2, ffn=16, shared_ffn=8,
                       expert_biases=True)
# no router losses: they average over every token of a row, padding included, so
# packed and separate rows would differ by design there
PLAIN = CFG.replace(aux_loss_coef=0.0, z_loss_coef=0.0)


def generator(seed):
    return torch.Generator().manual_seed(seed)


def fine_tuning_batch(B=4, S=12, vocab=32, seed=0):
    """Random ids, a random mask, and segments of random document lengths."""
    g = generator(seed)
    tokens = torch.randint(0, vocab, (B, S + 1), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.6
    cuts = (torch.rand(B, S + 1, generator=g) < 0.25).long()
    cuts[:, 0] = 0
    return {"tokens": tokens, "loss_mask": mask, "segments": cuts.cumsum(1) + 3}


def counted(batch):
    keep = batch.get("loss_mask", torch.ones(batch["tokens"][:, 1:].shape, dtype=torch.bool)).clone()
    if "segments" in batch:
        keep &= batch["segments"][:, :-1] == batch["segments"][:, 1:]
    return keep


def autograd_loss_and_grads(params, batch, cfg, loss=None):
    leaves = optree.tree_map(lambda t: t.detach().clone().requires_grad_(True), params)
    ce, stats = (loss or fmoe_loss)(leaves, batch, cfg)
    s = stack_stats(stats) if stats else None  # the reference returns no router stats
    n = int(counted(batch).sum())
    router = 0.0 if s is None else cfg.aux_loss_coef * s.aux_loss.sum() + cfg.z_loss_coef * s.z_loss.sum()
    (ce / n + router).backward()
    return (ce / n).detach(), optree.tree_map(lambda t: t.grad if t.grad is not None else torch.zeros_like(t), leaves)


def fmoe_loss(params, batch, cfg):
    from fmoe.batch import IGNORE
    targets = batch["tokens"][:, 1:].masked_fill(~counted(batch), IGNORE)
    docs = batch["segments"][:, :-1] if "segments" in batch else None
    return lm_loss_sum(params, batch["tokens"], cfg, targets_BS=targets, segments_BS=docs)


def reference_loss(params, batch, cfg):
    ce, aux, z = ref.lm_loss_sum(params, batch["tokens"], cfg, batch.get("loss_mask"), batch.get("segments"))
    return ce, []


def test_masked_packed_loss_and_grads_equal_the_float64_per_token_reference():
    params = ref.random_params(PLAIN, seed=1)  # float64
    batch = fine_tuning_batch(B=2, S=10)
    got_loss, got = autograd_loss_and_grads(params, batch, PLAIN)
    want_loss, want = autograd_loss_and_grads(params, batch, PLAIN, reference_loss)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=0)
    assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mb", [1, 2])
def test_step_with_mask_and_segments_equals_plain_autograd_bitwise(mb):
    cfg = CFG.replace(aux_loss_coef=0.1, z_loss_coef=0.01)
    params = ref.random_params(cfg, seed=1, dtype=torch.float32)
    batch = fine_tuning_batch()
    out = fmoe.step(params, batch, fmoe.Plan(model=cfg, microbatches=mb))
    if mb == 1:  # plain autograd on the whole batch: the same operations
        loss, grads = autograd_loss_and_grads(params, batch, cfg)
        torch.testing.assert_close(out.loss, loss, rtol=0, atol=0)
        assert_trees_close(out.grads, grads, rtol=0, atol=0)
    assert out.metrics["tokens"] == int(counted(batch).sum())
    one = fmoe.step(params, batch, fmoe.Plan(model=cfg))
    # the global mean, whatever the split (router losses average per microbatch: not compared)
    torch.testing.assert_close(out.loss, one.loss, rtol=1e-6, atol=0)


def test_loss_is_transformers_labels_minus_100_mean():
    params = ref.random_params(PLAIN, seed=2, dtype=torch.float32)
    g = generator(3)
    tokens = torch.randint(0, 32, (3, 9), generator=g)
    mask = torch.rand(3, 8, generator=g) < 0.5
    mask[0, 0] = True
    labels = tokens.clone()  # transformers' convention: labels aligned with inputs, shifted inside the loss
    labels[:, 1:][~mask] = -100
    logits, _ = forward(params, tokens[:, :-1], PLAIN)
    want = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    out = fmoe.step(params, {"tokens": tokens, "loss_mask": mask}, fmoe.Plan(model=PLAIN))
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=0)


def packed_and_separate(S=12, seed=0):
    """The same documents packed into rows with segments, and one per row (padded with
    masked-out ids)."""
    g = generator(seed)
    lengths = [[6, 7], [3, 4, 4, 2], [9, 4], [6, 6, 1]]  # each row S + 1 = 13 positions
    docs = [[torch.randint(0, 32, (n,), generator=g) for n in row] for row in lengths]
    tokens = torch.stack([torch.cat(row) for row in docs])
    segments = torch.stack([torch.cat([torch.full((len(d),), i) for i, d in enumerate(row)]) for row in docs])
    flat = [d for row in docs for d in row]
    sep_tokens = torch.zeros(len(flat), S + 1, dtype=torch.long)
    sep_mask = torch.zeros(len(flat), S, dtype=torch.bool)
    for i, d in enumerate(flat):
        sep_tokens[i, :len(d)] = d
        sep_tokens[i, len(d):] = torch.randint(0, 32, (S + 1 - len(d),), generator=g)
        sep_mask[i, :len(d) - 1] = True
    return {"tokens": tokens, "segments": segments}, {"tokens": sep_tokens, "loss_mask": sep_mask}


PACKED_PLANS = {
    "eager": dict(),
    "microbatches": dict(microbatches=2),
    "1f1b_overlap": dict(microbatches=2, schedule="1f1b_overlap", delay_wgrad=True),
    "remat_full": dict(microbatches=2, remat="full"),
    "remat_selective": dict(remat="selective"),
    "loss_chunk": dict(loss_chunk=5),
    "compiled": dict(compile=True),
}


@pytest.mark.parametrize("name", PACKED_PLANS)
def test_packed_documents_equal_the_same_documents_as_separate_rows(name):
    params = ref.random_params(PLAIN, seed=4, dtype=torch.float32)
    packed, separate = packed_and_separate()
    plan = fmoe.Plan(model=PLAIN, **PACKED_PLANS[name])
    got = fmoe.step(params, packed, plan)
    want = fmoe.step(params, separate, fmoe.Plan(model=PLAIN))
    assert got.metrics["tokens"] == want.metrics["tokens"] == sum(int(m.sum()) for m in separate["loss_mask"])
    # fp32; attention over a document's keys in another order (a masked row vs a shorter one)
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-6, atol=0)
    assert_trees_close(got.grads, want.grads, rtol=1e-4, atol=2e-6)


def test_schedules_give_bitwise_the_same_results_on_packed_rows():
    params = ref.random_params(PLAIN, seed=5, dtype=torch.float32)
    batch = fine_tuning_batch(B=4)
    standard = fmoe.step(params, batch, fmoe.Plan(model=PLAIN, microbatches=2))
    for changes in (dict(schedule="1f1b_overlap"), dict(delay_wgrad=True), dict(remat="full"),
                    dict(sharding="optim_grads_params")):
        other = fmoe.step(params, batch, fmoe.Plan(model=PLAIN, microbatches=2, **changes))
        assert torch.equal(other.loss, standard.loss), changes
        assert_trees_close(other.grads, standard.grads, rtol=0, atol=0)


def test_a_microbatch_with_no_counted_target_contributes_nothing():
    params = ref.random_params(PLAIN, seed=6, dtype=torch.float32)
    batch = fine_tuning_batch(B=4)
    batch["loss_mask"][:2] = False  # the first microbatch counts nothing
    out = fmoe.step(params, batch, fmoe.Plan(model=PLAIN, microbatches=2))
    rest = {k: v[2:] for k, v in batch.items()}
    alone = fmoe.step(params, rest, fmoe.Plan(model=PLAIN))
    torch.testing.assert_close(out.loss, alone.loss, rtol=1e-6, atol=0)
    assert torch.isfinite(out.loss) and out.metrics["tokens"] == alone.metrics["tokens"]
    assert_trees_close(out.grads, alone.grads, rtol=1e-4, atol=1e-6)


def test_eval_loss_and_module_count_the_same_targets():
    from interop.module import FMoEModule
    params = ref.random_params(PLAIN, seed=7, dtype=torch.float32)
    batch = fine_tuning_batch()
    plan = fmoe.Plan(model=PLAIN, microbatches=2)
    out = fmoe.step(params, batch, plan)
    torch.testing.assert_close(fmoe.eval_loss(params, batch, plan), out.loss, rtol=0, atol=0)
    module = FMoEModule(plan, params=optree.tree_map(torch.clone, params))
    value = module(batch)
    value.backward()
    torch.testing.assert_close(value.detach(), out.metrics["objective"], rtol=1e-6, atol=0)
    grads = {path: torch.zeros_like(p) if p.grad is None else p.grad  # expert_bias: no gradient
             for path, p in named_leaves(module.params()).items()}
    want = named_leaves(out.grads)
    assert grads.keys() == want.keys()
    for path in want:
        torch.testing.assert_close(grads[path], want[path], rtol=1e-5, atol=1e-7)


def test_a_plain_batch_gives_bitwise_what_it_gave_before_masks_existed():
    params = ref.random_params(CFG, seed=8, dtype=torch.float32)
    tokens = torch.randint(0, 32, (4, 13), generator=generator(9))
    plan = fmoe.Plan(model=CFG)
    plain = fmoe.step(params, {"tokens": tokens}, plan)
    everything = fmoe.step(params, {"tokens": tokens, "loss_mask": torch.ones(4, 12, dtype=torch.bool),
                                    "segments": torch.zeros(4, 13, dtype=torch.long)}, plan)
    # one document a row and every target counted: the same numbers (the exact path
    # differs only in how attention masks, which rounds alike on CPU for these sizes)
    torch.testing.assert_close(everything.loss, plain.loss, rtol=1e-6, atol=0)
    assert plain.metrics["tokens"] == everything.metrics["tokens"] == 48
