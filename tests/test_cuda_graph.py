"""CUDA graphs: refusals (plan-only checks, so they run on CPU too) and, on a GPU,
graphed steps that are bitwise the eager ones."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import optree
import pytest
import torch

import fmoe
from interop.cuda_graph import (CaptureError, GraphedTrainStep, aliased_copy, capture_scopes, capture_step,
                                check_capturable, strided_copy)
from interop.graph_capture import compiles_nothing

from .ranks.harness import free_port
from .ranks.workloads import CFG, global_batch, graphed_losses
from .reference import assert_trees_equal

MODEL = fmoe.ModelConfig(vocab=64, dim=64, layers=2, heads=2, experts=4, topk=2, ffn=32)
BF16 = dict(dtype="bfloat16", device="cuda")


@pytest.mark.parametrize("plan,scopes,match", [
    (fmoe.Plan(model=MODEL, ep=2, **BF16), ("step",),
     r"whole step.*dropless routing over Plan.ep=2 reads the all-to-all split sizes.*capacity_factor > 0"),
    (fmoe.Plan(model=MODEL, ep=2, **BF16), ("experts",), r"scope 'experts'.*Plan.ep=2"),
    (fmoe.Plan(model=MODEL.replace(pad_multiple=16), **BF16), ("step",),
     r"pad_multiple=16\) reads the permuted row count.*set pad_multiple=0"),
    (fmoe.Plan(model=MODEL, expert_backend="loop", **BF16), ("step",),
     r"expert_backend='loop' reads each expert's row count.*use 'torch'"),
    (fmoe.Plan(model=MODEL, expert_backend="te", **BF16), ("step",),
     r"'te' hands dropless row counts.*capacity_factor > 0"),
    (fmoe.Plan(model=MODEL.replace(dim=36, heads=2, ffn=20), **BF16), ("experts",),
     r"dim=36 / ffn=20 are not multiples of 16 bytes in bfloat16"),
    (fmoe.Plan(model=MODEL, delay_wgrad=True, **BF16), ("attn", "experts"),
     r"delay_wgrad=True defers the experts' weight GEMMs.*leave 'experts' out"),
    (fmoe.Plan(model=MODEL, dtype="float32", device="cuda"), ("experts",),
     r"torch._grouped_mm has no float32 CUDA kernel.*dtype='bfloat16'"),
    (fmoe.Plan(model=MODEL), ("attn",), r"need Plan.device='cuda'.*got 'cpu'"),
    (fmoe.Plan(model=MODEL, **BF16), ("attn", "mlp"), r"scopes=\['attn', 'mlp'\] is invalid.*'router'"),
    (fmoe.Plan(model=MODEL, **BF16), (), r"at least one"),
    (fmoe.Plan(model=MODEL.replace(pad_multiple=16), **BF16), ("attn", "dispatch"),
     r"scope 'dispatch'.*pad_multiple=16\) reads the permuted row count.*leave 'dispatch' out"),
    (fmoe.Plan(model=MODEL, cp=2, **BF16), ("attn",), r"Plan.cp=2.*context-parallel chunks.*cp = pp = 1"),
    (fmoe.Plan(model=MODEL, pp=2, **BF16), ("router",), r"Plan.pp=2.*pipeline's transfers"),
    (fmoe.Plan(model=MODEL.replace(capacity_factor=1.5), dp=2, ep=2, etp=2, **BF16), ("step",),
     r"whole step.*Plan.etp=2 reads its group's row counts.*allowed: etp = 1"),
    (fmoe.Plan(model=MODEL.replace(ffn=8), dp=2, etp=2, **BF16), ("experts",),
     r"scope 'experts'.*ffn=8 \(ffn / Plan.etp=2 = 4 a rank\) are not multiples of 16 bytes"),
])
def test_uncapturable_plans_are_refused_with_the_setting_that_fixes_them(plan, scopes, match):
    with pytest.raises(ValueError, match=match):
        check_capturable(plan, scopes)


def test_capturable_plans_pass_the_check():
    # Shapes and splits fixed on the device: nothing is read on the host.
    check_capturable(fmoe.Plan(model=MODEL, **BF16), ("step",))
    check_capturable(fmoe.Plan(model=MODEL.replace(capacity_factor=1.25), ep=2, **BF16), ("step",))
    check_capturable(fmoe.Plan(model=MODEL, ep=2, delay_wgrad=True, **BF16), ("attn", "router"))
    check_capturable(fmoe.Plan(model=MODEL.replace(capacity_factor=1.0), expert_backend="te", **BF16),
                     ("experts",))
    # the dispatch's index work has static shapes beside dropless expert parallelism too
    check_capturable(fmoe.Plan(model=MODEL, ep=2, **BF16), ("attn", "router", "dispatch"))
    check_capturable(fmoe.Plan(model=MODEL.replace(pad_multiple=16, capacity_factor=1.0), **BF16), ("dispatch",))
    # tensor parallelism's collectives are captured with the attention; etp's row counts
    # are read outside a graphed 'experts'
    check_capturable(fmoe.Plan(model=MODEL, tp=2, **BF16), ("step",))
    check_capturable(fmoe.Plan(model=MODEL.replace(capacity_factor=1.5), dp=2, ep=2, etp=2, **BF16),
                     ("attn", "router", "dispatch", "experts"))
    check_capturable(fmoe.Plan(model=MODEL, dp=2, etp=2, **BF16), ("experts",))  # T * K rows a rank, fixed


def test_capture_refuses_before_any_work():
    # ep=2 in a world of one would fail fmoe.step's own check; the capture check comes first.
    plan = fmoe.Plan(model=MODEL, ep=2, **BF16)
    params = fmoe.init(fmoe.Plan(model=MODEL), seed=0)
    batch = {"tokens": global_batch(4, 8)}
    with pytest.raises(ValueError, match="cannot capture a whole step"):
        capture_step(params, batch, plan)
    with pytest.raises(ValueError, match="cannot capture scope 'experts'"):
        capture_scopes(params, batch, plan, ("attn", "experts"))
    with pytest.raises(ValueError, match="cannot capture a whole step"):
        GraphedTrainStep(plan, lambda out, p, s: (p, s))
    with pytest.raises(ValueError, match=r"need Plan.device='cuda'"):
        GraphedTrainStep(fmoe.Plan(model=MODEL, dtype="bfloat16"), lambda out, p, s: (p, s))
    with pytest.raises(ValueError, match=r"warmup=0 is invalid: an int >= 1"):
        GraphedTrainStep(fmoe.Plan(model=MODEL, **BF16), lambda out, p, s: (p, s), warmup=0)


def test_the_graphs_own_batch_keeps_the_strides_compiled_kernels_guard_on():
    # fmoe.step's targets view the tokens (row stride S + 1); a dense copy would make a
    # compiled head compile again inside the capture
    buf = torch.arange(4 * 9).view(4, 9)
    for t in (buf[:, 1:], buf[:, :-1], buf.t(), buf[:, ::2], buf):
        copy = strided_copy(t)
        assert torch.equal(copy, t) and copy.stride() == t.stride() and copy.data_ptr() != t.data_ptr()
    expanded = torch.arange(5).expand(3, 5)  # overlapping elements: a dense copy
    assert torch.equal(strided_copy(expanded), expanded) and strided_copy(expanded).stride() == (5, 1)


def test_the_graph_tests_eager_reference_runs_on_the_cpu():
    # The GPU tests compare every graphed mode with graphed_losses' eager mode; its path (the
    # plan's kernels, the step, AdamW and the expert biases) runs here too, so a change to
    # what it calls fails on CI rather than first on a GPU
    losses = graphed_losses(fmoe.Plan(model=CFG, microbatches=2), global_batch(), modes=("eager",), steps=2)
    assert losses["eager"].shape == (2,) and torch.isfinite(losses["eager"]).all()
    assert losses["eager"][1] != losses["eager"][0]


def _row_sums(x):
    return (x * 2).sum(-1)


def test_the_graphs_own_batch_views_a_copy_of_the_base_its_tensors_viewed():
    # A kernel compiled at several shapes guards on a view's base (automatic dynamic
    # shapes relate its strides to the base's sizes): a copy with the strides alone is
    # not a view and would compile again inside the capture; the same view of a copy of
    # the base would not. Tokens and targets of one buffer share one copy of it.
    summed = torch.compile(_row_sums, backend="eager")
    for width in (9, 11, 13):
        buf = torch.arange(4 * width).view(4, width)
        summed(buf[:, 1:])
    bases = {}
    tokens, targets = aliased_copy(buf[:, :-1], bases), aliased_copy(buf[:, 1:], bases)
    assert torch.equal(targets, buf[:, 1:]) and torch.equal(tokens, buf[:, :-1]) and len(bases) == 1
    assert targets._base is tokens._base and targets._base.data_ptr() != buf.data_ptr()
    with compiles_nothing():
        assert torch.equal(summed(targets), summed(buf[:, 1:]))
    with pytest.raises(CaptureError, match=r"capture would compile _row_sums"):
        with compiles_nothing():
            summed(strided_copy(buf[:, 1:]))


def _doubled(x):
    return x * 2


def _tripled(x):
    return x * 3


def test_a_compile_inside_a_capture_is_refused_naming_the_function_and_its_guard():
    # compiles_nothing is every capture's context; a compile there would fail in inductor
    # with a CUDA error (its first host copy) instead of this line
    doubled = torch.compile(_doubled, backend="eager", dynamic=False)
    tripled = torch.compile(_tripled, backend="eager", dynamic=False)
    buf = torch.randn(3, 7)
    doubled(buf[:, :-1])
    with compiles_nothing():  # the same guards: the compiled code runs
        assert torch.equal(doubled(buf[:, 1:]), buf[:, 1:] * 2)
    with pytest.raises(CaptureError, match=r"capture would compile _doubled \(.*test_cuda_graph.py:\d+\) \(its "
                                           r"guards: .*tensor 'x' stride mismatch at index 0\. expected 7, actual 6"):
        with compiles_nothing():
            doubled(buf[:, :-1].contiguous())
    with pytest.raises(CaptureError, match=r"would compile _tripled .*the warm-up never called it"):
        with compiles_nothing():
            tripled(buf)
    assert torch.equal(doubled(buf[:, :-1].contiguous()), buf[:, :-1] * 2)  # outside, it compiles


def _train_update(opt, rate):
    def update(out, params, state):
        params, state = opt.update(out.grads, state, params)
        if rate:
            params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], rate, donate=True,
                                             applied=state.applied)
        return params, state
    return update


def _train_loop(plan, batches, update, params, state, graphed=None, base=None):
    """A step and ``update`` per batch, eager or through ``graphed`` (a GraphedTrainStep):
    the losses, the last params and state, and (graphed) where the params and state
    lived after each step. Under ``Plan.lora`` the params are the adapters on ``base``."""
    losses, places = [], []
    for batch in batches:
        if graphed is None:
            out = fmoe.step(params, batch, plan, base=base)
            params, state = update(out, params, state)
        else:
            out, params, state = graphed(params, state, batch)
            places.append([t.data_ptr() for t in optree.tree_leaves((params, state))])
        losses.append(out.loss.clone())
    return torch.stack(losses), params, state, places


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["chain", "fused", "fused-bf16-moments"])
def test_graphed_train_steps_are_bitwise_the_eager_loop(optimizer):
    # The step, AdamW (a device-side schedule, clipping, the non-finite check) and the
    # expert biases' update in one graph: after two eager steps and the capture, every
    # replay's loss and the final params and state are the eager loop's, bit for bit.
    # chain: a pure optimizer, whose new leaves the graph copies back; fused: donated,
    # updated where the graph reads them.
    rate = 1e-2 if optimizer == "fused-bf16-moments" else 0.0
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16, expert_bias_rate=rate),
                     microbatches=2, **BF16)
    batches = [{"tokens": global_batch(seed=s).cuda()} for s in range(6)]
    fused = optimizer != "chain"
    results = {}
    for mode in ("eager", "graph"):
        params = fmoe.init(plan, seed=0)
        opt = fmoe.adamw(fmoe.warmup_cosine(1e-2, 2, 6), weight_decay=0.1, max_grad_norm=0.5, plan=plan,
                         fused=fused, donate=fused, skip_nonfinite=3,
                         moments="bfloat16" if optimizer == "fused-bf16-moments" else "float32")
        state, update = opt.init(params), _train_update(opt, rate)
        graphed = GraphedTrainStep(plan, update) if mode == "graph" else None
        losses, params, state, places = _train_loop(plan, batches, update, params, state, graphed)
        results[mode] = (losses, params, state)
        if graphed is not None:  # from the capture (the third call) on, the graph's own tensors
            assert places[2] == places[3] == places[5]
    (want_losses, want_params, want_state), (got_losses, got_params, got_state) = results["eager"], results["graph"]
    assert len(set(want_losses.tolist())) == len(batches)  # every step changed the loss
    assert torch.equal(got_losses, want_losses), (got_losses, want_losses)
    assert_trees_equal(got_params, want_params)
    assert_trees_equal(got_state, want_state)


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen_base", "base_tree"])
def test_graphed_adapter_train_steps_are_bitwise_the_eager_loop(frozen):
    # Plan.lora: the adapters' step (their products inside the layers, the base frozen) and
    # fused AdamW on the adapters in one graph: every replay's loss and the final adapters
    # and state are the eager loop's, bit for bit. The base is read where it was at the
    # capture: laid out once (a FrozenBase), or a tree the graph copies into its shards.
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), microbatches=2, compile=True,
                     lora=fmoe.LoRA(rank=8, alpha=16.0, targets=("q", "k", "v", "out", "experts", "shared")), **BF16)
    batches = [{"tokens": global_batch(seed=s).cuda()} for s in range(6)]
    base = fmoe.init(plan, seed=1, dtype=torch.bfloat16)
    base = fmoe.lora.freeze(base, plan) if frozen else base
    results = {}
    for mode in ("eager", "graph"):
        g = torch.Generator().manual_seed(2)  # b nonzero, so the first steps already move every leaf
        adapters = optree.tree_map(lambda t: (torch.randn(t.shape, generator=g) * 0.05).cuda(), fmoe.lora.init(plan))
        opt = fmoe.adamw(1e-2, weight_decay=0.1, max_grad_norm=0.5, plan=plan, fused=True, donate=True)
        state, update = opt.init(adapters), _train_update(opt, 0.0)
        graphed = GraphedTrainStep(plan, update, base=base) if mode == "graph" else None
        losses, adapters, state, places = _train_loop(plan, batches, update, adapters, state, graphed, base)
        results[mode] = (losses, adapters, state)
        if graphed is not None:
            assert places[2] == places[3] == places[5]
            graphed.release()
    (want_losses, want_adapters, want_state), (got_losses, got_adapters, got_state) = results["eager"], results["graph"]
    assert len(set(want_losses.tolist())) == len(batches)
    assert torch.equal(got_losses, want_losses), (got_losses, want_losses)
    assert_trees_equal(got_adapters, want_adapters)
    assert_trees_equal(got_state, want_state)


@pytest.mark.gpu
def test_graphed_train_step_of_a_compiled_plan_replays_what_its_eager_steps_compiled():
    # The targets fmoe.step reads view the tokens (row stride S + 1), and compiled kernels
    # guard on strides (and, once dynamic, on the view's base): the capture's own batch
    # keeps both, so nothing compiles inside
    # the capture (the presets' main jobs failed there with a dense copy) and every
    # replay is the compiled eager loop's, bit for bit. release() frees the graph.
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), compile=True, **BF16)
    batches = [{"tokens": global_batch(seed=s).cuda()} for s in range(5)]
    losses = {}
    for mode in ("eager", "graph"):
        params = fmoe.init(plan, seed=0)
        opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, plan=plan, fused=True, donate=True)
        state, update = opt.init(params), _train_update(opt, 0.0)
        graphed = GraphedTrainStep(plan, update) if mode == "graph" else None
        losses[mode] = _train_loop(plan, batches, update, params, state, graphed)[0]
        if graphed is not None:
            assert graphed.graphed is not None
            graphed.release()
            assert graphed.graphed is None
    assert len(set(losses["eager"].tolist())) == len(batches)
    assert torch.equal(losses["graph"], losses["eager"])


@pytest.mark.gpu
def test_a_capture_that_would_compile_raises_capture_error_and_leaves_the_device_working():
    torch._dynamo.reset()  # earlier tests' compiles of the head at other shapes made it dynamic: a static guard here
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), compile=True, **BF16)
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-2, plan=plan)
    state = opt.init(params)
    graphed = GraphedTrainStep(plan, _train_update(opt, 0.0))
    for seed in (0, 1):  # eager, on dense [16, 13] token rows
        _, params, state = graphed(params, state, {"tokens": global_batch(seed=seed).cuda()})
    wide = torch.cat([global_batch(seed=2), global_batch(seed=3)], 1).cuda()  # rows of stride 26
    with pytest.raises(CaptureError, match=r"capture would compile head_loss_sum .*stride mismatch"):
        graphed(params, state, {"tokens": wide[:, :13]})
    assert graphed.graphed is None
    out = fmoe.step(params, {"tokens": global_batch(seed=4).cuda()}, plan)  # no CUDA error left behind
    assert torch.isfinite(out.loss)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["standard", "1f1b_overlap"])
def test_graphed_steps_are_bitwise_eager_on_one_gpu(schedule):
    # Dropless routing on one rank reads nothing on the host: every scope and the whole
    # step capture. Persistent gather buffers, ZeRO-3 bookkeeping, 2 microbatches.
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), sharding="optim_grads_params",
                     schedule=schedule, microbatches=2, gather_buffers="persistent", **BF16)
    res = graphed_losses(plan, global_batch().cuda())
    for mode, losses in res.items():
        assert torch.isfinite(losses).all()
        assert torch.equal(losses, res["eager"]), (mode, losses, res["eager"])


def capture_after_other_work() -> None:
    """In a process of its own: a communicator and a compiled step first, then every
    scope and the whole step captured; raises unless each graphed mode's losses are the
    eager ones."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ones = torch.ones(8, device="cuda")
    dist.all_reduce(ones)  # its watchdog thread polls from now on, through every capture below
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), sharding="optim_grads_params",
                     schedule="1f1b_overlap", microbatches=2, gather_buffers="persistent", **BF16)
    tokens = global_batch().cuda()
    compiled = plan.replace(compile=True)  # inductor and Triton compile in this process first
    fmoe.step(fmoe.init(compiled, seed=1), {"tokens": tokens}, compiled).loss.item()
    res = graphed_losses(plan, tokens)
    for mode, losses in res.items():
        assert torch.isfinite(losses).all() and torch.equal(losses, res["eager"]), (mode, losses, res["eager"])
    dist.destroy_process_group()


@pytest.mark.gpu
def test_captures_on_cold_caches_after_other_work_are_bitwise_eager(tmp_path):
    # Fresh Triton and inductor caches (as on a fresh machine), so every kernel is
    # compiled and loaded in this process, beside a live NCCL watchdog: the captures
    # that failed on fresh machines (cudaErrorStreamCaptureInvalidated) ran in such a process.
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    code = "from tests.test_cuda_graph import capture_after_other_work; capture_after_other_work()"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]


@pytest.mark.parametrize("capacity", [0.0, 1.5])
def test_scope_arguments_rebuild_the_pure_functions_exactly(capacity):
    # Before capture, the scope kernels call the pure functions through the flat
    # tensor lists the graphs are made from: a step through them is bitwise eager.
    from interop.graph_scopes import _ScopeGraphs

    plan = fmoe.Plan(model=CFG.replace(capacity_factor=capacity), microbatches=2)
    params, batch = fmoe.init(plan, seed=0), {"tokens": global_batch()}
    scopes = ("attn", "router", "dispatch", "experts")
    graphs = _ScopeGraphs(plan, scopes)
    got = fmoe.step(params, batch, plan, graphs.kernels())
    want = fmoe.step(params, batch, plan)
    assert {key[0] for key in graphs.samples} == set(scopes)
    assert len(graphs.samples) == len(scopes) * CFG.layers * plan.microbatches
    assert torch.equal(got.loss, want.loss)
    assert_trees_equal(got.grads, want.grads)


def test_a_dispatch_scope_refuses_two_permutations_it_cannot_tell_apart():
    from interop.graph_scopes import _ScopeGraphs

    graphs = _ScopeGraphs(fmoe.Plan(model=CFG), ("dispatch",))
    dispatch = graphs.kernels().dispatch
    indices = torch.randint(0, CFG.experts, (8, CFG.topk))
    dispatch((0, 0), indices, CFG.experts)
    dispatch((0, 0), indices, CFG.experts + 1)  # another number of groups: a graph of its own
    with pytest.raises(ValueError, match=r"two permutations of the same shape at site \(0, 0\)"):
        dispatch((0, 0), indices.flip(0), CFG.experts)


def test_a_call_no_graph_was_made_for_runs_the_kernel_and_says_so_once():
    from fmoe.layers import make_dispatch
    from interop.graph_scopes import NotGraphed, _ScopeGraphs

    graphs = _ScopeGraphs(fmoe.Plan(model=CFG), ("dispatch",))
    dispatch = graphs.kernels().dispatch
    graphs.samples.clear()  # as a capture that made no graph (the capture itself needs CUDA)
    graphs.recording = False
    more = torch.randint(0, CFG.experts, (16, CFG.topk))  # a shape the recording step did not see
    with pytest.warns(NotGraphed, match=r"scope 'dispatch' at site \(1, 0\) has no graph for \(\(16, 2\)"):
        got = dispatch((1, 0), more, CFG.experts)
    want = make_dispatch(more, CFG.experts)
    assert all(torch.equal(a, b) for a, b in zip(got[:7], want[:7]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotGraphed)  # once per key
        dispatch((1, 0), more, CFG.experts)


def test_scopes_not_graphed_run_as_the_plan_says():
    # Under Plan.compile the scopes left out of the capture keep their compiled kernels.
    from fmoe.schedule.compiled import compiled_kernels
    from fmoe.layers.nodes import EAGER
    from interop.graph_scopes import _ScopeGraphs

    compiled = compiled_kernels()
    kernels = _ScopeGraphs(fmoe.Plan(model=MODEL, compile=True, **BF16), ("attn",)).kernels()
    assert kernels.attn not in (EAGER.attn, compiled.attn)
    assert kernels[1:] == compiled[1:]
    assert _ScopeGraphs(fmoe.Plan(model=MODEL, **BF16), ("attn",)).kernels()[1:] == EAGER[1:]


@pytest.mark.gpu
@pytest.mark.parametrize("scopes", [("attn",), ("attn", "router"), ("attn", "router", "dispatch")],
                         ids=["attn", "attn+router", "attn+router+dispatch"])
def test_graphed_compiled_scopes_are_bitwise_the_compiled_step(scopes):
    # Under Plan.compile a scope's graph replays the compiled kernels; the rest stays compiled.
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), microbatches=2, compile=True, **BF16)
    params, batch = fmoe.init(plan, seed=0), {"tokens": global_batch().cuda()}
    graphed = capture_scopes(params, batch, plan, scopes)
    want = fmoe.step(params, batch, plan)
    got = fmoe.step(params, batch, plan, graphed)
    assert torch.equal(got.loss, want.loss)
    assert_trees_equal(got.grads, want.grads)


@pytest.mark.gpu
@pytest.mark.parametrize("remat", ["none", "selective"])
def test_donated_graphed_step_with_compiled_kernels_is_bitwise_the_compiled_eager_run(remat):
    # Plan.compile's kernels inside a whole-step graph; the fused, donating AdamW updates
    # the graph's own buffers in place, so a call copies nothing and still sees the update.
    # (selective: the compiled kernels' policy, recomputing inside the captured backward)
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), compile=True, remat=remat, **BF16)
    batches = [{"tokens": global_batch(seed=s).cuda()} for s in range(4)]
    losses = {}
    for mode in ("eager", "graph"):
        params = fmoe.init(plan, seed=0)
        opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, plan=plan, fused=True, donate=True)
        state = opt.init(params)
        run = capture_step(params, batches[0], plan, donate=True) if mode == "graph" else \
            (lambda p, b: fmoe.step(p, b, plan))
        losses[mode] = []
        for batch in batches:
            out = run(params, batch)
            losses[mode].append(out.loss.clone())
            params, state = opt.update(out.grads, state, params)
        if mode == "graph":
            assert optree.tree_structure(params) == optree.tree_structure(run.static_params)
            for new, static in zip(optree.tree_leaves(params), optree.tree_leaves(run.static_params)):
                assert new.data_ptr() == static.data_ptr()
    assert len(set(float(x) for x in losses["eager"])) == len(batches)  # the updates change the loss
    assert torch.equal(torch.stack(losses["graph"]), torch.stack(losses["eager"]))


@pytest.mark.gpu
@pytest.mark.parametrize("remat", ["full", "selective"])
def test_graphed_scopes_under_remat_are_bitwise_the_eager_remat_step(remat):
    # full: the forward replays each scope's graph without autograd, the recompute
    # replays it again with autograd: the same kernels, the same values, twice.
    # selective: the graphed scopes keep what they save in their own pools (no policy
    # inside a graph), the scopes not graphed follow the policy.
    plan = fmoe.Plan(model=CFG.replace(dim=64, ffn=32, shared_ffn=16), microbatches=2, remat=remat, **BF16)
    params, batch = fmoe.init(plan, seed=0), {"tokens": global_batch().cuda()}
    graphed = capture_scopes(params, batch, plan, ("attn", "router", "experts"))
    want = fmoe.step(params, batch, plan)
    got = fmoe.step(params, batch, plan, graphed)
    assert torch.equal(got.loss, want.loss)
    assert_trees_equal(got.grads, want.grads)
