"""The main job's own settings as one typed value, ``RunSettings``: a frozen dataclass
beside ModelConfig and Plan (which hold the model's and the plan's), checked when
built. ``fmoe.trainer.options`` makes its flags and TOML keys from the fields."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NoReturn

from ..optim.transforms import MOMENT_DTYPES

TYPES = {"int": int, "float": float, "str": str, "bool": bool}
# Every int a settings file holds is a TOML integer: a 64-bit one.
_MAX_INT = 2**63 - 1
_MAX_TIMEOUT_S = 365 * 86400
_POSITIVE = ("steps", "batch", "seq", "log_every", "eval_every", "eval_batches", "keep")
_NON_NEGATIVE = ("warmup", "save_every", "stop_after", "profile_step", "seed", "threads", "sample_tokens", "max_skips",
                 "lora_rank")


def _option(default, help_: str):
    return dataclasses.field(default=default, metadata={"help": help_})


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The main job's own settings (the model's and the plan's are ModelConfig and Plan
    fields), typed and checked when built. A field's ``metadata["help"]`` is its
    ``--help`` text; a bool is a switch, present meaning true. The fields' order is
    that of ``--help`` and ``settings.toml``.

    Raises:
        ValueError: for a value of another type (naming the key), or out of range
            (naming the flag: ``--steps=0 is invalid: must be an int >= 1``).
    """

    config: str = _option("", "a TOML file of settings, or a shipped preset's name (see --print-config)")
    print_config: bool = _option(False, "print the merged settings as TOML and exit")
    # optimization
    steps: int = _option(1000, "optimizer steps (the cosine decay ends at the last; changed on --resume, the decay "
                               "goes on from the rate the run had reached to the new last step)")
    batch: int = _option(16, "sequences per step, over all ranks")
    seq: int = _option(128, "tokens per sequence")
    lr: float = _option(3e-3, "peak learning rate (linear warm-up, cosine decay)")
    warmup: int = _option(30, "warm-up steps, at most --steps (the rate reaches --lr at the warm-up's last step); "
                              "a longer --warmup is refused, a longer one from a preset, --config file or the "
                              "resumed run's settings is cut to --steps")
    min_lr_ratio: float = _option(0.1, "the cosine decay ends at this fraction of --lr")
    weight_decay: float = _option(0.1, "decoupled weight decay of the matrices")
    clip: float = _option(1.0, "global grad-norm clip (0: off)")
    fused_optimizer: bool = _option(False, "a fused AdamW kernel (fmoe's per leaf on CUDA, torch's elsewhere), "
                                           "updating params and moments in place (same state and update up to "
                                           "rounding)")
    moments: str = _option("float32", "the dtype AdamW keeps its moments in: float32, or bfloat16 (half their "
                                      "memory; computed in fp32, rounded once a step)")
    max_skips: int = _option(5, "skip updates whose gradients hold NaN/inf; stop after this many in a row (0: off)")
    seed: int = _option(0, "init and data sampling seed")
    # data and initial weights
    data: str = _option("", "a directory written by `python -m fmoe.data prepare` (default: the embedded corpus)")
    heldout_fraction: float = _option(0.05, "the tail of the tokens held out for evaluation")
    init_from_hf: str = _option("", "start from this Hugging Face checkpoint directory (fine-tuning)")
    lora_rank: int = _option(0, "train low-rank adapters of this rank on the --init-from-hf model, which stays "
                                "frozen (0: train every weight)")
    lora_alpha: float = _option(0.0, "the adapters' products are scaled by alpha / rank (0: twice --lora-rank)")
    lora_targets: str = _option("q,k,v,out,experts", "the matrices --lora-rank adapts, comma-separated from q, k, "
                                                     "v, out, experts, shared, mlp (latent attention: q, q_down, "
                                                     "q_up, kv_down, kv_up)")
    # logging and evaluation
    log_every: int = _option(1, "read the step's metrics to the host and log them every N steps (and at "
                                "evaluations, checkpoints and the last step); the steps between queue on the "
                                "device without a sync")
    eval_every: int = _option(200, "evaluate the held-out loss every N steps")
    eval_batches: int = _option(8, "held-out batches per evaluation")
    # the run folder and its checkpoints
    out: str = _option("runs/fmoe-lm", "folder for metrics.jsonl, TensorBoard events and the checkpoint")
    save_every: int = _option(250, "checkpoint every N steps (0: only at the end)")
    keep: int = _option(1, "checkpoints to keep (the newest; one is removed only after a newer one is complete)")
    resume: bool = _option(False, "continue from the checkpoint in --out, with the run's settings.toml (flags "
                                  "left out keep the run's values; training flags given override them; model and "
                                  "data flags must match) (--no-resume: not, whatever --config says)")
    overwrite: bool = _option(False, "start afresh in an --out that holds a run: its settings, metrics, events and "
                                     "checkpoints are removed (and listed) first")
    auto_resume: bool = _option(False, "continue from the checkpoint in --out if there is one (as --resume), else "
                                       "start (for torchrun --max-restarts)")
    stop_after: int = _option(0, "end this run after that step, with a checkpoint (0: run to --steps; never kept "
                                 "for a resumed run)")
    profile_step: int = _option(0, "write that step's trace (torch.profiler: CPU ops, CUDA kernels, fmoe's actions) "
                                   "to --out as trace-step<N>-rank<R>.json.gz, which Chrome / Perfetto and "
                                   "benchmarks/trace_gaps.py read (0: none; never kept for a resumed run)")
    # the machine
    timeout: float = _option(1800.0, "seconds a collective waits for the other ranks before the job fails")
    stall_report: float = _option(300.0, "seconds the host may spend in one step (or setup, evaluation, checkpoint) "
                                         "before each rank prints what it was doing, its stack and its device "
                                         "memory, and again every as many seconds (0: never; else >= 1)")
    cuda_graph: str = _option("", "CUDA-graph scopes, comma-separated from attn, router, dispatch, experts; or 'step' "
                                  "(the step and its update as one graph, after two eager steps; "
                                  "python -m interop.train)")
    peak_tflops: float = _option(0.0, "the device's peak for MFU (0: known GPUs only)")
    sample_tokens: int = _option(64, "tokens to generate from a held-out prompt at the end (0: none)")
    threads: int = _option(0, "CPU threads per process (0: torch's default)")
    no_progress: bool = _option(False, "no progress bar")
    no_tensorboard: bool = _option(False, "no TensorBoard events even when tensorboard is installed")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_type(f.name, TYPES[f.type], getattr(self, f.name), "RunSettings"))
        _check_ranges(self)

    def replace(self, **changes) -> RunSettings:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


def invalid(name: str, value, allowed: str) -> NoReturn:
    """Refuse ``--name=value``, saying what is ``allowed``."""
    raise ValueError(f"--{name.replace('_', '-')}={value!r} is invalid: {allowed}")


def _check_ranges(s: RunSettings) -> None:
    """Each int within TOML's 64-bit range, threads no more than the machine's cores,
    rates and fractions where they mean something."""
    for name in _POSITIVE:
        value = getattr(s, name)
        if not 1 <= value <= _MAX_INT:
            invalid(name, value, f"must be an int in 1..{_MAX_INT}" if value > 0 else "must be an int >= 1")
    for name in _NON_NEGATIVE:
        value = getattr(s, name)
        if not 0 <= value <= _MAX_INT:
            invalid(name, value, f"must be an int in 0..{_MAX_INT}" if value > 0 else "must be an int >= 0")
    cores = os.cpu_count() or 1
    if s.threads > cores:
        invalid("threads", s.threads, f"must be an int in 0..{cores} (this machine's cores; 0: torch's default)")
    for name in ("lr", "timeout", "clip", "weight_decay", "peak_tflops", "lora_alpha"):
        value, positive = getattr(s, name), name in ("lr", "timeout")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            invalid(name, value, "must be a finite number " + ("> 0" if positive else ">= 0"))
    if not (s.stall_report == 0 or 1 <= s.stall_report <= _MAX_TIMEOUT_S):  # a report at most every second
        invalid("stall_report", s.stall_report, f"must be 0 (never) or a number of seconds in 1..{_MAX_TIMEOUT_S}")
    if s.timeout > _MAX_TIMEOUT_S:
        invalid("timeout", s.timeout, f"must be at most {_MAX_TIMEOUT_S} seconds (a year)")
    if not 0 < s.heldout_fraction < 1:
        invalid("heldout_fraction", s.heldout_fraction, "must be in (0, 1)")
    if not 0 <= s.min_lr_ratio <= 1:
        invalid("min_lr_ratio", s.min_lr_ratio, "must be in [0, 1]")
    if s.moments not in MOMENT_DTYPES:
        invalid("moments", s.moments, "must be one of " + ", ".join(MOMENT_DTYPES))
    if s.warmup > s.steps:
        invalid("warmup", s.warmup, f"must be <= --steps ({s.steps}): a longer warm-up ends after the run, so the "
                "rate never reaches --lr")
    if s.stop_after and s.stop_after > s.steps:
        invalid("stop_after", s.stop_after, f"must be <= --steps ({s.steps}) or 0")


RUN_FIELDS = {f.name: TYPES[f.type] for f in dataclasses.fields(RunSettings)}
RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSettings)}
RUN_HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(RunSettings)}


def check_type(name: str, kind: type, value, where: str):
    """``value`` as a ``kind`` (an int where a float is meant becomes the float).

    Raises:
        ValueError: naming ``where`` and the key, for a value of another type (a bool
            is not an int).
    """
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ValueError(f"{where}: key {name!r} must be {'a' if kind is not int else 'an'} {kind.__name__}, "
                         f"got {value!r}")
    return value
