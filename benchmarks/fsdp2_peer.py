"""fmoe vs a peer on PyTorch's own FSDP2 (``fully_shard``): same layers, batch, precision.

    torchrun --nproc-per-node 2 benchmarks/fsdp2_peer.py [--layers 6 --dim 2048 ...]

The peer is what a user would write with hooks: ``nn.Module``s per layer whose
forward calls fmoe's pure layer functions (``fmoe.layers.block``: the same
attention, router, permute, grouped GEMMs and, under expert parallelism, the same
all-to-alls), each layer and the root wrapped in ``fully_shard`` with
``MixedPrecisionPolicy(bf16 params, fp32 reduce)``, trained with ``torch.optim.AdamW``
(foreach) and one ``backward()`` per microbatch. fmoe runs ``fmoe.step`` +
``fmoe.adamw`` (the optax-style chain, and ``fused=True``) under the matching plan.
Neither clips gradients.

Meshes: dp=2 ZeRO-3 (FSDP2 shards everything; fmoe ``optim_grads_params``) and
dp=1 x ep=2 (each rank owns half the experts, left out of FSDP2 with
``ignored_params`` and cast to bf16 in forward; dense weights sharded over both
ranks, as fmoe's ZeRO-3 does). Prints tokens/s and peak memory side by side, as a
table last; ``--device cpu`` runs a small smoke version on gloo.
"""

from __future__ import annotations

import statistics
import time

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fmoe
from fmoe.layers import block
from fmoe.layers.expert_parallel import ExpertParallel
from fmoe.layers.norm import rms_norm
from fmoe.layers.precision import upcast
from fmoe.params import init_full, named_leaves
from fmoe.shard.comm import Group
from fsdp_step import lm_config, lm_parser, shard_of
from interop.module import _child, _tree_of

PEAK_TFLOPS = 789.0


def parse():
    ap = lm_parser()
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a gloo smoke run")
    return ap.parse_args()


class PeerLayer(nn.Module):
    """One transformer layer whose forward is ``fmoe.layers.block``."""

    def __init__(self, tree: dict, cfg: fmoe.ModelConfig, ep: ExpertParallel | None):
        super().__init__()
        self.params = _child(tree)
        self.cfg, self.ep = cfg, ep

    def forward(self, h_BSD, dtype):
        p = _tree_of(self.params)
        if self.ep is not None:  # experts are not FSDP2's: cast them like its policy casts the rest
            p["moe"]["experts"] = {k: v.to(dtype) for k, v in p["moe"]["experts"].items()}
        return block(p, h_BSD, self.cfg, "torch", self.ep)[0]


class Peer(nn.Module):
    def __init__(self, full: dict, cfg: fmoe.ModelConfig, ep: ExpertParallel | None, ep_rank: int):
        super().__init__()
        full = optree.tree_map(lambda t: t.clone(), full)
        for layer in full["layers"]:
            if ep is not None:
                El = ep.experts_per_rank
                layer["moe"]["experts"] = {k: v[ep_rank * El:(ep_rank + 1) * El].clone()
                                           for k, v in layer["moe"]["experts"].items()}
        self.embed = nn.Parameter(full["embed"])
        self.layers = nn.ModuleList(PeerLayer(layer, cfg, ep) for layer in full["layers"])
        self.final_norm = nn.Parameter(full["final_norm"])
        self.head = nn.Parameter(full["head"])
        self.cfg = cfg

    def forward(self, tokens, total_targets, dtype):
        h = self.embed[tokens[:, :-1]]
        for layer in self.layers:
            h = layer(h, dtype)
        logits = rms_norm(h, self.final_norm, self.cfg.norm_eps) @ self.head
        ce = F.cross_entropy(upcast(logits).flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        return ce / total_targets


def build_peer(full, cfg, ep_size, rank, device, dtype):
    world = dist.get_world_size()
    ep = ExpertParallel(Group(world, rank, dist.group.WORLD), cfg.experts // ep_size) if ep_size > 1 else None
    model = Peer(full, cfg, ep, rank).to(device)
    mesh = init_device_mesh(device, (world,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    experts = {p for layer in model.layers for p in layer.params.moe.experts.parameters()} if ep else None
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, ignored_params=experts)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=experts)
    return model


def timed(step, args, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), loss


def run_peer(full, cfg, ep_size, tokens, total, args, rank, dtype):
    model = build_peer(full, cfg, ep_size, rank, args.device, dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    # foreach kernels take either FSDP2's DTensors or the plain expert tensors, not both.
    groups = [[p for p in trained if isinstance(p, DTensor)], [p for p in trained if not isinstance(p, DTensor)]]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-4, weight_decay=0.1, foreach=True)

    def step():
        loss = 0.0
        for mb in tokens.chunk(args.microbatches):
            part = model(mb, total, dtype)
            part.backward()
            loss += part.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step_s, loss = timed(step, args, args.device)
    dist.all_reduce(loss)  # each rank's share of the global mean, as fmoe's loss is
    return step_s, loss


def run_fmoe(full, plan, tokens, args, rank, fused: bool):
    params = shard_of(list(named_leaves(full).items()), plan, rank) if args.device == "cuda" else \
        fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=fused)
    state = {"params": params, "opt": opt.init(params)}

    def step():
        out = fmoe.step(state["params"], {"tokens": tokens}, plan)
        state["params"], state["opt"] = opt.update(out.grads, state["opt"], state["params"])
        return out.loss

    return timed(step, args, args.device)


def main():
    args = parse()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    cfg = lm_config(args)
    dtype = torch.bfloat16
    full = init_full(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(rank)).to(args.device)
    total = args.batch * args.seq * world
    rows = []
    for mesh, dp, ep in (("dp2 ZeRO-3", world, 1), ("dp1 x ep2", 1, world)):
        for system in ("fmoe", "fmoe, fused AdamW", "FSDP2 peer"):
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if system.startswith("fmoe"):
                plan = fmoe.Plan(model=cfg, dp=dp, ep=ep, sharding="optim_grads_params",
                                 microbatches=args.microbatches, dtype="bfloat16", device=args.device)
                step_s, loss = run_fmoe(full, plan, tokens, args, rank, fused="fused" in system)
            else:
                step_s, loss = run_peer(full, cfg, ep, tokens, total, args, rank, dtype)
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
            rows.append((mesh, system, step_s, total / step_s, peak, float(loss)))
            if rank == 0:
                print(f"  done {mesh} {system}: {step_s * 1e3:.1f} ms", flush=True)
    flops = fmoe.train_flops_per_token(cfg, args.seq) * total
    if rank == 0:
        print(f"\nD={cfg.dim}, {cfg.layers} layers, E={cfg.experts} top-{cfg.topk} F={cfg.ffn}, vocab {cfg.vocab}; "
              f"{world} ranks x {args.batch} x {args.seq} tokens, {args.microbatches} microbatches, bf16; "
              f"median of {args.steps} steps (step + AdamW)")
        print(f"{'mesh':12s} {'system':18s} {'step ms':>8s} {'tokens/s':>9s} {'MFU':>6s} {'peak GiB':>9s} "
              f"{'vs peer':>8s} {'last loss':>9s}")
        for mesh, system, step_s, tps, peak, loss in rows:
            peer = next(r for r in rows if r[0] == mesh and r[1] == "FSDP2 peer")
            mfu = flops / step_s / world / (PEAK_TFLOPS * 1e12)
            print(f"{mesh:12s} {system:18s} {step_s * 1e3:8.1f} {tps:9.0f} {mfu:6.1%} {peak:9.2f} "
                  f"{peer[2] / step_s:7.2f}x {loss:9.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
