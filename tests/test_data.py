"""fmoe.data: preparing token corpora (byte-level and with a real tokenizer), reading
them back, deterministic batches, and the errors that name the file or key."""

import hashlib
import json
import sys

import numpy as np
import pytest
import torch

from fmoe.data import (check_vocab, corpus_bytes, embedded_corpus, heldout_batches, open_corpus, sample_batch,
                       tiled_windows, train_heldout_split, unigram_cross_entropy)
import fmoe.data.prepare as prepare_module
from fmoe.data.prepare import prepare

from .procs import run_at_once

DOCS = {"a.txt": "Hello, world.\n", "sub/b.md": "Ünïcode and\nlines\n", "sub/c.rst": "third document"}
ORDER = ["a.txt", "sub/b.md", "sub/c.rst"]


@pytest.fixture
def texts(tmp_path):
    for name, text in DOCS.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    (tmp_path / "in" / "skip.bin").write_bytes(b"\x00\x01")  # not a text file: ignored in directories
    (tmp_path / "in" / ".hidden").mkdir()
    (tmp_path / "in" / ".hidden" / "x.txt").write_text("hidden folders are skipped")
    return tmp_path


def bpe_tokenizer(path, vocab=300):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(DOCS.values()) * 20, trainer)
    tok.save(str(path))
    return tok


def test_byte_level_corpus_holds_the_documents_bytes(texts):
    meta = prepare([texts / "in" / "a.txt", texts / "in" / "sub"], texts / "out", quiet=True)
    expected = b"".join(DOCS[n].encode() + b"\n\n" for n in ORDER)  # a blank line after each document
    ids = np.fromfile(texts / "out" / "tokens.bin", dtype=np.uint16)
    assert bytes(ids.astype(np.uint8)) == expected
    assert (meta["dtype"], meta["vocab"], meta["documents"], meta["tokens"]) == ("uint16", 256, 3, len(expected))
    assert meta["max_id"] == max(expected) and meta["tokenizer"] is None and meta["eos_id"] is None
    assert json.loads((texts / "out" / "meta.json").read_text()) == meta
    corpus = open_corpus(texts / "out", heldout_fraction=0.25)
    assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.uint16
    assert (corpus.vocab, corpus.tokenizer, corpus.eos_id, corpus.source) == (256, None, None, str(texts / "out"))
    assert bytes(np.concatenate([corpus.train, corpus.heldout]).astype(np.uint8)) == expected
    assert len(corpus.heldout) == len(expected) - int(len(expected) * 0.75)
    # a directory gives the same corpus: sorted, recursive, .bin and hidden folders skipped
    assert prepare([texts / "in"], texts / "dir", quiet=True)["tokens"] == len(expected)
    assert prepare([texts / "in"], texts / "md", quiet=True, globs=("*.md",))["documents"] == 1


def test_a_tokenizer_json_encodes_documents_with_end_of_text(texts):
    tok = bpe_tokenizer(texts / "tokenizer.json")
    meta = prepare([texts / "in"], texts / "out", tokenizer=texts / "tokenizer.json", quiet=True)
    eos = tok.token_to_id("<|endoftext|>")
    expected = [i for n in ORDER for i in tok.encode(DOCS[n]).ids + [eos]]
    assert np.fromfile(texts / "out" / "tokens.bin", dtype=np.uint16).tolist() == expected
    assert (meta["eos_id"], meta["vocab"], meta["max_id"]) == (eos, tok.get_vocab_size(), max(expected))
    corpus = open_corpus(texts / "out", heldout_fraction=0.25)
    assert corpus.tokenizer == texts / "out" / "tokenizer.json" and corpus.eos_id == eos
    assert corpus.tokenizer.read_bytes() == (texts / "tokenizer.json").read_bytes()
    # no end-of-document token: documents end with a blank line, encoded with them
    prepare([texts / "in"], texts / "no_eos", tokenizer=texts / "tokenizer.json", eos="", quiet=True)
    expected = [i for n in ORDER for i in tok.encode(DOCS[n] + "\n\n").ids]
    assert np.fromfile(texts / "no_eos" / "tokens.bin", dtype=np.uint16).tolist() == expected
    with pytest.raises(ValueError, match="--eos '<eos>' is not a token of .*tokenizer.json"):
        prepare([texts / "in"], texts / "x", tokenizer=texts / "tokenizer.json", eos="<eos>", quiet=True)


def test_large_vocabularies_are_stored_as_uint32(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "t.txt").write_text("w1 w69999 w65536 w2")
    meta = prepare([tmp_path / "t.txt"], tmp_path / "out", tokenizer=tmp_path / "tok.json", quiet=True)
    assert (meta["dtype"], meta["vocab"], meta["max_id"], meta["eos_id"]) == ("uint32", 70_000, 69_999, None)
    corpus = open_corpus(tmp_path / "out", heldout_fraction=0.5)
    ids = np.concatenate([corpus.train, corpus.heldout])
    assert corpus.train.dtype == np.uint32 and ids.tolist() == tok.encode("w1 w69999 w65536 w2\n\n").ids
    assert ids.tolist()[:4] == [1, 69999, 65536, 2]


def test_jsonl_documents_and_a_line_without_text(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    assert prepare([tmp_path / "d.jsonl"], tmp_path / "out", quiet=True)["documents"] == 2
    assert (tmp_path / "out" / "tokens.bin").read_bytes()[::2] == b"one\n\ntwo\n\n"
    (tmp_path / "e.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(ValueError, match=r"e.jsonl:2: a jsonl line needs a string field 'text'"):
        prepare([tmp_path / "e.jsonl"], tmp_path / "bad", quiet=True)
    (tmp_path / "f.jsonl").write_text('{"text": "one"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"f.jsonl:2: not JSON"):
        prepare([tmp_path / "f.jsonl"], tmp_path / "bad", quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "e.jsonl", "f.jsonl", "out"]  # no leftovers


def test_an_existing_output_is_kept_unless_overwritten(texts):
    prepare([texts / "in" / "a.txt"], texts / "out", quiet=True)
    before = (texts / "out" / "tokens.bin").read_bytes()
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        prepare([texts / "in"], texts / "out", quiet=True)
    (texts / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):  # fails midway: the old corpus stays whole
        prepare([texts / "in", texts / "bad.jsonl"], texts / "out", overwrite=True, quiet=True)
    assert (texts / "out" / "tokens.bin").read_bytes() == before
    assert prepare([texts / "in"], texts / "out", overwrite=True, quiet=True)["documents"] == 3
    assert sorted(p.name for p in texts.iterdir()) == ["bad.jsonl", "in", "out"]
    # --overwrite replaces corpora only: never, say, the folder of input texts
    with pytest.raises(ValueError, match="is not a corpus written by fmoe.data prepare; refusing"):
        prepare([texts / "in"], texts / "in", overwrite=True, quiet=True)
    assert (texts / "in" / "a.txt").exists()


def test_inputs_and_tokenizers_that_cannot_be_read(texts, monkeypatch):
    cases = [([texts / "nope"], {}, "input .*nope does not exist"),
             ([texts / "in" / "sub"], {"globs": ("*.csv",)}, r"no files matching \*.csv under .*sub"),
             ([texts / "in"], {"tokenizer": texts / "in" / "a.txt"}, "a.txt: not a readable tokenizer.json"),
             ([texts / "in"], {"eos": "</s>"}, "byte-level data has none")]
    (texts / "blank.txt").write_text(" \n")
    (texts / "blank.jsonl").write_text('{"text": ""}\n')
    cases.append(([texts / "blank.txt", texts / "blank.jsonl"], {}, r"the inputs hold no text \(2 file"))
    for inputs, kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            prepare(inputs, texts / "out", quiet=True, **kwargs)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"pip install tokenizers \(or the extra fmoe\[data\]\)"):
        prepare([texts / "in"], texts / "out", tokenizer=texts / "tokenizer.json", quiet=True)
    assert not (texts / "out").exists()


# every kind of input prepare reads, as the bytes of each file: several documents per
# batch and batches per file, non-ASCII, invalid UTF-8, CRLF, blank files, jsonl blank lines
VARIED = {
    "a.txt": "Hello, world.\n".encode(),
    "b/ünï.md": "Ünïcode — ✓ and\r\nCRLF lines\r\n".encode(),
    "b/bad.rst": b"invalid \xff\xfe utf-8 \xc3(\n",
    "b/blank.txt": b" \n\t\n",
    "b/empty.py": b"",
    "c.jsonl": b"".join(json.dumps({"text": t}).encode() + b"\n" + (b"\n \n" if i % 4 == 0 else b"")
                        for i, t in enumerate(["one", "   ", "two\nlines", "ünï ✓", "\u2028", "", "x" * 300,
                                               "zzz"] * 6)),
    "d.py": "".join(f"def f{i}(x):\n    return x * {i}  # ünï {i % 7}\n\n" for i in range(300)).encode(),
}
# sha256 of tokens.bin for VARIED, byte-level, written by prepare before it was made
# faster (issue 22): the output must not change
VARIED_BYTES_SHA256 = "956e0cdf3b5f28fb38b185415357d753cccc6ff6df48f5885e0bc09da2da572c"


def write_varied(root):
    for name, data in VARIED.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def reference_tokens(files, tok=None, eos_id=None, dtype=np.uint16):
    """tokens.bin and ``(tokens, documents, max_id)`` as prepare wrote them before issue 22
    (its code, one document at a time through ``encode_batch``): the reference the faster
    prepare must match byte for byte."""
    docs = []
    for path in files:
        if path.suffix != ".jsonl":
            docs.append(path.read_bytes().decode("utf-8", errors="replace"))
            continue
        with open(path, "rb") as f:
            for raw in f:
                line = raw.decode("utf-8", errors="replace")
                if line.strip():
                    docs.append(json.loads(line)["text"])
    docs = [d for d in docs if d.strip()]
    if tok is None:
        ids = [np.frombuffer((d + "\n\n").encode("utf-8"), dtype=np.uint8) for d in docs]
    elif eos_id is None:
        ids = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch([d + "\n\n" for d in docs])]
    else:
        ids = [np.asarray(e.ids + [eos_id], dtype=np.int64) for e in tok.encode_batch(docs)]
    data = b"".join(i.astype(dtype).tobytes() for i in ids)
    return data, (sum(map(len, ids)), len(docs), max((int(i.max(initial=0)) for i in ids), default=0))


@pytest.mark.parametrize("batches", [None, (2, 64, 3)], ids=["default-batches", "tiny-batches"])
def test_tokens_are_bit_identical_to_the_one_document_at_a_time_reference(tmp_path, monkeypatch, batches):
    if batches:  # many batches, several in flight: the order and the counts must not change
        for name, value in zip(("_BATCH_DOCS", "_BATCH_BYTES", "_IN_FLIGHT"), batches):
            monkeypatch.setattr(prepare_module, name, value)
    root = write_varied(tmp_path / "in")
    files = prepare_module.find_inputs([root])
    assert len(files) == len(VARIED)  # the blank and empty files are read too, and hold no document

    def check(out, expected, **kwargs):
        meta = prepare([root], tmp_path / out, quiet=True, **kwargs)
        data, counts = expected
        assert (tmp_path / out / "tokens.bin").read_bytes() == data
        assert (meta["tokens"], meta["documents"], meta["max_id"]) == counts
        return meta, hashlib.sha256(data).hexdigest()

    meta, sha = check("bytes", reference_tokens(files))
    assert sha == VARIED_BYTES_SHA256 and meta["documents"] == 3 + 5 * 6 + 1
    tok = bpe_tokenizer(tmp_path / "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    meta, _ = check("eos", reference_tokens(files, tok, eos), tokenizer=tmp_path / "tokenizer.json")
    assert meta["eos_id"] == eos
    meta, _ = check("no_eos", reference_tokens(files, tok), tokenizer=tmp_path / "tokenizer.json", eos="")
    assert meta["eos_id"] is None and meta["separator"] == "\n\n"
    # uint32 ids, and documents ("zzz") that encode to nothing but their end-of-document token
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "x": 69_999, "one": 65_536, "</s>": 7},
                                                             unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.normalizer = tokenizers.normalizers.Replace("zzz", "")
    words.save(str(tmp_path / "words.json"))
    meta, _ = check("uint32", reference_tokens(files, words, 7, np.uint32), tokenizer=tmp_path / "words.json")
    assert (meta["dtype"], meta["eos_id"], meta["max_id"]) == ("uint32", 7, 69_999)


def test_the_progress_bar_counts_the_input_bytes_batch_by_batch(tmp_path, monkeypatch, capsys):
    bars = []

    class Recorder(prepare_module.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.updates, self.shown = [], not self.disable  # close() disables a bar
            bars.append(self)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

    monkeypatch.setattr(prepare_module, "tqdm", Recorder)
    monkeypatch.setattr(prepare_module, "_BATCH_BYTES", 256)
    root = write_varied(tmp_path / "in")
    size = sum(map(len, VARIED.values()))  # blank files and jsonl blank lines included
    bpe_tokenizer(tmp_path / "tokenizer.json")
    for kwargs in ({}, {"tokenizer": tmp_path / "tokenizer.json"}):
        bars.clear()
        prepare([root], tmp_path / "out", overwrite=True, **kwargs)
        (bar,) = bars
        assert (bar.total, bar.n, sum(bar.updates)) == (size, size, size)
        assert (bar.unit, bar.unit_scale, bar.shown) == ("B", True, True)
        # an update per batch of about _BATCH_BYTES (d.py is one batch), not one at the end
        assert len(bar.updates) >= (size - len(VARIED["d.py"])) // 512 >= 5 and min(bar.updates) > 0
    assert "tokenize" in capsys.readouterr().err
    bars.clear()
    prepare([root], tmp_path / "out", overwrite=True, quiet=True)
    assert not bars[0].shown


def test_batches_are_deterministic_per_step_and_split_by_rank():
    ids = embedded_corpus().train
    one = sample_batch(ids, 8, 16, seed=3, step=5)["tokens"]
    assert torch.equal(one, sample_batch(ids, 8, 16, seed=3, step=5)["tokens"])
    assert not torch.equal(one, sample_batch(ids, 8, 16, seed=3, step=6)["tokens"])
    assert not torch.equal(one, sample_batch(ids, 8, 16, seed=4, step=5)["tokens"])
    halves = [sample_batch(ids, 8, 16, seed=3, step=5, rank=r, world=2)["tokens"] for r in range(2)]
    assert torch.equal(torch.cat(halves), one) and one.shape == (8, 17) and one.dtype == torch.long
    flat = np.asarray(ids, dtype=np.int64)
    for row in one.tolist():  # every row is a real window of the corpus
        starts = np.flatnonzero(flat[:len(flat) - 16] == row[0])
        assert any(flat[s:s + 17].tolist() == row for s in starts)
    short = np.arange(17, dtype=np.uint16)  # exactly one window fits
    assert sample_batch(short, 2, 16, 0, 0)["tokens"].tolist() == [list(range(17))] * 2
    with pytest.raises(ValueError, match="does not split over 3 rank"):
        sample_batch(ids, 8, 16, 0, 1, rank=0, world=3)
    with pytest.raises(ValueError, match="a window needs seq \\+ 1 = 18"):
        sample_batch(short, 2, 17, 0, 0)


def test_heldout_batches_tile_in_order_and_split_by_rank():
    heldout = embedded_corpus().heldout
    tiles = tiled_windows(torch.from_numpy(heldout.astype(np.int64)), 4, 16, 3)
    whole = heldout_batches(heldout, 4, 16, 3)
    assert len(whole) == 3 and all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(whole, tiles))
    halves = [heldout_batches(heldout, 4, 16, 3, rank=r, world=2) for r in range(2)]
    assert all(torch.equal(torch.cat([h0["tokens"], h1["tokens"]]), w["tokens"])
               for h0, h1, w in zip(*halves, whole))
    with pytest.raises(ValueError, match="shorter than one row of 16 positions"):
        heldout_batches(heldout[:16], 4, 16, 3)


def test_a_heldout_split_shorter_than_a_batch_is_one_batch_filled_with_rows_that_count_nothing():
    heldout = embedded_corpus().heldout[:40]  # two windows of 16 and their targets
    windows = tiled_windows(torch.from_numpy(heldout.astype(np.int64)), 2, 16, 1)[0]["tokens"]
    (whole,) = heldout_batches(heldout, 4, 16, 3)
    assert torch.equal(whole["tokens"][:2], windows) and whole["tokens"].shape == (4, 17)
    assert whole["loss_mask"].shape == (4, 16) and whole["loss_mask"][:2].all() and not whole["loss_mask"][2:].any()
    halves = [heldout_batches(heldout, 4, 16, 3, rank=r, world=2)[0] for r in range(2)]
    assert halves[0]["loss_mask"].all() and not halves[1]["loss_mask"].any()
    assert torch.equal(torch.cat([h["tokens"] for h in halves]), whole["tokens"])


def test_the_embedded_corpus_and_its_unigram_baseline_are_unchanged():
    train_t, heldout_t = train_heldout_split(corpus_bytes())
    corpus = embedded_corpus()
    assert torch.equal(torch.from_numpy(corpus.train.astype(np.int64)), train_t)
    assert torch.equal(torch.from_numpy(corpus.heldout.astype(np.int64)), heldout_t)
    assert (corpus.vocab, corpus.tokenizer, corpus.source) == (256, None, "embedded:pydoc_data.topics")
    counts = torch.bincount(train_t, minlength=256).double() + 1.0  # the formula before numpy ids
    old = float(-(counts / counts.sum()).log()[heldout_t].mean())
    assert unigram_cross_entropy(train_t, heldout_t) == old
    assert unigram_cross_entropy(corpus.train, corpus.heldout) == old
    assert unigram_cross_entropy(corpus.train, corpus.heldout, max_tokens=1000) != old  # a bounded sample


@pytest.mark.parametrize("damage,needle", [
    (lambda d: (d / "meta.json").unlink(), "no meta.json"),
    (lambda d: (d / "meta.json").write_text("{"), "meta.json: unreadable"),
    (lambda d: _edit(d, format="other"), "meta.json: key 'format' must be 'fmoe-tokens'"),
    (lambda d: _edit(d, version=9), "meta.json: key 'version'=9"),
    (lambda d: _edit(d, dtype="int8"), "meta.json: key 'dtype'='int8'"),
    (lambda d: _edit(d, tokens="many"), "meta.json: key 'tokens'='many'"),
    (lambda d: _edit(d, max_id=300), "meta.json: key 'max_id'=300 must be < 'vocab'=256"),
    (lambda d: _edit(d, eos_id=256), "meta.json: key 'eos_id'=256"),
    (lambda d: _edit(d, tokenizer="../tok.json"), "meta.json: key 'tokenizer'='../tok.json'"),
    (lambda d: _edit(d, tokenizer="tokenizer.json"), "key 'tokenizer' names 'tokenizer.json', which is missing"),
    (lambda d: (d / "tokens.bin").write_bytes(b"\x00" * 7), "tokens.bin: 7 bytes"),
    (lambda d: (d / "tokens.bin").unlink(), "tokens.bin is missing"),
    (lambda d: _edit(d, tokens=2) or (d / "tokens.bin").write_bytes(b"\x00" * 4), "2 tokens are too few"),
])
def test_damaged_corpora_are_refused_naming_the_file_and_key(texts, damage, needle):
    prepare([texts / "in"], texts / "out", quiet=True)
    damage(texts / "out")
    with pytest.raises(ValueError, match="out") as err:
        open_corpus(texts / "out")
    assert needle in str(err.value)


def test_a_missing_corpus_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"nothing: no such corpus directory"):
        open_corpus(tmp_path / "nothing")


def _edit(directory, **changes):
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps(dict(meta, **changes)))


def test_vocab_check_names_the_corpus_and_the_allowed_vocab(texts):
    prepare([texts / "in"], texts / "out", quiet=True)
    check_vocab(open_corpus(texts / "out"), 256)
    with pytest.raises(ValueError, match=r"out: its tokenizer has 256 tokens, but the model's vocab is 100 "
                                         r"\(use --vocab >= 256\)"):
        check_vocab(open_corpus(texts / "out"), 100)


def test_cli_prints_a_summary_and_fails_cleanly(texts):
    ok, bad = run_at_once([sys.executable, "-m", "fmoe.data", "prepare", texts / "in", "--out", texts / "out"],
                          [sys.executable, "-m", "fmoe.data", "prepare", texts / "nope", "--out", texts / "o2"])
    assert ok.returncode == 0, ok.stderr
    tokens = sum(len(t.encode()) + 2 for t in DOCS.values())
    assert ok.stdout == f"fmoe.data: 3 documents, {tokens} tokens (uint16, vocab 256) -> {texts / 'out'}\n"
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == f"fmoe.data: input {texts / 'nope'} does not exist"
