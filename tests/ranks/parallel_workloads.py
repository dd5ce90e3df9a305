"""What the tensor-, expert-tensor- and context-parallel tests run on each rank
(importable by spawned workers)."""

from __future__ import annotations

import optree
import torch

import fmoe

# heads 4 over kv heads 2 (tp=4 holds copies of them), a dense layer, a shared expert,
# expert biases (fc2's added once under etp), q/k/v and output biases, per-head q/k norms
CFG = fmoe.ModelConfig(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, experts=4, topk=2, ffn=16, shared_ffn=8,
                       expert_biases=True, qkv_bias=True, out_bias=True, qk_norm="head", dense_layers=(0,),
                       dense_ffn=16)
STEPS = 3
INTERLEAVED = (("embed", "layers.0"), ("layers.1",), ("layers.2",), ("head",))

PLANS = {
    2: {"tp2": dict(tp=2),
        "tp2_overlap": dict(tp=2, schedule="1f1b_overlap", microbatches=4, loss_chunk=24),
        "tp2_standard": dict(tp=2, microbatches=4, loss_chunk=24),
        "cp2": dict(cp=2),
        "dp2_etp2": dict(dp=2, etp=2, sharding="optim_grads"),
        "tp2_compiled_selective": dict(tp=2, compile=True, remat="selective"),
        "pp2": dict(pp=2),
        "pp2_standard": dict(pp=2, microbatches=4),
        "pp2_overlap": dict(pp=2, microbatches=4, schedule="1f1b_overlap", delay_wgrad=True),
        "pp2_overlap_standard": dict(pp=2, microbatches=4, delay_wgrad=True),
        # interleaved: 4 stages of 5 members, the last one the head alone
        "pp2_v2": dict(pp=2, virtual_stages=2, pp_layout=INTERLEAVED),
        "pp2_v2_overlap": dict(pp=2, virtual_stages=2, pp_layout=INTERLEAVED, microbatches=4,
                               schedule="1f1b_overlap", delay_wgrad=True)},
    4: {"dp2_tp2_zero3": dict(dp=2, tp=2, sharding="optim_grads_params"),
        "dp2_tp2_zero3_overlap": dict(dp=2, tp=2, sharding="optim_grads_params", schedule="1f1b_overlap",
                                      delay_wgrad=True),
        "ep2_tp2_etp1": dict(ep=2, tp=2, sharding="optim_grads"),
        "ep2_tp2_etp2": dict(ep=2, tp=2, etp=2, sharding="optim_grads_params", schedule="1f1b_overlap",
                             delay_wgrad=True),
        "ep2_tp2_etp2_tokens": dict(ep=2, tp=2, etp=2, sharding="optim_grads_params", ep_exchange="tokens"),
        "dp2_cp2": dict(dp=2, cp=2, sharding="optim_grads_params", schedule="1f1b_overlap"),
        "cp2_tp2": dict(cp=2, tp=2, remat="full"),
        "tp4": dict(tp=4, sharding="optim"),
        "pp2_dp2_zero3": dict(pp=2, dp=2, sharding="optim_grads_params"),
        "pp2_ep2_zero3_overlap": dict(pp=2, ep=2, sharding="optim_grads_params", schedule="1f1b_overlap",
                                      delay_wgrad=True, microbatches=4),
        "pp2_tp2": dict(pp=2, tp=2, pp_layout=(("embed", "layers.0"), ("layers.1", "layers.2", "head")))},
}


def global_batch(rows: int = 8, seq: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, CFG.vocab, (rows, seq + 1), generator=g),
            "loss_mask": torch.rand(rows, seq, generator=g) > 0.25}


def plan_of(kw: dict) -> fmoe.Plan:
    return fmoe.Plan(**dict({"model": CFG, "microbatches": 2}, **kw))


def train(plan: fmoe.Plan, batch: dict, steps: int = STEPS, params=None, state=None) -> dict:
    """``steps`` of step + AdamW on ``batch`` (this rank's part): the losses, the first
    step's gradients (and trace) and the last params, gathered whole."""
    params = fmoe.init(plan, seed=0) if params is None else params
    # eps above the rounding noise of gradients that cancel to about zero (~1e-10 here):
    # with 1e-8, Adam turns that noise into steps of up to lr / 100, which differ between
    # layouts that round differently
    opt = fmoe.adamw(lr=1e-2, eps=1e-6, weight_decay=0.1, max_grad_norm=0.5, plan=plan)
    state = opt.init(params) if state is None else state
    losses, first, trace = [], None, None
    for _ in range(steps):
        out = fmoe.step(params, batch, plan)
        losses.append(out.loss)
        if first is None:
            first, trace = fmoe.gather_full(out.grads, plan), out.metrics["trace"]
        params, state = opt.update(out.grads, state, params)
        params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], plan.model.expert_bias_rate)
    cpu = lambda tree: optree.tree_map(lambda t: t.cpu(), tree)  # noqa: E731
    return {"losses": torch.stack(losses), "grads": cpu(first), "params": cpu(fmoe.gather_full(params, plan)),
            "tokens": out.metrics["tokens"], "state": state, "last": params, "trace": trace}


def mesh_ranks(plan: fmoe.Plan) -> dict:
    """``{group name: world ranks}`` of this rank's groups under ``plan`` (its mesh)."""
    import torch.distributed as dist
    from fmoe.resolve import resolve

    mesh = resolve(plan).mesh
    groups = {"tp": mesh.tp, "cp": mesh.cp, "ep": mesh.ep, "etp": mesh.etp, "edp": mesh.edp,
              "tensor_data": mesh.tensor_data}
    return {name: tuple(range(dist.get_world_size())) if g.group is dist.group.WORLD else
            (tuple(dist.get_process_group_ranks(g.group)) if g.group is not None else (dist.get_rank(),))
            for name, g in groups.items()}


def gradients_group(plan: fmoe.Plan) -> dict:
    """Interleaving's group for the stream's gradients, asked of two resolves of ``plan``:
    whether they are one group (made once per layout, not per step), not the world's,
    and its ranks."""
    import torch.distributed as dist
    from fmoe.resolve import resolve

    first, again = (resolve(plan).mesh.pp_gradients.group for _ in range(2))
    return {"once": first is again, "own": first is not dist.group.WORLD,
            "ranks": tuple(dist.get_process_group_ranks(first))}


# Where CUDA-graphed scopes take the tensor-parallel groups: every scope, before capture
SCOPE_PLANS = {2: dict(tp=2), 4: dict(ep=2, tp=2, etp=2, sharding="optim_grads_params",
                                      model=CFG.replace(capacity_factor=1.5))}


def scope_steps(plan: fmoe.Plan, rank: int) -> dict:
    """One step through ``interop.cuda_graph``'s scope kernels as they record (the flat
    argument lists the graphs are made from, the groups passed through) and one plain
    step: ``{"scoped" | "plain": (loss, grads)}``."""
    from interop.capturable import SCOPES
    from interop.graph_scopes import _ScopeGraphs

    params, batch = fmoe.init(plan, seed=0), fmoe.local_batch(global_batch(), plan, rank)
    graphs = _ScopeGraphs(plan, SCOPES)
    runs = {"scoped": fmoe.step(params, batch, plan, graphs.kernels()), "plain": fmoe.step(params, batch, plan)}
    assert {key[0] for key in graphs.samples} == set(SCOPES)
    return {name: (out.loss, out.grads) for name, out in runs.items()}


def parallel_plans(rank: int, world: int, checkpoint=None) -> dict:
    """Every plan of ``PLANS[world]`` trained on this rank's part of the global batch;
    with ``checkpoint`` (a directory), also one saved under ``dp2_tp2_zero3`` after its
    steps and loaded under ``ep2_tp2_etp2``, which trains on from it, and under
    ``pp2_dp2_zero3``; and ``pp2_dp2_zero3``'s own saved at ``checkpoint`` + ``_pp``."""
    out = {}
    for name, kw in PLANS[world].items():
        plan = plan_of(kw)
        res = train(plan, fmoe.local_batch(global_batch(), plan, rank))
        res["purposes"] = sorted({e.purpose for e in res.pop("trace")})
        if checkpoint is not None and name in ("dp2_tp2_zero3", "pp2_dp2_zero3"):
            fmoe.save(f"{checkpoint}{'_pp' if plan.pp > 1 else ''}", plan, res["last"], opt_state=res["state"],
                      step=STEPS)
        out[name] = {k: v for k, v in res.items() if k not in ("state", "last")}
    out["mesh"] = mesh_ranks(plan_of(dict(ep=2, tp=2, etp=2) if world == 4 else dict(cp=2)))
    out["scopes"] = scope_steps(plan_of(SCOPE_PLANS[world]), rank)
    if world == 2:
        out["gradients_group"] = gradients_group(plan_of(PLANS[2]["pp2_v2"]))
    if checkpoint is not None:
        plan = plan_of(PLANS[4]["ep2_tp2_etp2"])
        ck = fmoe.load(checkpoint, plan)
        res = train(plan, fmoe.local_batch(global_batch(), plan, rank), 2, ck.params, ck.opt_state)
        out["resumed"] = {"loaded": fmoe.gather_full(ck.params, plan), "losses": res["losses"]}
        plan = plan_of(PLANS[4]["pp2_dp2_zero3"])  # and into pipeline stages
        out["resumed_pp"] = {"loaded": fmoe.gather_full(fmoe.load(checkpoint, plan).params, plan)}
    return out

