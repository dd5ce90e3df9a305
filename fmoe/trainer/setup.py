"""Everything the main job settles before a process group starts: the merged settings,
the world, the data, the model config and the plan, each refused with a message
naming the setting (or file) when it cannot work."""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Callable, NamedTuple

from .. import hf
from ..backends import BUILT_IN, declared_backends, expert_backend_names, registered_backend
from ..config import ModelConfig, Plan
from ..data import TokenCorpus, check_corpus, check_packed_seq, check_vocab, embedded_corpus, open_corpus
from ..generate import kv_cache_bytes
from ..hf.families import TRAINING_FIELDS
from ..params import flat_shapes
from ..runtime import check_device_and_backend, device_memory, gib
from . import options, run_lock
from .launch import World, rank_device, world_from_env
from .resilience import is_staging, run_contents

_POSITIVE = ("steps", "batch", "seq", "log_every", "eval_every", "eval_batches", "keep")
_NON_NEGATIVE = ("warmup", "save_every", "stop_after", "seed", "threads", "sample_tokens", "max_skips")
# Every int a settings file holds is a TOML integer: a 64-bit one.
_MAX_INT = 2**63 - 1
_MAX_TIMEOUT_S = 365 * 86400
# The end-of-run sample's prompt: this many held-out tokens.
SAMPLE_PROMPT = 16


class Adapters(NamedTuple):
    """What the main job takes from ``interop`` when ``python -m interop.train`` runs
    it: the core never imports its adapters, they are handed in.

    Attributes:
        check_capturable, capture_step, capture_scopes: ``interop.cuda_graph``'s.
        load_backend: imports the ``interop`` module that registers an expert
            backend (``interop.te``); the backend's own check says what is missing.
    """

    check_capturable: Callable
    capture_step: Callable
    capture_scopes: Callable
    load_backend: Callable[[str], None]


class Run(NamedTuple):
    """A checked run: ``settings`` (every key) and those given explicitly, the world,
    the corpus and its fingerprint (``check_corpus``), the plan, and the run folder's
    lock (held by the main rank of ``fmoe.train.main``; None otherwise)."""

    settings: dict
    explicit: frozenset
    world: World
    corpus: TokenCorpus
    fingerprint: str
    plan: Plan
    scopes: tuple  # CUDA-graph scopes, or ("step",)
    adapters: Adapters | None
    lock: run_lock.RunLock | None

    @property
    def out(self) -> Path:
        return Path(self.settings["out"])


def _bad(name: str, value, allowed: str):
    raise ValueError(f"--{name.replace('_', '-')}={value!r} is invalid: {allowed}")


def check_run_options(s: dict) -> None:
    """Range checks of the run options (ModelConfig and Plan check their own fields):
    each int within TOML's 64-bit range, threads no more than the machine's cores."""
    for name in _POSITIVE:
        if not 1 <= s[name] <= _MAX_INT:
            _bad(name, s[name], f"must be an int in 1..{_MAX_INT}" if s[name] > 0 else "must be an int >= 1")
    for name in _NON_NEGATIVE:
        if not 0 <= s[name] <= _MAX_INT:
            _bad(name, s[name], f"must be an int in 0..{_MAX_INT}" if s[name] > 0 else "must be an int >= 0")
    cores = os.cpu_count() or 1
    if s["threads"] > cores:
        _bad("threads", s["threads"], f"must be an int in 0..{cores} (this machine's cores; 0: torch's default)")
    for name in ("lr", "timeout", "clip", "weight_decay", "peak_tflops"):
        value, positive = s[name], name in ("lr", "timeout")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            _bad(name, value, "must be a finite number " + ("> 0" if positive else ">= 0"))
    if s["timeout"] > _MAX_TIMEOUT_S:
        _bad("timeout", s["timeout"], f"must be at most {_MAX_TIMEOUT_S} seconds (a year)")
    if not 0 < s["heldout_fraction"] < 1:
        _bad("heldout_fraction", s["heldout_fraction"], "must be in (0, 1)")
    if not 0 <= s["min_lr_ratio"] <= 1:
        _bad("min_lr_ratio", s["min_lr_ratio"], "must be in [0, 1]")
    if s["stop_after"] and s["stop_after"] > s["steps"]:
        _bad("stop_after", s["stop_after"], f"must be <= --steps ({s['steps']}) or 0")


def check_paths(s: dict, explicit: set) -> None:
    """Paths given explicitly may not be empty: an empty ``--data`` would mean the
    embedded corpus, ``--init-from-hf`` random weights, ``--out`` the current folder,
    each silently."""
    for name in ("out", "data", "init_from_hf", "config"):
        if name in explicit and not str(s[name]).strip():
            default = {"out": f"(the default is {options.RUN_DEFAULTS['out']})",
                       "data": "(leave it out for the embedded corpus)",
                       "init_from_hf": "(leave it out to start from random weights)",
                       "config": "(leave it out for the cpu preset)"}[name]
            _bad(name, s[name], f"an empty path; name a path {default}")


_ADAPTERS_NEEDED = "it needs fmoe's adapters: run python -m interop.train with the same settings"


def parse_scopes(text: str, plan: Plan, adapters: Adapters | None) -> tuple:
    """``--cuda-graph``: "" (none), "step", or scopes from attn, router, experts."""
    if not text:
        return ()
    scopes = tuple(s.strip() for s in text.split(",") if s.strip())
    allowed = ("attn", "router", "experts")
    if scopes != ("step",) and not all(s in allowed for s in scopes):
        _bad("cuda_graph", text, "'step', or comma-separated scopes from " + ", ".join(allowed))
    if adapters is None:
        _bad("cuda_graph", text, _ADAPTERS_NEEDED)
    adapters.check_capturable(plan, scopes)
    return scopes


def load_expert_backend(name: str, adapters: Adapters | None) -> None:
    """Make ``--expert-backend name`` runnable before the Plan is built: the built-in
    and registered ones are; a declared one is imported from the module that declares
    it (``fmoe.backends``), through the adapters when that module is in ``interop``
    (``te``: the core job never imports ``interop``)."""
    allowed = expert_backend_names()
    if name not in allowed:
        _bad("expert_backend", name, "allowed: " + ", ".join(map(repr, allowed)))
    if name in BUILT_IN or registered_backend(name) is not None:
        return
    module = declared_backends()[name]
    if module.split(".")[0] != "interop":
        importlib.import_module(module)
    elif adapters is None:
        _bad("expert_backend", name, _ADAPTERS_NEEDED)
    else:
        adapters.load_backend(module)


def _open_corpus(s: dict) -> TokenCorpus:
    """``--data``; else the embedded corpus: as bytes, or, under ``--init-from-hf``,
    tokenized with that model's own ``tokenizer.json`` (its ids are not bytes)."""
    if s["data"]:
        return open_corpus(s["data"], s["heldout_fraction"])
    if not s["init_from_hf"]:
        return embedded_corpus(s["heldout_fraction"])
    tokenizer = Path(s["init_from_hf"]) / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"--init-from-hf={s['init_from_hf']!r} without --data: the embedded corpus is bytes, and "
                         "that model's folder has no tokenizer.json to tokenize it with; prepare your data with the "
                         "model's tokenizer (`python -m fmoe.data prepare FILES --out DIR --tokenizer "
                         "TOKENIZER.json`) and pass --data DIR")
    try:
        return embedded_corpus(s["heldout_fraction"], tokenizer)
    except ValueError as err:
        raise ValueError(f"--init-from-hf without --data tokenizes the embedded corpus with {tokenizer}: {err}; "
                         "or pass --data (a corpus written by `python -m fmoe.data prepare`)") from None


def _model_config(s: dict, explicit: set, corpus: TokenCorpus, base: ModelConfig | None):
    """The model: from the settings (the vocabulary the corpus's, unless given), or
    ``base`` (``--init-from-hf``'s) with only training fields changed."""
    if base is None:
        vocab = s["vocab"] if "vocab" in explicit else corpus.vocab
        return options.model_config(s, vocab=vocab)
    mine = options.model_config(s)
    clash = [k for k in options.MODEL_FIELDS if k in explicit and k not in TRAINING_FIELDS
             and getattr(mine, k) != getattr(base, k)]
    if clash:
        k = clash[0]
        raise ValueError(f"--{k.replace('_', '-')}={getattr(mine, k)!r} contradicts --init-from-hf "
                         f"{s['init_from_hf']} ({k}={getattr(base, k)!r}); only training fields may differ: "
                         + ", ".join(TRAINING_FIELDS))
    return base.replace(**{k: s[k] for k in TRAINING_FIELDS if k in explicit})


def _corpus_and_model(s: dict, explicit: set) -> tuple[TokenCorpus, ModelConfig]:
    base = hf.config(s["init_from_hf"]) if s["init_from_hf"] else None  # its folder named before its tokenizer
    corpus = _open_corpus(s)
    if corpus.packed is not None and "seq" not in explicit:  # a packed corpus's rows fix the sequence
        s["seq"] = corpus.packed.row - 1
    check_packed_seq(corpus, s["seq"])
    return corpus, _model_config(s, explicit, corpus, base)


def _derived(explicit: set) -> dict:
    """Settings the run works out rather than is given, for ``options.to_toml``."""
    return {} if "dp" in explicit else {"dp": "from the number of processes / ep when left out"}


def settings_file(s: dict, explicit: set, plan: Plan) -> str:
    """What ``--print-config`` prints and ``settings.toml`` holds: the settings with the
    model and plan the run builds (the corpus's vocabulary, ``--init-from-hf``'s model)."""
    return options.to_toml(options.resolved(s, plan), _derived(explicit))


def check_memory(s: dict, plan: Plan, world: World) -> None:
    """Refuse sizes this device cannot hold whatever the sharding: the model's params,
    grads and AdamW moments (16 bytes a parameter, split over every rank), a
    microbatch's ids and residual stream, and the end-of-run sample's KV cache. A lower
    bound, so a plan that fits is never refused; an absurd number fails here, in one
    line, instead of in an allocation or the kernel's OOM killer."""
    cfg, have = plan.model, device_memory(plan.device)
    n_params = sum(math.prod(shape) for shape in flat_shapes(cfg).values())
    state = 16 * n_params / world.size
    rows = s["batch"] // world.size
    activations = rows * (s["seq"] + 1) * 8 + rows // plan.microbatches * s["seq"] * cfg.dim * 4 * cfg.layers
    if state + activations > have:
        what = ("the model (--dim, --layers, --experts, --ffn, --vocab)" if state >= activations else
                "the batch (--batch, --seq, --microbatches)")
        raise ValueError(f"{what} needs at least {gib(state + activations)} per rank ({n_params / 1e9:,.2f}B params "
                         f"x 16 bytes for params, grads and AdamW state over {world.size} rank(s): {gib(state)}; "
                         f"ids and residual stream: {gib(activations)}), but {plan.device} has {gib(have)}")
    cache = kv_cache_bytes(cfg, 1, SAMPLE_PROMPT + s["sample_tokens"], plan.compute_dtype)
    if cache > have:
        _bad("sample_tokens", s["sample_tokens"], f"its KV cache needs {gib(cache)}, but {plan.device} has "
             f"{gib(have)}")


def prepare(argv=None, adapters: Adapters | None = None, lock: bool = False) -> Run | str:
    """Merge and check everything; the printed config for ``--print-config``.

    ``adapters``: what ``--cuda-graph`` and ``--expert-backend te`` need (handed in by
    ``python -m interop.train``); without them those settings are refused.
    ``lock``: take the run folder's lock (main rank only) before reading the folder,
    held in the returned ``Run`` until ``run_lock.release(run.lock)``.

    Raises:
        ValueError: naming the setting, key or file that cannot work; ``run_lock.FolderInUse``
            when another live run holds ``--out``.
    """
    prog = "python -m interop.train" if adapters is not None else "python -m fmoe.train"
    s, explicit = options.resolve(argv, prog)
    check_run_options(s)
    check_paths(s, explicit)
    if s["print_config"]:  # what it prints would run: the model and plan fields are checked too
        _, cfg = _corpus_and_model(s, explicit)
        preset = f"# preset{options.preset_summary(s['config'])[1:]}\n" if s["config"] in options.presets() else ""
        return preset + settings_file(s, explicit, options.plan_for(s, cfg))
    world = world_from_env()
    check_out_place(s)
    held = run_lock.acquire(s["out"]) if lock and world.is_main else None
    try:
        return _prepare_locked(s, explicit, world, adapters, held)
    except BaseException:
        run_lock.release(held)
        raise


def _prepare_locked(s: dict, explicit: set, world: World, adapters: Adapters | None,
                    held: run_lock.RunLock | None) -> Run:
    if "dp" not in explicit:
        s["dp"] = max(1, world.size // s["ep"])
    if s["dp"] * s["ep"] != world.size:
        raise ValueError(f"--dp={s['dp']} x --ep={s['ep']} must equal the number of processes "
                         f"(WORLD_SIZE={world.size})")
    corpus, cfg = _corpus_and_model(s, explicit)
    check_vocab(corpus, cfg.vocab)
    load_expert_backend(s["expert_backend"], adapters)  # a name its module registers: loaded before the Plan
    plan = options.plan_for(s, cfg, dp=s["dp"], device=rank_device(s["device"], world))
    per_rank = s["batch"] // world.size
    if s["batch"] % world.size or per_rank % plan.microbatches:
        _bad("batch", s["batch"], f"must split into {world.size} rank(s) x --microbatches={plan.microbatches} "
             f"equal parts (a multiple of {world.size * plan.microbatches})")
    check_device_and_backend(plan)
    check_memory(s, plan, world)
    scopes = parse_scopes(s["cuda_graph"], plan, adapters)
    checkpoint = Path(s["out"]) / "checkpoint"
    if s["auto_resume"] and checkpoint.exists():  # a restarted job (torchrun --max-restarts)
        s["resume"] = True
    if s["resume"] and not checkpoint.exists():
        raise ValueError(f"--resume, but there is no checkpoint at {checkpoint}")
    check_out(s)
    fingerprint = check_corpus(corpus)  # every id, before the first step needs one
    return Run(s, frozenset(explicit), world, corpus, fingerprint, plan, scopes, adapters, held)


def check_out_place(s: dict) -> None:
    """``--out`` can be a run folder: a folder, or a place where one can be made."""
    out = Path(s["out"])
    if out.exists() and not out.is_dir():
        _bad("out", s["out"], "it is a file; name a folder")
    if s["overwrite"] and (s["resume"] or s["auto_resume"]):
        _bad("overwrite", True, "contradicts --resume / --auto-resume: choose one")
    existing = out
    while not existing.exists():  # the folder is made later: its nearest existing parent must take it
        existing = existing.parent
    if not existing.is_dir():
        _bad("out", s["out"], f"{existing} is a file, so no folder can be made in it")
    if not os.access(existing, os.W_OK | os.X_OK):
        _bad("out", s["out"], f"{existing} is not writable")


def check_out(s: dict) -> None:
    """``--out`` can take this run: unless the run resumes or ``--overwrite`` says so,
    not holding another run, which would be overwritten. ``--auto-resume`` without a
    checkpoint replaces a run that never saved one (a job restarted before its first
    checkpoint)."""
    check_out_place(s)
    held = [p.name for p in run_contents(Path(s["out"])) if not is_staging(p)]
    if held and not (s["resume"] or s["auto_resume"] or s["overwrite"]):
        shown = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "")
        raise ValueError(f"--out={s['out']!r} holds a run ({shown}): add --resume to continue it, --overwrite "
                         "to remove it and start afresh, or name another --out")


__all__ = ["Adapters", "Run", "SAMPLE_PROMPT", "check_memory", "check_out", "check_out_place", "check_paths",
           "check_run_options", "load_expert_backend", "parse_scopes", "prepare", "settings_file"]
