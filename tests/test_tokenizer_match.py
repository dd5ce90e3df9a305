"""fmoe.data.tokenizer_match: "the same tokenizer" is the same content; a corpus records the
tokenizer that made its ids; ``--init-from-hf`` refuses a corpus of another tokenizer (or
of bytes) before any work; ``fmoe.generate`` warns about a foreign ``--tokenizer``; and
``prepare --chat`` reads ``chat_template.jinja`` as transformers saves it."""

import json
import shutil

import pytest

import fmoe
from fmoe.data.chat import prepare_chat, summary
from fmoe.data.prepare import prepare
from fmoe.data.tokenizer_match import check_model_tokenizer, same_tokenizer, tokenizer_digest
from fmoe.data.tokens import open_corpus, read_meta
from fmoe.generate import foreign_tokenizer, main as generate_main
from fmoe.train import main as train_main
from fmoe.trainer.setup import prepare as setup_prepare

from .test_chat_data import CHATML, CHATS, as_messages, chatml, documents, make_tokenizer, write_chats

TEXT = "Hello, world. Ünïcode and lines; a third document.\n" * 8


def tokenizer(folder, specials=("<|im_start|>", "<|im_end|>"), config=None):
    """``folder/tokenizer.json``: the small BPE of test_data with ``specials`` added."""
    make_tokenizer(folder, config, specials)
    return folder / "tokenizer.json"


def hf_folder(path, tokenizer_json=None, vocab=None):
    """A tiny Hugging Face model folder (config.json and weights, written by fmoe.hf.save)
    with ``tokenizer_json`` copied in, its vocabulary the tokenizer's (or ``vocab``)."""
    from tokenizers import Tokenizer

    vocab = vocab or Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    plan = fmoe.Plan(model=fmoe.ModelConfig(vocab=vocab, dim=32, layers=1, heads=4, kv_heads=2, experts=4, topk=2,
                                            ffn=16))
    fmoe.hf.save(path, fmoe.init(plan), plan)
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, path / "tokenizer.json")
    return path


def corpus(tmp_path, name, tokenizer_json=None):
    (tmp_path / "text.txt").write_text(TEXT)
    prepare([tmp_path / "text.txt"], tmp_path / name, tokenizer=tokenizer_json, quiet=True)
    return tmp_path / name


def test_the_same_tokenizer_is_the_same_content_whatever_the_formatting(tmp_path):
    path = tokenizer(tmp_path / "a")
    data = json.loads(path.read_text())
    digest = tokenizer_digest(path)
    # re-indented, keys in another order, merges as "left right" strings (tokenizers < 0.20)
    assert isinstance(data["model"]["merges"][0], list)
    reformatted = dict(reversed(list(data.items())))
    reformatted["model"] = dict(data["model"], merges=[" ".join(m) for m in data["model"]["merges"]])
    (tmp_path / "b.json").write_text(json.dumps(reformatted, indent=None, ensure_ascii=True))
    assert tokenizer_digest(tmp_path / "b.json") == digest and same_tokenizer(path, tmp_path / "b.json")
    # one more special token, or one merge fewer, is another tokenizer
    assert tokenizer_digest(tokenizer(tmp_path / "c", ("<|im_start|>", "<|im_end|>", "<|x|>"))) != digest
    (tmp_path / "d.json").write_text(json.dumps(dict(data, model=dict(data["model"],
                                                                       merges=data["model"]["merges"][:-1]))))
    assert not same_tokenizer(path, tmp_path / "d.json")
    assert same_tokenizer(None, None) and not same_tokenizer(path, None) and not same_tokenizer(None, path)
    (tmp_path / "e.json").write_text("{")
    with pytest.raises(ValueError, match=r"e.json: not a readable tokenizer.json \("):
        tokenizer_digest(tmp_path / "e.json")


def test_a_corpus_records_the_tokenizer_it_was_prepared_with(tmp_path):
    path = tokenizer(tmp_path / "tok", config={"chat_template": CHATML, "eos_token": "<|im_end|>"})
    assert read_meta(corpus(tmp_path, "text", path))["tokenized_with"] == {
        "path": str(path.resolve()), "blake2b": tokenizer_digest(path)}
    assert read_meta(corpus(tmp_path, "bytes"))["tokenized_with"] == "bytes"
    write_chats(tmp_path / "c.jsonl", CHATS)
    chat = prepare_chat([tmp_path / "c.jsonl"], tmp_path / "chat", seq=127, tokenizer=path, quiet=True)
    assert chat["tokenized_with"] == {"path": str(path.resolve()), "blake2b": tokenizer_digest(path)}
    assert prepare_chat([tmp_path / "c.jsonl"], tmp_path / "chat-bytes", seq=127, quiet=True)["tokenized_with"] == \
        "bytes"


@pytest.fixture
def model_and_tokenizers(tmp_path):
    """A model folder with tokenizer A; A itself and another tokenizer B."""
    a = tokenizer(tmp_path / "a")
    b = tokenizer(tmp_path / "b", ("<|im_end|>", "<|x|>", "<|im_start|>"))
    return hf_folder(tmp_path / "hf", a), a, b


def test_init_from_hf_refuses_a_corpus_of_another_tokenizer_or_bytes_before_any_work(tmp_path,
                                                                                     model_and_tokenizers):
    hf, a, b = model_and_tokenizers
    run = tmp_path / "run"
    theirs = tokenizer_digest(hf / "tokenizer.json")[:12]
    redo = f"prepare it with `python -m fmoe.data prepare ... --tokenizer {hf / 'tokenizer.json'}`"
    other = corpus(tmp_path, "other", b)
    with pytest.raises(ValueError) as err:
        setup_prepare(["--init-from-hf", str(hf), "--data", str(other), "--out", str(run)])
    assert str(err.value) == (f"--data {other} was tokenized with {b.resolve()} (blake2b "
                              f"{tokenizer_digest(b)[:12]}), but --init-from-hf {hf}'s tokenizer.json is blake2b "
                              f"{theirs}; {redo}")
    raw = corpus(tmp_path, "bytes")
    with pytest.raises(ValueError) as err:
        setup_prepare(["--init-from-hf", str(hf), "--data", str(raw), "--out", str(run)])
    assert str(err.value) == (f"--data {raw} holds UTF-8 bytes (prepared without --tokenizer), but --init-from-hf "
                              f"{hf}'s tokenizer.json is blake2b {theirs}; {redo}")
    # a packed corpus is told to prepare with --chat; the CLI says it in one line
    write_chats(tmp_path / "c.jsonl", CHATS)
    prepare_chat([tmp_path / "c.jsonl"], tmp_path / "chat", seq=63, tokenizer=b, eos="<|im_end|>", quiet=True)
    with pytest.raises(SystemExit, match=r"^fmoe.train: --data .*chat was tokenized with .*; prepare it with "
                                         r"`python -m fmoe.data prepare --chat \.\.\. --tokenizer"):
        train_main(["--init-from-hf", str(hf), "--data", str(tmp_path / "chat"), "--out", str(run)])
    assert not run.exists()
    # the model's own tokenizer (its copy: the same content) is taken
    same = corpus(tmp_path, "same", a)
    assert "vocab = " in setup_prepare(["--init-from-hf", str(hf), "--data", str(same), "--print-config"])


def test_older_altered_and_unrecorded_corpora(tmp_path, model_and_tokenizers):
    hf, a, b = model_and_tokenizers
    warnings = []

    def check(path, model=hf, vocab=None):
        c = open_corpus(path)
        check_model_tokenizer(c, model, vocab or fmoe.hf.config(model).vocab, warnings.append)

    def rewrite(path, drop=(), **keys):
        meta = read_meta(path)
        for key in drop:
            del meta[key]
        (path / "meta.json").write_text(json.dumps(dict(meta, **keys)))

    # an older corpus (no "tokenized_with") is judged by its copy of the tokenizer
    old_same, old_other = corpus(tmp_path, "old-same", a), corpus(tmp_path, "old-other", b)
    rewrite(old_same, drop=["tokenized_with"])
    rewrite(old_other, drop=["tokenized_with"])
    check(old_same)
    with pytest.raises(ValueError, match=rf"--data {old_other} was tokenized with {old_other / 'tokenizer.json'} "
                                         rf"\(prepared by an older fmoe\) \(blake2b {tokenizer_digest(b)[:12]}\), but"):
        check(old_other)
    # a copy that is not what meta.json recorded
    altered = corpus(tmp_path, "altered", a)
    shutil.copyfile(b, altered / "tokenizer.json")
    with pytest.raises(ValueError, match=r"altered/tokenizer.json is not the tokenizer .*meta.json records \(key "
                                         r"'tokenized_with': .*the corpus was altered; prepare it again"):
        check(altered)
    rewrite(altered, tokenized_with="bytes")
    with pytest.raises(ValueError, match=r"key 'tokenized_with' is \"bytes\", but key 'tokenizer' names"):
        check(altered)
    rewrite(altered, tokenized_with={"path": "x", "blake2b": "short"})
    with pytest.raises(ValueError, match=r"key 'tokenized_with'=.* must be \"bytes\" or"):
        check(altered)
    # no tokenizer on record and more ids than bytes: warned in one line, not refused
    unknown = corpus(tmp_path, "unknown", a)
    rewrite(unknown, drop=["tokenized_with"], tokenizer=None)
    check(unknown)
    vocab = read_meta(unknown)["vocab"]
    assert warnings == [f"warning: --data {unknown} holds ids of a vocab of {vocab} and no tokenizer on "
                        f"record, so it cannot be checked against --init-from-hf {hf}'s tokenizer.json (blake2b "
                        f"{tokenizer_digest(a)[:12]}); if it is not that tokenizer's, prepare it with `python -m "
                        f"fmoe.data prepare ... --tokenizer {hf / 'tokenizer.json'}`"]


def test_a_model_folder_without_tokenizer_json(tmp_path, capsys):
    a = tokenizer(tmp_path / "a")
    text, raw = corpus(tmp_path, "text", a), corpus(tmp_path, "bytes")
    bare = hf_folder(tmp_path / "bare", vocab=320)
    # a model of more than 256 ids: nothing to compare with; one line on stderr, the run goes on
    assert "vocab = 320" in setup_prepare(["--init-from-hf", str(bare), "--data", str(text), "--print-config"])
    assert capsys.readouterr().err == (f"warning: --init-from-hf {bare} has no tokenizer.json, so --data {text} "
                                       f"({a.resolve()} (blake2b {tokenizer_digest(a)[:12]})) cannot be checked "
                                       "against the model's tokenizer; make sure it was prepared with it\n")
    # a model of 256 ids or fewer reads bytes: a byte corpus passes, a tokenizer's is refused
    byte_model = tmp_path / "byte-model"
    shutil.copytree(bare, byte_model)
    config = json.loads((byte_model / "config.json").read_text())
    (byte_model / "config.json").write_text(json.dumps(dict(config, vocab_size=256)))
    check_model_tokenizer(open_corpus(raw), byte_model, 256, pytest.fail)
    with pytest.raises(ValueError, match=rf"--data {text} was tokenized with .* but --init-from-hf {byte_model} has "
                                         r"no tokenizer.json and a vocab of 256: its ids are UTF-8 bytes; prepare the "
                                         r"corpus without --tokenizer"):
        check_model_tokenizer(open_corpus(text), byte_model, 256, pytest.fail)
    # the embedded corpus under --init-from-hf is the model's own tokenizer's
    check_model_tokenizer(fmoe.data.embedded_corpus(0.05, a), bare, 320, pytest.fail)


def test_generate_warns_when_the_tokenizer_is_not_the_models_own(tmp_path, model_and_tokenizers, capsys):
    hf, a, b = model_and_tokenizers
    args = ["--checkpoint", str(hf), "--prompt", "Hello", "--max-new-tokens", "2", "--temperature", "0"]
    generate_main(args + ["--tokenizer", str(b)])
    assert capsys.readouterr().err == (f"fmoe.generate: warning: --tokenizer {b} (blake2b {tokenizer_digest(b)[:12]}) "
                                       f"is not {hf}'s own tokenizer, {hf / 'tokenizer.json'} (blake2b "
                                       f"{tokenizer_digest(a)[:12]}); the model reads ids it was not trained on\n")
    generate_main(args + ["--tokenizer", str(a)])  # a copy of its own: the same tokenizer
    assert capsys.readouterr().err == ""
    (hf / "tokenizer.json").unlink()  # nothing of its own to compare with (vocab > 256)
    assert foreign_tokenizer(b, hf) is None
    byte_model = hf_folder(tmp_path / "bytes", vocab=256)
    assert foreign_tokenizer(b, byte_model).endswith(f"is not {byte_model}'s own tokenizer (its ids are UTF-8 "
                                                     "bytes); the model reads ids it was not trained on")


def test_prepare_chat_reads_chat_template_jinja_beside_the_tokenizer(tmp_path):
    write_chats(tmp_path / "c.jsonl", CHATS)
    # as transformers 5 saves a tokenizer: the template in chat_template.jinja, none in the config
    path = tokenizer(tmp_path / "tok", config={"eos_token": "<|im_end|>"})
    (tmp_path / "tok" / "chat_template.jinja").write_text(CHATML)
    meta = prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=127, tokenizer=path, quiet=True)
    jinja = str((tmp_path / "tok" / "chat_template.jinja").resolve())
    assert (meta["packed"]["template"], meta["packed"]["template_file"]) == ("tokenizer", jinja)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path))
    assert sorted(tok.decode(ids, skip_special_tokens=False) for ids, _ in documents(tmp_path / "out")) == \
        sorted(chatml(as_messages(c)) for c in CHATS)
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == CHATML  # the corpus keeps it
    assert summary(meta, "OUT").endswith(f"%, template {jinja} -> OUT")
    # the .jinja file wins over the config's chat_template, as in transformers
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                         "chat_template": "{{ 'other' }}"}))
    meta = prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=127, tokenizer=path, overwrite=True,
                        quiet=True)
    assert meta["packed"]["template_file"] == jinja
    # without it, the config's; without either, the plain template, and the summary says so
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    meta = prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=127, tokenizer=path, overwrite=True,
                        train_on="all", quiet=True)
    assert meta["packed"]["template_file"] == str((tmp_path / "tok" / "tokenizer_config.json").resolve())
    assert not (tmp_path / "out" / "chat_template.jinja").exists()
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    meta = prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=127, tokenizer=path, overwrite=True,
                        quiet=True)
    assert (meta["packed"]["template"], meta["packed"]["template_file"]) == ("plain", None)
    assert summary(meta, "OUT").endswith("%, the plain template -> OUT")
    # a .jinja that does not parse is named
    (tmp_path / "tok" / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"tok/chat_template.jinja: its chat_template does not parse"):
        prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=127, tokenizer=path, overwrite=True, quiet=True)
