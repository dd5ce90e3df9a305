"""The 1F1B overlap schedule and delayed wgrad on gloo ranks with expert parallelism.

Schedules reorder work, never arithmetic: on the deterministic CPU backend every
loss, gradient and parameter must be bitwise equal to the standard schedule's.
"""

import functools

import pytest
import torch

from ..reference import assert_trees_equal
from .harness import run_ranks
from .workloads import CFG, SCHEDULE_CASES, eval_and_step_losses, schedule_configs

COMPUTE = ("forward", "backward", "wgrad")


@functools.lru_cache(maxsize=None)
def runs(dp, ep, cases=tuple(SCHEDULE_CASES)):
    return run_ranks(dp * ep, schedule_configs, dp, ep, cases)


def assert_bitwise(a, b):
    torch.testing.assert_close(a["losses"], b["losses"], rtol=0, atol=0)
    for key in ("grads", "params"):
        assert_trees_equal(a[key], b[key])


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_1f1b_overlap_is_bitwise_the_standard_schedule(case):
    for res in runs(1, 2):
        assert_bitwise(res[(case, "1f1b_overlap")], res[(case, "standard")])


def test_the_tokens_case_sends_tokens():
    # the tokens exchange shows in the trace as its expert slots' all-to-all
    for res in runs(1, 2):
        for case, sends_slots in (("zero3_delay_tokens", True), ("zero3_delay", False)):
            assert any(e.purpose == "slots" for e in res[(case, "standard")]["trace"]) == sends_slots


def test_1f1b_overlap_on_a_dp2_x_ep2_mesh():
    for res in runs(2, 2, ("zero3_delay",)):
        assert_bitwise(res[("zero3_delay", "1f1b_overlap")], res[("zero3_delay", "standard")])


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_delayed_wgrad_changes_no_bit(sharding):
    for res in runs(1, 2):
        for schedule in ("standard", "1f1b_overlap"):
            assert_bitwise(res[(f"{sharding}_delay", schedule)], res[(sharding, schedule)])


def compute_events(trace):
    return [e for e in trace if e.kind in COMPUTE]


def test_trace_weaves_the_next_forward_into_the_backward():
    L = CFG.layers
    for res in runs(1, 2):
        trace = res[("zero3_delay", "1f1b_overlap")]["trace"]
        order = [(e.kind, e.node, e.mb) for e in compute_events(trace)]
        for f in (1, 2, 3):
            for j in range(L):
                k = L - 1 - j
                start = order.index(("backward", f"layers.{k}.combine", f - 1))
                end = order.index(("backward", f"layers.{k}.attn", f - 1))
                inside = order[start:end]
                for kind in ("attn", "dispatch", "experts", "combine"):
                    assert ("forward", f"layers.{j}.{kind}", f) in inside
                assert ("wgrad", f"layers.{k}.experts", f - 1) in inside
        # The standard schedule finishes a microbatch's backward before the next forward.
        standard = [(e.kind, e.mb) for e in compute_events(res[("zero3_delay", "standard")]["trace"])]
        assert standard.index(("forward", 1)) > max(i for i, x in enumerate(standard) if x == ("backward", 0))


def woven(event, microbatches=4):
    """Whether an exchange belongs to a forward or backward that the schedule interleaves."""
    backward = event.purpose.endswith("_grad")
    return event.mb < microbatches - 1 if backward else event.mb > 0


@pytest.mark.parametrize("case", ["zero3_delay", "zero3_delay_capacity", "zero2"])
def test_every_exchange_is_issued_before_the_compute_it_overlaps(case):
    for res in runs(1, 2):
        trace = res[(case, "1f1b_overlap")]["trace"]
        exchanges = [e for e in trace if e.kind == "all_to_all" and e.purpose != "a2a_splits"]
        assert {e.purpose for e in exchanges} == {"dispatch", "combine", "dispatch_grad", "combine_grad"}
        computes = compute_events(trace)
        overlapped = [e for e in exchanges if woven(e)]
        assert len(overlapped) == 4 * CFG.layers * 3  # 4 exchanges per layer, 3 woven pairs, each direction
        for a2a in overlapped:
            under = [c for c in computes if c.mb != a2a.mb and a2a.start <= c.start and c.end <= a2a.end]
            assert under, f"{a2a.purpose} of {a2a.node} mb{a2a.mb} has no compute of another microbatch under it"


def test_eval_loss_runs_the_forward_only_program_across_expert_ranks():
    for evaluated, trained in run_ranks(2, eval_and_step_losses, 1, 2):
        torch.testing.assert_close(evaluated, trained, rtol=1e-6, atol=0)
