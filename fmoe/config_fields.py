"""The values a config field may hold, and the reader of a config class's docstring
that the main job's ``--help`` shows: shared by ``ModelConfig`` and ``Plan``."""

from __future__ import annotations

import dataclasses
import enum

from .backends import expert_backend_names
from .checks import check_choice



class Activation(enum.StrEnum):
    """``ModelConfig.activation`` as a value (``ModelConfig.activation_mode``)."""

    SWIGLU = "swiglu"
    GEGLU = "geglu"
    QUICK_GEGLU = "quick_geglu"  # GPT-OSS's: clamped, with glu_limit and glu_offset
    RELU2 = "relu2"

    @property
    def gated(self) -> bool:
        """Two halves, a gate and an up projection (fc1 is twice as wide)."""
        return self is not Activation.RELU2


ACTIVATIONS = tuple(mode.value for mode in Activation)
GLU_ACTIVATIONS = tuple(mode.value for mode in Activation if mode.gated)


class ScoreFunc(enum.StrEnum):
    """``ModelConfig.score_func`` as a value (``ModelConfig.score_func_mode``): how router
    logits become the scores experts are chosen by and weighted with."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    TOPK_SOFTMAX = "topk_softmax"

    @property
    def independent(self) -> bool:
        """Each expert's score is its own sigmoid (DeepSeek-V3, GLM-4.5), not a share of one softmax."""
        return self is ScoreFunc.SIGMOID

    @property
    def selects_by_logit(self) -> bool:
        """Experts are chosen by logit and weighted by a softmax over the chosen k (GPT-OSS)."""
        return self is ScoreFunc.TOPK_SOFTMAX


SCORE_FUNCS = tuple(mode.value for mode in ScoreFunc)
PROB_PLACEMENTS = ("output", "activation")
PAD_MULTIPLES = (0, 8, 16, 32, 64, 128, 256)
SHARDINGS = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class Schedule(enum.StrEnum):
    """``Plan.schedule`` as a value (``Plan.schedule_mode``); the order each gives a
    stage's node runs is its entry in ``fmoe.schedule.program.ORDERS``."""

    STANDARD = "standard"  # each microbatch's forward, then its backward
    OVERLAP = "1f1b_overlap"  # a microbatch's forward woven into the one before's backward, layer by layer


SCHEDULES = tuple(mode.value for mode in Schedule)


class EpExchange(enum.StrEnum):
    """``Plan.ep_exchange`` as a value (``Plan.ep_exchange_mode``)."""

    ROWS = "rows"  # each routed row crosses to its expert's rank and back
    TOKENS = "tokens"  # each token crosses once to every rank it routes to, and is routed there

    @property
    def tokens_cross_once(self) -> bool:
        return self is EpExchange.TOKENS


EP_EXCHANGES = tuple(mode.value for mode in EpExchange)
DTYPES = ("float32", "bfloat16")


class GatherBuffers(enum.StrEnum):
    """``Plan.gather_buffers`` as a value (``Plan.gather_buffers_mode``): where a gathered
    unit's weights live."""

    DYNAMIC = "dynamic"
    DOUBLE = "double"
    PERSISTENT = "persistent"

    @property
    def allocated_each_gather(self) -> bool:
        """A new buffer for each gather, freed at its release."""
        return self is GatherBuffers.DYNAMIC

    @property
    def two_slots(self) -> bool:
        """Two preallocated buffers a unit kind, used in turn (prefetch at most 1)."""
        return self is GatherBuffers.DOUBLE

    @property
    def kept(self) -> bool:
        """Every unit gathered once and kept for the whole run."""
        return self is GatherBuffers.PERSISTENT


GATHER_BUFFERS = tuple(mode.value for mode in GatherBuffers)


class QkNorm(enum.StrEnum):
    """``ModelConfig.qk_norm`` as a value (``ModelConfig.qk_norm_mode``): no norm on
    queries and keys, one RMSNorm weight a head dimension shared by the heads
    (``HEAD``, Qwen3), or one over the whole projection (``FULL``, OLMoE)."""

    NONE = "none"
    HEAD = "head"
    FULL = "full"


QK_NORMS = tuple(mode.value for mode in QkNorm)


class Remat(enum.StrEnum):
    """``Plan.remat`` as a value (``Plan.remat_mode``), with what each recomputes."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @property
    def whole_layers(self) -> bool:
        """Each layer's forward runs again before its backward; only its input is kept."""
        return self is Remat.FULL

    @property
    def selected_kernels(self) -> bool:
        """Inside each node, the cheap elementwise kernels run again; the products' outputs are kept."""
        return self is Remat.SELECTIVE


REMATS = tuple(mode.value for mode in Remat)
FP8S = ("none", "rowwise", "tensorwise")
ROPE_SCALINGS = ("none", "yarn")
# The fields with a fixed set of values (with expert_backend's names: ``choices``, what the
# main job's --help lists).
CHOICES = {"activation": ACTIVATIONS, "score_func": SCORE_FUNCS, "prob_placement": PROB_PLACEMENTS,
           "pad_multiple": PAD_MULTIPLES, "qk_norm": QK_NORMS, "sharding": SHARDINGS, "schedule": SCHEDULES,
           "dtype": DTYPES, "gather_buffers": GATHER_BUFFERS,
           "remat": REMATS, "fp8": FP8S, "rope_scaling": ROPE_SCALINGS, "ep_exchange": EP_EXCHANGES}


def choices(field: str) -> tuple | None:
    """The values a config field may hold, or None for a field without a fixed set:
    ``CHOICES``, and for ``expert_backend`` the names known now (``fmoe.backends``)."""
    if field == "expert_backend":
        return expert_backend_names()
    return CHOICES.get(field)


def _check_choices(config, own: str) -> None:
    """Every field of ``config`` with a set of values (``choices``) holds one of them."""
    for field in dataclasses.fields(config):
        allowed = choices(field.name)
        if allowed is not None:
            check_choice(f"{own}.{field.name}", getattr(config, field.name), allowed)


def field_docs(cls) -> dict:
    """``{field: its text}`` from the ``Arguments:`` section of a config class's
    docstring (entries ``name, other: text`` with indented continuation lines), so
    that the command line's help is the docstring, not a second copy."""
    docs, names = {}, []
    lines = (cls.__doc__ or "").split("Arguments:", 1)[-1].splitlines()
    for line in lines[1:]:
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(stripped)
        head, sep, text = stripped.partition(": ")
        if sep and indent <= 8 and all(n.isidentifier() for n in head.split(", ")):
            names = head.split(", ")
            for n in names:
                docs[n] = text
        elif names:
            for n in names:
                docs[n] += " " + stripped
    return {n: t.replace("``", "") for n, t in docs.items()}
