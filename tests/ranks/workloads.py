"""What the distributed tests run on each rank (importable by spawned workers)."""

from __future__ import annotations

import functools
import gc
import importlib
import json
import os
import warnings
from pathlib import Path

import optree
import torch

import fmoe
from fmoe.batch import Batch
from fmoe.config import PROB_PLACEMENTS
from fmoe.schedule import Node
from fmoe.comm import count
from fmoe.resolve import plan_kernels

CFG = fmoe.ModelConfig(vocab=64, dim=32, layers=2, heads=2, experts=4, topk=2, ffn=16, shared_ffn=8,
                       expert_biases=True)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
STEPS = 3


def global_batch(rows=16, seq=12, seed=0):
    return torch.randint(0, CFG.vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def rank_rows(tokens, rank, world):
    """Rank r's contiguous slice of the global batch."""
    per = tokens.shape[0] // world
    return tokens[rank * per:(rank + 1) * per]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (fake tensors, which
    a compiled run leaves in its caches, hold none)."""
    from torch._subclasses.fake_tensor import is_fake

    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and not is_fake(obj)]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def collective_counts(trace) -> dict:
    return {"all_gather": count(trace, "all_gather", "params"),
            "reduce_scatter": count(trace, "reduce_scatter", "grads"),
            "all_reduce": count(trace, "all_reduce", "grads")}


def train(plan: fmoe.Plan, tokens: torch.Tensor, steps: int = STEPS) -> dict:
    """``steps`` of step + AdamW on this rank's rows; what the tests compare (with the
    first step's trace)."""
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, plan=plan)
    state = opt.init(params)
    losses, counts, first_grads = [], [], None
    for i in range(steps):
        out = fmoe.step(params, {"tokens": tokens}, plan)
        losses.append(out.loss)
        counts.append(collective_counts(out.metrics["trace"]))
        if i == 0:
            first_grads = fmoe.gather_full(out.grads, plan)
            first_trace = out.metrics["trace"]
        params, state = opt.update(out.grads, state, params)
        params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], plan.model.expert_bias_rate)
    cpu = lambda tree: optree.tree_map(lambda t: t.cpu(), tree)  # noqa: E731
    return {"losses": torch.stack(losses).cpu(), "grads": cpu(first_grads),
            "params": cpu(fmoe.gather_full(params, plan)), "counts": counts, "trace": first_trace}


def tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def fsdp_configs(rank, world, device="cpu"):
    """Every strategy x {1, 4} microbatches at dp=world, on this rank's rows."""
    tokens = rank_rows(global_batch(), rank, world)
    out = {}
    for sharding in STRATEGIES:
        for mb in (1, 4):
            plan = fmoe.Plan(model=CFG, dp=world, sharding=sharding, microbatches=mb, device=device)
            out[(sharding, mb)] = train(plan, tokens)
    return out


def resting_memory(rank, world, sharding):
    """Live tensor bytes held after training, beyond what was alive before."""
    tokens = rank_rows(global_batch(), rank, world)
    plan = fmoe.Plan(model=CFG, dp=world, sharding=sharding, microbatches=2)
    baseline = live_tensor_bytes()
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-2, plan=plan)
    state = opt.init(params)
    for _ in range(2):
        out = fmoe.step(params, {"tokens": tokens}, plan)
        params, state = opt.update(out.grads, state, params)
    grads = out.grads
    del out
    held = live_tensor_bytes() - baseline
    return {"held": held, "trees": tree_bytes(params) + tree_bytes(grads) + tree_bytes(state)}


VARIANTS = {
    "dynamic": dict(),
    "double": dict(gather_buffers="double"),
    "persistent": dict(gather_buffers="persistent"),
    "no_prefetch": dict(prefetch=0),
    "prefetch2": dict(prefetch=2),
    "grouped_units": dict(units=(("embed", "head"), ("layers.0", "layers.1"))),
}


def zero3_variants(rank, world, device="cpu"):
    """ZeRO-3 under each buffer mode, prefetch depth and unit grouping; plus bf16."""
    tokens = rank_rows(global_batch(), rank, world)
    out = {}
    for name, kw in VARIANTS.items():
        plan = fmoe.Plan(model=CFG, dp=world, sharding="optim_grads_params", microbatches=2, device=device, **kw)
        res = train(plan, tokens, steps=2)
        step = fmoe.step(fmoe.init(plan, seed=0), {"tokens": tokens}, plan)
        res["trace"] = [(e.kind, e.unit, e.node, e.mb, e.start, e.end) for e in step.metrics["trace"]]
        out[name] = res
    bf16 = fmoe.Plan(model=CFG, dp=world, sharding="optim_grads_params", microbatches=2, dtype="bfloat16",
                     device=device)
    out["bfloat16"] = train(bf16, tokens, steps=2)
    return out


def released_weights(rank, world):
    """Run ZeRO-3 with the re-gather before a backward node removed: the lifecycle
    must refuse before autograd reads freed storage."""
    from fmoe.params import named_leaves
    from fmoe.resolve import resolve
    from fmoe.schedule import Backward, execute
    from fmoe.shard import LifecycleError

    plan = fmoe.Plan(model=CFG, dp=world, sharding="optim_grads_params")
    setup = resolve(plan)
    program = setup.train.actions
    bwd = next(i for i, a in enumerate(program) if isinstance(a, Backward) and a.node == Node("experts", 1))
    regather = [i for i, a in enumerate(program[:bwd]) if a.unit == "layers.1" and a.op in ("gather", "wait")][-2:]
    wrong = [a for i, a in enumerate(program) if i not in regather]
    tokens = rank_rows(global_batch(), rank, world)
    try:
        execute(setup, named_leaves(fmoe.init(plan, seed=0)), Batch.of_tokens(tokens), 16 * 12,
                setup.train.with_actions(wrong))
    except LifecycleError as err:
        return str(err)
    return "no error"


SCHEDULE_CASES = {
    "zero2": dict(sharding="optim_grads"),
    "zero2_delay": dict(sharding="optim_grads", delay_wgrad=True),
    "zero3": dict(sharding="optim_grads_params"),
    "zero3_delay": dict(sharding="optim_grads_params", delay_wgrad=True),
    "zero3_delay_capacity": dict(sharding="optim_grads_params", delay_wgrad=True, capacity_factor=2.0),
    "zero3_delay_prob_in_activation": dict(sharding="optim_grads_params", delay_wgrad=True,
                                           prob_placement="activation"),
    "zero3_delay_tokens": dict(sharding="optim_grads_params", delay_wgrad=True, ep_exchange="tokens"),
}


def schedule_configs(rank, world, dp, ep, cases=tuple(SCHEDULE_CASES), device="cpu"):
    """``{(case, schedule): train(...)}`` for both executors, 4 microbatches at dp x ep."""
    tokens = rank_rows(global_batch(), rank, world)
    out = {}
    for case in cases:
        kw = dict(SCHEDULE_CASES[case])
        model = CFG.replace(**{k: kw.pop(k) for k in ("capacity_factor", "prob_placement") if k in kw})
        for schedule in ("standard", "1f1b_overlap"):
            plan = fmoe.Plan(model=model, dp=dp, ep=ep, schedule=schedule, microbatches=4, device=device, **kw)
            out[(case, schedule)] = train(plan, tokens)
    return out


SCALE_MESHES = [(4, 1), (2, 2), (1, 4), (8, 1), (2, 4), (4, 2)]


def scale_plan(dp=1, ep=1, device="cpu") -> fmoe.Plan:
    """ZeRO-3, 1F1B overlap, delayed wgrad, 2 microbatches: the large-mesh configuration."""
    return fmoe.Plan(model=CFG, dp=dp, ep=ep, sharding="optim_grads_params", schedule="1f1b_overlap",
                     delay_wgrad=True, microbatches=2, device=device)


def scale_config(rank, world, dp, ep, device="cpu"):
    """Two training steps of ``scale_plan`` at dp x ep on this rank's rows."""
    return train(scale_plan(dp, ep, device), rank_rows(global_batch(), rank, world), steps=2)


def init_devices(rank, world, dp, ep, device="cpu"):
    """The devices ``fmoe.init`` put this rank's leaves on (``scale_plan`` at dp x ep), as
    strings, and this process's current device."""
    params = fmoe.init(scale_plan(dp, ep, device), seed=0)
    here = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu"
    return sorted({str(leaf.device) for leaf in optree.tree_leaves(params)}), here


def eval_and_step_losses(rank, world, dp, ep):
    """``(eval_loss, step loss)`` under 1F1B + delayed wgrad at dp x ep (forward-only program vs training)."""
    plan = fmoe.Plan(model=CFG, dp=dp, ep=ep, sharding="optim_grads_params", schedule="1f1b_overlap",
                     delay_wgrad=True, microbatches=2)
    params = fmoe.init(plan, seed=0)
    batch = {"tokens": rank_rows(global_batch(), rank, world)}
    return fmoe.eval_loss(params, batch, plan), fmoe.step(params, batch, plan).loss


def ep_configs(rank, world, dp, ep, device="cpu"):
    """Every strategy at dp x ep, 2 microbatches, on this rank's rows."""
    tokens = rank_rows(global_batch(), rank, world)
    out = {}
    for sharding in STRATEGIES:
        plan = fmoe.Plan(model=CFG, dp=dp, ep=ep, sharding=sharding, microbatches=2, device=device)
        res = train(plan, tokens)
        step = fmoe.step(fmoe.init(plan, seed=0), {"tokens": tokens}, plan)
        res["metrics"] = {k: step.metrics[k] for k in ("expert_counts", "a2a_bytes", "dropped_tokens")}
        res["trace_kinds"] = sorted({e.kind for e in step.metrics["trace"]})
        out[sharding] = res
    cap = fmoe.Plan(model=CFG.replace(capacity_factor=float(CFG.experts)), dp=dp, ep=ep,
                    sharding="optim_grads_params", microbatches=2, device=device)
    out["capacity"] = train(cap, tokens)
    in_act = fmoe.Plan(model=CFG.replace(prob_placement="activation"), dp=dp, ep=ep, microbatches=2, device=device)
    out["prob_in_activation"] = train(in_act, tokens)
    for placement in PROB_PLACEMENTS:
        plan = fmoe.Plan(model=CFG.replace(prob_placement=placement), dp=dp, ep=ep, sharding="optim_grads_params",
                         microbatches=2, device=device, ep_exchange="tokens")
        res = train(plan, tokens)
        step = fmoe.step(fmoe.init(plan, seed=0), {"tokens": tokens}, plan)
        res["metrics"] = {k: step.metrics[k] for k in ("expert_counts", "a2a_bytes", "dropped_tokens")}
        out[f"tokens_{placement}"] = res
    return out


def round_trip(rank, world, route_to_first_rank: bool):
    """dispatch -> identity experts -> combine on ``world`` EP ranks; returns the
    output, the input gradient and the split sizes this rank saw."""
    from fmoe.layers.dispatch import make_dispatch, permute, unpermute
    from fmoe.layers.expert_parallel import ExpertParallel, combine, dispatch, plan_exchange
    from fmoe.comm.mesh import mesh_for

    E, K, T, D = 2 * world, 2, 5 + 3 * rank, 8  # uneven token counts per rank
    mesh = mesh_for(fmoe.Plan(model=CFG.replace(experts=E), dp=1, ep=world))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    if route_to_first_rank:  # every token to rank 0's experts: the other ranks receive nothing
        idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long)], 1)
    else:
        idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 idle
    d = make_dispatch(idx, E)
    ep = ExpertParallel(mesh.ep, 2)
    ex = plan_exchange(d.rows_E, None, ep)
    bound = world * T * min(K, ep.experts_per_rank)  # moe_route's: the most a rank receives at this T everywhere
    early = plan_exchange(d.rows_E, None, ep, bound)
    same_plan = all(torch.equal(a, b) for a, b in zip((ex.order, ex.inverse, *ex.segments[:3]),
                                                      (early.order, early.inverse, *early.segments[:3])))
    local = dispatch(permute(x, d), ex, ep, None).wait()
    back = combine(local * 1.0, ex, ep, None).wait()
    y = unpermute(back, d)
    upstream = torch.randn(T, D, generator=g)
    y.backward(upstream)
    return {"x": x.detach(), "y": y.detach(), "grad": x.grad, "upstream": upstream, "local_rows": local.shape[0],
            "recv_splits": ex.recv_splits, "segments": ex.segments.rows_E.tolist(), "same_plan": same_plan,
            "over_bound": sum(ex.recv_splits) > bound}


def token_round_trip(rank, world, route_to_first_rank: bool):
    """Tokens to their experts' ranks once each (``plan_token_exchange``), identity
    experts weighted by the probabilities, and back: ``y = x * sum_k p[:, k]``; returns
    the output, the gradients of the tokens and probabilities, and what this rank saw."""
    from fmoe.layers.dispatch import permute, unpermute
    from fmoe.layers.expert_parallel import ExpertParallel, combine, dispatch, plan_token_exchange
    from fmoe.comm.mesh import mesh_for

    E, K, T, D = 2 * world, 2, 5 + 3 * rank, 8  # two experts a rank, uneven token counts
    mesh = mesh_for(fmoe.Plan(model=CFG.replace(experts=E), dp=1, ep=world, ep_exchange="tokens"))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    probs = torch.rand(T, K, generator=g).requires_grad_()
    if route_to_first_rank:  # both experts on rank 0: the other ranks receive nothing
        idx = torch.tensor([[0, 1]] * T)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ep = ExpertParallel(mesh.ep, 2, tokens=True)
    by_rank, ex = plan_token_exchange(idx, ep)
    tokens = dispatch(permute(x, by_rank), ex, ep, None).wait()
    token_probs = dispatch(permute(probs, by_rank), ex, ep, None).wait()
    summed = unpermute(permute(tokens, ex.local), ex.local, token_probs)  # identity experts
    y = unpermute(combine(summed, ex, ep, None).wait(), by_rank)
    upstream = torch.randn(T, D, generator=g)
    y.backward(upstream)
    return {"x": x.detach(), "probs": probs.detach(), "y": y.detach(), "grad_x": x.grad, "grad_probs": probs.grad,
            "upstream": upstream, "sent": by_rank.num_rows, "received": tokens.shape[0],
            "local_rows": ex.local.num_rows, "held": [len(set((row // 2).tolist())) for row in idx]}


def adam_moments(state):
    return state["adam"]


def _steps(plan, params, opt, state, tokens, n):
    losses = []
    for _ in range(n):
        out = fmoe.step(params, {"tokens": tokens}, plan)
        losses.append(out.loss)
        params, state = opt.update(out.grads, state, params)
        params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], plan.model.expert_bias_rate)
    return params, state, torch.stack(losses)


def checkpoint_writer(rank, world, path, dp, ep, sharding, device="cpu", moments="float32"):
    """Train 2 steps, save, train 2 more: the uninterrupted run to compare with."""
    plan = fmoe.Plan(model=CFG, dp=dp, ep=ep, sharding=sharding, microbatches=2, device=device)
    tokens = rank_rows(global_batch(), rank, world)
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, plan=plan, moments=moments)
    params = fmoe.init(plan, seed=0)
    params, state, _ = _steps(plan, params, opt, opt.init(params), tokens, 2)
    fmoe.save(path, plan, params, opt_state=state, step=2, extra={"rows": tokens.shape[0]})
    full = {"params": fmoe.gather_full(params, plan), "mu": fmoe.gather_full(adam_moments(state).mu, plan)}
    _, _, after = _steps(plan, params, opt, state, tokens, 2)
    return optree.tree_map(lambda t: t.cpu(), {"full": full, "after": after})


def checkpoint_reader(rank, world, path, dp, ep, sharding, device="cpu", moments="float32"):
    """Load under another plan: the full tensors it sees, and 2 more steps."""
    plan = fmoe.Plan(model=CFG, dp=dp, ep=ep, sharding=sharding, microbatches=2, device=device)
    tokens = rank_rows(global_batch(), rank, world)
    ck = fmoe.load(path, plan)
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, plan=plan, moments=moments)
    full = {"params": fmoe.gather_full(ck.params, plan), "mu": fmoe.gather_full(adam_moments(ck.opt_state).mu, plan)}
    _, _, after = _steps(plan, ck.params, opt, ck.opt_state, tokens, 2)
    return optree.tree_map(lambda t: t.cpu(), {"full": full, "after": after}) | {"step": ck.step}


def checkpoint_round_trip_on_threads(rank, world, path, threads):
    """Save at dp=2 ZeRO-3 with ``threads`` writer and hashing threads a rank, load back:
    the written full tensors, the read ones and the data files each rank wrote."""
    from fmoe.checkpoint import api, files
    api.io_threads = files.io_threads = lambda: threads
    written = checkpoint_writer(rank, world, path, 2, 1, "optim_grads_params")
    read = checkpoint_reader(rank, world, path, 2, 1, "optim_grads_params")
    mine = sorted(f for f in os.listdir(path) if f.startswith(f"__{rank}_") and f.endswith(".distcp"))
    return {"written": written["full"], "read": read["full"], "files": mine}


def checkpoint_load_error(rank, world, path, dp, ep, sharding, unreadable_on=None):
    """What loading ``path`` under a plan raises on this rank (a ValueError's text), or None;
    on rank ``unreadable_on`` reading a data file back fails as a permission error would."""
    if rank == unreadable_on:
        from fmoe.checkpoint import files

        def unreadable(path):
            raise PermissionError(13, "Permission denied", str(path))
        files.digest = unreadable
    plan = fmoe.Plan(model=CFG, dp=dp, ep=ep, sharding=sharding, microbatches=2)
    try:
        fmoe.load(path, plan)
    except ValueError as err:
        return str(err)
    return None


TE_SEED = dict(dp=1, ep=2, sharding="optim_grads_params", schedule="1f1b_overlap", microbatches=4, delay_wgrad=True)


def te_seed_scenario(rank, world, device="cuda"):
    """The case that broke a hook-driven stack: TE experts + ZeRO-3 + delayed wgrad at
    dp1 x ep2 over 4 microbatches; ``train`` results for the TE backend in bf16 and
    the torch backend in bf16 and fp32 (the reference)."""
    importlib.import_module("interop.te")  # registers expert_backend "te"

    tokens = rank_rows(global_batch(), rank, world)
    runs = {"te": ("te", "bfloat16"), "torch": ("torch", "bfloat16"), "fp32": ("torch", "float32")}
    return {name: train(fmoe.Plan(model=CFG, expert_backend=backend, dtype=dtype, device=device, **TE_SEED), tokens)
            for name, (backend, dtype) in runs.items()}


GRAPH_MODES = {"eager": None, "attn": ("attn",), "router": ("router",), "attn+router": ("attn", "router"),
               "attn+router+dispatch": ("attn", "router", "dispatch"),
               "attn+router+experts": ("attn", "router", "experts"),
               "every scope": ("attn", "router", "dispatch", "experts"), "step": "step",
               "train step": "train step"}  # the step and the update as one graph (GraphedTrainStep)


def graphed_losses(plan: fmoe.Plan, tokens: torch.Tensor, modes=tuple(GRAPH_MODES), steps: int = 5) -> dict:
    """``{mode: losses over steps}`` of step + AdamW + expert-bias update, eager or with
    CUDA graphs (``GRAPH_MODES``); every mode starts from the same params. A graphed scope
    that ran its kernel instead of a graph (``NotGraphed``) fails the run."""
    from interop.cuda_graph import NotGraphed

    batch = {"tokens": tokens}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotGraphed)
        for mode in modes:
            out[mode] = _graphed_run(plan, batch, GRAPH_MODES[mode], steps)
    return out


def _graphed_run(plan, batch, scopes, steps) -> torch.Tensor:
    """One mode of ``graphed_losses``: its losses over ``steps``."""
    from interop.cuda_graph import GraphedTrainStep, capture_scopes, capture_step

    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, plan=plan)
    state = opt.init(params)

    def update(res, params, state):
        params, state = opt.update(res.grads, state, params)
        return fmoe.update_expert_bias(params, res.metrics["expert_counts"], plan.model.expert_bias_rate), state
    if scopes == "train step":
        train_step = GraphedTrainStep(plan, update)
    else:
        if scopes == "step":
            run = capture_step(params, batch, plan)
        else:
            kernels = capture_scopes(params, batch, plan, scopes) if scopes else plan_kernels(plan)
            run = functools.partial(lambda k, p, b: fmoe.step(p, b, plan, k), kernels)

        def train_step(params, state, batch):
            res = run(params, batch)
            return (res, *update(res, params, state))
    losses = []
    for _ in range(steps):
        res, params, state = train_step(params, state, batch)
        losses.append(res.loss.clone())
    return torch.stack(losses).cpu()


# name: (plan settings, world, graph modes)
GRAPH_MESHES = {
    "dp2-zero3": (dict(dp=2, sharding="optim_grads_params"), 2, ("eager", "attn", "attn+router", "step", "train step")),
    "ep2-capacity": (dict(ep=2, sharding="optim_grads_params", capacity_factor=1.5), 2,
                     ("eager", "attn", "attn+router", "every scope", "step", "train step")),
    "ep2-dropless": (dict(ep=2, sharding="optim_grads_params"), 2, ("eager", "router", "attn+router+dispatch")),
    "ep2-tokens": (dict(ep=2, sharding="optim_grads_params", ep_exchange="tokens"), 2,
                   ("eager", "attn+router+dispatch")),
    "tp2": (dict(tp=2, sharding="optim_grads_params"), 2,
            ("eager", "attn", "router", "attn+router+dispatch", "every scope", "step", "train step")),
    "ep2-tp2-etp2-capacity": (dict(ep=2, tp=2, etp=2, sharding="optim_grads_params", capacity_factor=1.5), 4,
                              ("eager", "attn", "router", "attn+router+dispatch", "every scope")),
}


def graph_configs(rank, world, mesh, device="cuda"):
    """``graphed_losses`` at a mesh of ``GRAPH_MESHES``, 2 microbatches."""
    kw, _, modes = GRAPH_MESHES[mesh]
    kw = dict(kw)
    model = CFG.replace(dim=64, ffn=32, shared_ffn=16, capacity_factor=kw.pop("capacity_factor", 0.0))
    plan = fmoe.Plan(model=model, microbatches=2, dtype="bfloat16", device=device, **kw)
    tokens = fmoe.local_batch({"tokens": global_batch()}, plan, rank)["tokens"]
    return graphed_losses(plan, tokens.to(device), modes=modes)


# Grouped-query attention with a head size of its own, per-head q/k norms, a qkv bias,
# tied embeddings and a gated shared expert: the features the Hugging Face families need.
HF_CFG = CFG.replace(heads=4, kv_heads=2, head_size=12, qk_norm="head", qkv_bias=True, tie_embeddings=True,
                     shared_gate=True)
HF_PLANS = {
    "zero3_dp_1f1b": dict(sharding="optim_grads_params", schedule="1f1b_overlap"),
    "zero3_ep_1f1b_delay": dict(sharding="optim_grads_params", schedule="1f1b_overlap", delay_wgrad=True, ep=0),
}


# GLM-4.5's features: a dense first layer (with three layers the 1F1B weave pairs it
# with a MoE layer both ways), sigmoid routing over groups with routed scaling and a
# selection bias that moves (a large rate: it changes the choices within three steps),
# partial RoPE, q/k/v bias
GLM_CFG = CFG.replace(layers=3, dense_layers=(0,), dense_ffn=24, score_func="sigmoid", expert_groups=2,
                      topk_groups=1, routed_scaling=2.5, expert_bias_rate=0.05, rope_fraction=0.5, qkv_bias=True,
                      expert_biases=False, shared_ffn=16)
GLM_PLANS = {
    "zero3_ep_1f1b_delay_remat": dict(sharding="optim_grads_params", schedule="1f1b_overlap", delay_wgrad=True,
                                      remat="full", ep=0),
    "zero2_dp_1f1b": dict(sharding="optim_grads", schedule="1f1b_overlap"),
}
# DeepSeek-V3's multi-head latent attention (a low-rank query, value heads narrower than
# the q/k heads, interleaved RoPE pairs, YaRN) over GLM's routing and dense first layer
MLA_CFG = GLM_CFG.replace(heads=4, head_size=12, kv_lora_rank=16, q_lora_rank=8, rope_head_dim=4, v_head_size=6,
                          rope_interleave=True, rope_fraction=1.0, qkv_bias=False, rope_scaling="yarn",
                          rope_factor=4.0, rope_original_max=4, yarn_mscale_all_dim=1.0)
# GPT-OSS's: sinks, a sliding-window layer, biases on attention and experts, softmax over
# the top-k logits with a router bias, the clamped GLU stored interleaved
OSS_CFG = CFG.replace(layers=3, heads=4, kv_heads=2, attn_sinks=True, sliding_window=4, window_layers=(0, 2),
                      qkv_bias=True, out_bias=True, expert_biases=True, router_bias=True, score_func="topk_softmax",
                      activation="quick_geglu", glu_interleave=1, shared_ffn=0)
FEATURES = {"hf": (HF_CFG, HF_PLANS), "glm": (GLM_CFG, GLM_PLANS), "mla": (MLA_CFG, GLM_PLANS),
            "gpt_oss": (OSS_CFG, HF_PLANS)}


def feature_plans(rank, world, feature):
    """Each plan of ``FEATURES[feature]`` at ``world`` ranks (``ep=0``: all of them
    expert-parallel)."""
    cfg, plans = FEATURES[feature]
    tokens = rank_rows(global_batch(), rank, world)
    out = {}
    for name, kw in plans.items():
        ep = world if kw.get("ep") == 0 else 1
        plan = fmoe.Plan(model=cfg, microbatches=2, **dict(kw, ep=ep, dp=world // ep))
        out[name] = train(plan, tokens)
    return out


def hf_sharded_round_trip(rank, world, hf_dir, out_dir, layout="ep"):
    """Load a Hugging Face checkpoint straight into ZeRO-3 shards (``layout``: ``ep``, of
    EP x dp; ``tp``, of tensor-parallel slices), save it back (collective), and return
    the gathered model and this rank's shapes."""
    plan = fmoe.Plan(model=fmoe.hf.config(hf_dir), dp=world // 2, sharding="optim_grads_params", **{layout: 2})
    params = fmoe.hf.load(hf_dir, plan)
    fmoe.hf.save(out_dir, params, plan)
    shapes = {k: tuple(v.shape) for k, v in fmoe.params.named_leaves(params).items()}
    return {"full": fmoe.gather_full(params, plan), "shapes": shapes}


def fused_adamw_steps(rank, world, dp, ep, sharding):
    """Two steps from the same params three ways: the pure fused AdamW, the donating
    one, and the chain. Returns each run's losses, grads and params, and whether the
    run's params stayed in the tensors they started in."""
    from fmoe.params import named_leaves

    plan = fmoe.Plan(model=CFG, dp=dp, ep=ep, sharding=sharding, microbatches=2)
    tokens = rank_rows(global_batch(), rank, world)
    runs = {}
    for name, fused, donate in (("pure", True, False), ("donated", True, True), ("chain", False, False)):
        params = fmoe.init(plan, seed=0)
        opt = fmoe.adamw(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, plan=plan, fused=fused, donate=donate)
        state = opt.init(params)
        first = {p: leaf.data_ptr() for p, leaf in named_leaves(params).items()}
        losses, grads = [], []
        for _ in range(2):
            out = fmoe.step(params, {"tokens": tokens}, plan)
            losses.append(out.loss)
            grads.append(optree.tree_map(torch.clone, out.grads))
            params, state = opt.update(out.grads, state, params)
        named = named_leaves(params)
        kept = all(named[p].data_ptr() == ptr for p, ptr in first.items() if named[p].numel())
        runs[name] = {"losses": torch.stack(losses), "grads": grads, "params": params, "state": state,
                      "kept_storage": kept}
    return runs


COMPILE_CASES = {
    "zero1": dict(sharding="optim"),
    "zero3_1f1b_delay": dict(sharding="optim_grads_params", schedule="1f1b_overlap", delay_wgrad=True),
    "zero3_tokens": dict(sharding="optim_grads_params", ep_exchange="tokens"),  # compiled token dispatches
}


def compiled_configs(rank, world, dp, ep, device="cpu"):
    """``{(case, compile): train(...)}``: each case eager and with ``Plan.compile``, 2 microbatches."""
    tokens = rank_rows(global_batch(), rank, world).to(device)
    return {(case, compiled): train(fmoe.Plan(model=CFG, dp=dp, ep=ep, microbatches=2, compile=compiled,
                                              device=device, **kw), tokens, steps=2)
            for case, kw in COMPILE_CASES.items() for compiled in (False, True)}


REMAT_CASES = ("zero3_delay", "zero3_delay_capacity", "zero3_delay_tokens")


def remat_configs(rank, world, dp, ep, device="cpu"):
    """``{(case, remat): train(...)}`` under ``1f1b_overlap``, 4 microbatches at dp x ep."""
    tokens = rank_rows(global_batch(), rank, world)
    out = {}
    for case in REMAT_CASES:
        kw = dict(SCHEDULE_CASES[case])
        model = CFG.replace(**{k: kw.pop(k) for k in ("capacity_factor",) if k in kw})
        for remat in fmoe.config.REMATS:
            plan = fmoe.Plan(model=model, dp=dp, ep=ep, schedule="1f1b_overlap", microbatches=4, remat=remat,
                             device=device, **kw)
            out[(case, remat)] = train(plan, tokens)
    return out


def user_state_round_trip(rank, world, path, kind):
    """Save a state the user built (not adamw's) on ZeRO-3 ranks and load it back:
    ``by_name``: tensors keyed by the parameters' dotted names; ``subset``: a moment over
    the layers only. Returns how many tensors were saved as parameter mirrors and
    whether every rank got its own shards back."""
    from fmoe.params import named_leaves

    plan = fmoe.Plan(model=CFG, dp=world, sharding="optim_grads_params")
    params = fmoe.init(plan, seed=0)
    if kind == "by_name":
        state = {"ema": {p: t.detach() + rank + 1 for p, t in named_leaves(params).items()}}
    else:
        state = {"mu": {"layers": optree.tree_map(lambda t: t.detach() + rank + 1, params["layers"])},
                 "count": torch.tensor(3)}
    fmoe.save(path, plan, params, opt_state=state)
    back = fmoe.load(path, plan).opt_state
    same = optree.tree_structure(back) == optree.tree_structure(state) and all(
        torch.equal(a, b) for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(state)))
    mirrored = json.loads((Path(path) / "fmoe.json").read_text())["opt_params"]
    return {"mirrored": len(mirrored), "same": same}


# widths and tokens FP8 GEMMs take (multiples of 16)
FP8_CFG = CFG.replace(ffn=16, shared_ffn=16)
FP8_GATHER_CASES = {"ddp": dict(sharding="no_shard"), "zero1": dict(sharding="optim"),
                    "zero3": dict(sharding="optim_grads_params"),
                    "zero3_remat": dict(sharding="optim_grads_params", remat="full"),
                    "ddp_compiled": dict(sharding="no_shard", compile=True),
                    "zero3_compiled": dict(sharding="optim_grads_params", compile=True),
                    "ddp_chunked": dict(sharding="no_shard", loss_chunk=16),
                    "zero3_chunked": dict(sharding="optim_grads_params", loss_chunk=16)}


def fp8_all_gather(rank, world):
    """Each rank's FP8 shard gathered by ``Group.all_gather``, and what it must give."""
    from fmoe.comm import Group

    shards = [(torch.randn(40, generator=torch.Generator().manual_seed(r)) * 100).to(torch.float8_e4m3fn)
              for r in range(world)]
    gathered = torch.empty(40 * world, dtype=torch.float8_e4m3fn)
    Group.world().all_gather(gathered, shards[rank]).wait()
    return {"gathered": gathered, "expected": torch.cat([s.view(torch.uint8) for s in shards]).view(gathered.dtype)}


def fp8_gather_configs(rank, world, device="cuda"):
    """One ``fp8='tensorwise'`` step per case (the sharded ones gather the dense products'
    weights in FP8), ZeRO-3's gathered ``Fp8Weight``s beside ``quantize_tensor`` of the
    full bf16 weights, and ZeRO-3's losses with graphed scopes (``graphed_losses``)."""
    from fmoe.layers.fp8 import Fp8Weight, quantize_tensor
    from fmoe.params import named_leaves
    from fmoe.resolve import resolve
    from fmoe.shard import lifecycle as lc
    from fmoe.shard.shards import build_shards

    tokens = rank_rows(global_batch(rows=8, seq=16), rank, world).to(device)
    out = {}
    for name, kw in FP8_GATHER_CASES.items():
        plan = fmoe.Plan(model=FP8_CFG, dp=world, dtype="bfloat16", fp8="tensorwise", device=device, **kw)
        step = fmoe.step(fmoe.init(plan, seed=0), {"tokens": tokens}, plan)
        grads = named_leaves(fmoe.gather_full(step.grads, plan))
        out[name] = {"loss": step.loss.cpu(), "grads": {p: g.cpu() for p, g in grads.items()},
                     "gathered_bytes": sum(e.nbytes for e in step.metrics["trace"] if e.kind == "all_gather")}
    plan = fmoe.Plan(model=FP8_CFG, dp=world, dtype="bfloat16", fp8="tensorwise", device=device,
                     sharding="optim_grads_params")
    setup = resolve(plan)
    spec, mesh = setup.spec, setup.mesh
    shards = build_shards(named_leaves(fmoe.init(plan, seed=0)), spec, setup.units, mesh, plan.device)
    state = lc.start(spec, mesh, shards, len(setup.units), None, plan.device, dynamic=True, microbatches=1)
    full = named_leaves(fmoe.init(plan.replace(sharding="no_shard"), seed=0))
    weights = {}
    for u in spec.units:
        state = lc.wait(lc.gather(state, u.name), u.name)
        for path, w in state.units[u.name].views.items():
            if isinstance(w, Fp8Weight):
                q, _, scale = quantize_tensor(full[path].to(torch.bfloat16))
                weights[path] = {"q": w.q.view(torch.uint8).cpu(), "scale": w.scale.cpu(),
                                 "ref_q": q.view(torch.uint8).cpu(), "ref_scale": scale.cpu()}
        out.setdefault("buffer_dtypes", {}).update({(u.name, key): buf.dtype
                                                    for key, buf in state.units[u.name].buffers.items()})
        state = lc.release(state, u.name)
    out["weights"] = weights
    out["graphed"] = graphed_losses(plan, tokens, modes=("eager", "attn", "attn+router"), steps=3)
    return out


def finetune_configs(rank, world, dp, ep):
    """Fine-tuning batches under ZeRO-3 x EP: packed rows (``segments``) and separate
    rows (``loss_mask``), and a batch whose ranks count very different numbers of
    targets; each rank's loss and the full gradients."""
    from ..test_finetune import PLAIN, fine_tuning_batch, packed_and_separate
    plan = fmoe.Plan(model=PLAIN, dp=dp, ep=ep, sharding="optim_grads_params", microbatches=2)
    params = fmoe.init(plan, seed=0)
    packed, separate = packed_and_separate()
    uneven = fine_tuning_batch(B=8, seed=3)
    uneven["loss_mask"][:4] = False  # rank 0's rows (of 2 ranks): one counted target
    uneven["loss_mask"][0, 5] = True
    uneven["segments"][0, 5:7] = uneven["segments"][0, 5]
    out = {}
    for name, batch in (("packed", packed), ("uneven", uneven), ("separate", separate)):
        if name == "separate":  # 11 rows: rank r takes its share of whole rows, padded by masked rows
            batch = {k: torch.cat([v, torch.zeros_like(v[:5])]) for k, v in batch.items()}
        mine = fmoe.local_batch(batch, plan, rank)
        step = fmoe.step(params, mine, plan)
        out[name] = {"loss": step.loss, "tokens": step.metrics["tokens"], "grads": fmoe.gather_full(step.grads, plan)}
    return out


# Adapters under each kind of plan (name -> world and Plan fields): ZeRO's three stages, expert, tensor
# (tp=4 copies the 2 key/value heads), pipeline, expert-tensor and context parallelism, and meshes of them
LORA_PLANS = {
    "dp2": (2, dict(dp=2)),
    "dp2_zero1": (2, dict(dp=2, sharding="optim")),
    "dp2_zero2": (2, dict(dp=2, sharding="optim_grads")),
    "dp2_zero3": (2, dict(dp=2, sharding="optim_grads_params")),
    "ep2": (2, dict(ep=2)),
    "tp2": (2, dict(tp=2)),
    "pp2": (2, dict(pp=2)),
    "dp2_ep2_zero3": (4, dict(dp=2, ep=2, sharding="optim_grads_params", microbatches=1)),
    "tp4": (4, dict(tp=4, microbatches=1)),
    "pp2_dp2_zero3_1f1b": (4, dict(pp=2, dp=2, sharding="optim_grads_params", schedule="1f1b_overlap",
                                   microbatches=1)),
    "dp2_etp2": (2, dict(dp=2, etp=2)),
    "cp2": (2, dict(cp=2)),
    "ep2_tokens_remat": (2, dict(ep=2, ep_exchange="tokens", remat="full")),
}


def lora_rows(plan):
    """``test_lora.lora_batch()``, its packed documents left out under context parallelism
    (which takes one sequence per row)."""
    from ..test_lora import lora_batch
    batch = lora_batch()
    return {"tokens": batch["tokens"]} if plan.cp > 1 else batch


def lora_configs(rank, world, names):
    """Each plan of ``LORA_PLANS`` named: this rank's loss and adapter gradients for its
    rows of one global batch, from its part of the base (``fmoe.init``, seed 11), and the
    kinds of the step's gradient collectives."""
    from ..test_lora import CFG, EVERY, random_adapters
    out = {}
    for name in names:
        plan = fmoe.Plan(model=CFG, lora=EVERY, **{"microbatches": 2, **LORA_PLANS[name][1]})
        base, adapters = fmoe.init(plan, seed=11), random_adapters(plan, seed=3)
        batch = fmoe.local_batch(lora_rows(plan), plan, rank)
        step = fmoe.step(adapters, batch, plan, base=base)
        frozen = fmoe.step(adapters, batch, plan, base=fmoe.lora.freeze(base, plan))
        summed = [e.kind for e in step.metrics["trace"] if e.purpose == "grads"]
        out[name] = {"loss": step.loss, "grads": fmoe.gather_full(step.grads, plan), "grads_summed": summed,
                     "frozen_same": torch.equal(frozen.loss, step.loss) and all(
                         torch.equal(x, y) for x, y in zip(optree.tree_leaves(frozen.grads), optree.tree_leaves(step.grads)))}
    return out


def ref_params_fp32(cfg):
    from ..reference import random_params
    return random_params(cfg, seed=11, dtype=torch.float32)
