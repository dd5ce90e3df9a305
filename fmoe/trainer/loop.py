"""The training loop of the main job, the same on every rank of any plan.

``train`` reads as its parts: ``_setup`` (the optimizer, and the state built or
resumed), ``_step`` (one step, queued on the device), on a logged step ``_record``
and ``_evaluate`` (its one host read, its metrics, the held-out loss), checkpoints
(``checkpointing.Checkpoints``), and ``_finish`` (the last checkpoint, the sample,
the summary)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Any, Callable, NamedTuple

import torch
from tqdm import tqdm

from .. import lora
from ..batch import context_chunks
from ..data import corpus_unigram, heldout_rows, heldout_set, train_batch
from ..generate import generate, load_tokenizer
from ..optim import Optimizer, adamw, global_norm, last_grad_norm, skipped_steps, update_expert_bias
from ..params import param_count, train_flops_per_token
from ..gather import gather_full
from ..step import eval_loss, step
from . import lr_schedule
from .checkpointing import Checkpoints, prepare_out
from .metrics import MetricsLog, Window, expert_load, peak_tflops, to_host
from .resilience import StopSignals
from .run_settings import RunSettings
from .setup import SAMPLE_PROMPT, Run
from .stall import Watchdog

# The end-of-run sample gathers the whole fp32 model on the main rank; beyond this it
# is left to `python -m fmoe.generate`, which loads a checkpoint in the compute dtype.
_SAMPLE_MAX_BYTES = 8 << 30


class _Stepper:
    """A training step of this run, ``(params, opt_state, batch) -> (out, params,
    opt_state)``: ``fmoe.step`` and ``update``, eager or with CUDA-graphed scopes, or
    both as one CUDA graph (``--cuda-graph step``), built on the first batch it sees."""

    def __init__(self, run: Run, update: Callable, base: dict | None):
        self.run, self.update, self.base, self.call = run, update, base, None

    def __call__(self, params, opt_state, batch):
        if self.call is None:
            self.call = self._build(params, batch)
        return self.call(params, opt_state, batch)

    def close(self) -> None:
        """Free its CUDA graphs, before the process group goes: NCCL cannot destroy a
        communicator while a graph holding its collectives lives, and the run would
        hang at exit (the step's graph is reset; the scopes' go with their last
        reference)."""
        release = getattr(self.call, "release", None)
        if release is not None:
            release()
        self.call = None
        gc.collect()

    def _build(self, params, batch):
        plan, scopes, adapters = self.run.plan, self.run.scopes, self.run.adapters
        if scopes == ("step",):  # the update inside the step's graph, after two eager steps
            return adapters.graph_train_step(plan, self.update, base=self.base)
        kernels = adapters.capture_scopes(params, batch, plan, scopes) if scopes else None

        def eager(params, opt_state, batch):
            out = step(params, batch, plan, kernels, base=self.base)
            return (out, *self.update(out, params, opt_state))
        return eager


def _update(run: Run, opt: Optimizer) -> Callable:
    """What follows a step: ``(out, params, opt_state) -> (params, opt_state)``, the
    optimizer's update and, with ``expert_bias_rate``, the expert biases'. It reads
    nothing on the host, so ``--cuda-graph step`` captures it with the step."""
    rate, skipping = run.plan.model.expert_bias_rate, bool(run.settings.max_skips)

    def update(out, params, opt_state):
        params, opt_state = opt.update(out.grads, opt_state, params)
        if rate:  # a skipped step changes no parameter, the expert biases included
            params = update_expert_bias(params, out.metrics["expert_counts"], rate, donate=True,
                                        applied=opt_state.applied if skipping else None)
        return params, opt_state
    return update


class _Job(NamedTuple):
    """What every step of a run reads, built once by ``_setup``."""

    run: Run
    base: dict | None  # under --lora-rank, the frozen params the adapters (the state's params) adapt
    schedule: Callable[[int], Any]
    opt: Optimizer
    norm_in_state: bool  # the optimizer computes the grad norm and keeps it
    heldout: list
    checkpoints: Checkpoints
    stepper: _Stepper
    watchdog: Watchdog  # says where the host is when a step runs past --stall-report seconds
    first: int  # the first step this process takes
    last: int  # and its last
    baseline: float  # the held-out unigram loss
    tokens_per_step: int
    flops_per_step: float
    peak: float | None  # the device's peak TFLOP/s for MFU; None when unknown


@dataclasses.dataclass
class _State:
    """What the loop changes as it goes."""

    params: dict
    opt_state: Any
    done: int  # the last step taken
    started: float = 0.0  # the loop's start (time.perf_counter): elapsed_s, wall_s
    train_loss: float = math.nan  # at the last logged step
    heldout_loss: float = math.nan  # at the last evaluation
    step_times: list = dataclasses.field(default_factory=list)  # seconds a step, per logged step
    stopped: str | None = None  # the signal that stopped the run


def train(run: Run) -> dict:
    """Train as ``run`` says; returns a summary (losses, throughput, checkpoint path).

    Reads values back to the host only on logged steps (``_logged``: every
    ``log_every`` steps, evaluations, checkpoints, the last step); the steps between
    queue on the device. Stops early, with a checkpoint, when SIGTERM or SIGINT
    arrives (``stopped`` in the summary names the signal): after the step in flight on
    one process, after the next logged step on several (they agree on it there).
    Raises SystemExit, keeping the last good checkpoint, when ``max_skips`` steps in a
    row have non-finite gradients, seen at the next logged step; every one of them is
    skipped on the device meanwhile.
    """
    signals = StopSignals()  # from the start: a signal while the run loads stops it after its first step
    try:
        return _train(run, signals)
    finally:
        signals.restore()


def _train(run: Run, signals: StopSignals) -> dict:
    watchdog = Watchdog(run.settings.stall_report, run.world.rank, run.plan.device)
    try:
        watchdog.mark("the run's setup (the initial parameters or a checkpoint, the held-out batches)")
        job, state = _setup(run, watchdog)
        try:
            _loop(job, state, signals)
            watchdog.mark(f"the end of the run (the checkpoint of step {state.done}, the sample)")
            summary = _finish(job, state)
        except BaseException:
            with contextlib.suppress(Exception):  # the error in flight says more than a failed release
                job.stepper.close()
            raise
        job.stepper.close()
        return summary
    finally:
        watchdog.close()


def _loop(job: _Job, state: _State, signals: StopSignals) -> None:
    """The steps, with a logged step's record, evaluation and checkpoint."""
    run = job.run
    s, world = run.settings, run.world
    log = MetricsLog(run.out, world.is_main, job.first - 1 if s.resume else None, not s.no_tensorboard)
    bar = tqdm(range(job.first, job.last + 1), desc="train", disable=s.no_progress or not world.is_main,
               dynamic_ncols=True)
    state.started = time.perf_counter()
    window = Window()
    try:
        for step_num in bar:
            job.watchdog.mark(f"step {step_num}")
            reads, stop = _step(job, state, step_num, signals, window)
            if reads is None:
                continue  # nothing read to the host: the next step queues behind this one
            record, in_a_row = _record(job, state, step_num, reads, window)
            if s.max_skips and in_a_row >= s.max_skips:
                log.write(record)
                raise SystemExit(job.checkpoints.nonfinite_stop(in_a_row, step_num, job.first, state.train_loss))
            _evaluate(job, state, step_num, record)
            log.write(record)
            _show(bar, record)
            if stop:
                state.stopped = signals.received or "a signal on another rank"
                break
            if s.save_every and step_num % s.save_every == 0 and step_num < job.last:
                job.watchdog.mark(f"the checkpoint of step {step_num}")
                job.checkpoints.save(step_num, state.params, state.opt_state)
            window.restart()  # after the evaluation, log and checkpoint: they are not training
    finally:
        bar.close()
        log.close()


def _setup(run: Run, watchdog: Watchdog) -> tuple[_Job, _State]:
    """Everything before the first step: CPU threads and the seed, the checkpoint of a
    resumed run and the schedule it continues, the optimizer, the held-out batches, the
    first state (fresh, from Hugging Face weights, or resumed), the run folder (main
    rank), and what the run says of itself."""
    s, plan, world, corpus = run.settings, run.plan, run.world, run.corpus
    if s.threads:
        torch.set_num_threads(s.threads)
    if torch.device(plan.device).type == "cuda":  # the peak the records report is this run's
        torch.cuda.reset_peak_memory_stats(plan.device)
    torch.manual_seed(s.seed)
    checkpoints = Checkpoints(run)
    resumed = checkpoints.resumed()  # the schedule goes on from the checkpoint's
    schedule = lr_schedule.build(checkpoints.lr_schedule, s)
    # The job, not the optimizer, gives up on non-finite steps: it stops at the first
    # logged step that sees max_skips of them in a row, which may come up to log_every - 1
    # steps later. Until then every one must be skipped, so the optimizer is told to give
    # up only after more of them in a row than the run has steps.
    opt = adamw(schedule, weight_decay=s.weight_decay, max_grad_norm=s.clip or None, plan=plan,
                fused=s.fused_optimizer, donate=s.fused_optimizer, moments=s.moments,
                skip_nonfinite=s.steps + s.max_skips if s.max_skips else 0)
    eval_note = _eval_note(run)
    heldout = [context_chunks(b, plan, world.rank)
               for b in heldout_set(corpus, s.batch, s.seq, s.eval_batches, *row_block(plan, world.rank))]
    params, opt_state, first, base = checkpoints.start(opt, resumed)
    if world.is_main:  # every check has passed: now the folder changes
        prepare_out(run)
    baseline = corpus_unigram(corpus, plan.model.vocab)
    _introduce(run, baseline)
    for note in (*run.notes, *(line for line in (checkpoints.drawn, eval_note) if line)):
        run.say(note)
    tokens_per_step = s.batch * s.seq
    job = _Job(run, base, schedule, opt, norm_in_state=bool(s.clip or s.max_skips), heldout=heldout,
               checkpoints=checkpoints, stepper=_Stepper(run, _update(run, opt), base), first=first,
               last=min(s.steps, s.stop_after) if s.stop_after else s.steps, baseline=baseline,
               tokens_per_step=tokens_per_step,
               flops_per_step=train_flops_per_token(plan.model, s.seq) * tokens_per_step,
               peak=peak_tflops(plan.device, plan.dtype, s.peak_tflops), watchdog=watchdog)
    return job, _State(params, opt_state, done=first - 1)


def _eval_note(run: Run) -> str | None:
    """The line for a held-out split of fewer rows than ``--batch`` (the embedded corpus's
    12 rows of 2048 against a global batch of 8 a GPU): each evaluation counts every row
    it holds, in a batch of ``--batch`` rows that ``heldout_set`` fills with rows that count
    nothing."""
    s = run.settings
    have = heldout_rows(run.corpus, s.seq)
    if not 0 < have < s.batch:
        return None
    return (f"the held-out split holds {have} rows of {s.seq} positions, fewer than --batch {s.batch}: each "
            f"evaluation counts those {have}, in a batch filled to {s.batch} with rows that count nothing")


def _introduce(run: Run, baseline: float) -> None:
    """The run's opening lines: the model, the data, the world, the baseline loss."""
    plan, corpus = run.plan, run.corpus
    n_params = param_count(plan.model)
    more = "".join(f" {k}={getattr(plan, k)}" for k in ("tp", "etp", "cp", "pp", "virtual_stages")
                   if getattr(plan, k) > 1)
    run.say(f"fmoe.train: {n_params / 1e6:.2f}M params, {len(corpus.train)} train / {len(corpus.heldout)} held-out "
            f"tokens from {corpus.source}; {run.world.size} rank(s), dp={plan.dp} ep={plan.ep}{more} "
            f"sharding={plan.sharding} dtype={plan.dtype} device={plan.device}")
    if plan.lora is not None:
        adapted = sum(math.prod(shape) for shape in lora.adapter_shapes(plan).values())
        run.say(f"training adapters of rank {plan.lora.rank} (alpha {plan.lora.alpha:g}) on "
                f"{', '.join(plan.lora.targets)}: {adapted / 1e6:.3f}M params ({adapted / n_params:.2%} of the "
                "model's, which stay frozen)")
    if corpus.packed is not None:
        run.say(f"packed rows of {corpus.packed.row} positions: the loss counts the trained targets "
                "(loss_mask.bin) and attention stays inside each document (segments.bin)")
    run.say(f"unigram baseline (held-out{', trained targets' if corpus.packed is not None else ''}): "
            f"{baseline:.4f} nats/token")


def _logged(step_num: int, s: RunSettings, last: int) -> bool:
    """Whether the loop reads step ``step_num``'s metrics to the host and logs them:
    every ``log_every`` steps, and at the steps that wait for the device anyway (a
    held-out evaluation, a checkpoint, the last step)."""
    return (step_num % s.log_every == 0 or step_num % s.eval_every == 0 or step_num == last
            or bool(s.save_every) and step_num % s.save_every == 0)


def row_block(plan, rank: int) -> tuple[int, int]:
    """``(block, blocks)``: which of the global batch's ``dp * ep`` row blocks a rank
    reads, as the data functions' ``rank, world`` (``fmoe.local_batch``'s split)."""
    return plan.dims.row_block(rank), plan.dp * plan.ep


@contextlib.contextmanager
def _profiled(run: Run, step_num: int):
    """Step ``--profile-step`` under ``torch.profiler`` (CPU ops, CUDA kernels, the
    executor's named actions), its trace written to the run folder, one file a rank."""
    if step_num != run.settings.profile_step:
        yield
        return
    cuda = torch.device(run.plan.device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if cuda:  # the step's kernels, not only their launches
            torch.cuda.synchronize()
    path = run.out / f"trace-step{step_num}-rank{run.world.rank}.json.gz"
    prof.export_chrome_trace(str(path))
    run.say(f"step {step_num}'s trace: {path} (a file a rank; python benchmarks/trace_gaps.py {path} says where "
            "the GPU waited)")


def _step(job: _Job, state: _State, step_num: int, signals: StopSignals, window: Window) -> tuple[dict | None, bool]:
    """Take step ``step_num``: its batch, ``fmoe.step`` and the update, queued on the
    device (and the expert biases' update).

    Returns:
        ``(reads, stop)``: on a logged step the device values to read to the host, else
        None; whether a signal stops the run after this step.
    """
    run, s, plan = job.run, job.run.settings, job.run.plan
    batch = context_chunks(train_batch(run.corpus, s.batch, s.seq, s.seed, step_num, *row_block(plan, run.world.rank)),
                       plan, run.world.rank)
    if step_num == job.first and plan.compile:  # minutes on a cold cache at a large shape: say why nothing moves
        run.say(f"step {step_num}: compiling the node kernels (Plan.compile) ...")
    try:
        with _profiled(run, step_num):
            out, state.params, state.opt_state = job.stepper(state.params, state.opt_state, batch)
    except ValueError as err:  # e.g. ids beyond the vocabulary in a corpus whose meta.json said otherwise
        capture = run.adapters is not None and isinstance(err, run.adapters.capture_error)
        about = f"--cuda-graph {s.cuda_graph}" if capture else f"a batch of {run.corpus.source}"
        raise (type(err) if capture else ValueError)(f"step {step_num}, {about}: {err}") from None
    # On one process a signal is a Python flag; several agree on it with a host read,
    # so only on the steps that read anyway. A stop is logged.
    logged = _logged(step_num, s, job.last)
    stop = signals.agreed(plan.device) if logged or run.world.size == 1 else False
    logged = logged or stop
    reads = {"loss": out.loss, "aux_loss": out.metrics["aux_loss"], "dropped_tokens": out.metrics["dropped_tokens"],
             "expert_load": expert_load(out.metrics["expert_counts"])} if logged else None
    if logged and not job.norm_in_state:  # no clipping, so the update left the grads as they were
        reads["grad_norm"] = global_norm(out.grads, plan)
    window.steps += 1
    window.trained += out.metrics["tokens"]  # the global batch's counted targets: a host int
    state.done = step_num
    if step_num == job.first and plan.compile:  # say what the first step's wait was
        float(out.loss)
        run.say(f"the first step compiled the node kernels (Plan.compile): {time.perf_counter() - window.start:.1f}s")
        if not logged:  # the next logged step's rate leaves the compilation out
            window.restart()
    if logged and job.norm_in_state:
        reads["grad_norm"] = last_grad_norm(state.opt_state)
    if logged and s.max_skips:
        reads["in_a_row"], reads["skipped_steps"] = skipped_steps(state.opt_state)
    return reads, stop


def _record(job: _Job, state: _State, step_num: int, reads: dict, window: Window) -> tuple[dict, int]:
    """A logged step's ``metrics.jsonl`` record, from its one host read of ``reads``;
    and the steps in a row, to this one, whose gradients were non-finite."""
    run = job.run
    got = to_host(reads)  # the one sync of a logged step
    step_s = window.seconds_per_step()
    state.step_times.append(step_s)
    state.train_loss, in_a_row = got["loss"], int(got.get("in_a_row", 0))
    record = {"step": step_num, "loss": state.train_loss, "grad_norm": got["grad_norm"],
              "lr": float(job.schedule(step_num - 1)), "aux_loss": got["aux_loss"],
              "tokens_per_s": job.tokens_per_step / step_s, "skipped_steps": int(got.get("skipped_steps", 0)),
              "expert_load": got["expert_load"], "dropped_tokens": int(got["dropped_tokens"]),
              "elapsed_s": time.perf_counter() - state.started}
    record["max_load"] = max(record["expert_load"])
    if run.corpus.packed is not None:  # fine-tuning: the targets the loss counts, per second
        record["trained_tokens_per_s"] = window.trained / window.steps / step_s
    if job.peak:
        record["mfu"] = job.flops_per_step / step_s / run.world.size / (job.peak * 1e12)
    if torch.device(run.plan.device).type == "cuda":  # this rank's, since the run began
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.plan.device) / 2**30
    return record, in_a_row


def _evaluate(job: _Job, state: _State, step_num: int, record: dict) -> None:
    """The held-out loss, into ``record``: every ``eval_every`` steps and at the last."""
    if step_num % job.run.settings.eval_every != 0 and step_num != job.last:
        return
    job.watchdog.mark(f"the held-out evaluation after step {step_num}")
    state.heldout_loss = sum(float(eval_loss(state.params, b, job.run.plan, base=job.base))
                             for b in job.heldout) / len(job.heldout)
    record["heldout_loss"] = state.heldout_loss
    job.run.say(f"step {step_num:5d}  train {state.train_loss:.4f}  held-out {state.heldout_loss:.4f}  "
                f"(unigram {job.baseline:.4f})")


def _show(bar: tqdm, record: dict) -> None:
    trained = {"trained_tok_s": f"{record['trained_tokens_per_s']:.0f}"} if "trained_tokens_per_s" in record else {}
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", **trained,
                    skipped=record["skipped_steps"])


def _finish(job: _Job, state: _State) -> dict:
    """After the loop: the last checkpoint, the sample (unless a signal stopped the
    run), and the summary."""
    run = job.run
    wall = time.perf_counter() - state.started
    ckpt = job.checkpoints.save(state.done, state.params, state.opt_state)
    if state.stopped:
        run.say(f"fmoe.train: stopped by {state.stopped} after step {state.done}; checkpoint {ckpt}. Continue with "
                f"the same command and --resume.")
    else:
        _sample(run, state.params, job.base)
    # each entry is a logged step's average over the steps since the one before
    median = sorted(state.step_times)[len(state.step_times) // 2] if state.step_times else float("nan")
    peak, train_loss, heldout_loss = job.peak, state.train_loss, state.heldout_loss
    summary = {"unigram": job.baseline, "train_loss": train_loss, "heldout_loss": heldout_loss, "wall_s": wall,
               "steps": state.done, "checkpoint": str(ckpt), "tokens_per_s": job.tokens_per_step / median,
               "mfu": job.flops_per_step / median / run.world.size / (peak * 1e12) if peak else None,
               "stopped": state.stopped}
    cuda = torch.device(run.plan.device).type == "cuda"
    summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.plan.device) / 2**30 if cuda else None
    if not state.stopped:
        run.say(f"done in {wall:.1f}s: train {train_loss:.4f}, held-out {heldout_loss:.4f} nats/token "
                f"vs unigram {job.baseline:.4f} ({heldout_loss / job.baseline:.0%} of baseline); "
                f"{summary['tokens_per_s']:.0f} tokens/s (median over the logged steps)"
                + (f", MFU {summary['mfu']:.1%}" if peak else "")
                + (f"; peak memory {summary['peak_memory_gib']:.1f} GiB (rank 0)" if cuda else "")
                + f"; checkpoint {ckpt}")
    return summary


def _sample(run: Run, params, base: dict | None) -> None:
    """Generate from a held-out prompt with the trained model (rank 0 prints it); under
    ``--lora-rank`` the base with the adapters merged."""
    n = run.settings.sample_tokens
    if not n:
        return
    size = 4 * param_count(run.plan.model)
    if size > _SAMPLE_MAX_BYTES:
        run.say(f"sample skipped: the whole model is {size / 2**30:.1f} GiB in fp32; sample from the "
                "checkpoint with python -m fmoe.generate")
        return
    plan = run.plan.replace(lora=None)
    if base is not None:
        params = lora.merge(base, params, run.plan)
    full = gather_full(params, plan)  # a collective: every rank takes part
    if not run.world.is_main:
        return
    prompt = torch.as_tensor(run.corpus.heldout[:SAMPLE_PROMPT].astype("int64"), device=plan.device)[None]
    ids = generate(full, prompt, plan.model, n, temperature=0.8, top_k=50, seed=run.settings.seed,
                   eos_id=run.corpus.eos_id, dtype=plan.compute_dtype)[0].tolist()
    try:
        tok = load_tokenizer(run.corpus.tokenizer)
        text = f"{tok.decode(ids[:SAMPLE_PROMPT])!r} -> {tok.decode(ids[SAMPLE_PROMPT:])!r}"
    except ValueError as err:  # the tokenizers package is optional
        text = f"token ids {ids[:SAMPLE_PROMPT]} -> {ids[SAMPLE_PROMPT:]} ({err})"
    tqdm.write(f"sample: {text}")
