"""ModelConfig and Plan: frozen dataclasses, validated when they are built.

A bad value raises ``ValueError`` naming the field and what is allowed, before any
tensor exists; everything downstream may trust these objects. ``ModelConfig`` lives in
``model_config.py``, the fields' sets of values in ``config_fields.py``; both are
re-exported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .checks import check_bool, check_int, fail
from .lora_spec import LoRA
from .config_fields import (ACTIVATIONS, CHOICES, DTYPES, EP_EXCHANGES, FP8S, GATHER_BUFFERS, GLU_ACTIVATIONS,
                            PAD_MULTIPLES, PROB_PLACEMENTS, QK_NORMS, REMATS, ROPE_SCALINGS, SCHEDULES, SCORE_FUNCS,
                            SHARDINGS, EpExchange, GatherBuffers, Remat, Schedule, _check_choices, choices,
                            field_docs)
from .model_config import ModelConfig, Yarn, yarn_get_mscale
from .parallel_checks import check_parallel
from .parallel_dims import ParallelDims
from .units import check_stages, check_units, even_stages

__all__ = ["ACTIVATIONS", "CHOICES", "DTYPES", "EP_EXCHANGES", "FP8S", "GATHER_BUFFERS", "GLU_ACTIVATIONS",
           "PAD_MULTIPLES", "PROB_PLACEMENTS", "QK_NORMS", "REMATS", "ROPE_SCALINGS", "SCHEDULES", "SCORE_FUNCS",
           "SHARDINGS", "ModelConfig", "Plan", "Yarn", "choices", "field_docs", "yarn_get_mscale"]

@dataclass(frozen=True)
class Plan:
    """How to run a model: parallelism, sharding, schedule, precision, device.

    Arguments:
        model: the ModelConfig.
        dp, ep: data- and expert-parallel sizes: the ``dp * ep`` row blocks of the global
            batch (expert parallelism splits the experts, not the data).
        ep_exchange: what crosses the expert-parallel ranks: ``rows`` (one row per token
            and chosen expert, each way) or ``tokens`` (a token once to each rank holding
            any of its experts, with its probabilities, expanded there into its experts'
            rows, and their weighted outputs summed before the way back: under top-k
            routing over few ranks, several times fewer bytes). ``tokens`` needs dropless
            routing without padding (``model.capacity_factor=0``, ``model.pad_multiple=0``);
            its output sums a token's experts per rank first, so it agrees with ``rows``
            to rounding, not bitwise.
        tp: tensor parallelism: attention's heads, the dense MLPs' and the shared
            expert's hidden width and the vocabulary (embedding and head) split over
            ``tp`` ranks, which also split the residual stream's positions (sequence
            parallelism of the norms, the router and the experts' input).
        etp: the routed experts' own tensor parallelism: each expert's hidden width
            split over ``etp`` ranks of one expert index (``fmoe.parallel_dims``).
        cp: context parallelism: each sequence in ``2 * cp`` chunks, rank ``c`` holding
            chunks ``c`` and ``2 * cp - 1 - c`` (``fmoe.local_batch``); attention's keys
            and values gathered over the ``cp`` ranks.
        pp: pipeline parallelism: the members (``embed``, ``layers.<i>``, ``head``) in
            ``pp`` stages of contiguous members, each stage on a ``dp * ep * cp * tp``
            mesh of its own, activations and their gradients sent between stages
            (``fmoe.schedule.pipeline``).
        pp_layout: the members of each stage, e.g. ``(("embed", "layers.0"),
            ("layers.1", "layers.2", "head"))`` to count the embedding and head as the
            layers they cost; None: layers split evenly, ``embed`` first, ``head`` last.
            With ``virtual_stages`` it lists ``pp * virtual_stages`` stages.
            The world is ``pp * dp * ep * cp * tp`` ranks (``Plan.world``), laid out as
            ``fmoe.parallel_dims`` says.
        virtual_stages: interleaved pipelining: the members cut into ``pp *
            virtual_stages`` stages, stage ``k`` on pipeline rank ``k % pp``, so each
            rank holds ``virtual_stages`` chunks of the model and the pipeline fills
            ``virtual_stages`` times faster (bubble ``(pp - 1) / (virtual_stages *
            microbatches + pp - 1)``); needs ``microbatches`` a multiple of ``pp``.
        sharding: ``no_shard | optim | optim_grads | optim_grads_params``.
        schedule: ``standard`` (each microbatch forward, then backward) or
            ``1f1b_overlap`` (the forward of microbatch i+1 woven into the backward of
            microbatch i so one microbatch's all-to-alls run under the other's compute).
        microbatches: gradient-accumulation steps per ``fmoe.step`` (must divide each
            rank's batch rows).
        dtype: compute dtype, ``float32 | bfloat16``; params, grads and optimizer
            state stay fp32.
        delay_wgrad: the experts' backward computes input gradients only; their
            weight-gradient GEMMs run later, under the dispatch's backward all-to-all.
        expert_backend: ``torch`` (``torch._grouped_mm`` where shapes allow, an exact
            per-expert loop otherwise), ``loop`` (always the loop), or a backend
            registered or declared by name (``fmoe.backends``), such as ``te``
            (TransformerEngine's grouped GEMMs and scaled GLU kernels on CUDA; provided
            by ``interop.te``, which must be imported before the first step).
        device: where params live and compute runs (``cpu``, ``cuda``, ``cuda:1``...).
        units: FSDP units as groups of members (``embed``, ``layers.<i>``, ``head``),
            e.g. ``(("embed", "head"), ("layers.0", "layers.1"))``; None: one unit per
            member.
        prefetch: how many unit spans ahead ``optim_grads_params`` gathers while computing.
        gather_buffers: memory for gathered units: ``dynamic`` (allocated per gather,
            freed on release), ``double`` (two slots reused alternately; needs
            ``prefetch <= 1``) or ``persistent`` (one fixed buffer per unit).
        compile: run the layer nodes' compute (attention half, router, head and loss,
            the experts' torch-code activation) through ``torch.compile``
            (``fmoe/schedule/compiled.py``); the first step compiles. Same results as
            eager up to the reassociation of fused floating-point sums.
        remat: activation recomputation, ``none | selective | full``. ``selective``:
            the attention, router and expert kernels keep their GEMM (and SDPA)
            outputs and recompute the elementwise work around them (norms, RoPE, the
            GLU activation with its probability scaling, the router's fp32 copy) in
            their node's backward (``fmoe/schedule/remat.py``); meant for
            ``compile=True``, where it costs ~3% (eager, torch runs the policy per op
            from Python, ~20% slower: use ``full`` there). ``full``: a layer's forward
            keeps only its input (and what routing decided; under expert parallelism
            also the rows that crossed ranks, so no all-to-all runs twice) and a
            ``recompute`` action re-runs the layer right before its backward. Same
            results, bitwise; less activation memory for about a third more compute.
        loss_chunk: tokens per piece of the head's loss (0: all of a microbatch at
            once). Each piece's logits are computed, used and dropped, in the forward
            and again in the backward, so the ``[tokens, vocab]`` logits never exist
            whole.
        fp8: ``none | rowwise | tensorwise``. ``rowwise``: the GEMMs of attention's
            projections, the shared expert and the routed experts run in FP8 E4M3 with
            one scale per row of each operand, computed on the fly
            (``fmoe/layers/fp8.py``); the head stays bf16. ``tensorwise``: the same
            products and the head's, the dense ones with one scale per operand and
            their output gradients in E5M2 (the experts' as ``rowwise``). Either way
            master params, gradients and optimizer state stay fp32, router, norms,
            softmax and the loss as without. Under ``tensorwise`` with the dense
            weights sharded, those products' weights are gathered already in FP8
            (half the bytes; the same FP8 weights bit for bit) from a buffer group of
            their own, so each rank holds other rows of the dense params than under
            ``none`` or ``rowwise``: to switch ``fp8`` under a sharded plan, ``fmoe.load``
            a checkpoint with the new plan. Needs ``dtype='bfloat16'``, the
            ``torch`` expert backend, GEMM widths that are multiples of 16 (the
            vocabulary too under ``tensorwise``) and a Hopper GPU (compute capability
            9.x); refused elsewhere.
        lora: ``fmoe.LoRA(rank, alpha, targets)``: train low-rank adapters on the frozen
            params (``fmoe.lora``; ``fmoe.step(adapters, batch, plan, base=params)``), or
            None. This version trains them on one process or on data-parallel replicas
            (``sharding='no_shard'``, ``dp`` only).
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    dp: int = 1
    ep: int = 1
    sharding: str = "no_shard"
    schedule: str = "standard"
    microbatches: int = 1
    dtype: str = "float32"
    delay_wgrad: bool = False
    expert_backend: str = "torch"
    device: str = "cpu"
    units: tuple | None = None
    prefetch: int = 1
    gather_buffers: str = "dynamic"
    compile: bool = False
    remat: str = "none"
    loss_chunk: int = 0
    fp8: str = "none"
    # after the fields that existed before them, so that a Plan built by position keeps its meaning
    tp: int = 1
    etp: int = 1
    cp: int = 1
    pp: int = 1
    pp_layout: tuple | None = None
    virtual_stages: int = 1
    ep_exchange: str = "rows"
    lora: LoRA | None = None

    def __post_init__(self):
        own = "Plan"
        if not isinstance(self.model, ModelConfig):
            fail(f"{own}.model", type(self.model).__name__, "must be a fmoe.ModelConfig")
        for name in ("dp", "ep", "tp", "etp", "cp", "pp", "virtual_stages", "microbatches"):
            check_int(f"{own}.{name}", getattr(self, name), 1, builtin=True)
        _check_choices(self, own)
        check_bool(f"{own}.delay_wgrad", self.delay_wgrad)
        check_bool(f"{own}.compile", self.compile)
        check_int(f"{own}.loss_chunk", self.loss_chunk, 0, builtin=True)
        check_int(f"{own}.prefetch", self.prefetch, 0, builtin=True)
        if self.gather_buffers_mode.two_slots and self.prefetch > 1:
            fail(f"{own}.prefetch", self.prefetch,
                  "gather_buffers='double' holds 2 units, so prefetch must be 0 or 1 "
                  "(or use gather_buffers 'dynamic' / 'persistent')")
        if self.fp8 != "none":
            self._check_fp8()
        if self.units is not None:
            object.__setattr__(self, "units", check_units(self.units, self.model))
        if self.model.experts % self.ep:
            fail(f"{own}.ep", self.ep, f"must divide model.experts ({self.model.experts})")
        if self.ep_exchange_mode.tokens_cross_once and (self.model.capacity_factor or self.model.pad_multiple):
            fail(f"{own}.ep_exchange", self.ep_exchange, "sends tokens under dropless routing only: needs "
                 f"model.capacity_factor=0 and model.pad_multiple=0 (they are {self.model.capacity_factor} and "
                 f"{self.model.pad_multiple}), or ep_exchange='rows'")
        check_parallel(self.dims, self.model)
        if self.lora is not None and not isinstance(self.lora, LoRA):
            fail(f"{own}.lora", self.lora, "must be None or a fmoe.LoRA(rank, alpha, targets)")
        if self.virtual_stages > 1 and self.pp == 1:
            fail(f"{own}.virtual_stages", self.virtual_stages, "interleaves pipeline stages: needs Plan.pp > 1 "
                                                               "(or virtual_stages=1)")
        if self.virtual_stages > 1 and self.microbatches % self.pp:
            fail(f"{own}.microbatches", self.microbatches, f"must be a multiple of Plan.pp={self.pp} under "
                 f"Plan.virtual_stages={self.virtual_stages} (the interleaved schedule runs them in groups of pp)")
        stages = check_stages(self.pp_layout, self.model, self.pp, self.virtual_stages)
        if self.pp_layout is not None:
            object.__setattr__(self, "pp_layout", stages)
        if self.pp > 1:
            self._check_pipeline(stages)
        if not isinstance(self.device, str):
            fail(f"{own}.device", self.device, "must be a device string such as 'cpu' or 'cuda'")
        try:
            import torch

            torch.device(self.device)
        except RuntimeError:
            fail(f"{own}.device", self.device, "must be a device string such as 'cpu' or 'cuda'")

    def _check_pipeline(self, stages: tuple) -> None:
        own = "Plan.pp"
        if self.model.tie_embeddings and self.pp > 1:
            fail(own, self.pp, "cannot split tied embeddings (the first stage's embed is the last stage's head) "
                               "over stages; allowed: pp=1 or model.tie_embeddings=False")
        stage_of = {m: s % self.pp for s, members in enumerate(stages) for m in members}
        for unit in self.unit_groups:
            if len({stage_of[m] for m in unit}) > 1:
                fail("Plan.units", self.units, f"unit {unit} spans pipeline stages; a unit's members must share "
                                               "a stage (Plan.pp_layout)")

    def _check_fp8(self) -> None:
        # What is known without touching a GPU; the device's capability is checked
        # before the first step (fmoe.runtime).
        own = "Plan.fp8"
        if not str(self.device).startswith("cuda"):
            fail(own, self.fp8, f"needs a CUDA device with FP8 GEMMs, but Plan.device={self.device!r} has none "
                                "(allowed here: 'none')")
        if self.dtype != "bfloat16":
            fail(own, self.fp8, f"computes with bfloat16 around its FP8 GEMMs: set Plan.dtype='bfloat16' "
                                f"(is {self.dtype!r}) or fp8='none'")
        if self.expert_backend != "torch":
            fail(own, self.fp8, f"runs the routed experts through torch's FP8 grouped GEMM: set "
                                f"Plan.expert_backend='torch' (is {self.expert_backend!r}) or fp8='none'")
        cfg = self.model  # the K and N of every FP8 product
        widths = {"dim": cfg.dim, "ffn": cfg.ffn, "q_width": cfg.q_width}
        if cfg.latent:
            widths.update(kv_lora_rank=cfg.kv_lora_rank, attn_out_width=cfg.attn_out_width,
                          kv_down_width=cfg.kv_lora_rank + cfg.rope_head_dim,
                          kv_up_width=cfg.heads * (cfg.head_dim - cfg.rope_head_dim + cfg.v_head_dim))
            if cfg.q_lora_rank:
                widths["q_lora_rank"] = cfg.q_lora_rank
        else:
            widths["kv_width"] = cfg.kv_width
        if cfg.dense_layers:
            widths["dense_ffn"] = cfg.dense_ffn
        if cfg.shared_ffn:
            widths["shared_ffn"] = cfg.shared_ffn
        if self.fp8 == "tensorwise":  # its head's product is FP8 too
            widths["vocab"] = cfg.vocab
        # what one rank multiplies: tensor parallelism cuts these widths (a copied key/value
        # head stays whole), expert tensor parallelism the experts'
        cut = {"q_width": self.tp, "kv_width": min(self.tp, cfg.num_kv_heads), "attn_out_width": self.tp,
               "kv_up_width": self.tp, "dense_ffn": self.tp, "shared_ffn": self.tp, "vocab": self.tp,
               "ffn": self.etp}
        odd = {k: v // cut.get(k, 1) for k, v in widths.items() if (v // cut.get(k, 1)) % 16}
        if odd:
            per_rank = " per rank" if self.tp > 1 or self.etp > 1 else ""
            fail(own, self.fp8, f"FP8 GEMMs need every width{per_rank} a multiple of 16; the model has "
                                f"{', '.join(f'{k}={v}' for k, v in odd.items())}{per_rank} (or use fp8='none')")

    @property
    def world(self) -> int:
        """The ranks the plan runs on: ``pp * dp * ep * cp * tp``."""
        return self.dims.world

    @property
    def gather_buffers_mode(self) -> GatherBuffers:
        """``gather_buffers`` as a GatherBuffers."""
        return GatherBuffers(self.gather_buffers)

    @property
    def ep_exchange_mode(self) -> EpExchange:
        """``ep_exchange`` as an EpExchange."""
        return EpExchange(self.ep_exchange)

    @property
    def remat_mode(self) -> Remat:
        """``remat`` as a Remat."""
        return Remat(self.remat)

    @property
    def schedule_mode(self) -> Schedule:
        """``schedule`` as a Schedule."""
        return Schedule(self.schedule)

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees as one value (``fmoe.parallel_dims``)."""
        return ParallelDims(self.dp, self.ep, self.cp, self.tp, self.etp, self.pp)

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        """The members of each of the ``pp * virtual_stages`` stages in forward order
        (``pp_layout``, or an even split); stage ``k`` runs on pipeline rank ``k % pp``."""
        return self.pp_layout if self.pp_layout is not None else \
            even_stages(self.model, self.pp * self.virtual_stages)

    def stage_chunks(self, stage: int) -> tuple[tuple[str, ...], ...]:
        """The members of each chunk pipeline rank ``stage`` holds (one per virtual stage)."""
        return self.stages[stage::self.pp]

    def stage_members(self, stage: int) -> tuple[str, ...]:
        """Every member pipeline rank ``stage`` holds, in forward order."""
        return tuple(m for chunk in self.stage_chunks(stage) for m in chunk)

    @property
    def unit_groups(self) -> tuple:
        """The FSDP units: ``units`` if given, else one unit per member."""
        return check_units(self.units, self.model)

    @property
    def compute_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)
