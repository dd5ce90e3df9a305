"""fmoe.local_batch: each rank's rows of a global batch (its multi-rank use, against one
process, is tests/ranks's fine-tuning feature)."""

import pytest
import torch

import fmoe

from .test_finetune import PLAIN, fine_tuning_batch


def test_the_ranks_blocks_in_rank_order_are_the_global_batch():
    plan = fmoe.Plan(model=PLAIN, dp=2, ep=2)
    batch = fine_tuning_batch(B=8, seed=11)
    parts = [fmoe.local_batch(batch, plan, r) for r in range(plan.world)]
    for key, value in batch.items():
        assert all(p[key].shape[0] == 2 for p in parts)
        assert torch.equal(torch.cat([p[key] for p in parts]), value), key
    whole = fmoe.local_batch(batch, fmoe.Plan(model=PLAIN), 0)  # one rank: every row
    assert all(torch.equal(whole[k], v) for k, v in batch.items())


def test_one_rank_steps_on_its_rows_as_on_them_alone():
    batch = fine_tuning_batch(B=4, seed=12)
    mine = fmoe.local_batch(batch, fmoe.Plan(model=PLAIN, dp=2), 1)
    plan = fmoe.Plan(model=PLAIN)
    params = fmoe.init(plan, seed=0)
    alone = {k: v[2:].clone() for k, v in batch.items()}
    assert torch.equal(fmoe.step(params, mine, plan).loss, fmoe.step(params, alone, plan).loss)


@pytest.mark.parametrize("rank, words", [(-1, "rank=-1"), (4, "rank=4"), (True, "rank=True"), (1.0, "rank=1.0")])
def test_a_rank_outside_the_plan_names_rank_and_the_allowed_range(rank, words):
    with pytest.raises(ValueError, match=rf"{words}.*0\.\.3 \(Plan\.world=4\)"):
        fmoe.local_batch(fine_tuning_batch(B=8), fmoe.Plan(model=PLAIN, dp=2, ep=2), rank)


def test_rows_the_world_does_not_divide_and_mismatched_keys_are_named():
    plan = fmoe.Plan(model=PLAIN, dp=2, ep=2)
    with pytest.raises(ValueError, match=r"6 rows, which the Plan's dp \* ep = 4 row blocks.*multiple of 4"):
        fmoe.local_batch(fine_tuning_batch(B=6), plan, 0)
    batch = fine_tuning_batch(B=8)
    with pytest.raises(ValueError, match=r"batch\['loss_mask'\] must have the 8 rows"):
        fmoe.local_batch({**batch, "loss_mask": batch["loss_mask"][:4]}, plan, 0)
    with pytest.raises(ValueError, match=r"unknown key 'labels'"):
        fmoe.local_batch({**batch, "labels": batch["tokens"]}, plan, 0)
    with pytest.raises(ValueError, match=r"'tokens': LongTensor"):
        fmoe.local_batch({"segments": batch["segments"]}, plan, 0)
