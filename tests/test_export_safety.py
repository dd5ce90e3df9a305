"""``python -m fmoe.hf export`` never loses a folder: ``--out`` taken or the source
refused, the write all at once (a failure or Ctrl-C leaves the old folder), files
readable by all, and a tokenizer ``AutoTokenizer`` reads in every export (issue 62)."""

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fmoe
from fmoe.checkpoint.dcp_io import BoxLoadPlanner
from fmoe.data import TokenCorpus, tokenizer_record
from fmoe.generate import load_tokenizer
from fmoe.hf import export_folder
from fmoe.hf.export import main as export_main

from .test_data import bpe_tokenizer

transformers = pytest.importorskip("transformers")

TINY = fmoe.ModelConfig(vocab=256, dim=32, layers=1, heads=4, experts=4, topk=2, ffn=16)
# A source folder's tokenizer: everything a Hugging Face tokenizer may hold beside its weights
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
SOURCE_TOKENIZER = {"tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "eos_token": "<|endoftext|>"}),
                    "chat_template.jinja": CHAT_TEMPLATE, "added_tokens.json": json.dumps({"<|tool|>": 300}),
                    "special_tokens_map.json": json.dumps({"eos_token": "<|endoftext|>"})}


def make_checkpoint(run: Path, cfg=TINY, seed=0, extra=None, init_from_hf=None) -> Path:
    """An fmoe checkpoint in the run folder ``run`` (a ``settings.toml`` naming
    ``init_from_hf`` if given), as the main job leaves one."""
    plan = fmoe.Plan(model=cfg)
    fmoe.save(run / "checkpoint", plan, fmoe.init(plan, seed=seed), extra={"tokenizer": None, **(extra or {})})
    if init_from_hf is not None:
        (run / "settings.toml").write_text(f'init_from_hf = "{init_from_hf}"\n')
    return run / "checkpoint"


def make_source(path: Path, cfg=TINY, tokenizer=True) -> Path:
    """A Hugging Face model folder (fp32 weights, generation config, a README) and, with
    ``tokenizer``, a BPE tokenizer's files and a chat template."""
    plan = fmoe.Plan(model=cfg)
    fmoe.hf.save(path, fmoe.init(plan, seed=1), plan, dtype="float32")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (path / "README.md").write_text("a downloaded model\n")
    if tokenizer:
        bpe_tokenizer(path / "tokenizer.json", vocab=300)
        for name, text in SOURCE_TOKENIZER.items():
            (path / name).write_text(text)
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tools.jinja").write_text("{{ tools }}")
    return path


def files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("hf") / "Model")


# --- --out: refused when taken, replaced only with --overwrite and only when complete ---


def test_an_existing_out_is_refused_unless_overwrite_and_then_replaced_whole(byte_run, source, tmp_path):
    out = shutil.copytree(source, tmp_path / "downloaded")  # a model folder with README and chat template
    before = files(out)
    with pytest.raises(SystemExit, match=rf"^fmoe.hf export: --out {out} exists and is not empty; pass "
                                         r"--overwrite to replace it \(the old folder stays whole until the new one "
                                         r"is complete\)$"):
        export_main(["export", str(byte_run), "--out", str(out)])
    assert files(out) == before
    export_main(["export", str(byte_run), "--out", str(out), "--overwrite"])
    assert sorted(files(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                  "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downloaded"]  # no temporary or old folder left
    # an empty folder is no export to lose; a folder that is no model is never replaced
    (tmp_path / "empty").mkdir()
    export_main(["export", str(byte_run), "--out", str(tmp_path / "empty")])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(SystemExit, match=rf"^fmoe.hf export: --out {tmp_path / 'notes'} holds no config.json, so "
                                         "it is no Hugging Face model folder; refusing to replace it, even with "
                                         "--overwrite$"):
        export_main(["export", str(byte_run), "--out", str(tmp_path / "notes"), "--overwrite"])
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_the_folder_the_run_started_from_is_refused_as_out_even_with_overwrite(source, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "run", init_from_hf=source)
    before = files(source)
    (tmp_path / "link").symlink_to(source)
    spellings = [source, tmp_path / "link", source.parent / ".." / source.parent.name / source.name, source.parent]
    for out in spellings:
        for via in ([], ["--source", str(source)]):
            with pytest.raises(SystemExit, match=rf"^fmoe.hf export: --out {out} is or holds the folder the run "
                                                 rf"started from \({source}\), which the export reads and would "
                                                 r"destroy: choose another --out \(--overwrite does not apply\)$"):
                export_main(["export", str(checkpoint), "--out", str(out), "--overwrite"] + via)
    with pytest.raises(SystemExit, match=r"--out .*run is or holds the checkpoint, which the export reads"):
        export_main(["export", str(checkpoint), "--out", str(tmp_path / "run"), "--overwrite"])
    # --source naming a copy: the folder the run started from is still never replaced, nor the copy
    copy = shutil.copytree(source, tmp_path / "copy")
    for out, what in ((source, "the folder the run started from"), (copy, "--source")):
        with pytest.raises(SystemExit, match=rf"^fmoe.hf export: --out {out} is or holds {what} "):
            export_main(["export", str(checkpoint), "--out", str(out), "--overwrite", "--source", str(copy)])
    assert files(source) == before == files(copy)


def test_an_interrupted_or_failed_export_leaves_the_old_folder_and_nothing_else(byte_run, source, tmp_path,
                                                                               monkeypatch, capsys):
    out = shutil.copytree(source, tmp_path / "old")
    before = files(out)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    # Ctrl-C while reading the checkpoint (torch's reader wraps it), within fmoe.hf.save's
    # writing, and after the weights are written
    for module, name in ((BoxLoadPlanner, "create_local_plan"), (fmoe.hf.api._ShardWriter, "add"),
                         (fmoe.hf.export, "_write_generation_config")):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, interrupt)
            with pytest.raises(SystemExit) as done:
                export_main(["export", str(byte_run), "--out", str(out), "--overwrite"])
        assert done.value.code == 130
        assert capsys.readouterr().err == (f"fmoe.hf export: interrupted (Ctrl-C); nothing was written (--out {out} "
                                           "is as it was)\n")
        assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    # a new --out under folders that did not exist: none of them is left behind
    monkeypatch.setattr(fmoe.hf.export, "_write_generation_config", interrupt)
    with pytest.raises(SystemExit) as done:
        export_main(["export", str(byte_run), "--out", str(tmp_path / "a" / "b" / "new")])
    assert done.value.code == 130 and "(--out" in capsys.readouterr().err and not (tmp_path / "a").exists()
    # a failure (a full disk) says so in one line, and leaves the same
    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmoe.hf.export, "_write_generation_config", disk_full)
    with pytest.raises(SystemExit, match=r"^fmoe.hf export: \[Errno 28\] No space left on device$"):
        export_main(["export", str(byte_run), "--out", str(out), "--overwrite"])
    assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_without_an_atomic_exchange_the_old_folder_is_moved_aside_and_removed_last(byte_run, source, tmp_path,
                                                                                  monkeypatch):
    out = shutil.copytree(source, tmp_path / "old")
    renamed = []
    rename = os.rename
    monkeypatch.setattr(export_folder, "_exchange", lambda a, b: False)  # a system without renameat2
    monkeypatch.setattr(export_folder.os, "rename", lambda a, b: renamed.append((Path(a).name, Path(b).name))
                        or rename(a, b))
    export_main(["export", str(byte_run), "--out", str(out), "--overwrite"])
    assert renamed[-2][0] == "old" and renamed[-2][1].startswith(".old.old-")  # aside first,
    assert renamed[-1][0].startswith(".old.export-") and renamed[-1][1] == "old"  # then the new one in place
    assert "README.md" not in files(out) and sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_every_file_is_readable_by_all_as_the_umask_allows(byte_run, source, tmp_path):
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            out = export_main(["export", str(byte_run), "--out", str(tmp_path / f"byte-{umask:o}")])
            with_source = export_main(["export", str(byte_run), "--out", str(tmp_path / f"src-{umask:o}"), "--source",
                                       str(source)])
        finally:
            os.umask(old)
        for path in [out, *out.rglob("*"), with_source, *with_source.rglob("*")]:
            want = mode | 0o111 & ~umask if path.is_dir() else mode
            assert oct(path.stat().st_mode & 0o777) == oct(want), path


# --- the tokenizer: AutoTokenizer reads every export ---


def test_a_byte_level_export_decodes_every_id_to_the_byte_fmoe_decodes(byte_run, tmp_path):
    out = export_main(["export", str(byte_run), "--out", str(tmp_path / "hf")])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    fmoe_bytes = load_tokenizer(None)
    for ids in ([*range(256)], [0xFF, 65, 0xE2, 0x82, 66, 0xC3, 0xF0, 0x9F, 0x98], [32, 46, 32, 44, 10, 10, 32]):
        assert tok.decode(ids) == fmoe_bytes.decode(ids)
        assert [tok.decode([i]) for i in ids] == [fmoe_bytes.decode([i]) for i in ids]
    text = "def f(x):\n    return x  # héllo ☃ 😀 , .\n\n"
    assert tok(text)["input_ids"] == fmoe_bytes.encode(text) == list(text.encode())
    assert (tok.eos_token, len(tok)) == (None, 256)


def test_without_tokenizers_a_byte_level_export_is_refused_in_one_line(byte_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers fails
    with pytest.raises(SystemExit, match=r"^fmoe.hf export: the export's tokenizer needs the tokenizers package, "
                                         r"which is missing: pip install tokenizers \(or the extra fmoe\[data\]\)$"):
        export_main(["export", str(byte_run), "--out", str(tmp_path / "hf")])
    assert list(tmp_path.iterdir()) == []


def test_a_custom_tokenizer_gets_a_config_naming_its_end_of_document_token(tmp_path):
    bpe = bpe_tokenizer(tmp_path / "bpe.json", vocab=300)
    eos = bpe.token_to_id("<|endoftext|>")
    vocab = bpe.get_vocab_size(with_added_tokens=True)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(tmp_path / "bpe.json", run / "tokenizer.json")  # what the main job keeps, recorded by content
    record = tokenizer_record(TokenCorpus(np.zeros(1), np.zeros(1), vocab, run / "tokenizer.json", eos, "corpus"))
    checkpoint = make_checkpoint(run, dataclasses.replace(TINY, vocab=vocab),
                                 extra={"tokenizer": record, "eos_id": eos})
    for name, flags in (("recorded", []), ("given", ["--tokenizer", str(tmp_path / "bpe.json")])):
        out = export_main(["export", str(checkpoint), "--out", str(tmp_path / name)] + flags)
        tok = transformers.AutoTokenizer.from_pretrained(out)
        assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", eos)
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
        ids = bpe.encode("def main():\n    return 0\n").ids + [eos]
        # fmoe's decoding leaves special tokens out, as transformers' does when asked to
        assert tok.decode(ids, skip_special_tokens=True) == load_tokenizer(run / "tokenizer.json").decode(ids)
        assert tok.decode(ids).endswith("return 0\n<|endoftext|>")


def test_the_source_tokenizer_is_copied_with_its_chat_template_and_never_its_weights(tmp_path):
    source = make_source(tmp_path / "Model")
    (source / "model-00001-of-00002.safetensors").write_bytes(b"source weights")
    (source / "pytorch_model.bin").write_bytes(b"source weights")
    checkpoint = make_checkpoint(tmp_path / "run", init_from_hf=source)
    out = export_main(["export", str(checkpoint), "--out", str(tmp_path / "hf")])
    copied = {*SOURCE_TOKENIZER, "tokenizer.json", "additional_chat_templates/tools.jinja", "generation_config.json"}
    assert set(files(out)) == copied | {"config.json", "model.safetensors"}
    assert all(files(out)[name] == files(source)[name] for name in copied)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == {"default": CHAT_TEMPLATE, "tools": "{{ tools }}"}
    assert tok.eos_token == "<|endoftext|>"
    # the weights are the checkpoint's (seed 0), not the source's (seed 1)
    params = fmoe.hf.load(out, fmoe.Plan(model=TINY))
    trained = fmoe.init(fmoe.Plan(model=TINY), seed=0)["embed"]
    assert torch.equal(params["embed"], trained.to(torch.bfloat16).float())  # the default bf16 export


def test_a_source_of_another_family_or_shape_is_refused_naming_the_first_difference(byte_run, tmp_path):
    qwen = make_source(tmp_path / "qwen", dataclasses.replace(TINY, qk_norm="head"), tokenizer=False)
    wide = make_source(tmp_path / "wide", dataclasses.replace(TINY, experts=8), tokenizer=False)
    for source, why in ((qwen, "its config.json has model_type='qwen3_moe', but this checkpoint is written as "
                                "'mixtral': pass the --source the run started from, or none"),
                        (wide, "describes another model than the checkpoint: its experts=8 \\(the checkpoint's: 4\\); "
                               "pass the --source the run started from, or none")):
        with pytest.raises(SystemExit, match=rf"^fmoe.hf export: --source {source}:? {why}$"):
            export_main(["export", str(byte_run), "--out", str(tmp_path / "hf"), "--source", str(source)])
    assert not (tmp_path / "hf").exists()
    # training fields may differ: a source trained with another aux-loss coefficient is this model
    trained = make_source(tmp_path / "aux", dataclasses.replace(TINY, aux_loss_coef=0.02), tokenizer=False)
    out = export_main(["export", str(byte_run), "--out", str(tmp_path / "hf"), "--source", str(trained)])
    assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
