"""The training loop of the main job, the same on every rank of any plan."""

from __future__ import annotations

import math
import shutil
import time

import torch
from tqdm import tqdm

from .. import hf
from ..checkpoint import load, save
from ..data import corpus_unigram, heldout_set, tokenizer_record, train_batch
from ..initialize import init
from ..generate import generate, load_tokenizer
from ..optim import adamw, global_norm, last_grad_norm, skipped_steps, update_expert_bias, warmup_cosine
from ..params import flat_shapes, train_flops_per_token
from ..shard.gather import gather_full
from ..step import eval_loss, step
from .metrics import MetricsLog, expert_load, peak_tflops
from .resilience import CheckpointDir, StopSignals, is_staging, remove, run_contents
from .setup import SAMPLE_PROMPT, Run, settings_file

# What the data a step sees depends on: a resumed run must agree on them. The corpus is
# compared by content (``corpus_fingerprint``), so a moved corpus or another spelling of
# its path resumes; ``data`` (its path) is kept in checkpoints for people to read.
_DATA_KEYS = ("seed", "batch", "seq", "corpus", "heldout_fraction")
# Settings whose being on or off shapes the optimizer state: a resumed run must agree.
_STATE_SWITCHES = ("clip", "max_skips")
# The end-of-run sample gathers the whole fp32 model on the main rank; beyond this it
# is left to `python -m fmoe.generate`, which loads a checkpoint in the compute dtype.
_SAMPLE_MAX_BYTES = 8 << 30


def _say(run: Run, text: str) -> None:
    if run.world.is_main:
        tqdm.write(text)


class _Stepper:
    """``fmoe.step`` for this run: eager, with CUDA-graphed scopes, or a graphed whole
    step, captured on the first batch it sees."""

    def __init__(self, run: Run):
        self.run, self.call = run, None

    def __call__(self, params, batch):
        if self.call is None:
            self.call = self._build(params, batch)
        return self.call(params, batch)

    def _build(self, params, batch):
        plan, scopes, adapters = self.run.plan, self.run.scopes, self.run.adapters
        if scopes == ("step",):
            # the fused optimizer updates the params' buffers in place: the graph reads them there
            return adapters.capture_step(params, batch, plan, donate=self.run.settings["fused_optimizer"])
        if scopes:
            kernels = adapters.capture_scopes(params, batch, plan, scopes)
            return lambda p, b: step(p, b, plan, kernels)
        return lambda p, b: step(p, b, plan)


def _start(run: Run, opt, data: dict):
    """``(params, opt_state, first step)``: fresh, from a Hugging Face checkpoint, or resumed
    (``data``: this run's ``_DATA_KEYS`` values, which a resumed checkpoint must share)."""
    s, plan = run.settings, run.plan
    if s["resume"]:
        ck = load(run.out / "checkpoint", plan)
        if "corpus" not in ck.extra and "data" in ck.extra and ck.extra["data"] != run.corpus.source:
            raise SystemExit(f"fmoe.train: cannot resume: --data={run.corpus.source!r}, but the checkpoint (saved by "
                             f"an older fmoe, which kept only the path) was trained with {ck.extra['data']!r}")
        for key in _DATA_KEYS:
            if key in ck.extra and ck.extra[key] != data[key]:
                what = "--data gives a corpus of " if key == "corpus" else f"--{key.replace('_', '-')}="
                raise SystemExit(f"fmoe.train: cannot resume: {what}{data[key]!r}, but the checkpoint was trained "
                                 f"with {ck.extra[key]!r}")
        for key, was_on in ck.extra.get("state_switches", {}).items():
            if bool(s[key]) != was_on:
                raise SystemExit(f"fmoe.train: cannot resume: --{key.replace('_', '-')}={s[key]!r} turns "
                                 f"{'off' if was_on else 'on'} what the checkpoint's optimizer state was built "
                                 f"{'with' if was_on else 'without'}")
        if ck.step >= s["steps"]:
            raise SystemExit(f"fmoe.train: the checkpoint is at step {ck.step} already; raise --steps to go on")
        if s["stop_after"] and ck.step >= s["stop_after"]:
            raise SystemExit(f"fmoe.train: the checkpoint is at step {ck.step} already; raise --stop-after "
                             "(or leave it out) to go on")
        if ck.extra.get("threads") not in (None, _threads(run)):
            _say(run, f"warning: resuming with {_threads(run)} CPU thread(s) per process where the run used "
                      f"{ck.extra['threads']} (--threads): CPU kernels split their sums by thread, so from here on "
                      "the run is not bit for bit what an uninterrupted one gives")
        _say(run, f"resumed from {run.out / 'checkpoint'} at step {ck.step}")
        return ck.params, ck.opt_state, ck.step + 1
    if s["init_from_hf"]:
        params = hf.load(s["init_from_hf"], plan)
        _say(run, f"initialised from the Hugging Face checkpoint {s['init_from_hf']}")
    else:
        params = init(plan, seed=s["seed"])
    return params, opt.init(params), 1


def _threads(run: Run) -> int | None:
    """The CPU threads a step's kernels use, which decide its rounding; None on GPUs."""
    return torch.get_num_threads() if torch.device(run.plan.device).type == "cpu" else None


def _nonfinite_stop(in_a_row: int, step_num: int, first: int, loss: float, checkpoints: CheckpointDir) -> str:
    """The message of the non-finite stop: the real last good checkpoint (or that there
    is none) and the likely cause."""
    if checkpoints.latest.exists():
        where = f"The last good checkpoint is {checkpoints.latest.resolve()}: --resume from it"
    else:
        where = "No checkpoint was saved before them"
    if step_num - in_a_row + 1 <= first:  # non-finite from this run's first step on
        cause = ("they began at the run's first step, so a setting is the likely cause (the model config, "
                 "--init-from-hf weights or the data), not the learning rate")
    else:
        cause = "after finite steps, so the likely cause is divergence: try a lower --lr or --clip"
    return (f"fmoe.train: {in_a_row} steps in a row (to step {step_num}) had non-finite gradients (loss {loss}); "
            f"stopping without applying them. {where}; {cause}")


def _prepare_out(run: Run) -> None:
    """The run folder, once every check has passed (main rank): with ``--overwrite`` the
    old run removed, a killed save's staging removed, then the settings (and the
    corpus's tokenizer, for ``fmoe.generate``) written."""
    s = run.settings
    if s["overwrite"] and (old := run_contents(run.out)):
        remove(old)
        _say(run, f"--overwrite: removed {', '.join(p.name for p in old)} from {run.out}")
    elif stale := [p for p in run_contents(run.out) if is_staging(p)]:
        remove(stale)
        _say(run, f"removed {len(stale)} staging folder(s) left in {run.out} by an interrupted save")
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "settings.toml").write_text(settings_file(s, run.explicit, run.plan))
    if run.corpus.tokenizer is not None:
        shutil.copyfile(run.corpus.tokenizer, run.out / "tokenizer.json")


def _sample(run: Run, params) -> None:
    """Generate from a held-out prompt with the trained model (rank 0 prints it)."""
    n = run.settings["sample_tokens"]
    if not n:
        return
    size = 4 * sum(math.prod(shape) for shape in flat_shapes(run.plan.model).values())
    if size > _SAMPLE_MAX_BYTES:
        _say(run, f"sample skipped: the whole model is {size / 2**30:.1f} GiB in fp32; sample from the "
                  "checkpoint with python -m fmoe.generate")
        return
    full = gather_full(params, run.plan)  # a collective: every rank takes part
    if not run.world.is_main:
        return
    prompt = torch.as_tensor(run.corpus.heldout[:SAMPLE_PROMPT].astype("int64"), device=run.plan.device)[None]
    ids = generate(full, prompt, run.plan.model, n, temperature=0.8, top_k=50, seed=run.settings["seed"],
                   eos_id=run.corpus.eos_id, dtype=run.plan.compute_dtype)[0].tolist()
    try:
        tok = load_tokenizer(run.corpus.tokenizer)
        text = f"{tok.decode(ids[:SAMPLE_PROMPT])!r} -> {tok.decode(ids[SAMPLE_PROMPT:])!r}"
    except ValueError as err:  # the tokenizers package is optional
        text = f"token ids {ids[:SAMPLE_PROMPT]} -> {ids[SAMPLE_PROMPT:]} ({err})"
    tqdm.write(f"sample: {text}")


def _logged(step_num: int, s: dict, last: int) -> bool:
    """Whether the loop reads step ``step_num``'s metrics to the host and logs them:
    every ``log_every`` steps, and at the steps that wait for the device anyway (a
    held-out evaluation, a checkpoint, the last step)."""
    return (step_num % s["log_every"] == 0 or step_num % s["eval_every"] == 0 or step_num == last
            or bool(s["save_every"]) and step_num % s["save_every"] == 0)


def _to_host(values: dict) -> dict:
    """``values``' tensors read to the host in one transfer (one sync): 0-dim ones as
    floats, 1-D ones as lists of floats (fp32 and int64 values come back exactly)."""
    flat = torch.cat([v.detach().reshape(-1).double() for v in values.values()]).tolist()
    out, at = {}, 0
    for key, v in values.items():
        out[key] = flat[at] if v.dim() == 0 else flat[at:at + v.numel()]
        at += v.numel()
    return out


class _Window:
    """Wall time and steps since the last logged step: tokens/s and MFU on a logged step
    are averages over them. The host read of a logged step waits for the device, so the
    time from one such read to the next is the device's time for the steps between;
    what the loop does after a read (evaluation, log, checkpoint) is left out by
    ``restart`` after it."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start, self.steps, self.trained = time.perf_counter(), 0, 0

    def seconds_per_step(self) -> float:
        """The wall time per step since ``restart``; call it right after a host read."""
        return (time.perf_counter() - self.start) / max(self.steps, 1)


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
    s, plan, world, corpus = run.settings, run.plan, run.world, run.corpus
    cfg = plan.model
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    schedule = warmup_cosine(s["lr"], s["warmup"], s["steps"], floor=s["min_lr_ratio"])
    # The job, not the optimizer, gives up on non-finite steps: it stops at the first
    # logged step that sees max_skips of them in a row, which may come up to log_every - 1
    # steps later. Until then every one must be skipped, so the optimizer is told to give
    # up only after more of them in a row than the run has steps.
    opt = adamw(schedule, weight_decay=s["weight_decay"], max_grad_norm=s["clip"] or None, plan=plan,
                fused=s["fused_optimizer"], donate=s["fused_optimizer"],
                skip_nonfinite=s["steps"] + s["max_skips"] if s["max_skips"] else 0)
    norm_in_state = bool(s["clip"] or s["max_skips"])  # the optimizer computes the norm and keeps it
    heldout = heldout_set(corpus, s["batch"], s["seq"], s["eval_batches"], world.rank, world.size)
    data = {key: s[key] for key in _DATA_KEYS if key != "corpus"}
    data["corpus"] = run.fingerprint
    params, opt_state, first = _start(run, opt, data)
    if world.is_main:  # every check has passed: now the folder changes
        _prepare_out(run)
    last = min(s["steps"], s["stop_after"]) if s["stop_after"] else s["steps"]
    baseline = corpus_unigram(corpus, cfg.vocab)
    n_params = sum(math.prod(shape) for shape in flat_shapes(cfg).values())
    _say(run, f"fmoe.train: {n_params / 1e6:.2f}M params, {len(corpus.train)} train / {len(corpus.heldout)} held-out "
              f"tokens from {corpus.source}; {world.size} rank(s), dp={plan.dp} ep={plan.ep} "
              f"sharding={plan.sharding} dtype={plan.dtype} device={plan.device}")
    if corpus.packed is not None:
        _say(run, f"packed rows of {corpus.packed.row} positions: the loss counts the trained targets "
                  "(loss_mask.bin) and attention stays inside each document (segments.bin)")
    _say(run, f"unigram baseline (held-out{', trained targets' if corpus.packed is not None else ''}): "
              f"{baseline:.4f} nats/token")
    tokens_per_step = s["batch"] * s["seq"]
    flops_per_step = train_flops_per_token(cfg, s["seq"]) * tokens_per_step
    peak = peak_tflops(plan.device, plan.dtype, s["peak_tflops"])
    log = MetricsLog(run.out, world.is_main, first - 1 if s["resume"] else None, not s["no_tensorboard"])
    stepper = _Stepper(run)
    checkpoints = CheckpointDir(run.out, s["keep"])

    tokenizer = tokenizer_record(corpus)  # the run folder's tokenizer.json, by content

    def checkpoint(step_num):
        extra = dict(data, data=corpus.source, tokenizer=tokenizer, threads=_threads(run))
        extra["state_switches"] = {key: bool(s[key]) for key in _STATE_SWITCHES}
        extra.update(samples_seen=step_num * s["batch"], eos_id=corpus.eos_id)
        save(checkpoints.path_for(step_num), plan, params, opt_state=opt_state, step=step_num, extra=extra)
        if world.is_main:
            checkpoints.publish(step_num)
        return checkpoints.latest

    bar = tqdm(range(first, last + 1), desc="train", disable=s["no_progress"] or not world.is_main,
               dynamic_ncols=True)
    train_loss = heldout_loss = float("nan")
    step_times, stopped, done = [], None, first - 1
    start = time.perf_counter()
    window = _Window()
    try:
        for step_num in bar:
            batch = train_batch(corpus, s["batch"], s["seq"], s["seed"], step_num, world.rank, world.size)
            try:
                out = stepper(params, batch)
            except ValueError as err:  # e.g. ids beyond the vocabulary in a corpus whose meta.json said otherwise
                raise ValueError(f"step {step_num}, a batch of {corpus.source}: {err}") from None
            # On one process a signal is a Python flag; several agree on it with a host
            # read, so only on the steps that read anyway. A stop is logged.
            logged = _logged(step_num, s, last)
            stop = signals.agreed(plan.device) if logged or world.size == 1 else False
            logged = logged or stop
            reads = {"loss": out.loss, "aux_loss": out.metrics["aux_loss"],
                     "dropped_tokens": out.metrics["dropped_tokens"],
                     "expert_load": expert_load(out.metrics["expert_counts"])} if logged else None
            if logged and not norm_in_state:
                reads["grad_norm"] = global_norm(out.grads, plan)  # before a donated update reuses the grads
            params, opt_state = opt.update(out.grads, opt_state, params)
            if cfg.expert_bias_rate:  # a skipped step changes no parameter, the expert biases included
                params = update_expert_bias(params, out.metrics["expert_counts"], cfg.expert_bias_rate, donate=True,
                                            applied=opt_state.applied if s["max_skips"] else None)
            window.steps += 1
            window.trained += out.metrics["tokens"]  # the global batch's counted targets: a host int
            done = step_num
            if step_num == first and plan.compile:  # say what the first step's wait was
                float(out.loss)
                _say(run, f"the first step compiled the node kernels (Plan.compile): "
                          f"{time.perf_counter() - window.start:.1f}s")
                if not logged:  # the next logged step's rate leaves the compilation out
                    window.restart()
            if not logged:
                continue  # nothing read to the host: the next step queues behind this one
            if norm_in_state:
                reads["grad_norm"] = last_grad_norm(opt_state)
            if s["max_skips"]:
                reads["in_a_row"], reads["skipped_steps"] = skipped_steps(opt_state)
            got = _to_host(reads)  # the one sync of a logged step
            step_s = window.seconds_per_step()
            step_times.append(step_s)
            train_loss, in_a_row = got["loss"], int(got.get("in_a_row", 0))
            record = {"step": step_num, "loss": train_loss, "grad_norm": got["grad_norm"],
                      "lr": float(schedule(step_num - 1)), "aux_loss": got["aux_loss"],
                      "tokens_per_s": tokens_per_step / step_s, "skipped_steps": int(got.get("skipped_steps", 0)),
                      "expert_load": got["expert_load"], "dropped_tokens": int(got["dropped_tokens"]),
                      "elapsed_s": time.perf_counter() - start}
            record["max_load"] = max(record["expert_load"])
            if corpus.packed is not None:  # fine-tuning: the targets the loss counts, per second
                record["trained_tokens_per_s"] = window.trained / window.steps / step_s
            if peak:
                record["mfu"] = flops_per_step / step_s / world.size / (peak * 1e12)
            if s["max_skips"] and in_a_row >= s["max_skips"]:
                log.write(record)
                raise SystemExit(_nonfinite_stop(in_a_row, step_num, first, train_loss, checkpoints))
            if step_num % s["eval_every"] == 0 or step_num == last:
                heldout_loss = sum(float(eval_loss(params, b, plan)) for b in heldout) / len(heldout)
                record["heldout_loss"] = heldout_loss
                _say(run, f"step {step_num:5d}  train {train_loss:.4f}  held-out {heldout_loss:.4f}  "
                          f"(unigram {baseline:.4f})")
            log.write(record)
            trained = {"trained_tok_s": f"{record['trained_tokens_per_s']:.0f}"} if corpus.packed is not None else {}
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", **trained,
                            skipped=record["skipped_steps"])
            if stop:
                stopped = signals.received or "a signal on another rank"
                break
            if s["save_every"] and step_num % s["save_every"] == 0 and step_num < last:
                checkpoint(step_num)
            window.restart()  # after the evaluation, log and checkpoint: they are not training
    finally:
        bar.close()
        log.close()
    wall = time.perf_counter() - start
    ckpt = checkpoint(done)
    if stopped:
        _say(run, f"fmoe.train: stopped by {stopped} after step {done}; checkpoint {ckpt}. Continue with the same "
                  f"command and --resume.")
    else:
        _sample(run, params)
    # each entry is a logged step's average over the steps since the one before
    median = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
    summary = {"unigram": baseline, "train_loss": train_loss, "heldout_loss": heldout_loss, "wall_s": wall,
               "steps": done, "checkpoint": str(ckpt), "tokens_per_s": tokens_per_step / median,
               "mfu": flops_per_step / median / world.size / (peak * 1e12) if peak else None, "stopped": stopped}
    if not stopped:
        _say(run, f"done in {wall:.1f}s: train {train_loss:.4f}, held-out {heldout_loss:.4f} nats/token "
                  f"vs unigram {baseline:.4f} ({heldout_loss / baseline:.0%} of baseline); "
                  f"{summary['tokens_per_s']:.0f} tokens/s (median over the logged steps)"
                  + (f", MFU {summary['mfu']:.1%}" if peak else "") + f"; checkpoint {ckpt}")
    return summary
