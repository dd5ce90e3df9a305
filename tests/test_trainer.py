"""The main job as a user runs it: torchrun on gloo ranks, TOML configs, prepared data,
Hugging Face initialisation, preemption, a dead rank, non-finite steps."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optree
import pytest
import torch

import fmoe
from fmoe import train
from fmoe.data import prepare
from fmoe.generate import checkpoint_tokenizer
from fmoe.trainer import options
from fmoe.train import main as train_main
from tests.procs import finish, results, start, start_for_tests, stop
from tests.ranks.harness import free_port
from tests.test_data import bpe_tokenizer

from .reference import assert_trees_equal

ROOT = Path(__file__).resolve().parents[1]
# A tiny Qwen3-MoE-like model sharded ZeRO-3 over dp1 x ep2 with the 1F1B schedule.
TOML = """
dim = 32
layers = 2
heads = 4
kv_heads = 2
qk_norm = "head"
experts = 4
topk = 2
ffn = 32
ep = 2
sharding = "optim_grads_params"
schedule = "1f1b_overlap"
microbatches = 2
batch = 4
seq = 32
steps = 8
eval_every = 4
eval_batches = 1
save_every = 2
threads = 1
no_progress = true
sample_tokens = 8
"""


def env(**extra):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **extra)


def start_torchrun(*args, env_extra=None) -> subprocess.Popen:
    """A 2-rank ``torchrun`` of the main job (on one node torchrun rendezvouses on a free
    port of its own: jobs may run at once)."""
    return start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "fmoe.train", *args],
                 cwd=ROOT, env=env(**(env_extra or {})))


def torchrun(*args, timeout=240, env_extra=None):
    return finish(start_torchrun(*args, env_extra=env_extra), timeout=timeout)[0]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level corpus prepared from a few of the repository's own files."""
    root = tmp_path_factory.mktemp("data")
    prepare.prepare([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "fmoe"], root / "tokens", quiet=True)
    (root / "run.toml").write_text(TOML)
    return root


def test_two_gloo_ranks_with_a_toml_config_resume_bit_for_bit(corpus, tmp_path):
    common = ["--config", corpus / "run.toml", "--data", corpus / "tokens"]
    straight, first = finish(start_torchrun(*common, "--out", tmp_path / "a"),  # two runs at once
                             start_torchrun(*common, "--out", tmp_path / "b", "--stop-after", 5))
    assert straight.returncode == 0, straight.stderr
    assert "2 rank(s), dp=1 ep=2 sharding=optim_grads_params" in straight.stdout
    assert "sample: " in straight.stdout
    assert first.returncode == 0, first.stderr
    assert fmoe.checkpoint.read_meta(tmp_path / "b" / "checkpoint")[1]["step"] == 5
    resumed = torchrun(*common, "--out", tmp_path / "b", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[-1]["heldout_loss"] == b[-1]["heldout_loss"] < a[0]["loss"]
    assert all(len(r["expert_load"]) == 2 and r["tokens_per_s"] > 0 for r in a)
    # the settings were recorded, and the resumed run refuses other data settings
    assert 'qk_norm = "head"' in (tmp_path / "a" / "settings.toml").read_text()
    other = torchrun(*common, "--out", tmp_path / "b", "--resume", "--steps", 10, "--seed", 1)
    assert other.returncode != 0 and "cannot resume: --seed=1" in other.stderr


def test_tensor_context_and_pipeline_parallel_runs_train_the_same_model(corpus, tmp_path):
    # --tp 2 (each rank half the heads, hidden units and vocabulary, and half the
    # positions), --cp 2 (each rank two chunks of every sequence) and --pp 2 (each rank
    # one layer and the embedding or the head) read the same global batches as one
    # process would: the same losses up to fp32 rounding; so do 2 interleaved stages on
    # each rank (--virtual-stages 2, one member a stage)
    common = ["--config", corpus / "run.toml", "--data", corpus / "tokens", "--ep", 1, "--steps", 3,
              "--eval-every", 3, "--save-every", 0, "--sample-tokens", 0]
    jobs = (("tp", ["--tp", 2], "tp=2"), ("cp", ["--cp", 2], "cp=2"), ("pp", ["--pp", 2], "pp=2"),
            ("interleaved", ["--pp", 2, "--virtual-stages", 2, "--pp-layout", "embed,layers.0,layers.1,head"],
             "pp=2 virtual_stages=2"))
    procs = finish(*[start_torchrun(*common, *flags, "--out", tmp_path / name) for name, flags, _ in jobs])
    runs = {}
    for (name, _, shown), proc in zip(jobs, procs):
        assert proc.returncode == 0, proc.stderr
        assert f"2 rank(s), dp=1 ep=1 {shown} " in proc.stdout
        runs[name] = records(tmp_path / name)
    tp = runs["tp"]
    assert all(len(r) == 3 for r in runs.values())
    for name in ("cp", "pp", "interleaved"):
        for a, b in zip(tp, runs[name]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), name
        assert runs[name][-1]["heldout_loss"] == pytest.approx(tp[-1]["heldout_loss"], rel=1e-4), name


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_on_nccl_resume_bit_for_bit(corpus, tmp_path):
    # the same run in bf16 on NCCL; Ring all-reduces and a fixed cuBLAS workspace keep a
    # rerun of the same steps bitwise, so stopping and resuming must change nothing
    common = ["--config", corpus / "run.toml", "--data", corpus / "tokens", "--device", "cuda",
              "--dtype", "bfloat16"]
    extra = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    straight = torchrun(*common, "--out", tmp_path / "a", env_extra=extra)
    assert straight.returncode == 0, straight.stderr
    assert "dp=1 ep=2" in straight.stdout and "sample: " in straight.stdout
    first = torchrun(*common, "--out", tmp_path / "b", "--stop-after", 5, env_extra=extra)
    assert first.returncode == 0, first.stderr
    resumed = torchrun(*common, "--out", tmp_path / "b", "--resume", env_extra=extra)
    assert resumed.returncode == 0, resumed.stderr
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[-1]["heldout_loss"] == b[-1]["heldout_loss"] < a[0]["loss"]


@pytest.fixture(scope="module")
def started(request, corpus, tmp_path_factory):
    """The command-line jobs of the tests below that start one, by test name
    (``procs.start_for_tests``): all started when the first of them runs (each is a new
    Python's start-up, on one core: 2 cores run them side by side), ``(root, jobs)``."""
    root = tmp_path_factory.mktemp("jobs")
    for name in ("te", "bad_setting"):  # each test's own tmp_path, as it were
        (root / name).mkdir()
    job = [sys.executable, "-m", "fmoe.train"]
    procs = start_for_tests(request, {
        "test_print_config_merges_preset_file_and_flags": [
            ([*job, "--config", corpus / "run.toml", "--steps", "3", "--no-norm-topk-prob", "--print-config"],
             dict(env=env()))],
        "test_the_core_main_job_leaves_te_to_the_adapters": [
            ([*job, "--expert-backend", "te", "--out", root / "te"], dict(env=env())),
            ([sys.executable, "-c", "import sys, fmoe.train; print(*sys.modules)"], dict(env=env()))],
        "test_a_bad_setting_on_the_command_line_exits_with_the_message_and_no_traceback": [
            ([*job, "--kv-heads", "3", "--out", root / "bad_setting" / "run"], dict(env=env()))],
    })
    yield root, procs
    stop(procs)


def test_print_config_merges_preset_file_and_flags(started, request):
    proc, = results(started[1], request)
    assert proc.returncode == 0, proc.stderr
    import tomllib

    merged = tomllib.loads(proc.stdout)
    assert (merged["steps"], merged["kv_heads"], merged["norm_topk_prob"], merged["lr"]) == (3, 2, False, 3e-3)
    assert merged["sharding"] == "optim_grads_params" and merged["units"] == ""
    assert len(options.presets()) == 12
    assert options.resolve([])[0]["log_every"] == 1  # the CPU default logs every step; GPU presets every 10
    # a switch a preset sets is undone on the command line (the 30B preset's fused AdamW on a CPU)
    assert options.resolve(["--config", "qwen3-30b-a3b"])[0]["fused_optimizer"] is True
    assert options.resolve(["--config", "qwen3-30b-a3b", "--no-fused-optimizer"])[0]["fused_optimizer"] is False
    assert {options.resolve(["--config", p])[0]["log_every"] for p in options.presets() if p != "cpu"} == {10}
    for preset in options.presets():  # every shipped preset builds a valid model and plan
        settings, _ = options.resolve(["--config", preset])
        assert tomllib.loads(options.to_toml(settings))["dim"] == settings["dim"]
        options.plan_for(settings, options.model_config(settings))


def test_run_settings_are_one_typed_frozen_value_checked_when_built():
    run, fields = options.split(options.resolve(["--steps", "3", "--no-resume"])[0])
    assert (run.steps, run.resume, run.log_every) == (3, False, 1) and "steps" not in fields and "dim" in fields
    assert options.joined(run, fields) == options.resolve(["--steps", "3", "--no-resume"])[0]
    with pytest.raises(AttributeError):  # frozen
        run.steps = 4
    with pytest.raises(ValueError, match="--steps=0 is invalid: must be an int >= 1"):
        run.replace(steps=0)
    with pytest.raises(ValueError, match="key 'steps' must be an int"):
        options.RunSettings(steps=3.0)
    assert options.RunSettings(lr=1).lr == 1.0 and isinstance(options.RunSettings(lr=1).lr, float)


@pytest.mark.parametrize("toml,flags,needle", [
    ("dimm = 64\n", [], "unknown key 'dimm' (did you mean 'dim'?)"),
    ("dim = \"wide\"\n", [], "key 'dim' must be an int, got 'wide'"),
    ("[model]\ndim = 64\n", [], "key 'model' is a table"),
    ("dim = 64\nheads = 3\n", [], "ModelConfig.dim=64 is invalid"),
    ("", ["--sharding", "zero3"], "Plan.sharding='zero3' is invalid"),
    ("", ["--fp8", "e5m2"], "Plan.fp8='e5m2' is invalid: allowed: 'none', 'rowwise', 'tensorwise'"),
    ("", ["--fp8", "rowwise"], "Plan.fp8='rowwise' is invalid: needs a CUDA device with FP8 GEMMs"),
    ("", ["--config", "nope-small"], "no such file, nor a preset"),
    ("", ["--ep", "2"], "--pp=1 x --dp=1 x --ep=2 x --cp=1 x --tp=1 must equal the number of processes (WORLD_SIZE=1)"),
    ("", ["--tp", "2"], "--pp=1 x --dp=1 x --ep=1 x --cp=1 x --tp=2 must equal the number of processes (WORLD_SIZE=1)"),
    ("", ["--batch", "6", "--microbatches", "4"], "--batch=6 is invalid"),
    ("", ["--steps", "0"], "--steps=0 is invalid: must be an int >= 1"),
    ("", ["--log-every", "0"], "--log-every=0 is invalid: must be an int >= 1"),
    ("", ["--lr", "nan"], "--lr=nan is invalid"),
    ("", ["--vocab", "100"], "vocab"),
    ("", ["--cuda-graph", "attn"], "--cuda-graph='attn' is invalid: it needs fmoe's adapters: run python -m interop"),
    ("", ["--data", "/nonexistent/tokens"], "/nonexistent/tokens"),
    ("", ["--data", ""], "--data='' is invalid: an empty path"),
    ("", ["--init-from-hf", ""], "--init-from-hf='' is invalid: an empty path"),
    ("", ["--config", ""], "--config='' is invalid: an empty path"),
    ("", ["--overwrite", "--auto-resume"], "--overwrite=True is invalid: contradicts --resume / --auto-resume"),
    ("rope_theta = nan\n", [], "ModelConfig.rope_theta=nan is invalid: must be a finite number > 0"),
    ("", ["--expert-bias-rate", "nan"], "ModelConfig.expert_bias_rate=nan is invalid"),
    ("", ["--norm-eps", "inf"], "ModelConfig.norm_eps=inf is invalid"),
])
def test_bad_settings_fail_before_any_work(tmp_path, toml, flags, needle):
    (tmp_path / "c.toml").write_text(toml)
    args = (["--config", str(tmp_path / "c.toml")] if toml else []) + flags + ["--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as err:
        train_main(args)
    assert needle in str(err.value) and str(err.value).startswith("fmoe.train: ")
    assert not (tmp_path / "run").exists()


def test_the_core_main_job_leaves_te_to_the_adapters(started, request):
    # a fresh process: importing interop.te anywhere in this one registers the backend
    proc, modules = results(started[1], request)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--expert-backend='te' is invalid: it needs fmoe's adapters: run python -m interop.train" in proc.stderr
    assert modules.returncode == 0 and "interop" not in modules.stdout, modules.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--cuda-graph", "attn"], "Plan.device"),  # interop.cuda_graph's own check ran
    (["--cuda-graph", "step"], "cannot capture a whole step in a CUDA graph"),  # the step path, not scopes
    (["--expert-backend", "te"], "Plan.expert_backend='te'"),  # interop.te's check ran: CPU, or no TE
    pytest.param(["--device", "cuda"], "Plan.device='cuda:0', but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_the_adapters_main_job_checks_graphs_and_te_before_any_work(tmp_path, flags, needle):
    from interop.train import main as interop_main

    with pytest.raises(SystemExit) as err:
        interop_main(flags + ["--out", str(tmp_path / "run")])
    assert needle in str(err.value) and str(err.value).startswith("fmoe.train: ")
    assert not (tmp_path / "run").exists()


def test_a_bad_setting_on_the_command_line_exits_with_the_message_and_no_traceback(started, request):
    root, procs = started
    proc, = results(procs, request)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "fmoe.train: ModelConfig.kv_heads=3 is invalid: must divide heads (4)" in proc.stderr
    assert not (root / "bad_setting" / "run").exists()


def test_fine_tuning_starts_from_a_hugging_face_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, norm_topk_prob=True)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    args = ["--init-from-hf", tmp_path / "hf", "--steps", 3, "--batch", 4, "--seq", 16, "--eval-every", 3,
            "--eval-batches", 1, "--no-progress", "--sample-tokens", 0, "--out", tmp_path / "run"]
    # without --data the embedded corpus goes through the model's own tokenizer: none, so refused
    with pytest.raises(SystemExit, match="without --data: the embedded corpus is bytes, and that model's folder "
                                         "has no tokenizer.json"):
        train_main(list(map(str, args)))
    assert not (tmp_path / "run").exists()
    bpe_tokenizer(tmp_path / "hf" / "tokenizer.json", vocab=300)
    summary = train_main(list(map(str, args)))
    # the first step's loss is the Hugging Face model's loss on that step's batch of its own tokens
    plan = fmoe.Plan(model=fmoe.hf.config(tmp_path / "hf"))
    corpus = fmoe.data.embedded_corpus(tokenizer=tmp_path / "hf" / "tokenizer.json")
    assert corpus.vocab > 256 and corpus.eos_id == 1 and int(corpus.train.max()) >= 256  # not bytes
    batch = fmoe.data.sample_batch(corpus.train, 4, 16, seed=0, step=1)
    expected = fmoe.eval_loss(fmoe.hf.load(tmp_path / "hf", plan), batch, plan)
    assert records(tmp_path / "run")[0]["loss"] == pytest.approx(float(expected), rel=1e-6)
    assert summary["steps"] == 3
    # the run keeps that tokenizer, and reading its checkpoint takes it
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert checkpoint_tokenizer(tmp_path / "run" / "checkpoint") == (tmp_path / "run" / "tokenizer.json").resolve()
    # settings.toml records the model that was trained (from config.json), and runs again
    assert "dim = 32" in (tmp_path / "run" / "settings.toml").read_text()
    rerun = ["--config", tmp_path / "run" / "settings.toml", "--steps", 1, "--out", tmp_path / "again"]
    assert train_main(list(map(str, rerun)))["steps"] == 1
    with pytest.raises(SystemExit, match=r"--dim=64 contradicts --init-from-hf"):
        train_main(list(map(str, args + ["--dim", 64])))


def test_non_finite_steps_stop_the_job_and_keep_the_last_good_checkpoint(tmp_path):
    # a huge rate makes the first update finite but the parameters absurd: every later
    # step's gradients are NaN, so updates are skipped until the job gives up
    args = ["--steps", 20, "--batch", 4, "--seq", 16, "--lr", 1e30, "--warmup", 0, "--max-skips", 3,
            "--save-every", 1, "--keep", 5, "--expert-bias-rate", 0.01, "--no-progress", "--out", tmp_path]
    with pytest.raises(SystemExit, match=r"3 steps in a row \(to step 4\) had non-finite gradients") as err:
        train_main(list(map(str, args)))
    # the real last good checkpoint, and divergence (not a setting) as the cause
    assert f"The last good checkpoint is {tmp_path / 'checkpoint-00000003'}" in str(err.value)
    assert "try a lower --lr" in str(err.value)
    rec = records(tmp_path)
    assert [r["skipped_steps"] for r in rec] == [0, 1, 2, 3]
    assert fmoe.checkpoint.read_meta(tmp_path / "checkpoint")[1]["step"] == 3
    # a skipped step changes no parameter: not even the expert biases, which get no gradient
    plan = train.parse_args(list(map(str, args[:-1] + [tmp_path / "elsewhere"]))).plan
    one, three = (fmoe.load(tmp_path / f"checkpoint-{n:08d}", plan).params for n in (1, 3))
    assert_trees_equal(one, three)


def test_log_every_reads_the_device_only_on_logged_steps(tmp_path, monkeypatch):
    from fmoe.trainer import loop

    from .test_optim_finite import _HostReads

    marks, inside = [0], [False]  # the step each read belongs to; whether fmoe.step is running

    class Reads(_HostReads):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in self.READS and not inside[0]:
                self.seen.append(marks[-1])
            return func(*args, **(kwargs or {}))

    def sampling(*args, _real=loop.train_batch):
        marks.append(args[4])
        return _real(*args)

    def stepping(*args, _real=loop.step, **kwargs):  # fmoe.step's own checks are the bare loop's too
        inside[0] = True
        try:
            return _real(*args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(loop, "train_batch", sampling)
    monkeypatch.setattr(loop, "step", stepping)
    args = ["--steps", 8, "--log-every", 3, "--eval-every", 8, "--save-every", 4, "--batch", 4, "--seq", 16,
            "--eval-batches", 1, "--sample-tokens", 0, "--no-progress", "--threads", 1, "--out", tmp_path]
    with Reads() as reads:
        train_main(list(map(str, args)))
    # every log_every steps, and where the loop waits anyway: a checkpoint, an evaluation, the last step
    rec = records(tmp_path)
    assert [r["step"] for r in rec] == [3, 4, 6, 8]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and len(r["expert_load"]) == 2 for r in rec)
    assert set(reads.seen) - {0} == {3, 4, 6, 8}  # steps 1, 2, 5 and 7 read nothing back


def test_with_log_every_a_non_finite_streak_stops_at_the_next_logged_step_and_none_is_applied(tmp_path,
                                                                                               monkeypatch):
    from fmoe.trainer import loop

    finite, biases = [], []

    def watched_adamw(*args, _real=loop.adamw, **kwargs):
        opt = _real(*args, **kwargs)

        def update(grads, state, params):
            params, state = opt.update(grads, state, params)
            finite.append(all(bool(torch.isfinite(t).all()) for t in optree.tree_leaves(params)))
            return params, state

        return fmoe.Optimizer(opt.init, update)

    def watched_bias(*args, _real=loop.update_expert_bias, **kwargs):
        params = _real(*args, **kwargs)
        biases.append(params["layers"][0]["moe"]["expert_bias"].clone())
        return params

    monkeypatch.setattr(loop, "adamw", watched_adamw)
    monkeypatch.setattr(loop, "update_expert_bias", watched_bias)
    # as test_non_finite_steps_stop_the_job_...: step 1 is finite, every later one NaN
    args = ["--steps", 20, "--batch", 4, "--seq", 16, "--lr", 1e30, "--warmup", 0, "--max-skips", 2,
            "--log-every", 4, "--save-every", 0, "--expert-bias-rate", 0.01, "--no-progress", "--out", tmp_path]
    with pytest.raises(SystemExit, match=r"3 steps in a row \(to step 4\) had non-finite gradients"):
        train_main(list(map(str, args)))
    assert [(r["step"], r["skipped_steps"]) for r in records(tmp_path)] == [(4, 3)]
    # the optimizer did not give up after --max-skips: the streak was skipped to the end
    assert finite == [True] * 4
    assert all(torch.equal(b, biases[0]) for b in biases[1:]) and len(biases) == 4


def test_resume_continues_the_log_and_refuses_what_cannot_continue(tmp_path):
    args = ["--steps", 8, "--batch", 4, "--seq", 16, "--save-every", 2, "--eval-every", 8, "--eval-batches", 1,
            "--no-progress", "--sample-tokens", 0, "--out", tmp_path]
    train_main(list(map(str, args + ["--stop-after", 4])))
    # a run that died after step 4's checkpoint had logged steps 5 and half of 6
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n" + '{"step": 6, "lo')
    for extra, needle in ((["--stop-after", 4], "at step 4 already; raise --stop-after"),
                          (["--clip", 0], "--clip=0.0 turns off what the checkpoint's optimizer state was built with"),
                          (["--max-skips", 0], "--max-skips=0 turns off")):
        with pytest.raises(SystemExit, match=needle):
            train_main(list(map(str, args + ["--resume"] + extra)))
    train_main(list(map(str, args + ["--resume"])))
    rec = records(tmp_path)
    assert [r["step"] for r in rec] == list(range(1, 9)) and rec[4]["loss"] > 0


def launch_ranks(args, world=2):
    """The main job as torchrun would start it, one process per rank, without torchrun
    in between (so a test can signal or kill one rank)."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "fmoe.train", *map(str, args)], cwd=ROOT,
                             env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]


def wait_for_step(out: Path, step: int, procs, limit=120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= step:
            return
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {limit}s")


SLOW = ["--steps", 40, "--batch", 4, "--seq", 64, "--dim", 64, "--ffn", 128, "--eval-every", 40,
        "--eval-batches", 1, "--no-progress", "--threads", 1, "--sample-tokens", 0, "--save-every", 0]


def test_sigterm_saves_on_every_rank_and_resume_is_bit_for_bit(tmp_path):
    procs = launch_ranks(SLOW + ["--out", tmp_path / "b"])
    wait_for_step(tmp_path / "b", 3, procs)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "stopped by SIGTERM" in outs[0][0] and "--resume" in outs[0][0]
    stopped = fmoe.checkpoint.read_meta(tmp_path / "b" / "checkpoint")[1]["step"]
    assert 3 <= stopped < 40
    resumed = launch_ranks(SLOW + ["--out", tmp_path / "b", "--resume"])
    assert [p.wait(timeout=240) for p in resumed] == [0, 0], [p.communicate() for p in resumed]
    straight = launch_ranks(SLOW + ["--out", tmp_path / "a"])
    assert [p.wait(timeout=240) for p in straight] == [0, 0], [p.communicate() for p in straight]
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 41))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_a_killed_rank_makes_the_other_exit_with_an_error(tmp_path):
    procs = launch_ranks(SLOW + ["--out", tmp_path, "--save-every", 2, "--timeout", 30])
    wait_for_step(tmp_path, 4, procs)
    procs[1].kill()
    start = time.monotonic()
    _, err = procs[0].communicate(timeout=90)
    assert procs[0].returncode != 0 and time.monotonic() - start < 60
    assert "rank 0 of 2: a collective failed" in err and "--resume" in err, err
    procs[1].communicate()
    step = fmoe.checkpoint.read_meta(tmp_path / "checkpoint")[1]["step"]
    assert step >= 2 and step % 2 == 0


def _workers_of(pid: int) -> list[int]:
    """The fmoe.train processes torchrun's agent (process ``pid``) started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and b"fmoe.train" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux only: finds torchrun's workers through /proc")
def test_torchrun_restarts_a_job_whose_rank_died_and_it_resumes(tmp_path):
    # the README's recipe: torchrun --max-restarts with --auto-resume
    launcher = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    args = SLOW + ["--out", tmp_path, "--save-every", 2, "--auto-resume", "--timeout", 30]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "fmoe.train",
                             *map(str, args)], cwd=ROOT, env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path, 5, [proc])
    workers = _workers_of(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert "resumed from" in out
    assert [r["step"] for r in records(tmp_path)] == list(range(1, 41))


def test_compile_flag_compiles_the_kernels_and_reports_the_first_step(tmp_path, capsys):
    args = ["--compile", "--steps", 3, "--log-every", 2, "--eval-every", 3, "--dim", 32, "--layers", 1, "--heads", 4,
            "--experts", 4, "--topk", 2, "--ffn", 32, "--batch", 2, "--seq", 16, "--eval-batches", 1,
            "--sample-tokens", 0, "--no-progress", "--threads", 1, "--out", tmp_path]
    train_main(list(map(str, args)))
    out = capsys.readouterr().out
    assert out.index("step 1: compiling the node kernels (Plan.compile) ...") \
        < out.index("the first step compiled the node kernels (Plan.compile)")
    assert "compile = true" in (tmp_path / "settings.toml").read_text()
    rec = records(tmp_path)
    assert [r["step"] for r in rec] == [2, 3] and all(r["tokens_per_s"] > 0 for r in rec)



def test_profile_step_writes_that_steps_trace_with_the_programs_actions(tmp_path, capsys):
    import gzip

    train_main(list(map(str, SMALL + ["--profile-step", 2, "--out", tmp_path])))
    path = tmp_path / "trace-step2-rank0.json.gz"
    assert f"step 2's trace: {path}" in capsys.readouterr().out
    names = {e.get("name", "") for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}
    assert {"fmoe forward layers.0.attn mb0", "fmoe backward layers.0.experts mb0"} <= names
    assert sorted(p.name for p in tmp_path.glob("trace-*")) == [path.name]  # that step's alone
    with pytest.raises(SystemExit, match="--profile-step=-1 is invalid"):
        train_main(list(map(str, SMALL + ["--profile-step", -1, "--out", tmp_path / "b"])))


SMALL = ["--steps", 3, "--batch", 2, "--seq", 16, "--dim", 32, "--layers", 1, "--experts", 4, "--ffn", 32,
         "--eval-every", 3, "--eval-batches", 1, "--sample-tokens", 0, "--no-progress", "--threads", 1]


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes (links as their targets)."""
    return {str(p.relative_to(folder)): (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def test_a_folder_holding_a_run_is_refused_and_left_as_it_was(tmp_path):
    train_main(list(map(str, SMALL + ["--out", tmp_path])))
    before = snapshot(tmp_path)
    assert "metrics.jsonl" in before and "settings.toml" in before
    with pytest.raises(SystemExit, match=r"--out=.* holds a run \(.*metrics\.jsonl.*\): add --resume to continue "
                                         r"it, --overwrite to remove it"):
        train_main(list(map(str, SMALL + ["--steps", 2, "--out", tmp_path])))
    assert snapshot(tmp_path) == before


def test_overwrite_removes_the_old_run_and_says_what(tmp_path, capsys):
    train_main(list(map(str, SMALL + ["--save-every", 1, "--keep", 3, "--out", tmp_path])))
    assert (tmp_path / "checkpoint-00000001").is_dir()
    train_main(list(map(str, SMALL + ["--steps", 2, "--overwrite", "--out", tmp_path])))
    said = capsys.readouterr().out
    assert "--overwrite: removed checkpoint, checkpoint-00000001, checkpoint-00000002, checkpoint-00000003" in said
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-00000002"]


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_text("x") and p, "it is a file; name a folder"),
    (lambda p: p.write_text("x") and p / "run" / "deeper", "is a file, so no folder can be made in it"),
    (lambda p: (p.mkdir(), p.chmod(0o500), p / "run")[2], "is not writable"),
])
def test_out_must_be_a_writable_folder(tmp_path, make, needle):
    if needle == "is not writable" and os.geteuid() == 0:  # CI runs as root: the case above still runs there
        pytest.skip("root ignores permission bits: no folder is read-only to it")
    out = make(tmp_path / "place")
    with pytest.raises(SystemExit, match=needle):
        train_main(list(map(str, SMALL + ["--out", out])))


def test_an_empty_out_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--out='' is invalid: an empty path"):
        train_main(list(map(str, SMALL)) + ["--out", ""])


def test_print_config_refuses_what_would_be_refused():
    with pytest.raises(SystemExit, match=r"ModelConfig.dim=30 is invalid"):
        train_main(["--dim", "30", "--heads", "4", "--print-config"])


def test_a_refused_resume_leaves_the_settings_file_alone_and_a_moved_corpus_resumes(corpus, tmp_path):
    data = tmp_path / "tokens"
    shutil.copytree(corpus / "tokens", data)
    out = tmp_path / "run"
    args = SMALL + ["--steps", 4, "--save-every", 2, "--data", data, "--out", out]
    train_main(list(map(str, args + ["--stop-after", 2])))
    settings = (out / "settings.toml").read_bytes()
    with pytest.raises(SystemExit, match="--seq=32, but the checkpoint was trained with 16"):
        train_main(list(map(str, args + ["--resume", "--seq", 32])))
    assert (out / "settings.toml").read_bytes() == settings
    other = tmp_path / "other"  # another corpus: refused by content, whatever its path
    prepare.prepare([ROOT / "README.md"], other, quiet=True)
    with pytest.raises(SystemExit, match="--data gives a corpus of '.* tokens, vocab 256, blake2b"):
        train_main(list(map(str, args[:-4] + ["--data", other, "--out", out, "--resume"])))
    moved = tmp_path / "moved"
    data.rename(moved)  # the same corpus elsewhere, named by another spelling of its path
    (out / ".checkpoint-00000004.tmp-0123abcd").mkdir()  # what a save killed by SIGKILL leaves
    train_main(list(map(str, args[:-4] + ["--data", f"{moved}/../moved/", "--out", out, "--resume"])))
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]
    assert not list(out.glob(".checkpoint-*"))


def test_non_finite_from_the_first_step_blames_a_setting_and_says_no_checkpoint_exists(tmp_path):
    args = SMALL + ["--steps", 6, "--init-std", 1e30, "--max-skips", 2, "--save-every", 0, "--out", tmp_path]
    with pytest.raises(SystemExit) as err:
        train_main(list(map(str, args)))
    text = str(err.value)
    assert "2 steps in a row (to step 2) had non-finite gradients" in text
    assert "No checkpoint was saved before them" in text and "a setting is the likely cause" in text


def test_a_heldout_split_shorter_than_a_batch_is_evaluated_on_every_row_it_holds(tmp_path, capsys):
    # the embedded corpus holds 12 held-out rows of 2048: a preset's global batch on
    # several GPUs is more, and the job evaluates every row there is instead of refusing
    args = SMALL + ["--batch", 12, "--seq", 512, "--microbatches", 2, "--heldout-fraction", 0.01]
    summary = train_main(list(map(str, args + ["--out", tmp_path / "a"])))
    out = capsys.readouterr().out
    assert ("the held-out split holds 9 rows of 512 positions, fewer than --batch 12: each evaluation counts those "
            "9, in a batch filled to 12 with rows that count nothing") in out and math.isfinite(summary["heldout_loss"])
    train_main(list(map(str, args + ["--batch", 4, "--out", tmp_path / "b"])))  # 9 rows hold a batch of 4
    assert "held-out split holds" not in capsys.readouterr().out


def test_errors_found_after_setup_are_one_line_and_leave_no_run_behind(tmp_path):
    # a held-out split shorter than one row is found when the job builds its batches
    with pytest.raises(SystemExit) as err:
        train_main(list(map(str, SMALL + ["--batch", 64, "--seq", 512, "--heldout-fraction", 0.001,
                                          "--out", tmp_path / "a"])))
    assert str(err.value).startswith("fmoe.train: ValueError: the held-out split of") and "\n" not in str(err.value)
    assert not (tmp_path / "a").exists()
    # a checkpoint truncated on disk, found when resuming
    train_main(list(map(str, SMALL + ["--out", tmp_path / "b"])))
    shard = max((p for p in (tmp_path / "b" / "checkpoint").resolve().rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    settings = (tmp_path / "b" / "settings.toml").read_bytes()
    with pytest.raises(SystemExit) as err:
        train_main(list(map(str, SMALL + ["--steps", 5, "--resume", "--out", tmp_path / "b"])))
    assert str(err.value).startswith("fmoe.train: ") and shard.name in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and (tmp_path / "b" / "settings.toml").read_bytes() == settings


def test_help_gives_every_field_its_meaning_choices_and_default():
    text = options.parser().format_help()
    flat = " ".join(text.split())  # argparse wraps help lines
    docs = {**fmoe.config.field_docs(fmoe.ModelConfig), **fmoe.config.field_docs(fmoe.Plan)}
    for name in [*options.MODEL_FIELDS, *options.PLAN_FIELDS]:
        assert options.flag(name) in text, name
        assert " ".join(docs[name].split()[:6]) in flat, name  # the docstring's words, not a second copy
    assert "One of: no_shard, optim, optim_grads, optim_grads_params. (default: 'no_shard')" in flat
    dim_help = flat.split("--dim INT token vocabulary", 1)[1].split(" --", 1)[0]
    assert dim_help.endswith("(default: 128)")  # the main job's default: the cpu preset's, not the field's 256
    for preset in options.presets():
        assert f"  {preset}: " in text
    assert "qwen3-moe-medium: 2,641.7M params, 478.5M active at vocab 32000" in text


@pytest.mark.parametrize("argv,needle", [
    (["--sample", "5"], "unrecognized arguments: --sample 5\n  --sample: did you mean"),
    (["--dimm", "3"], "--dimm: did you mean --dim"),
])
def test_abbreviations_and_typos_are_refused_with_the_nearest_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as err:
        options.resolve(argv)
    assert err.value.code == 2
    said = capsys.readouterr().err
    assert needle in said and "usage:" not in said


def test_the_adapters_main_job_is_named_so_in_its_help():
    assert options.parser("python -m interop.train").format_usage().startswith("usage: python -m interop.train")


def test_ids_beyond_the_vocabulary_are_found_before_the_first_step(tmp_path):
    data = tmp_path / "tokens"
    prepare.prepare([ROOT / "README.md"], data, quiet=True)
    meta = json.loads((data / "meta.json").read_text())
    ids = np.fromfile(data / "tokens.bin", dtype=meta["dtype"])
    ids[5000] = 255  # a corrupted corpus: one id beyond the vocabulary its meta.json states, far from the start
    ids.tofile(data / "tokens.bin")
    args = SMALL + ["--data", data, "--out", tmp_path / "run"]
    meta.update(vocab=200, max_id=199)
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit) as err:
        train_main(list(map(str, args)))
    assert str(err.value) == (f"fmoe.train: {data}/tokens.bin: id 255 at position 5000 is not below the corpus's "
                              "vocab (200); its meta.json does not describe its tokens (prepare it again with "
                              "`python -m fmoe.data prepare`)")
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_two_runs_with_the_default_threads_write_the_same_metrics(tmp_path):
    # dim 128 x 16 x 32 tokens: an embedding gradient of 65536 elements, where autograd's
    # scatter-add turned parallel (and run-to-run different) on two threads. Two is this
    # machine's default; said explicitly, as earlier tests in the process set one.
    args = ["--steps", 4, "--batch", 16, "--seq", 32, "--dim", 128, "--eval-every", 4,
            "--eval-batches", 1, "--sample-tokens", 0, "--no-progress", "--threads", 2]
    timings = ("tokens_per_s", "mfu", "elapsed_s")
    runs = []
    for name in ("a", "b"):
        train_main(list(map(str, args + ["--out", tmp_path / name])))
        runs.append([{k: v for k, v in r.items() if k not in timings} for r in records(tmp_path / name)])
    assert runs[0] == runs[1]
