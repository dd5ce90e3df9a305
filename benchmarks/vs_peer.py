"""fmoe vs an independent plain-PyTorch MoE LM (``benchmarks/peer.py``), side by side
in one process: same model, batches, learning rate and precision. For each shape:
the peer eager, the peer with each block ``torch.compile``d (as torchtitan), then fmoe
(eager, and with ``Plan(compile=True)`` unless ``--fmoe-compile off``, or only compiled
with ``--fmoe-compile only``; also with its whole step replayed from a CUDA graph,
``interop.capture_step``, on every mesh without a dropless exchange over expert ranks,
unless ``--fmoe-graph off``).

    python benchmarks/vs_peer.py                                        # 1 GPU, --shape coarse
    python benchmarks/vs_peer.py --shapes coarse fine qwen3-moe-medium  # 1 GPU, three shapes
    torchrun --nproc-per-node 2 benchmarks/vs_peer.py --meshes dp dp1ep2
    torchrun --nproc-per-node 2 benchmarks/vs_peer.py --shapes fine --microbatches 4 \
        --peers --meshes dp1ep2 dp1ep2+1f1b+dw --profile      # the overlap schedule, no peer
    python benchmarks/vs_peer.py --out scale.jsonl; torchrun --nproc-per-node 2 \
        benchmarks/vs_peer.py --meshes dp dp1ep2 --out scale.jsonl    # + a weak-scaling table
    python benchmarks/vs_peer.py --device cpu --shapes coarse fine qwen3-moe-medium  # tiny smoke run
    torchrun --nproc-per-node 2 benchmarks/vs_peer.py --device cpu --meshes dp dp1ep2   # gloo
    python benchmarks/vs_peer.py --check --shapes coarse fine qwen3-moe-medium    # CPU fp32 parity
    python benchmarks/vs_peer.py --shapes qwen3-moe-medium glm4.5-medium gpt-oss-medium deepseek-v3-medium

Shapes (``--shape NAME`` or ``--shapes NAME...``; model flags such as ``--layers``
override the shape's value; aux-loss coefficient 0 on both sides unless --aux-loss):
  coarse: vocab 32000, D=2048, 8 layers, 16 heads, E=16 experts of F=1408, top-4 (issue 14).
  fine: the same with E=64 of F=704, top-8.
  qwen3-moe-medium: the model of ``fmoe/trainer/presets/qwen3-moe-medium.toml`` (D=1536,
    16 layers, 16 heads, 4 KV heads of 128, per-head q/k RMSNorm, E=64 of F=512, top-8,
    renormalised, rope_theta 1e6, eps 1e-6) with vocab 32000.
  glm4.5-medium, gpt-oss-medium, deepseek-v3-medium: the models of those presets, each
    with vocab 32000 (GLM-4.5: a dense first layer, sigmoid routing with the selection
    bias, routed scaling, a shared expert, partial RoPE, q/k/v bias; GPT-OSS: sinks,
    128-token windows on every other layer, attention and expert biases, topk_softmax
    with a router bias, the clamped SwiGLU, YaRN; DeepSeek-V3: multi-head latent
    attention, a dense first layer, group-limited sigmoid routing, routed scaling, a
    shared expert). The peer runs their attention as its users do on a GPU (see
    ``peer.py``: FlexAttention for sinks and windows, SDPA for MLA).
  qwen3-30b-a3b: the preset's model (Qwen3-30B-A3B's shape; vocab 32000 unless --vocab),
    named only on purpose: no GPU holds it whole, so give --layers (24: half depth).
8 x 2048 tokens per GPU per step in 1 microbatch; bf16 compute, fp32 params and AdamW
state. ``--device cpu`` shrinks each shape to a toy that runs in seconds (fp32, gloo),
keeping what tells it apart (top-k, GQA, head size, qk norm, and each preset's
features: ``CPU_SHAPES``).

The peer: plain on one GPU, FSDP2 (``fully_shard`` per block and the root, bf16 params /
fp32 reduce; compiled blocks are compiled before ``fully_shard``) over all ranks
otherwise (``--peers`` picks eager, compiled, both or neither). Each system is freed
(and dynamo's caches reset) before the next; fmoe runs each mesh of ``--meshes``: ``dp``
(``no_shard`` on one rank, ZeRO-3 ``optim_grads_params`` over all ranks otherwise) or
``dpXepY`` (X * Y ranks, ZeRO-3 with expert parallelism; also ``tpZ`` and ``cpW``,
tensor and context parallelism, e.g. ``dp1tp2``, ``dp1ep2tp2``), each optionally
followed by ``+1f1b`` (``schedule="1f1b_overlap"``; give it ``--microbatches`` >= 2),
``+dw`` (``delay_wgrad``), ``+tokens`` (``ep_exchange="tokens"``: a token crosses to a
rank once, not once per expert) and ``+capF`` (a static expert capacity,
``capacity_factor=F``: the exchange without a host read, assignments past it dropped). A
step is forward + backward + the AdamW update on both sides; neither clips gradients;
the median over ``--steps`` timed steps after ``--warmup``. The first step's time is
shown apart: for compiled systems it is the compile time (plus one step). MFU counts the
active parameters' FLOPs plus attention (``fmoe.train_flops_per_token``, the same model
on both sides) against 789 TFLOP/s per GPU. Prints a markdown table per shape, with each
system's loss after its last step (both start from a std-0.02 init and see the same
batches, so they should be close), and on expert-parallel meshes the last step's busiest
expert rank: its routed rows over an even share (mean and most over the layers; learned
routing starts far from balance, and an expert-parallel step waits for that rank), then a
summary over the shapes (fmoe on the first mesh).

``--profile``: one more step of each system under ``torch.profiler`` (rank 0's GPU):
the NCCL kernels' time, the part of it with no compute kernel on any stream
(exposed) and the GPU's idle time (the profiled step's wall time with no kernel
running: host waits such as the dropless exchange's read of split sizes).
``--out FILE``: rank 0 appends each row to a JSON-lines file and prints a weak-scaling
table of every row in it: tokens/s per GPU against the same shape and system on one
GPU (fmoe's ``dp`` row there is the baseline of each of its meshes).

``--check`` (CPU, fp32, one process): for each shape's toy, copies fmoe's initial
weights into the peer and compares the loss and gradients of one batch, then the
compiled peer's against the eager peer's; exits 1 on a mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import tomllib
from pathlib import Path

import optree
import torch
import torch.distributed as dist

import fmoe
import peer
from interop.cuda_graph import capture_scopes, capture_step
from fsdp_step import lm_parser
from kernel_time import exposure

PEAK_TFLOPS = 789.0  # dense bf16 GEMM ceiling of one H100/H200 (the other benchmarks' figure)
PRESETS = Path(fmoe.__file__).parent / "trainer" / "presets"
MODEL_FLAGS = ("vocab", "dim", "layers", "heads", "kv_heads", "head_size", "qk_norm", "experts", "topk", "ffn")


def preset_model(preset: str) -> dict:
    """A shipped preset's model fields (the ModelConfig ones; its layer lists, "0,2" in
    TOML, as tuples), vocab 32000, no aux loss."""
    fields = tomllib.loads((PRESETS / f"{preset}.toml").read_text())
    names = {f.name for f in dataclasses.fields(fmoe.ModelConfig)}
    model = {k: v for k, v in fields.items() if k in names}
    for name in ("dense_layers", "window_layers"):
        if isinstance(model.get(name), str):
            model[name] = tuple(int(i) for i in model[name].split(",") if i.strip())
    return {**model, "vocab": 32000, "aux_loss_coef": 0.0}


def qwen3_moe_medium() -> dict:
    return preset_model("qwen3-moe-medium")


COARSE = dict(vocab=32000, dim=2048, layers=8, heads=16, experts=16, topk=4, ffn=1408)
PRESET_SHAPES = ("qwen3-moe-medium", "glm4.5-medium", "gpt-oss-medium", "deepseek-v3-medium")
SHAPES = {"coarse": lambda: COARSE, "fine": lambda: {**COARSE, "experts": 64, "topk": 8, "ffn": 704},
          **{name: functools.partial(preset_model, name) for name in PRESET_SHAPES}}
# Shapes no single GPU holds, run only when named (other scripts default to every one of SHAPES):
# qwen3-30b-a3b is the preset's model (give --layers 24 for half depth, --vocab 151936, --seq 4096).
LARGE_SHAPES = {"qwen3-30b-a3b": functools.partial(preset_model, "qwen3-30b-a3b")}
# The CPU toys: small widths, the shape's routing and attention kept (GLM: a dense first
# layer, a shared expert, partial RoPE; GPT-OSS: one windowed and one full layer, a window
# shorter than the toy's rows; DeepSeek-V3: MLA with both low-rank projections, groups).
TOY = dict(vocab=512, dim=64, layers=2, heads=4, ffn=64)
CPU_SHAPES = {"coarse": dict(experts=8, topk=4), "fine": dict(experts=16, topk=8, ffn=32),
              "qwen3-moe-medium": dict(experts=16, topk=8, ffn=32, kv_heads=2, head_size=32),
              "qwen3-30b-a3b": dict(experts=16, topk=8, ffn=32, kv_heads=2, head_size=32),
              "glm4.5-medium": dict(layers=3, experts=16, topk=4, ffn=32, shared_ffn=32, dense_ffn=128,
                                    kv_heads=2, head_size=32),
              "gpt-oss-medium": dict(experts=8, topk=4, ffn=32, kv_heads=2, head_size=16, sliding_window=16, glu_limit=0.3,
                                     window_layers=(0,)),
              "deepseek-v3-medium": dict(layers=3, experts=16, topk=4, ffn=32, shared_ffn=32, dense_ffn=128,
                                         expert_groups=4, topk_groups=2, head_size=24, rope_head_dim=8,
                                         v_head_size=16, q_lora_rank=32, kv_lora_rank=32)}
GPU_RUN = dict(microbatches=1, warmup=3, steps=10)
CPU_RUN = dict(batch=2, seq=64, microbatches=1, warmup=1, steps=3)


def parse(more=None):
    """The flags; ``more(ap)`` adds a calling script's own."""
    ap = lm_parser(microbatches=1)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a tiny smoke run on gloo")
    ap.add_argument("--shape", choices=(*SHAPES, *LARGE_SHAPES), help="one model shape (default coarse)")
    ap.add_argument("--shapes", nargs="+", choices=(*SHAPES, *LARGE_SHAPES), help="several shapes, one table each")
    ap.add_argument("--meshes", nargs="+", default=["dp"],
                    help="fmoe meshes: dp or dpX[epY][tpZ][cpW] (e.g. dp1ep2, dp1tp2), each optionally +1f1b (1f1b_overlap) "
                         "and +dw (delay_wgrad), e.g. dp1ep2+1f1b+dw")
    ap.add_argument("--peers", nargs="*", default=["eager", "compiled"], choices=("eager", "compiled"),
                    help="which peers run (none: --peers alone)")
    ap.add_argument("--peer-mla-values", default="native", choices=("native", "padded"),
                    help="MLA shapes: the peer's values into SDPA as they are (torchtitan; cuDNN or "
                         "memory-efficient attention) or zero-padded to the q/k head size (flash)")
    ap.add_argument("--profile", action="store_true",
                    help="one more step per system under the profiler: NCCL time, exposed part, GPU idle")
    ap.add_argument("--out", help="append rows to this JSON-lines file and print its weak-scaling table")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--aux-loss", type=float, default=0.0,
                    help="the router's load-balancing loss coefficient on both sides (0: none; without it "
                         "routing drifts from balance over the steps, which slows expert-parallel meshes, not "
                         "data-parallel ones)")
    ap.add_argument("--fmoe-compile", default="auto", choices=("auto", "off", "only"),
                    help="auto: fmoe also with Plan(compile=True) where Plan has that field; only: just with it")
    ap.add_argument("--fmoe-graph", default="auto", choices=("auto", "off"),
                    help="auto: fmoe also with its whole step captured as a CUDA graph (meshes without a "
                         "dropless exchange over expert ranks)")
    ap.add_argument("--check", action="store_true",
                    help="CPU fp32: the peer with fmoe's weights gives fmoe's loss; compiled peer = eager")
    if more is not None:
        more(ap)
    ap.set_defaults(**{name: None for name in MODEL_FLAGS})  # unset: the shape's value
    known, _ = ap.parse_known_args()
    ap.set_defaults(**(CPU_RUN if known.device == "cpu" or known.check else GPU_RUN))
    args = ap.parse_args()
    args.shapes = args.shapes or [args.shape or "coarse"]
    return args


def shape_config(name: str, args, toy: bool, aux_loss: float = 0.0) -> fmoe.ModelConfig:
    """The shape's ModelConfig (its toy on the CPU), with any model flag given overriding;
    ``aux_loss``: the router's balancing-loss coefficient (``--aux-loss``)."""
    shape = {**SHAPES, **LARGE_SHAPES}[name]
    fields = {**shape(), **TOY, **CPU_SHAPES[name]} if toy else dict(shape())
    fields.update({k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None})
    return fmoe.ModelConfig(**{**fields, "aux_loss_coef": aux_loss})


def describe(cfg: fmoe.ModelConfig) -> str:
    """The shape's attention and MLP in a few words (what sets it apart)."""
    if cfg.kv_lora_rank:
        attn = (f"{cfg.heads} heads of {cfg.head_dim} (rope {cfg.rope_head_dim}) / values of {cfg.v_head_dim}, MLA "
                f"(q_lora {cfg.q_lora_rank or '-'}, kv_lora {cfg.kv_lora_rank}"
                + (", interleaved" if cfg.rope_interleave else "") + ")")
    else:
        attn = (f"{cfg.heads} heads" + (f" / {cfg.num_kv_heads} KV" if cfg.num_kv_heads != cfg.heads else "")
                + f" of {cfg.head_dim}" + (f", qk_norm {cfg.qk_norm}" if cfg.qk_norm != "none" else "")
                + (f", rope on {cfg.rope_dims}" if cfg.rope_dims != cfg.head_dim else "")
                + (", qkv bias" if cfg.qkv_bias else "") + (", out bias" if cfg.out_bias else "")
                + (", sinks" if cfg.attn_sinks else "")
                + (f", window {cfg.sliding_window} on {len(cfg.window_layers)} layers" if cfg.window_layers else ""))
    rope = f"rope_theta {cfg.rope_theta:g}" + (f" yarn x{cfg.rope_factor:g}" if cfg.rope_scaling == "yarn" else "")
    route = (f"{cfg.score_func}" + (f", groups {cfg.topk_groups}/{cfg.expert_groups}" if cfg.expert_groups > 1 else "")
             + (f", scaling {cfg.routed_scaling:g}" if cfg.routed_scaling != 1 else "")
             + (", router bias" if cfg.router_bias else "") + (", expert biases" if cfg.expert_biases else ""))
    mlp = (f"E={cfg.experts} top-{cfg.topk} F={cfg.ffn} {cfg.activation} ({route})"
           + (f" + shared F={cfg.shared_ffn}" if cfg.shared_ffn else "")
           + (f", dense layers {list(cfg.dense_layers)} F={cfg.dense_ffn}" if cfg.dense_layers else ""))
    return f"{attn}, {rope}, {mlp}"


def fmoe_has_compile(args) -> bool:
    return args.fmoe_compile != "off"


def fmoe_compiles(args) -> tuple[bool, ...]:
    """The ``Plan.compile`` values fmoe runs with (``--fmoe-compile``)."""
    return {"auto": (False, True), "off": (False,), "only": (True,)}[args.fmoe_compile]


def fmoe_graphs(args, bench) -> bool:
    """``--fmoe-graph auto``: fmoe also as a whole-step CUDA graph (on CUDA, for the meshes
    ``whole_step_graphable`` allows)."""
    return args.fmoe_graph == "auto" and bench.device == "cuda"


def whole_step_graphable(mesh_name: str, world: int) -> bool:
    """Whether a ``--meshes`` entry's step can be one CUDA graph: no dropless exchange
    over expert ranks (its split sizes are read on the host), no context parallelism,
    no scopes graphed already."""
    mesh = mesh_of(mesh_name, world)
    return (mesh["ep"] == 1 or mesh["capacity_factor"] > 0) and mesh["cp"] == 1 and not mesh["scopes"]


def fmoe_optimizer(plan: fmoe.Plan, lr: float) -> fmoe.Optimizer:
    """fmoe's side of the comparison: fused AdamW, no clipping. ``donate=True`` writes
    the update into the tensors passed in, as torch.optim.AdamW updates its params in
    place."""
    return fmoe.adamw(lr=lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, plan=plan, fused=True, donate=True)


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def mesh_of(name: str, world: int) -> dict:
    """The Plan fields of a ``--meshes`` entry: ``dp`` -> dp=world; ``dpX`` followed by any
    of ``epY``, ``tpZ``, ``cpW`` (in that order) -> those degrees (their product must be
    the world size; tensor and context parallel ranks share rows of the global batch,
    ``fmoe.local_batch``); ``+1f1b`` -> the overlap schedule, ``+dw`` -> delayed weight
    gradients, ``+tokens`` -> ``ep_exchange='tokens'``, ``+capF`` -> a static expert capacity
    of F x the even share (``ModelConfig.capacity_factor``: no host read of split sizes;
    assignments past it dropped), ``+graphs`` -> each layer's attention and router replayed
    from CUDA graphs (``interop.capture_scopes``, the trainer's ``--cuda-graph attn,router``),
    ``+dispatch`` -> the permutation's index work too (``--cuda-graph ...,dispatch``)."""
    options_re = r"((?:\+1f1b|\+dw|\+tokens|\+graphs|\+dispatch|\+cap\d+(?:\.\d+)?)*)"
    m = re.fullmatch(r"dp(?:(\d+)(?:ep(\d+))?(?:tp(\d+))?(?:cp(\d+))?)?" + options_re, name)
    degrees = [int(d) if d else 1 for d in m.groups()[:4]] if m and m[1] else [world, 1, 1, 1]
    options = m[5].split("+")[1:] if m else []
    caps = [float(o[3:]) for o in options if o.startswith("cap")]
    if not m or math.prod(degrees) != world or len(set(options)) != len(options) or len(caps) > 1:
        raise SystemExit(f"--meshes {name!r}: want 'dp' or 'dpX' with any of 'epY', 'tpZ', 'cpW' after it, the "
                         f"degrees' product {world} ranks, optionally followed by '+1f1b', '+dw', '+tokens', "
                         "'+graphs', '+dispatch' and/or '+capF' once each")
    dp, ep, tp, cp = degrees
    return dict(dp=dp, ep=ep, tp=tp, cp=cp, schedule="1f1b_overlap" if "1f1b" in options else "standard",
                delay_wgrad="dw" in options, ep_exchange="tokens" if "tokens" in options else "rows",
                capacity_factor=caps[0] if caps else 0.0,
                scopes=(("attn", "router") if "graphs" in options else ())
                + (("dispatch",) if "dispatch" in options else ()))


class Bench:
    """What both systems share: the ranks, the batches and the timing."""

    def __init__(self, args):
        self.args, self.device = args, args.device
        self.distributed = "RANK" in os.environ  # started by torchrun
        if self.distributed:
            dist.init_process_group("nccl" if self.device == "cuda" else "gloo")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if self.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.batches = []

    def draw(self, vocab: int):
        """Batch i of this rank: the same tokens for every system, drawn once, outside the
        timing; ``rows(i, block)``: batch i of row block ``block`` (a rank's on a ``dp`` or
        ``ep`` mesh), from which tensor- and context-parallel meshes build theirs."""
        args = self.args

        def rows(i, rank):
            return torch.randint(0, vocab, (args.batch, args.seq + 1),
                                 generator=torch.Generator().manual_seed(i * self.world + rank))

        steps = range(args.warmup + args.steps)
        self.batches = [rows(i, self.rank).to(self.device) for i in steps]
        self.rows = rows

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
        if self.distributed:
            dist.barrier()

    def fresh_memory(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else float("nan")

    def profiled(self, step) -> dict:
        """One more ``step`` under the profiler (batch 0 again): milliseconds of NCCL
        kernels, of their exposed part, and of GPU idle time within the step's wall time."""
        if not (self.args.profile and self.device == "cuda"):
            return {}
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step(self.batches[0])
            self.sync()
            wall_ms = (time.perf_counter() - t0) * 1e3
        ms = exposure(prof)
        return {"comm_ms": ms["comm"], "exposed_ms": ms["exposed"], "idle_ms": wall_ms - ms["busy"],
                "profiled_ms": wall_ms}

    def timed(self, step) -> tuple[float, float, torch.Tensor]:
        """Median seconds of ``step(tokens)`` over the timed steps, the first step's
        seconds (compilation included) and the last loss."""
        times, loss = [], None
        for tokens in self.batches:
            self.sync()
            t0 = time.perf_counter()
            loss = step(tokens)
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[self.args.warmup:]), times[0], loss

    def say(self, *parts):
        if self.rank == 0:
            print(*parts, flush=True)


def run_peer(bench: Bench, cfg: fmoe.ModelConfig, compile: bool) -> dict:
    args = bench.args
    model = peer.build(cfg, bench.device, seed=0, compile=compile,  # blocks compiled before fully_shard
                       mla_pad_values=args.peer_mla_values == "padded")
    params = sum(p.numel() for p in model.parameters())
    if bench.world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        model = peer.shard(model, init_device_mesh(bench.device, (bench.world,)))
        mesh = f"dp{bench.world} FSDP2"
    else:
        mesh = "1 rank, plain"
    opt = peer.optimizer(model, args.lr)
    bench.fresh_memory()

    def step(tokens):
        return peer.train_step(model, opt, tokens, args.microbatches)

    step_s, first_s, loss = bench.timed(step)
    peak = bench.peak_gib()
    if bench.distributed:  # each rank's mean -> the global batch's mean, as fmoe reports
        dist.all_reduce(loss)
        loss = loss / bench.world
    system = ("peer, compiled blocks" if compile else "peer, eager") \
        + (", MLA values padded" if cfg.kv_lora_rank and args.peer_mla_values == "padded" else "")
    return dict(system=system, mesh=mesh, mesh_name="dp",
                step_s=step_s, first_s=first_s, peak=peak, loss=float(loss), params=params, compiled=compile,
                **bench.profiled(step))
    # the model and its optimizer go with this frame; the caller frees the memory


def run_fmoe(bench: Bench, cfg: fmoe.ModelConfig, mesh_name: str, compile: bool, graph: bool = False,
             **plan_fields) -> dict:
    """fmoe's step + fused AdamW; ``graph``: the step replayed from one CUDA graph
    (``interop.capture_step``, captured on the first batch) that reads the params'
    tensors, which the donating optimizer updates in place. ``plan_fields``: more Plan
    fields (``fp8="rowwise"``), named in the row's system."""
    args = bench.args
    mesh = mesh_of(mesh_name, bench.world)
    cfg = dataclasses.replace(cfg, capacity_factor=mesh.pop("capacity_factor"))
    scopes = mesh.pop("scopes")
    sharding = "no_shard" if bench.world == 1 else "optim_grads_params"
    plan = fmoe.Plan(model=cfg, **mesh, sharding=sharding, microbatches=args.microbatches,
                     dtype="bfloat16" if bench.device == "cuda" else "float32", device=bench.device,
                     **({"compile": True} if compile else {}), **plan_fields)
    opt = fmoe_optimizer(plan, args.lr)
    held = {"params": fmoe.init(plan, seed=0)}
    held["state"] = opt.init(held["params"])

    # tensor- and context-parallel ranks share rows: --batch rows per row block (per model
    # replica), each rank its part (fmoe.local_batch), so such a mesh has fewer tokens per GPU
    blocks = plan.dp * plan.ep
    cut = plan.tp > 1 or plan.cp > 1
    local = {id(t): fmoe.local_batch({"tokens": torch.cat([bench.rows(i, b) for b in range(blocks)])}, plan,
                                     bench.rank)["tokens"].to(bench.device)
             for i, t in enumerate(bench.batches)} if cut else {}

    def step(tokens):
        batch = {"tokens": local.get(id(tokens), tokens)}
        if graph and "graph" not in held:
            held["graph"] = capture_step(held["params"], batch, plan, donate=True)
        if scopes and "kernels" not in held:
            held["kernels"] = capture_scopes(held["params"], batch, plan, scopes)
        out = held["graph"](held["params"], batch) if graph else fmoe.step(held["params"], batch, plan,
                                                                            held.get("kernels"))
        held["params"], held["state"] = opt.update(out.grads, held["state"], held["params"])
        held["counts"] = out.metrics["expert_counts"]  # read once, after the timing
        return out.loss

    bench.fresh_memory()
    step_s, first_s, loss = bench.timed(step)
    peak = bench.peak_gib()
    shown = (f"dp{plan.dp}" + "".join(f" x {k}{getattr(plan, k)}" for k in ("ep", "tp", "cp") if getattr(plan, k) > 1)
             + (" no_shard" if sharding == "no_shard" else " ZeRO-3")
             + (" 1f1b" if plan.schedule == "1f1b_overlap" else "") + (" delay_wgrad" if plan.delay_wgrad else "")
             + (f" capacity {cfg.capacity_factor:g}" if cfg.capacity_factor else "")
             + (" tokens" if plan.ep_exchange == "tokens" else "")
             + (" graphed " + "+".join(scopes) if scopes else ""))
    system = ("fmoe" + (", compile=True" if compile else "") + "".join(f", {k}={v}" for k, v in plan_fields.items())
              + (" + step graph" if graph else ""))
    row = dict(system=system, mesh=shown, mesh_name=mesh_name, step_s=step_s,
               tokens=args.batch * args.seq * blocks // bench.world, busiest=busiest_rank(held["counts"], plan, bench),
               first_s=first_s, peak=peak, loss=float(loss), compiled=compile, **bench.profiled(step))
    # graphs holding NCCL's collectives freed now: destroy_process_group would hang on them
    if "graph" in held:
        held["graph"].release()
    held.pop("kernels", None)
    gc.collect()
    return row


def busiest_rank(counts: torch.Tensor, plan: fmoe.Plan, bench: Bench) -> tuple[float, float] | None:
    """Under expert parallelism, the last step's routed rows of the busiest expert rank
    over an even share (``python -m fmoe.plan --routing-skew``), over every rank's tokens:
    its mean and its most over the MoE layers. Learned routing starts far from balance, and
    a step waits for that rank. None without expert parallelism."""
    if plan.ep == 1:
        return None
    counts = counts.float()
    if bench.distributed:
        dist.all_reduce(counts)
    by_rank = counts[counts.sum(-1) > 0].view(-1, plan.ep, counts.shape[-1] // plan.ep).sum(-1)
    share = by_rank.max(-1).values / by_rank.mean(-1)
    return float(share.mean()), float(share.max())


def freed(bench: Bench, row: dict) -> dict:
    """After a system's run: its memory and (if compiled) dynamo's caches released."""
    if row["compiled"]:
        torch._dynamo.reset()
    bench.fresh_memory()
    bench.say(f"  done {row['system']} ({row['mesh']}): {row['step_s'] * 1e3:.1f} ms, "
              f"first step {row['first_s']:.1f} s")
    return row


def run_shape(bench: Bench, name: str) -> dict:
    """Every system on one shape; prints its table and returns its summary."""
    args = bench.args
    on_gpu = args.device == "cuda"
    cfg = shape_config(name, args, toy=not on_gpu, aux_loss=args.aux_loss)
    bench.draw(cfg.vocab)
    bench.say(f"\n## {name}")
    peers = [freed(bench, run_peer(bench, cfg, compile=kind == "compiled"))
             for kind in ("eager", "compiled") if kind in args.peers]
    rows = list(peers)
    for compile in fmoe_compiles(args):
        rows += [freed(bench, run_fmoe(bench, cfg, m, compile)) for m in args.meshes]
    if fmoe_graphs(args, bench):
        rows += [freed(bench, run_fmoe(bench, cfg, m, fmoe_has_compile(args), graph=True)) for m in args.meshes
                 if whole_step_graphable(m, bench.world)]

    tokens = args.batch * args.seq  # per GPU per step
    flops = fmoe.train_flops_per_token(cfg, args.seq) * tokens
    shapes = optree.tree_leaves(fmoe.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    fmoe_params = sum(math.prod(shape) for shape in shapes)
    where = (f"{torch.cuda.get_device_name()} x {bench.world}" if on_gpu
             else f"CPU, {bench.world} rank(s)" + (" on gloo" if bench.distributed else ""))
    peer_params = f"{count(peers[0]['params'])} params (fmoe: " if peers else "("
    bench.say(f"\n{where}, torch {torch.__version__}; {name}: vocab {cfg.vocab}, D={cfg.dim}, {cfg.layers} layers, "
              f"{describe(cfg)}; "
              f"{peer_params}{count(fmoe_params)}, with expert_bias), "
              f"{count(fmoe.active_param_count(cfg))} active; {args.batch} x {args.seq} tokens per GPU, "
              f"{args.microbatches} microbatch(es), {'bf16' if on_gpu else 'fp32'}; "
              f"median of {args.steps} steps after {args.warmup} warmup (step + AdamW), lr {args.lr}\n")
    profiled = " NCCL ms | exposed NCCL ms | GPU idle ms |" if args.profile and on_gpu else ""
    bench.say("| system | mesh | step ms (median) | tokens/s/GPU | MFU | peak GiB | vs compiled peer "
              f"| first step s | loss after last step | busiest expert rank (mean / most) |{profiled}")
    bench.say("| --- " * (10 + profiled.count("|")) + "|")
    compiled_peer = next((r for r in peers if r["compiled"]), None)
    for r in rows:  # MFU and peak memory mean nothing on the CPU
        share = r.get("tokens", tokens) / tokens  # a tensor- or context-parallel mesh's tokens per GPU
        r["tokens_s_gpu"], r["mfu"] = share * tokens / r["step_s"], share * flops / r["step_s"] / (PEAK_TFLOPS * 1e12)
        mfu_s, peak_s = (f"{r['mfu']:.1%}", f"{r['peak']:.2f}") if on_gpu else ("-", "-")
        vs = f"{compiled_peer['step_s'] / r['step_s']:.2f}x" if compiled_peer else "-"
        times = "".join(f" {r[k]:.1f} |" for k in ("comm_ms", "exposed_ms", "idle_ms")) if profiled else ""
        busiest = f"{r['busiest'][0]:.2f}x / {r['busiest'][1]:.2f}x" if r.get("busiest") else "-"
        bench.say(f"| {r['system']} | {r['mesh']} | {r['step_s'] * 1e3:.1f} | {r['tokens_s_gpu']:,.0f} | "
                  f"{mfu_s} | {peak_s} | {vs} | {r['first_s']:.1f} | {r['loss']:.4f} | {busiest} |{times}")
    if args.out and bench.rank == 0:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"gpus": bench.world, "shape": name, "microbatches": args.microbatches,
                                    **{k: r[k] for k in ("system", "mesh", "mesh_name", "step_s", "tokens_s_gpu",
                                                         "mfu", "peak")}}) + "\n")
    fmoes = [r for r in rows[len(peers):] if r["mesh_name"] == args.meshes[0]]  # eager, then compiled if any
    return dict(shape=name, tokens=tokens, peer={("compiled" if r["compiled"] else "eager"): r for r in peers},
                fmoe=fmoes)


def summary(bench: Bench, results: list[dict]):
    on_gpu = bench.args.device == "cuda"
    variants = [r["system"].removeprefix("fmoe").lstrip(", ") or "eager" for r in results[0]["fmoe"]]
    per = f" ({' / '.join(variants)})" if len(variants) > 1 else ""
    bench.say(f"\n## Summary (tokens/s per GPU; fmoe on mesh {bench.args.meshes[0]}; first step = compile time)\n")
    bench.say(f"| shape | eager peer tok/s | compiled peer tok/s | fmoe tok/s{per} | fmoe MFU{per} "
              f"| fmoe / compiled peer{per} | peak GiB (peer compiled, fmoe{per}) "
              f"| first step s (peer compiled, fmoe{per}) |")
    bench.say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    peak = (lambda gib: f"{gib:.2f}") if on_gpu else (lambda gib: "-")
    for res in results:
        eager, compiled = res["peer"].get("eager"), res["peer"].get("compiled")

        def each(fmt, key):  # one value per fmoe variant, " / "-joined
            return " / ".join(fmt(r[key]) for r in res["fmoe"])

        def of_peer(row, fmt, key):
            return fmt(row[key]) if row else "-"

        def tok_s(s):
            return f"{res['tokens'] / s:,.0f}"

        ratio = each(lambda s: f"{compiled['step_s'] / s:.2f}x", "step_s") if compiled else "-"
        bench.say(f"| {res['shape']} | {of_peer(eager, tok_s, 'step_s')} | {of_peer(compiled, tok_s, 'step_s')} | "
                  f"{each(tok_s, 'step_s')} | {each(lambda m: f'{m:.1%}' if on_gpu else '-', 'mfu')} | "
                  f"{ratio} | {of_peer(compiled, peak, 'peak')}, {each(peak, 'peak')} | "
                  f"{of_peer(compiled, lambda s: f'{s:.1f}', 'first_s')}, {each(lambda s: f'{s:.1f}', 'first_s')} |")
    if not fmoe_has_compile(bench.args):
        bench.say("\n(fmoe ran eager only: --fmoe-compile off.)")


def weak_scaling(path: str):
    """The table of every row in ``path``: tokens/s per GPU at each GPU count against the
    same shape, system and microbatches on one GPU (fmoe's ``dp`` row for each of its meshes)."""
    with open(path) as f:
        table = [json.loads(line) for line in f if line.strip()]
    # the latest one-GPU row of the plain mesh (the file may hold several runs)
    base = {(r["shape"], r["system"], r["microbatches"]): r for r in table if r["gpus"] == 1 and r["mesh_name"] == "dp"}
    print(f"\n## Weak scaling ({path}): tokens/s per GPU against one GPU\n")
    print("| shape | system | GPUs | mesh | microbatches | tokens/s/GPU | MFU | peak GiB | vs 1 GPU |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in sorted(table, key=lambda r: (r["shape"], r["system"], r["gpus"], r["mesh_name"])):
        one = base.get((r["shape"], r["system"], r["microbatches"]))
        eff = f"{r['tokens_s_gpu'] / one['tokens_s_gpu']:.1%}" if one else "-"
        print(f"| {r['shape']} | {r['system']} | {r['gpus']} | {r['mesh']} | {r['microbatches']} | "
              f"{r['tokens_s_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak']:.2f} | {eff} |")


# --- --check: the peer reads fmoe's weights and gives fmoe's loss ---------------------------

def peer_pairs(model: peer.PeerLM, tree: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, peer tensor, the same tensor of fmoe's tree in the peer's layout)``:
    ``nn.Linear`` weights are fmoe's ``y = x @ W`` matrices transposed; biases, norms,
    sinks and the experts' ``[E, ...]`` tensors as they are. fmoe's ``expert_bias`` pairs
    with the peer's buffer of that name where the peer has one (sigmoid routing; it
    takes no gradient on either side); elsewhere it is zero and selects nothing."""
    pairs = [("embed", model.embed.weight, tree["embed"]), ("final_norm", model.final_norm.weight, tree["final_norm"]),
             ("head", model.head.weight, tree["head"].T)]

    def linear(name, module, w, b=None):  # an nn.Linear: its weight (and bias)
        out = [(name, module.weight, w.T)]
        return out + [(f"{name}_bias", module.bias, b)] if b is not None else out

    for i, (block, layer) in enumerate(zip(model.blocks, tree["layers"])):
        attn = layer["attn"]
        pairs.append((f"{i}.attn.norm", block.attn_norm.weight, attn["norm"]))
        if "qkv" in attn:
            pairs += linear(f"{i}.attn.qkv", block.attn.qkv, attn["qkv"], attn.get("qkv_bias"))
            pairs += linear(f"{i}.attn.out", block.attn.out, attn["out"], attn.get("out_bias"))
            for name in ("q_norm", "k_norm"):
                if name in attn:
                    pairs.append((f"{i}.attn.{name}", getattr(block.attn, name).weight, attn[name]))
            if "sinks" in attn:
                pairs.append((f"{i}.attn.sinks", block.attn.sinks, attn["sinks"]))
        else:  # multi-head latent attention
            for name in ("q", "q_down", "q_up", "kv_down", "kv_up", "out"):
                if name in attn:
                    pairs += linear(f"{i}.attn.{name}", getattr(block.attn, name), attn[name])
            for name in ("q_down_norm", "kv_down_norm"):
                if name in attn:
                    pairs.append((f"{i}.attn.{name}", getattr(block.attn, name).weight, attn[name]))
        if "mlp" in layer:  # a dense layer
            mlp = layer["mlp"]
            pairs += [(f"{i}.mlp.norm", block.mlp_norm.weight, mlp["norm"]),
                      *linear(f"{i}.mlp.fc1", block.mlp.fc1, mlp["fc1"]),
                      *linear(f"{i}.mlp.fc2", block.mlp.fc2, mlp["fc2"])]
            continue
        moe, experts = layer["moe"], layer["moe"]["experts"]
        pairs += [(f"{i}.moe.norm", block.moe_norm.weight, moe["norm"]),
                  *linear(f"{i}.moe.router", block.moe.router, moe["router"], moe.get("router_bias")),
                  (f"{i}.moe.fc1", block.moe.w1, experts["fc1"]),
                  (f"{i}.moe.fc2", block.moe.w2, experts["fc2"])]
        if "fc1_bias" in experts:
            pairs += [(f"{i}.moe.fc1_bias", block.moe.b1, experts["fc1_bias"]),
                      (f"{i}.moe.fc2_bias", block.moe.b2, experts["fc2_bias"])]
        if block.moe.expert_bias is not None:
            pairs.append((f"{i}.moe.expert_bias", block.moe.expert_bias, moe["expert_bias"]))
        if "shared" in moe:
            pairs += [*linear(f"{i}.moe.shared.fc1", block.moe.shared.fc1, moe["shared"]["fc1"]),
                      *linear(f"{i}.moe.shared.fc2", block.moe.shared.fc2, moe["shared"]["fc2"])]
    return pairs


def peer_loss_and_grads(cfg, params: dict, tokens: torch.Tensor, compile: bool):
    """The peer's loss and gradients (by ``peer_pairs`` name; trained tensors only) with
    fmoe's ``params`` copied in."""
    model = peer.build(cfg, "cpu")
    with torch.no_grad():
        for _, p, w in peer_pairs(model, params):
            p.copy_(w)
    model = peer.compile_blocks(model) if compile else model
    logits, _ = model(tokens[:, :-1])
    loss = model.loss_fn(logits, tokens[:, 1:])
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p, _ in peer_pairs(model, params) if p.requires_grad}


def check(args) -> bool:
    """One batch per shape's toy, CPU fp32: fmoe's loss and grads vs the peer's with the same
    weights, and the compiled peer's vs the eager peer's. True when all agree."""
    return all([check_shape(shape_config(name, args, toy=True, aux_loss=args.aux_loss), name, args.batch, args.seq)
                for name in args.shapes])


def check_shape(cfg: fmoe.ModelConfig, name: str, batch: int, seq: int, compiled: bool = True) -> bool:
    """``check`` of one config (fmoe's loss and grads vs the eager peer's; with
    ``compiled``, the compiled peer's vs the eager's too); prints the errors."""
    plan = fmoe.Plan(model=cfg, dp=1, ep=1, sharding="no_shard", microbatches=1, dtype="float32", device="cpu")
    params = fmoe.init(plan, seed=0)
    # norms away from their init of ones, biases (the selection-only expert bias too)
    # from their zeros, so a misplaced one shows
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for leaf, _, w in peer_pairs(peer.build(cfg, "cpu"), params):
            if w.ndim == 1 or leaf.endswith("bias"):
                w.add_(0.2 * torch.randn(w.shape, generator=g))
    tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    out = fmoe.step(params, {"tokens": tokens}, plan)
    fmoe_grads = {n: g for n, p, g in peer_pairs(peer.build(cfg, "cpu"), out.grads) if p.requires_grad}
    eager_loss, eager_grads = peer_loss_and_grads(cfg, params, tokens, compile=False)
    comp_loss, comp_grads, comp_s = eager_loss, eager_grads, 0.0  # without `compiled`: nothing to compare
    if compiled:
        t0 = time.perf_counter()
        comp_loss, comp_grads = peer_loss_and_grads(cfg, params, tokens, compile=True)
        comp_s = time.perf_counter() - t0
        torch._dynamo.reset()

    def grad_err(a, b):  # the largest |difference| over the largest |gradient|, over all tensors
        return max((a[n] - b[n]).abs().max().item() / b[n].abs().max().clamp_min(1e-30).item() for n in b)

    errs = (abs(eager_loss - float(out.loss)), grad_err(eager_grads, fmoe_grads),
            abs(comp_loss - eager_loss), grad_err(comp_grads, eager_grads))
    good = errs[0] < 1e-4 and errs[1] < 1e-3 and errs[2] < 1e-5 and errs[3] < 1e-4
    compiled_s = (f"peer compiled {comp_loss:.7f} (compiled in {comp_s:.0f} s)" if compiled
                  else "(peer not compiled)")
    print(f"{name} (toy: D={cfg.dim}, {cfg.layers} layers, {describe(cfg)}):\n"
          f"  loss fmoe {float(out.loss):.7f}  peer eager {eager_loss:.7f}  {compiled_s}\n"
          f"  |peer - fmoe| loss {errs[0]:.1e}, grads {errs[1]:.1e} (relative max); "
          f"|compiled - eager| loss {errs[2]:.1e}, grads {errs[3]:.1e}: {'ok' if good else 'MISMATCH'}",
          flush=True)
    return good


def main():
    args = parse()
    if args.check:
        sys.exit(0 if check(args) else 1)
    bench = Bench(args)
    for name in args.meshes:
        mesh_of(name, bench.world)  # refuse a bad mesh before any work
    results = [run_shape(bench, name) for name in args.shapes]
    summary(bench, results)
    if args.out and bench.rank == 0:
        weak_scaling(args.out)
    if bench.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
