"""The main job as supervised fine-tuning: a Hugging Face model, a chat corpus packed
with ``prepare --chat``, trained on the assistant's tokens, exported back to
transformers."""

import json
import shutil

import numpy as np
import optree
import pytest
import torch

import fmoe
from fmoe.data.chat import prepare_chat
from fmoe.generate import load_model
from fmoe.hf.export import main as export_main
from fmoe.train import main as train_main

from .reference import assert_trees_equal
from .test_chat_data import CHATML, make_tokenizer, varied_chats, write_chats


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def hf_chat(tmp_path):
    """A tiny random Qwen3-MoE in Hugging Face form with a ChatML tokenizer, and chats."""
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    tok = make_tokenizer(hf, {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None})
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.get_vocab_size() + 8, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(hf)
    chats = write_chats(tmp_path / "chats" / "train.jsonl", varied_chats(240))
    return transformers, hf, chats


def test_fine_tuning_on_chats_trains_the_assistant_tokens_and_exports_to_transformers(tmp_path, hf_chat):
    transformers, hf, chats = hf_chat
    data = tmp_path / "sft"
    meta = prepare_chat([chats], data, seq=63, tokenizer=hf / "tokenizer.json", quiet=True)
    assert meta["packed"]["row_tokens"] == 64 and 0 < meta["packed"]["trained_tokens"] < meta["tokens"]
    run = tmp_path / "run"
    args = ["--init-from-hf", hf, "--data", data, "--steps", 4, "--batch", 4, "--eval-every", 4,
            "--eval-batches", 2, "--log-every", 1, "--no-progress", "--sample-tokens", 0, "--lr", 1e-3,
            "--out", run]
    summary = train_main(list(map(str, args)))
    assert summary["steps"] == 4
    settings = (run / "settings.toml").read_text()
    assert "seq = 63" in settings  # the corpus's rows set --seq

    # the first step's loss is the HF model's mean over that step's trained targets
    corpus = fmoe.data.open_corpus(data)
    batch = fmoe.data.train_batch(corpus, 4, 63, seed=0, step=1)
    plan = fmoe.Plan(model=fmoe.hf.config(hf))
    logged = records(run)
    start = fmoe.hf.load(hf, plan)
    assert logged[0]["loss"] == pytest.approx(float(fmoe.eval_loss(start, batch, plan)), rel=1e-5)
    # transformers' own convention on one document of those rows: labels -100 where untrained
    rows = [b for b in range(4) if batch["loss_mask"][b, :int((batch["segments"][b] == 0).sum()) - 1].any()]
    b = rows[0]
    length = int((batch["segments"][b] == 0).sum())
    ids, mask = batch["tokens"][b:b + 1, :length], batch["loss_mask"][b:b + 1, :length - 1]
    labels = ids.clone()
    labels[:, 1:][~mask] = -100
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        want = model(ids, labels=labels).loss
    torch.testing.assert_close(fmoe.eval_loss(start, {"tokens": ids, "loss_mask": mask}, plan), want.float(),
                               rtol=1e-5, atol=1e-6)
    # the log shows the trained targets per second beside all tokens per second
    assert all(0 < r["trained_tokens_per_s"] < r["tokens_per_s"] for r in logged)
    assert "heldout_loss" in logged[-1]

    # exported back, transformers gives fmoe's logits
    export_main(["export", str(run / "checkpoint"), "--out", str(tmp_path / "export"), "--dtype", "float32"])
    tuned = fmoe.load(run / "checkpoint", plan).params
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokens = batch["tokens"][:2, :40]
    with torch.no_grad():
        hf_logits = model(tokens).logits
    logits, _ = fmoe.layers.forward(tuned, tokens, plan.model)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=2e-5)
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()


def test_a_packed_corpus_whose_rows_do_not_match_seq_is_refused_before_any_work(tmp_path, hf_chat):
    _, hf, chats = hf_chat
    data = tmp_path / "sft"
    prepare_chat([chats], data, seq=63, tokenizer=hf / "tokenizer.json", quiet=True)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"its rows hold 64 positions \(packed for --seq 63\), longer than "
                                         r"--seq=32 \+ 1; allowed: --seq 63"):
        train_main(["--init-from-hf", str(hf), "--data", str(data), "--seq", "32", "--out", str(run)])
    assert not run.exists()
    # a packed corpus's files are checked as its tokens.bin is
    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    (broken / "loss_mask.bin").write_bytes(np.zeros(3, np.uint8).tobytes())
    with pytest.raises(SystemExit, match=r"loss_mask.bin has 3 bytes; a packed corpus of \d+ tokens needs"):
        train_main(["--init-from-hf", str(hf), "--data", str(broken), "--out", str(run)])


def test_the_readmes_fine_tuning_example_runs(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    from fmoe.data.prepare import main as prepare_main
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_chats", root / "examples" / "make_chats.py")
    make_chats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_chats)
    monkeypatch.chdir(tmp_path)
    make_chats.main(["runs/chats.jsonl", "--count", "600"])
    prepare_main(["prepare", "--chat", "runs/chats.jsonl", "--seq", "256", "--out", "runs/sft-data", "--quiet"])
    summary = train_main(["--data", "runs/sft-data", "--steps", "30", "--batch", "8", "--eval-every", "30",
                          "--no-progress", "--sample-tokens", "0", "--out", "runs/sft"])
    assert summary["heldout_loss"] < summary["unigram"]  # the answers' pattern is learned from the start
    assert "seq = 256" in (tmp_path / "runs" / "sft" / "settings.toml").read_text()


def prepared(tmp_path, hf, chats):
    data = tmp_path / "sft"
    prepare_chat([chats], data, seq=15, tokenizer=hf / "tokenizer.json", quiet=True)
    return data


def lora_args(hf, data, out, *more):
    return list(map(str, ["--init-from-hf", hf, "--data", data, "--batch", 4, "--eval-every", 4, "--eval-batches", 1,
                          "--log-every", 1, "--no-progress", "--sample-tokens", 0, "--lr", 2e-2, "--lora-rank", 4,
                          "--lora-alpha", 8, "--out", out, *more]))


def test_a_lora_run_trains_only_adapters_resumes_bit_for_bit_and_exports_a_peft_adapter(tmp_path, hf_chat):
    """--lora-rank on a chat fine-tune: the frozen model's loss at step 1 (every b is zero),
    adapters alone in the checkpoint, a stopped and resumed run equal to one that ran
    through, and both exports: the merged model and the PEFT adapter, each computing
    fmoe's logits in transformers."""
    transformers, hf, chats = hf_chat
    peft = pytest.importorskip("peft")
    data = tmp_path / "sft"
    prepare_chat([chats], data, seq=63, tokenizer=hf / "tokenizer.json", quiet=True)
    through, split = tmp_path / "through", tmp_path / "split"
    summary = train_main(lora_args(hf, data, through, "--steps", 4))
    assert summary["steps"] == 4
    train_main(lora_args(hf, data, split, "--steps", 4, "--stop-after", 2))
    train_main(["--resume", "--out", str(split), "--no-progress"])  # its flags from the run's settings.toml
    a, b = fmoe.load(through / "checkpoint"), fmoe.load(split / "checkpoint")
    assert_trees_equal(a.params, b.params, "adapters")
    assert_trees_equal(a.opt_state, b.opt_state, "optimizer state")
    lora = fmoe.LoRA(rank=4, alpha=8.0, targets=("q", "k", "v", "out", "experts"))
    plan = fmoe.Plan(model=fmoe.hf.config(hf), lora=lora)
    assert fmoe.checkpoint.read_lora(through / "checkpoint") == lora
    fmoe.lora.check_adapters(a.params, plan)  # the adapters, nothing of the base
    assert all(t.abs().max() > 0 for t in optree.tree_leaves(a.params))  # every b moved off zero

    base = fmoe.hf.load(hf, fmoe.Plan(model=plan.model))
    corpus = fmoe.data.open_corpus(data)
    first = fmoe.data.train_batch(corpus, 4, 63, seed=0, step=1)
    logged = records(through)
    assert logged[0]["loss"] == pytest.approx(float(fmoe.eval_loss(base, first, fmoe.Plan(model=plan.model))),
                                              rel=1e-5)
    tokens = first["tokens"][:2, :40]
    with torch.no_grad():
        want = fmoe.layers.forward(fmoe.lora.merge(base, a.params, plan), tokens, plan.model)[0]
    export_main(["export", str(through / "checkpoint"), "--out", str(tmp_path / "merged"), "--dtype", "float32"])
    export_main(["export", str(through / "checkpoint"), "--out", str(tmp_path / "adapter"), "--adapter"])
    with torch.no_grad():
        merged = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(tokens).logits, want, rtol=1e-4, atol=2e-5)
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(hf).eval()
        adapted = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
        torch.testing.assert_close(adapted(tokens).logits, want, rtol=1e-4, atol=2e-5)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(hf)
    # python -m fmoe.generate merges them into the base the run names
    assert_trees_equal(load_model(through / "checkpoint").params, fmoe.lora.merge(base, a.params, plan))


@pytest.mark.parametrize("flags, error", [
    (["--lora-rank", "4", "--no-init"], r"--lora-rank=4 is invalid: adapters train on a released model: give "
                                        r"--init-from-hf DIR"),
    (["--lora-targets", "q,wq"], r"--lora-targets='q,wq' is invalid: comma-separated names, each once, from q, k"),
    (["--lora-targets", "q,shared"], r"--lora-targets='q,shared' is invalid: .*this model has no 'shared' to adapt"),
    (["--lora-alpha", "-1"], r"--lora-alpha=-1.0 is invalid: must be a finite number >= 0"),
    (["--expert-bias-rate", "0.01"], r"--expert-bias-rate=0.01 is invalid: the base model stays frozen"),
    (["--cuda-graph", "attn"], r"--cuda-graph='attn' is invalid: under --lora-rank the step is graphed whole"),
])
def test_lora_flags_are_refused_naming_the_flag_before_any_work(tmp_path, hf_chat, flags, error):
    _, hf, chats = hf_chat
    run = tmp_path / "run"
    base = ["--out", str(run), "--steps", "2", "--batch", "4"]
    if "--no-init" in flags:  # the embedded corpus of bytes, no Hugging Face model
        flags = [f for f in flags if f != "--no-init"] + ["--seq", "16"]
    else:
        base += ["--init-from-hf", str(hf), "--lora-rank", "4", "--data", str(prepared(tmp_path, hf, chats))]
    with pytest.raises(SystemExit, match=error):
        train_main(base + flags)
    assert not run.exists()


def test_a_full_fine_tune_is_not_resumed_as_adapters(tmp_path, hf_chat):
    """A run's checkpoint is its model's params and their optimizer state: resuming it with
    --lora-rank (adapters and their state) is refused before any work, naming the flag."""
    _, hf, chats = hf_chat
    run = tmp_path / "run"
    train_main(lora_args(hf, prepared(tmp_path, hf, chats), run, "--steps", 3, "--stop-after", 1, "--lora-rank", 0))
    with pytest.raises(SystemExit, match=r"cannot resume: --lora-rank=4 contradicts the run's lora_rank=0"):
        train_main(["--resume", "--out", str(run), "--lora-rank", "4"])
