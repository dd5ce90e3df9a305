"""Everything the main job settles before a process group starts: the merged settings
(the run's own as a ``RunSettings``), the world, the data, the model config and the
plan, each refused with a message naming the setting (or file) when it cannot work."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from tqdm import tqdm

from .. import hf, lora
from ..backends import BUILT_IN, declared_backends, expert_backend_names, registered_backend
from ..config import ModelConfig, Plan
from ..data import TokenCorpus, check_corpus, check_packed_seq, check_vocab, embedded_corpus, open_corpus
from ..data.tokenizer_match import check_model_tokenizer
from ..generate import kv_cache_bytes
from ..lora_spec import LoRA
from ..hf.families import training_fields
from ..params import param_count
from ..runtime import check_device_and_backend, device_memory, gib
from . import options, resuming, run_lock
from .launch import World, rank_device, world_from_env
from .resilience import is_staging, run_contents
from .run_settings import RunSettings, invalid

# The end-of-run sample's prompt: this many held-out tokens.
SAMPLE_PROMPT = 16


class Adapters(NamedTuple):
    """What the main job takes from ``interop`` when ``python -m interop.train`` runs
    it: the core never imports its adapters, they are handed in.

    Attributes:
        check_capturable, capture_scopes: ``interop.cuda_graph``'s; graph_train_step:
            its ``GraphedTrainStep`` (the step and the update as one graph).
        load_backend: imports the ``interop`` module that registers an expert
            backend (``interop.te``); the backend's own check says what is missing.
        capture_error: what a capture that cannot happen raises (``CaptureError``),
            which the job says as ``--cuda-graph``'s.
    """

    check_capturable: Callable
    graph_train_step: Callable
    capture_scopes: Callable
    load_backend: Callable[[str], None]
    capture_error: type[ValueError]


class Run(NamedTuple):
    """A checked run: its ``settings`` and the keys given explicitly, the world, the
    corpus and its fingerprint (``check_corpus``), the plan (the model and plan
    settings, built), the text of its ``settings.toml`` (``settings_file``), the
    run folder's lock (held by the main rank of ``fmoe.train.main``; None otherwise), and
    for a resumed run what it had and what this command changes (``resuming.Resumed``)."""

    settings: RunSettings
    explicit: frozenset
    world: World
    corpus: TokenCorpus
    fingerprint: str
    plan: Plan
    settings_toml: str
    scopes: tuple  # CUDA-graph scopes, or ("step",)
    adapters: Adapters | None
    lock: run_lock.RunLock | None
    resumed: resuming.Resumed | None = None
    notes: tuple = ()  # lines the run says before its first step (a warm-up cut to --steps)

    @property
    def out(self) -> Path:
        return Path(self.settings.out)

    def say(self, text: str) -> None:
        """Print ``text`` on the main rank, above the progress bar."""
        if self.world.is_main:
            tqdm.write(text)


def check_paths(s: RunSettings, explicit: set) -> None:
    """Paths given explicitly may not be empty: an empty ``--data`` would mean the
    embedded corpus, ``--init-from-hf`` random weights, ``--out`` the current folder,
    each silently."""
    for name in ("out", "data", "init_from_hf", "config"):
        if name in explicit and not getattr(s, name).strip():
            default = {"out": f"(the default is {options.RUN_DEFAULTS['out']})",
                       "data": "(leave it out for the embedded corpus)",
                       "init_from_hf": "(leave it out to start from random weights)",
                       "config": "(leave it out for the cpu preset)"}[name]
            invalid(name, getattr(s, name), f"an empty path; name a path {default}")


_ADAPTERS_NEEDED = "it needs fmoe's adapters: run python -m interop.train with the same settings"


def adapters_of(s: RunSettings, cfg: ModelConfig) -> LoRA | None:
    """``--lora-rank``, ``--lora-alpha``, ``--lora-targets`` as ``Plan.lora`` (None at rank 0),
    each refused naming its flag: adapters need ``--init-from-hf`` and targets ``cfg`` holds."""
    if not s.lora_rank:
        return None
    if not s.init_from_hf:
        invalid("lora_rank", s.lora_rank, "adapters train on a released model: give --init-from-hf DIR (or "
                "--lora-rank 0 to train every weight)")
    targets = tuple(t.strip() for t in s.lora_targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in lora.TARGETS]
    if not targets or unknown or len(set(targets)) != len(targets):
        invalid("lora_targets", s.lora_targets, "comma-separated names, each once, from " + ", ".join(lora.TARGETS))
    adapters = LoRA(rank=s.lora_rank, alpha=s.lora_alpha or 2.0 * s.lora_rank, targets=targets)
    try:
        lora.sites(adapters, cfg)
    except ValueError as err:
        invalid("lora_targets", s.lora_targets, str(err).split(": ", 1)[-1])
    return adapters


def check_lora_run(s: RunSettings, plan: Plan) -> None:
    """What a run of adapters cannot do, refused naming the flag: the base is frozen (no
    expert-bias updates), the experts run in fmoe's GEMMs, and only the whole step is
    CUDA-graphed."""
    if plan.model.expert_bias_rate:
        invalid("expert_bias_rate", plan.model.expert_bias_rate, "the base model stays frozen under --lora-rank: "
                "leave it 0")
    if plan.expert_backend not in BUILT_IN:
        invalid("expert_backend", plan.expert_backend, "the adapters' products run in fmoe's grouped GEMMs under "
                f"--lora-rank: one of {', '.join(BUILT_IN)}")
    if s.cuda_graph and s.cuda_graph.strip() != "step":
        invalid("cuda_graph", s.cuda_graph, "under --lora-rank the step is graphed whole: 'step', or leave it out")


def parse_scopes(text: str, plan: Plan, adapters: Adapters | None) -> tuple:
    """``--cuda-graph``: "" (none), "step", or scopes from attn, router, dispatch, experts."""
    if not text:
        return ()
    scopes = tuple(s.strip() for s in text.split(",") if s.strip())
    allowed = ("attn", "router", "dispatch", "experts")
    if scopes != ("step",) and not all(s in allowed for s in scopes):
        invalid("cuda_graph", text, "'step', or comma-separated scopes from " + ", ".join(allowed))
    if adapters is None:
        invalid("cuda_graph", text, _ADAPTERS_NEEDED)
    adapters.check_capturable(plan, scopes)
    return scopes


def load_expert_backend(name: str, adapters: Adapters | None) -> None:
    """Make ``--expert-backend name`` runnable before the Plan is built: the built-in
    and registered ones are; a declared one is imported from the module that declares
    it (``fmoe.backends``), through the adapters when that module is in ``interop``
    (``te``: the core job never imports ``interop``)."""
    allowed = expert_backend_names()
    if name not in allowed:
        invalid("expert_backend", name, "allowed: " + ", ".join(map(repr, allowed)))
    if name in BUILT_IN or registered_backend(name) is not None:
        return
    module = declared_backends()[name]
    if module.split(".")[0] != "interop":
        importlib.import_module(module)
    elif adapters is None:
        invalid("expert_backend", name, _ADAPTERS_NEEDED)
    else:
        adapters.load_backend(module)


def _open_corpus(s: RunSettings) -> TokenCorpus:
    """``--data``; else the embedded corpus: as bytes, or, under ``--init-from-hf``,
    tokenized with that model's own ``tokenizer.json`` (its ids are not bytes)."""
    if s.data:
        return open_corpus(s.data, s.heldout_fraction)
    if not s.init_from_hf:
        return embedded_corpus(s.heldout_fraction)
    tokenizer = Path(s.init_from_hf) / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"--init-from-hf={s.init_from_hf!r} without --data: the embedded corpus is bytes, and "
                         "that model's folder has no tokenizer.json to tokenize it with; prepare your data with the "
                         "model's tokenizer (`python -m fmoe.data prepare FILES --out DIR --tokenizer "
                         "TOKENIZER.json`) and pass --data DIR")
    try:
        return embedded_corpus(s.heldout_fraction, tokenizer)
    except ValueError as err:
        raise ValueError(f"--init-from-hf without --data tokenizes the embedded corpus with {tokenizer}: {err}; "
                         "or pass --data (a corpus written by `python -m fmoe.data prepare`)") from None


def _model_config(s: RunSettings, fields: dict, explicit: set, corpus: TokenCorpus, base: ModelConfig | None):
    """The model: from the ModelConfig ``fields`` (the vocabulary the corpus's, unless
    given), or ``base`` (``--init-from-hf``'s) with only training fields changed."""
    if base is None:
        vocab = fields["vocab"] if "vocab" in explicit else corpus.vocab
        return options.model_config(fields, vocab=vocab)
    mine = options.model_config(fields)
    free = training_fields(base)
    clash = [k for k in options.MODEL_FIELDS if k in explicit and k not in free
             and getattr(mine, k) != getattr(base, k)]
    if clash:
        k = clash[0]
        raise ValueError(f"--{k.replace('_', '-')}={getattr(mine, k)!r} contradicts --init-from-hf "
                         f"{s.init_from_hf} ({k}={getattr(base, k)!r}); only training fields may differ: "
                         + ", ".join(free))
    return base.replace(**{k: fields[k] for k in free if k in explicit})


def _warn_once(line: str) -> None:
    """A warning of the settings, which every rank checks alike: said by the main rank."""
    if world_from_env().is_main:
        tqdm.write(line, file=sys.stderr)


def _corpus_and_model(s: RunSettings, fields: dict, explicit: set) -> tuple[RunSettings, TokenCorpus, ModelConfig]:
    """The corpus and the model; ``s`` with the sequence a packed corpus's rows fix,
    unless ``--seq`` is given."""
    base = hf.config(s.init_from_hf) if s.init_from_hf else None  # its folder named before its tokenizer
    corpus = _open_corpus(s)
    if base is not None:  # a corpus of another tokenizer (or bytes) is refused before any compute
        check_model_tokenizer(corpus, s.init_from_hf, base.vocab, warn=_warn_once)
    if corpus.packed is not None and "seq" not in explicit:
        s = s.replace(seq=corpus.packed.row - 1)
    check_packed_seq(corpus, s.seq)
    return s, corpus, _model_config(s, fields, explicit, corpus, base)


def _derived(explicit: set) -> dict:
    """Settings the run works out rather than is given, for ``options.to_toml``."""
    return {} if "dp" in explicit else {"dp": "from the number of processes / (pp * ep * cp * tp) when left out"}


def settings_file(s: RunSettings, fields: dict, explicit: set, plan: Plan) -> str:
    """What ``--print-config`` prints and ``settings.toml`` holds: the settings with the
    model and plan the run builds (the corpus's vocabulary, ``--init-from-hf``'s model).

    Arguments:
        s, fields: ``options.split``'s (``s`` as the run settled it).
        explicit: the keys given by ``--config`` or a flag.
        plan: the run's.
    """
    return options.to_toml(options.resolved(options.joined(s, fields), plan), _derived(explicit))


def check_memory(s: RunSettings, plan: Plan, world: World) -> None:
    """Refuse sizes this device cannot hold whatever the sharding: the model's params,
    grads and AdamW moments (16 bytes a parameter, split over every rank), a
    microbatch's ids and residual stream, and the end-of-run sample's KV cache. A lower
    bound, so a plan that fits is never refused; an absurd number fails here, in one
    line, instead of in an allocation or the kernel's OOM killer."""
    cfg, have = plan.model, device_memory(plan.device)
    n_params = param_count(cfg)
    # every weight trained: params, grads and two moments; adapters (merged weights, this version): the
    # frozen params and the merged ones' grads
    per_param = 16 if plan.lora is None else 8
    state = per_param * n_params / world.size
    rows = s.batch // world.size
    activations = rows * (s.seq + 1) * 8 + rows // plan.microbatches * s.seq * cfg.dim * 4 * cfg.layers
    if state + activations > have:
        what = ("the model (--dim, --layers, --experts, --ffn, --vocab)" if state >= activations else
                "the batch (--batch, --seq, --microbatches)")
        held = (f"16 bytes for params, grads and AdamW state over {world.size} rank(s)" if plan.lora is None else
                f"8 bytes for the frozen params and their gradients through the adapters over {world.size} rank(s)")
        raise ValueError(f"{what} needs at least {gib(state + activations)} per rank ({n_params / 1e9:,.2f}B params "
                         f"x {held}: {gib(state)}; "
                         f"ids and residual stream: {gib(activations)}), but {plan.device} has {gib(have)}")
    cache = kv_cache_bytes(cfg, 1, SAMPLE_PROMPT + s.sample_tokens, plan.compute_dtype)
    if cache > have:
        invalid("sample_tokens", s.sample_tokens, f"its KV cache needs {gib(cache)}, but {plan.device} has "
             f"{gib(have)}")


def prepare(argv=None, adapters: Adapters | None = None, lock: bool = False) -> Run | str:
    """Merge and check everything; the printed config for ``--print-config``.

    ``adapters``: what ``--cuda-graph`` and ``--expert-backend te`` need (handed in by
    ``python -m interop.train``); without them those settings are refused.
    ``lock``: take the run folder's lock (main rank only) before reading the folder
    (but its ``settings.toml``, written atomically, which a resumed run's settings start
    from: ``resuming``), held in the returned ``Run`` until ``run_lock.release(run.lock)``.

    Raises:
        ValueError: naming the setting, key or file that cannot work; ``run_lock.FolderInUse``
            when another live run holds ``--out``.
    """
    prog = "python -m interop.train" if adapters is not None else "python -m fmoe.train"
    run_file, notes = resuming.RunFile(), []
    merged, explicit = options.resolve(argv, prog, base=run_file.read, notes=notes)
    s, fields = options.split(merged)
    check_paths(s, explicit)
    if s.print_config:  # what it prints would run: the model and plan fields are checked too
        s, _, cfg = _corpus_and_model(s, fields, explicit | set(run_file.had))
        preset = f"# preset{options.preset_summary(s.config)[1:]}\n" if s.config in options.presets() else ""
        return preset + settings_file(s, fields, explicit, options.plan_for(fields, cfg))
    world = world_from_env()
    check_out_place(s)
    held = run_lock.acquire(s.out) if lock and world.is_main else None
    try:
        return _prepare_locked(s, fields, explicit, world, adapters, held, run_file)._replace(notes=tuple(notes))
    except BaseException:
        run_lock.release(held)
        raise


def _resumes(s: RunSettings, fields: dict, explicit: set, run_file: resuming.RunFile) -> tuple:
    """``(s, resumed)``: ``--auto-resume`` with a checkpoint as ``--resume``; a resumed
    run's settings checked against its own (``resuming.check``), else None."""
    checkpoint = Path(s.out) / "checkpoint"
    if s.auto_resume and checkpoint.exists():  # a restarted job (torchrun --max-restarts)
        s = s.replace(resume=True)
    if not s.resume:
        return s, None
    if not checkpoint.exists():
        raise ValueError(f"--resume, but there is no checkpoint at {checkpoint}")
    merged = options.joined(s, fields)
    return s, resuming.check(run_file, merged, explicit, resuming.checkpoint_extra(s.out))


def _prepare_locked(s: RunSettings, fields: dict, explicit: set, world: World, adapters: Adapters | None,
                    held: run_lock.RunLock | None, run_file: resuming.RunFile) -> Run:
    s, resumed = _resumes(s, fields, explicit, run_file)
    others = fields["pp"] * fields["ep"] * fields["cp"] * fields["tp"]
    dp = fields["dp"] if "dp" in explicit else max(1, world.size // others)
    if dp * others != world.size:
        kept = [f"{k}={fields[k]}" for k in ("pp", "dp", "ep", "cp", "tp")
                if k in run_file.had and k not in explicit and fields[k] != 1]
        where = (f" ({', '.join(kept)} from the resumed run's {run_file.path}: pass the flag to change it; a "
                 "checkpoint reshards to any plan)" if kept else "")
        raise ValueError(f"--pp={fields['pp']} x --dp={dp} x --ep={fields['ep']} x --cp={fields['cp']} x "
                         f"--tp={fields['tp']} must equal the number of processes (WORLD_SIZE={world.size}){where}")
    # the resumed run's own model settings (its --vocab, a fine-tune's training fields) build its model as if
    # given, though they are not "explicit" for the checks that compare flags with the run
    s, corpus, cfg = _corpus_and_model(s, fields, explicit | set(run_file.had))
    check_vocab(corpus, cfg.vocab)
    if corpus.packed is not None and fields["cp"] > 1:
        invalid("cp", fields["cp"], f"context parallelism takes one sequence per row; {corpus.source} is packed "
             "with documents (segments): allowed --cp 1")
    load_expert_backend(fields["expert_backend"], adapters)  # a name its module registers: loaded before the Plan
    plan = options.plan_for(fields, cfg, dp=dp, device=rank_device(fields["device"], world), lora=adapters_of(s, cfg))
    blocks = plan.dp * plan.ep  # the ranks reading rows of their own (fmoe.local_batch)
    if s.batch % (blocks * plan.microbatches):
        invalid("batch", s.batch, f"must split into dp x ep = {blocks} row block(s) x --microbatches="
             f"{plan.microbatches} equal parts (a multiple of {blocks * plan.microbatches})")
    chunks = 2 * plan.cp if plan.cp > 1 else 1
    if s.seq % (chunks * plan.tp):
        invalid("seq", s.seq, f"--cp={plan.cp} cuts each sequence into {chunks} chunk(s) and --tp={plan.tp} splits "
             f"a chunk's positions: a multiple of {chunks * plan.tp}")
    check_device_and_backend(plan)
    check_memory(s, plan, world)
    if plan.lora is not None:
        check_lora_run(s, plan)
    scopes = parse_scopes(s.cuda_graph, plan, adapters)
    if world.is_main:  # the folder's contents are the main rank's: it may be writing them while others check
        check_out(s)
    else:
        check_out_place(s)
    fingerprint = check_corpus(corpus)  # every id, before the first step needs one
    return Run(s, frozenset(explicit), world, corpus, fingerprint, plan, settings_file(s, fields, explicit, plan),
               scopes, adapters, held, resumed)


def check_out_place(s: RunSettings) -> None:
    """``--out`` can be a run folder: a folder, or a place where one can be made."""
    out = Path(s.out)
    if out.exists() and not out.is_dir():
        invalid("out", s.out, "it is a file; name a folder")
    if s.overwrite and (s.resume or s.auto_resume):
        invalid("overwrite", True, "contradicts --resume / --auto-resume: choose one")
    existing = out
    while not existing.exists():  # the folder is made later: its nearest existing parent must take it
        existing = existing.parent
    if not existing.is_dir():
        invalid("out", s.out, f"{existing} is a file, so no folder can be made in it")
    if not os.access(existing, os.W_OK | os.X_OK):
        invalid("out", s.out, f"{existing} is not writable")


def check_out(s: RunSettings) -> None:
    """``--out`` can take this run: unless the run resumes or ``--overwrite`` says so,
    not holding another run, which would be overwritten. ``--auto-resume`` without a
    checkpoint replaces a run that never saved one (a job restarted before its first
    checkpoint)."""
    check_out_place(s)
    held = [p.name for p in run_contents(Path(s.out)) if not is_staging(p)]
    if held and not (s.resume or s.auto_resume or s.overwrite):
        shown = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "")
        raise ValueError(f"--out={s.out!r} holds a run ({shown}): add --resume to continue it, --overwrite "
                         "to remove it and start afresh, or name another --out")


__all__ = ["Adapters", "Run", "SAMPLE_PROMPT", "check_memory", "check_out", "check_out_place", "check_paths",
           "load_expert_backend", "parse_scopes", "prepare", "settings_file"]
