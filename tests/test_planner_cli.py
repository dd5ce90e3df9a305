"""``python -m fmoe.plan`` as a tool: its flags checked in one line, the memory budget,
``--help``, the released models' shapes, ``--search``'s reasons and its ``fmoe.train``
command line (run in-process through ``main(argv)``, a subprocess only for the exit of
the process itself)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fmoe
from fmoe.config import Plan
from fmoe.params import active_param_count, param_count
from fmoe.plan import CostModel
from fmoe.plan.__main__ import main
from fmoe.plan.budget import Budget, budget, over_budget
from fmoe.plan.memory import PARTS
from fmoe.plan.report import GIB
from fmoe.plan.command import launcher, train_flags
from fmoe.plan.models import MODELS, model
from fmoe.plan.search import search
from fmoe.trainer import options

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "cpu", "--dim", "64", "--layers", "2", "--batch", "8", "--seq", "64"]
# 128 experts of a 256-wide model on 8 GPUs: with the default links the experts' weights
# cost more to gather and reduce than the tokens cost to exchange, so ep wins
WIDE = ["--config", "cpu", "--vocab", "1024", "--dim", "256", "--layers", "2", "--heads", "4", "--experts", "128",
        "--topk", "2", "--ffn", "512", "--batch", "16", "--seq", "256", "--gpus", "8", "--search", "--memory", "80"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0"], "--gpus=0 is invalid: must be an int >= 1"),
    (["--gpus", "-2"], "--gpus=-2 is invalid: must be an int >= 1"),
    (["--memory", "-1"], "--memory=-1.0 is invalid: must be a finite number > 0 (GiB a GPU)"),
    (["--memory", "0"], "--memory=0.0 is invalid: must be a finite number > 0 (GiB a GPU)"),
    (["--memory", "inf"], "--memory=inf is invalid: must be a finite number > 0 (GiB a GPU)"),
    (["--memory", "nan"], "--memory=nan is invalid: must be a finite number > 0 (GiB a GPU)"),
    (["--top", "0"], "--top=0 is invalid: must be an int >= 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node=0 is invalid: must be an int >= 1"),
    (["--network-gbps", "0"], "--network-gbps=0.0 is invalid: must be a finite number > 0"),
    (["--routing-skew", "0.5"], "--routing-skew=0.5 is invalid: must be a finite number >= 1 (1: balanced routing)"),
    (["--routing-skew", "inf"], "--routing-skew=inf is invalid: must be a finite number >= 1 (1: balanced routing)"),
    (["--reserve", "1"], "--reserve=1.0 is invalid: must be a share of --memory in [0, 1) (0: plans may fill it)"),
    (["--reserve", "-0.1"], "--reserve=-0.1 is invalid: must be a share of --memory in [0, 1) (0: plans may fill it)"),
    (["--search"], "--search needs --gpus"),
])
def test_a_bad_planner_flag_is_one_line_naming_it(capsys, flags, message):
    code, out, err = run(capsys, *TINY, *flags)
    assert (code, out, err) == (2, "", f"fmoe.plan: {message}\n")


@pytest.mark.parametrize("text, why", [
    (None, "no such file (benchmarks/plan_calibration.py writes one)"),
    ("{", "unreadable (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("[1, 2]", "not a JSON object of calibration keys"),
    ('{"efficiency": [0.5]}', "efficiency must be an object of numbers by node kind"),
    ('{"efficiency": {"attn": -0.5}}', "efficiency.attn=-0.5 is invalid: must be a finite number > 0"),
    ('{"peak_tflops": "fast"}', "peak_tflops='fast' is invalid: must be a finite number > 0"),
])
def test_a_bad_calibration_file_is_one_line_naming_the_flag(capsys, tmp_path, text, why):
    path = tmp_path / "calibration.json"
    if text is not None:
        path.write_text(text)
    code, out, err = run(capsys, *TINY, "--calibration", path)
    assert (code, out, err) == (2, "", f"fmoe.plan: --calibration {path}: {why}\n")


def test_the_process_exits_2_without_a_traceback(tmp_path):
    missing = tmp_path / "missing.json"
    proc = subprocess.run([sys.executable, "-m", "fmoe.plan", "--calibration", str(missing)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"fmoe.plan: --calibration {missing}: no such file (benchmarks/plan_calibration.py writes one)"]


def test_a_plan_over_the_memory_budget_is_marked_without_search(capsys):
    code, out, _ = run(capsys, *TINY, "--gpus", "2", "--memory", "0.001")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("memory:"))
    assert re.fullmatch(r"memory: needs \d+\.\d GiB a GPU, over 0\.0009 GiB \(--memory 0\.001 GiB less the 10% "
                        r"--reserve\): params, grads and optimizer "
                        r"state \d+\.\d GiB, gathered weights and gradient buffers \d+\.\d GiB, activations "
                        r"\d+\.\d GiB; for the (.*) try (.*), or --search to rank the plans that fit", line), line
    assert "--sharding optim_grads_params (ZeRO-3)" in line  # the cpu preset's plan does not shard
    code, out, _ = run(capsys, *TINY, "--gpus", "2", "--memory", "80")
    assert re.search(r"^memory: needs \d+\.\d GiB a GPU, fits 72 GiB \(--memory 80 GiB less the 10% --reserve\)$",
                     out, re.M), out
    code, out, _ = run(capsys, *TINY, "--gpus", "2", "--memory", "80", "--reserve", "0")
    assert re.search(r"^memory: needs \d+\.\d GiB a GPU, fits --memory 80 GiB$", out, re.M), out


def test_a_plan_fits_when_its_estimate_leaves_the_reserve_free():
    plan = Plan(model=model("qwen3-30b-a3b"))
    parts = dict.fromkeys(PARTS, 0) | {"params": 90 * GIB, "activations": 10 * GIB}
    stages = [parts | {"total": 100 * GIB}]
    for memory, reserve, fits in ((118, 0.15, True), (117, 0.15, False), (100, 0.0, True), (99.9, 0.0, False),
                                  (111.2, 0.1, True), (111.1, 0.1, False)):
        over = over_budget(plan, stages, Budget(memory, f"--memory {memory:g} GiB", reserve), "float32", 8)
        assert (over is None) == fits, (memory, reserve, over)
    over = over_budget(plan, stages, Budget(111.1, "--memory 111.1 GiB", 0.1), "float32", 8)
    assert over.startswith("memory: needs 100.0 GiB a GPU, over 99.99 GiB (--memory 111.1 GiB less the 10% "
                           "--reserve): params, grads and optimizer state 90.0 GiB"), over


def test_the_budget_is_the_named_devices_when_memory_is_not_given(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    h200 = ROOT / "benchmarks/calibration/h200-2026-11-27/calibration.json"
    code, out, _ = run(capsys, "--model", "qwen3-30b-a3b", "--gpus", "8", "--batch", "64", "--seq", "4096",
                       "--calibration", h200)
    assert code == 0
    assert re.search(r"^memory: needs [\d,]+\.\d GiB a GPU, over 126\.36 GiB \(the calibration's H200 \(140\.4 GiB; "
                     r"--memory to change\) less the 10% --reserve\): ", out, re.M), out
    assert budget(None, "NVIDIA H100 80GB HBM3, torch 2.11").gib == pytest.approx(81559 / 1024)
    assert budget(None, "defaults (assumed, not measured)").source == "an assumed H100's 80 GiB (--memory to change)"
    assert budget(12.5, "NVIDIA H200").gib == 12.5  # --memory wins


def test_help_lists_every_flag_the_planner_takes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    listed = set(re.findall(r"^\s{2}(--[a-z0-9-]+)", out, re.M))
    own = {"--model", "--gpus", "--search", "--memory", "--reserve", "--top", "--trace", "--calibration", "--gpus-per-node",
           "--nvlink-gbps", "--network-gbps", "--routing-skew"}
    forwarded = {"--" + name.replace("_", "-") for name in options.KNOWN}
    assert own | forwarded <= listed, sorted((own | forwarded) - listed)
    for name in MODELS:
        assert name in out


# (total, active) parameters in billions as each release states them, and what its active
# count holds beyond fmoe's (matrices a token multiplies by, the head, not the embedding):
# Qwen, DeepSeek, Mixtral and OLMoE count the embedding too; GPT-OSS does not; GLM counts
# neither the embedding nor the head. The figures are rounded to two or three digits and
# none counts the multi-token-prediction layers fmoe does not load: within 2%.
RELEASED = {"qwen3-30b-a3b": (30.5, 3.3, "embed"), "qwen3-235b": (235, 22, "embed"),
            "deepseek-v3": (671, 37, "embed"), "mixtral-8x7b": (46.7, 12.9, "embed"),
            "mixtral-8x22b": (141, 39, "embed"), "olmoe-1b-7b": (6.9, 1.3, "embed"),
            "gpt-oss-20b": (21, 3.6, ""), "gpt-oss-120b": (117, 5.1, ""),
            "glm-4.5": (355, 32, "-head"), "glm-4.5-air": (106, 12, "-head")}


@pytest.mark.parametrize("name", MODELS)
def test_released_models_have_their_published_sizes(name):
    cfg = model(name)
    total, active, counted = RELEASED[name]
    embedding = cfg.vocab * cfg.dim
    mine = active_param_count(cfg) + {"embed": embedding, "": 0, "-head": -embedding}[counted]
    assert param_count(cfg) / 1e9 == pytest.approx(total, rel=0.02)
    assert mine / 1e9 == pytest.approx(active, rel=0.02)


def test_the_qwen3_30b_preset_is_the_released_shape_in_a_plan_that_fits_however_routing_starts(capsys):
    # one machine of 4 x H200 (--memory 141, 10% kept free). The released config.json turns the
    # router's aux loss off (output_router_logits=false, as for inference); training from
    # scratch uses its router_aux_loss_coef.
    settings, _ = options.resolve(["--config", "qwen3-30b-a3b"])
    assert options.model_config(settings) == model("qwen3-30b-a3b").replace(aux_loss_coef=1e-3)
    # the preset's own plan fits balanced and collapsed routing alike (it has no ep), and its
    # run line adds no flag
    for skew in (1, 4):
        code, out, _ = run(capsys, "--config", "qwen3-30b-a3b", "--gpus", 4, "--memory", 141, "--routing-skew", skew)
        assert code == 0 and re.search(r"^memory: needs 1\d\d\.\d GiB a GPU, fits 126\.9 GiB", out, re.M), out
        assert "run it: torchrun --nproc-per-node 4 -m fmoe.train --config qwen3-30b-a3b\n" in out
    # learned routing starts collapsed (every token's 8 choices on the same few experts): with
    # one expert rank taking the rows of all, the plan the preset had (ep=4) no longer fits,
    # and the search drops ep; the preset's plan is among those it ranks
    code, out, _ = run(capsys, "--config", "qwen3-30b-a3b", "--gpus", 4, "--memory", 141, "--routing-skew", 4,
                       "--pp", 1, "--virtual-stages", 1, "--ep", 4, "--schedule", "1f1b_overlap", "--microbatches", 2,
                       "--remat", "none")
    assert code == 0 and "memory: needs 185.7 GiB a GPU, over 126.9 GiB" in out
    code, out, _ = run(capsys, "--config", "qwen3-30b-a3b", "--gpus", 4, "--memory", 141, "--search",
                       "--routing-skew", 4)
    assert code == 0 and re.search(r"^best: .* ep=1 ", out, re.M), out
    assert re.search(r"^\s+[\d,]+ .* pp=4 virtual_stages=2 dp=1 ep=1 .*schedule=standard microbatches=8 remat=full",
                     out, re.M), out


def test_released_models_read_their_config_json_keys():
    v3 = model("deepseek-v3")
    assert (v3.kv_lora_rank, v3.q_lora_rank, v3.rope_head_dim, v3.v_head_dim, v3.head_dim) == (512, 1536, 64, 128, 192)
    assert (v3.dense_layers, v3.dense_ffn, v3.expert_groups, v3.topk_groups, v3.routed_scaling) == \
        ((0, 1, 2), 18432, 8, 4, 2.5)
    assert (v3.rope_scaling, v3.rope_factor, v3.score_func, v3.shared_ffn) == ("yarn", 40.0, "sigmoid", 2048)
    oss = model("gpt-oss-120b")
    assert (oss.layers, oss.experts, oss.topk, oss.sliding_window, oss.attn_sinks) == (36, 128, 4, 128, True)
    assert oss.window_layers == tuple(range(0, 36, 2)) and (oss.num_kv_heads, oss.head_dim) == (8, 64)
    glm, air = model("glm-4.5"), model("glm-4.5-air")
    assert (glm.rope_fraction, glm.qk_norm, glm.qkv_bias, glm.dense_layers) == (0.5, "head", True, (0, 1, 2))
    assert (air.qk_norm, air.dense_layers, air.experts, air.ffn) == ("none", (0,), 128, 1408)
    assert (model("olmoe-1b-7b").qk_norm, model("olmoe-1b-7b").norm_topk_prob) == ("full", False)
    assert (model("mixtral-8x22b").layers, model("mixtral-8x22b").ffn) == (56, 16384)


def _rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if "tokens/s (key)" in line)) + 1
    return [line.split()[:5] for line in lines[start:] if re.match(r"\s+[\d,]+\s", line)]


def test_search_says_why_each_plan_ranks_and_proposes_expert_parallelism(capsys):
    code, out, _ = run(capsys, *WIDE)
    assert code == 0
    assert "ranked by estimated tokens/s, higher first (ties: less memory first)" in out
    assert out.splitlines()[1].split() == ["tokens/s", "(key)", "step", "ms", "bubble", "exposed", "comm", "GiB", "a",
                                           "GPU", "plan"]
    rows = _rows(out)
    tokens = [float(r[0].replace(",", "")) for r in rows]
    assert len(rows) == 10 and tokens == sorted(tokens, reverse=True)
    for _, step_ms, bubble, exposed, gib in rows:
        assert float(step_ms) > 0 and 0 <= float(bubble) < 1 and exposed.endswith("%") and 0 < float(gib) <= 80
    best = re.search(r"^best: (.*)$", out, re.M).group(1)
    assert "ep=8" in best and "ep:" not in out  # no note: the best plan has expert parallelism
    assert re.search(r"^run it: torchrun --nproc-per-node 8 -m fmoe\.train .*--ep 8 ", out, re.M)


def test_search_says_in_one_line_why_expert_parallelism_lost(capsys):
    flags = [*WIDE]
    flags[flags.index("--experts") + 1], flags[flags.index("--ffn") + 1] = "8", "64"
    code, out, _ = run(capsys, *flags)
    notes = [line for line in out.splitlines() if line.startswith("ep:")]
    assert code == 0 and "ep=1" in re.search(r"^best: (.*)$", out, re.M).group(1)
    assert len(notes) == 1 and re.fullmatch(
        r"ep: the best plan with ep > 1 \(pp=\d .*ep=[248] .*\) estimates [\d,]+ tokens/s, \d+\.\d% fewer: its exposed "
        r"communication is \d+\.\d% of its step against \d+\.\d%, its bubble \d\.\d{3} against \d\.\d{3}", notes[0])
    flags[flags.index("--experts") + 1] = "3"  # no degree > 1 divides both 3 experts and 8 GPUs
    code, out, _ = run(capsys, *flags)
    assert "ep: not tried: no degree > 1 divides both the 3 experts and the 8 GPUs" in out.splitlines()
    code, out, _ = run(capsys, *TINY, "--batch", "3", "--gpus", "8", "--search")  # 3 rows: no dp * ep blocks
    assert "ep: not tried: the batch of 3 rows does not split into the dp * ep row blocks of ep in [2, 4, 8]" in \
        out.splitlines()


def _parsed_back(flags: list[str], vocab: int | None = None) -> fmoe.Plan:
    settings, explicit = options.resolve(flags)
    run, fields = options.split(settings)
    cfg = options.model_config(fields, **({"vocab": vocab} if vocab else {}))
    return options.plan_for(fields, cfg), run


def test_the_chosen_plans_flags_parse_back_to_it():
    cfg = fmoe.ModelConfig(vocab=1024, dim=256, layers=2, heads=4, experts=128, topk=2, ffn=512)
    for ranked in search(cfg, {}, 8, 16, 256, 80.0, CostModel())[:5]:
        flags = train_flags(ranked.plan, {"batch": 16, "seq": 256, "moments": "float32"})
        plan, run = _parsed_back(flags)
        assert plan == ranked.plan and (run.batch, run.seq) == (16, 256)
    # the fields that are tuples, bools turned off and floats: a released model under a pipeline layout
    oss = model("gpt-oss-20b")
    planned = fmoe.Plan(model=oss, dp=2, ep=4, pp=2, virtual_stages=2, microbatches=8, remat="full",
                        sharding="optim_grads_params", schedule="1f1b_overlap", dtype="bfloat16", device="cuda",
                        units=(("embed",), *((f"layers.{i}",) for i in range(24)), ("head",)))
    flags = train_flags(planned, {"batch": 64, "seq": 4096, "moments": "bfloat16"})
    plan, run = _parsed_back(flags)
    assert plan == planned and run.moments == "bfloat16"
    assert flags[flags.index("--window-layers") + 1] == ",".join(map(str, range(0, 24, 2)))
    # from a preset, with the vocabulary left to the data
    preset = fmoe.Plan(model=options.model_config(options.resolve(["--config", "qwen3-moe-small"])[0], vocab=32000),
                       pp=2, microbatches=8, dtype="bfloat16", device="cuda")
    flags = train_flags(preset, {"batch": 16, "seq": 128, "moments": "float32"}, vocab_from_data=True,
                        config="qwen3-moe-small")
    assert flags[:2] == ["--config", "qwen3-moe-small"] and "--vocab" not in flags
    assert _parsed_back(flags, vocab=32000)[0] == preset


def test_the_flags_are_only_those_that_differ_from_the_main_jobs_defaults():
    cfg = options.model_config(options.resolve([])[0])
    plan = fmoe.Plan(model=cfg, dp=2, ep=4, sharding="optim_grads_params", microbatches=4, dtype="bfloat16",
                     device="cuda")
    assert train_flags(plan, {"batch": 16, "seq": 128, "moments": "float32"}) == [
        "--dp", "2", "--ep", "4", "--sharding", "optim_grads_params", "--microbatches", "4", "--dtype", "bfloat16",
        "--device", "cuda"]
    assert launcher(8, 8) == "torchrun --nproc-per-node 8" and launcher(1, 8) == "python"
    assert launcher(16, 8).startswith("torchrun --nnodes 2 --nproc-per-node 8 ")
    assert launcher(12, 8).startswith("torchrun --nnodes 2 --nproc-per-node 6 ")  # the same count on each node
    assert launcher(13, 8) == "(torchrun cannot split 13 processes evenly over 2 nodes of 8 GPUs)"


def test_one_plan_prints_its_run_line_and_trace(capsys, tmp_path):
    trace = tmp_path / "step.json"
    code, out, _ = run(capsys, *TINY, "--gpus", "4", "--pp", "2", "--microbatches", "4", "--trace", trace)
    assert code == 0
    assert re.search(r"^run it: torchrun --nproc-per-node 4 -m fmoe\.train --config cpu --dim 64 --dp 2 "
                     r"--microbatches 4 --dtype bfloat16 --device cuda --pp 2 --batch 8 --seq 64 "
                     r"\(the vocabulary from --data\)$", out, re.M), out
    assert json.loads(trace.read_text())["traceEvents"] and [p.name for p in tmp_path.iterdir()] == ["step.json"]
    code, out, err = run(capsys, *TINY, "--trace", tmp_path / "nowhere" / "step.json")
    assert (code, out) == (2, "") and err == f"fmoe.plan: --trace {tmp_path / 'nowhere' / 'step.json'}: no directory " \
                                             f"{tmp_path / 'nowhere'}\n"
    assert math.isfinite(float(re.search(r"exposed communication (\d+\.\d)%", run(capsys, *TINY)[1]).group(1)))


def test_the_main_job_warns_of_a_plan_that_leaves_its_gpu_less_than_the_reserve(monkeypatch):
    from fmoe.plan import budget as budget_module
    settings, _ = options.resolve(["--config", "qwen3-30b-a3b"])
    plan = options.plan_for(settings, options.model_config(settings))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    args = (plan, settings["batch"], settings["seq"], settings["moments"])
    monkeypatch.setattr(budget_module, "device_memory", lambda device: 139.8 * GIB)
    assert budget_module.device_warning(*args) is None  # the preset's plan: 106.7 GiB of 125.8
    monkeypatch.setattr(budget_module, "device_memory", lambda device: 100 * GIB)
    line = budget_module.device_warning(*args)
    assert line.startswith("warning: by the planner's estimate this plan needs 106.7 GiB a GPU (stage 3), over 90 GiB (this NVIDIA H200's "
                           "100.0 GiB less a 10% reserve): "), line
    assert "may stall rather than run out of memory" in line and line.endswith("--reserve sets the share kept free)")
    cpu = options.plan_for(settings | {"device": "cpu"}, options.model_config(settings))
    assert budget_module.device_warning(cpu, settings["batch"], settings["seq"], settings["moments"]) is None


def test_a_plan_with_ep_that_fits_only_balanced_routing_says_so(capsys):
    # learned routing starts collapsed: the busiest expert rank then holds the rows of all
    ep4 = ("--pp", 1, "--virtual-stages", 1, "--ep", 4, "--schedule", "1f1b_overlap", "--microbatches", 2)
    code, out, _ = run(capsys, "--config", "qwen3-30b-a3b", "--gpus", 4, "--memory", 141, *ep4)
    assert code == 0 and "memory: needs 116.9 GiB a GPU, fits 126.9 GiB" in out
    assert re.search(r"^routing: with routing collapsed \(--routing-skew 4: .*\) this plan needs 152\.9 GiB a GPU, "
                     r"over 126\.9 GiB .*; --routing-skew 4 ranks the plans that fit it$", out, re.M), out
    code, out, _ = run(capsys, "--config", "qwen3-30b-a3b", "--gpus", 4, "--memory", 141, "--search")
    assert re.search(r"^best: .* ep=4 ", out, re.M) and "routing: with routing collapsed" in out, out
    for quiet in (("--routing-skew", 4, "--search"), ("--memory", 200, *ep4), ()):  # skewed, room, no ep
        code, out, _ = run(capsys, "--config", "qwen3-30b-a3b", "--gpus", 4, "--memory", 141, *quiet)
        assert code == 0 and "routing: with routing collapsed" not in out, (quiet, out)


def test_the_main_job_says_the_warning_on_its_main_rank_only(monkeypatch):
    import types
    import fmoe.train as train
    said, asked = [], []

    def warning(plan, rows, seq, moments):
        asked.append((plan, rows, seq, moments))
        return "warning: full"
    monkeypatch.setattr(train, "device_warning", warning)
    settings = types.SimpleNamespace(batch=8, seq=4096, moments="bfloat16")
    for main in (True, False):
        run = types.SimpleNamespace(world=types.SimpleNamespace(is_main=main), settings=settings, plan="the plan",
                                    say=said.append)
        train._warn_if_full(run)
    assert said == ["warning: full"] and asked == [("the plan", 8, 4096, "bfloat16")]
