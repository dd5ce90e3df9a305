"""fmoe.data.chat: chat JSONL rendered (a tokenizer's chat_template, or the plain one),
masked to the assistant's turns, packed into rows of seq + 1; and the errors that name the
file, line and field before anything is written."""

import json
import sys

import numpy as np
import pytest

import fmoe.data.chat as chat_module
import fmoe.data.prepare as prepare_module
from fmoe.data import heldout_rows, heldout_set, open_corpus
from fmoe.data.chat import prepare_chat
from fmoe.data.chat_template import Template, assistant_spans, message_starts, plain_render, plain_spans
from fmoe.data.packing import Packer, split_points
from fmoe.data.tokens import read_meta

from .procs import run_at_once
from .test_data import bpe_tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world?"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Ünïcode and lines"},
                  {"role": "assistant", "content": "third\ndocument"}]},
    {"prompt": "Say one", "completion": "one, ünï"},
    {"messages": [{"role": "user", "content": "only a question"}], "id": 7},  # extra keys are fine
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},  # an empty reply
]


def as_messages(chat):
    if "messages" in chat:
        return chat["messages"]
    return [{"role": "user", "content": chat["prompt"]}, {"role": "assistant", "content": chat["completion"]}]


def chatml(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def write_chats(path, chats, blank_lines=True):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" + ("\n" if blank_lines and i % 2 else "")
                            for i, c in enumerate(chats)))
    return path


def make_tokenizer(folder, config=None, specials=("<|im_start|>", "<|im_end|>")):
    """The small BPE of test_data (no prefix space, so that any run of tokens decodes to
    its text), with ``specials`` added, and ``config`` as its tokenizer_config.json."""
    from tokenizers.pre_tokenizers import ByteLevel

    folder.mkdir(parents=True, exist_ok=True)
    tok = bpe_tokenizer(folder / "tokenizer.json")
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(list(specials))
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


@pytest.fixture
def chatml_tok(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", {"chat_template": CHATML, "eos_token": {"content": "<|im_end|>"},
                                            "bos_token": None})
    return tok, tmp_path / "tok" / "tokenizer.json"


def read_rows(out):
    """``(meta, ids, flags, segments)``, each ``[rows, seq + 1]``."""
    meta = read_meta(out)
    width = meta["packed"]["row_tokens"]
    ids = np.fromfile(out / "tokens.bin", np.dtype(meta["dtype"])).reshape(-1, width)
    flags = np.fromfile(out / "loss_mask.bin", np.uint8).reshape(-1, width)
    segments = np.fromfile(out / "segments.bin", np.uint32).reshape(-1, width)
    return meta, ids, flags, segments


def documents(out, check=True):
    """Every document that is not padding, row by row: ``[(ids, flags)]``; with ``check``,
    the packing's invariants are asserted on the way."""
    meta, ids, flags, segments = read_rows(out)
    pad = meta["eos_id"] or 0
    docs, padding = [], 0
    for ids_R, flags_R, segments_R in zip(ids, flags, segments):
        assert segments_R[0] == 0 and set(np.diff(segments_R.astype(np.int64)).tolist()) <= {0, 1}
        for s in range(int(segments_R[-1]) + 1):
            where = segments_R == s
            doc_ids, doc_flags = ids_R[where], flags_R[where]
            assert doc_flags[0] == 0  # nothing precedes a document's first token
            if s == segments_R[-1] and (doc_ids == pad).all() and not doc_flags.any():
                padding += len(doc_ids)  # the rest of the row
                continue
            docs.append((doc_ids.tolist(), doc_flags.astype(bool)))
    if check:
        total = ids.size
        assert meta["tokens"] == total == meta["packed"]["rows"] * meta["packed"]["row_tokens"]
        assert meta["packed"]["packing_efficiency"] == pytest.approx((total - padding) / total)
        assert meta["packed"]["trained_tokens"] == int(flags.sum()) == sum(int(f.sum()) for _, f in docs)
        assert meta["max_id"] == int(ids.max()) and (out / "tokens.bin").stat().st_size == total * ids.itemsize
    return docs


def runs(ids, flags):
    """The trained runs of a document, each a list of ids."""
    out, current = [], []
    for i, f in zip(ids, flags):
        if f:
            current.append(i)
        elif current:
            out, current = out + [current], []
    return out + [current] if current else out


def test_the_mask_is_exactly_each_assistant_turn_and_its_end_token(tmp_path, chatml_tok):
    tok, path = chatml_tok
    data = write_chats(tmp_path / "in" / "chats.jsonl", CHATS)
    meta = prepare_chat([tmp_path / "in"], tmp_path / "out", seq=127, tokenizer=path, quiet=True)
    docs = documents(tmp_path / "out")
    expected = [chatml(as_messages(c)) for c in CHATS]
    assert sorted(tok.decode(ids, skip_special_tokens=False) for ids, _ in docs) == sorted(expected)
    for ids, flags in docs:
        text = tok.decode(ids, skip_special_tokens=False)
        (chat,) = [as_messages(c) for c in CHATS if chatml(as_messages(c)) == text]
        # the whole text is one encode of it (as at inference), no special tokens added
        assert ids == tok.encode(text, add_special_tokens=False).ids
        trained = [tok.decode(run, skip_special_tokens=False) for run in runs(ids, flags)]
        assert trained == [m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant"]
    assert (meta["packed"]["template"], meta["packed"]["train_on"], meta["packed"]["conversations"]) == \
        ("tokenizer", "assistant", 4)
    assert meta["documents"] == 4 and meta["files"] == 1 and meta["sources"] == [str((tmp_path / "in").resolve())]
    assert (meta["eos_id"], meta["vocab"], meta["dtype"]) == (tok.token_to_id("<|im_end|>"), tok.get_vocab_size(),
                                                              "uint16")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == path.read_bytes()
    assert (tmp_path / "out" / "tokenizer_config.json").read_bytes() == (path.parent / "tokenizer_config.json").read_bytes()
    corpus = open_corpus(tmp_path / "out", heldout_fraction=0.5)  # the plain reader takes it too
    assert len(corpus.train) + len(corpus.heldout) == meta["tokens"] and corpus.eos_id == meta["eos_id"]
    assert data.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in", "out", "tok"]


def test_rendering_matches_hugging_face_apply_chat_template(tmp_path, chatml_tok):
    transformers = pytest.importorskip("transformers")
    tok, path = chatml_tok
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")
    hf.chat_template = CHATML
    template = chat_module.load_template(path, tok, None)
    for chat in map(as_messages, CHATS):
        for gen in (False, True):
            assert template.render(chat, gen) == hf.apply_chat_template(chat, tokenize=False,
                                                                        add_generation_prompt=gen)


def test_train_on_all_trains_every_token_but_each_documents_first(tmp_path, chatml_tok):
    _, path = chatml_tok
    write_chats(tmp_path / "chats.jsonl", CHATS)
    meta = prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "out", seq=127, tokenizer=path, train_on="all",
                        quiet=True)
    docs = documents(tmp_path / "out")
    assert all(flags[1:].all() and not flags[0] for _, flags in docs) and len(docs) == 4
    assert meta["packed"]["trained_tokens"] == sum(len(ids) - 1 for ids, _ in docs)
    assert meta["packed"]["train_on"] == "all"


def test_the_plain_template_with_a_tokenizer_and_with_bytes(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", specials=())  # no config: the plain template
    write_chats(tmp_path / "chats.jsonl", CHATS)
    meta = prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "out", seq=200, tokenizer=tmp_path / "tok" /
                        "tokenizer.json", eos="<|endoftext|>", quiet=True)
    assert meta["packed"]["template"] == "plain" and meta["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()
    docs = documents(tmp_path / "out")
    for ids, flags in docs:
        text = tok.decode(ids, skip_special_tokens=False)
        (chat,) = [as_messages(c) for c in CHATS if plain_render(as_messages(c), False, "<|endoftext|>") == text]
        assert [tok.decode(r, skip_special_tokens=False) for r in runs(ids, flags)] == \
            [m["content"] + "<|endoftext|>\n" for m in chat if m["role"] == "assistant"]
    # bytes: no special tokens; an assistant turn ends with the newline after it
    meta = prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "bytes", seq=200, quiet=True)
    assert (meta["vocab"], meta["eos_id"], meta["tokenizer"], meta["packed"]["template"]) == (256, None, None, "plain")
    texts = []
    for ids, flags in documents(tmp_path / "bytes"):
        texts.append(bytes(ids).decode())
        chat = [as_messages(c) for c in CHATS if plain_render(as_messages(c), False) == texts[-1]][0]
        assert [bytes(r).decode() for r in runs(ids, flags)] == \
            [m["content"] + "\n" for m in chat if m["role"] == "assistant"]
    assert texts[0].startswith("<|system|>\nBe brief.\n<|user|>\nHello, world?\n<|assistant|>\nHello.\n")
    assert sorted(texts) == sorted(plain_render(as_messages(c), False) for c in CHATS)


def test_the_plain_templates_one_pass_spans_are_what_incremental_rendering_finds():
    for chat in map(as_messages, CHATS):
        for eos in ("", "</s>"):
            text, spans, starts = plain_spans(chat, eos)
            slow = Template("plain", lambda m, gen: plain_render(m, gen, eos), eos or None)
            assert text == plain_render(chat, False, eos)
            assert spans == assistant_spans(slow, chat, text, "x") and starts == message_starts(slow, chat, text, "x")


def test_prompt_completion_lines_are_a_user_then_an_assistant_turn(tmp_path, chatml_tok):
    _, path = chatml_tok
    pair = {"prompt": "Say one", "completion": "one, ünï"}
    write_chats(tmp_path / "a.jsonl", [pair])
    write_chats(tmp_path / "b.jsonl", [{"messages": as_messages(pair)}])
    for name in "ab":
        prepare_chat([tmp_path / f"{name}.jsonl"], tmp_path / f"out_{name}", seq=63, tokenizer=path, quiet=True)
    for name in ("tokens.bin", "loss_mask.bin", "segments.bin"):
        assert (tmp_path / "out_a" / name).read_bytes() == (tmp_path / "out_b" / name).read_bytes()


def varied_chats(n=300, seed=0):
    """Conversations of 1-6 messages of 0-40 distinct words (byte lengths 10 to ~700)."""
    rng = np.random.default_rng(seed)
    chats = []
    for c in range(n):
        roles = (["system"] if rng.random() < 0.3 else []) + ["user", "assistant"] * int(rng.integers(1, 4))
        chats.append({"messages": [{"role": r, "content": " ".join(f"c{c}m{k}w{w}" for w in
                                                                   range(int(rng.integers(0, 40))))}
                                   for k, r in enumerate(roles)]})
    return chats


def test_packing_fills_rows_best_fit_and_never_straddles_them(tmp_path, monkeypatch):
    chats = varied_chats()
    write_chats(tmp_path / "chats.jsonl", chats)
    texts = sorted(plain_render(c["messages"], False) for c in chats)
    width = max(len(t.encode()) for t in texts) + 1  # every conversation fits a row: none split
    meta = prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "out", seq=width - 1, quiet=True)
    docs = documents(tmp_path / "out")
    assert sorted(bytes(ids).decode() for ids, _ in docs) == texts  # each whole in one row
    packed = meta["packed"]
    assert (packed["split"], packed["truncated"], packed["conversations"]) == (0, 0, len(chats))
    assert packed["packing_efficiency"] > 0.9, packed  # best-fit: little padding, mostly in the last open rows
    # the output is the same whatever the batches and the threads' timing
    monkeypatch.setattr(chat_module, "_BATCH_CONVERSATIONS", 7)
    monkeypatch.setattr(chat_module, "_BATCH_BYTES", 999)
    prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "small", seq=width - 1, quiet=True)
    for name in ("tokens.bin", "loss_mask.bin", "segments.bin", "meta.json"):
        before, after = ((tmp_path / d / name).read_bytes() for d in ("out", "small"))
        assert before == after or name == "meta.json" and json.loads(before)["packed"] == json.loads(after)["packed"]
    # one open row: each conversation closes the row when it does not fit; more padding
    one = prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "one", seq=width - 1, quiet=True, open_rows=1)
    assert one["packed"]["packing_efficiency"] < packed["packing_efficiency"]
    assert sorted(bytes(ids).decode() for ids, _ in documents(tmp_path / "one")) == texts


def test_the_packer_takes_the_row_with_the_least_room_that_fits():
    rows = []
    packer = Packer(10, 99, np.dtype(np.uint16), lambda *row: rows.append([a.tolist() for a in row]), open_rows=2)
    for n in (6, 7, 3, 4, 2):
        packer.add(np.full(n, n, np.uint16), np.ones(n, np.uint8))
    packer.finish()
    # 3 fills the row of 7 (room 3, not 4); 4 fills the row of 6; 2 opens a row, padded
    assert rows == [[[7] * 7 + [3] * 3, [0] + [1] * 6 + [0] + [1] * 2, [0] * 7 + [1] * 3],
                    [[6] * 6 + [4] * 4, [0] + [1] * 5 + [0] + [1] * 3, [0] * 6 + [1] * 4],
                    [[2, 2] + [99] * 8, [0, 1] + [0] * 8, [0, 0] + [1] * 8]]
    assert (packer.closed, packer.content, packer.trained, packer.max_id) == (3, 22, 17, 99)
    rows.clear()
    packer = Packer(10, 0, np.dtype(np.uint16), lambda *row: rows.append(row[0].tolist()), open_rows=1)
    for n in (6, 7, 3):
        packer.add(np.full(n, n, np.uint16), np.ones(n, np.uint8))
    packer.finish()
    assert rows == [[6] * 6 + [0] * 4, [7] * 7 + [3] * 3]


def test_split_points_prefer_cutting_before_a_prompt():
    # messages start at 0, 4, 9, 12, 20 of 26 tokens; a row holds 10
    assert split_points(26, [4, 9, 12, 20], 10) == ([(0, 9), (9, 12), (12, 20), (20, 26)], False)
    assert split_points(26, [4, 9, 12, 20], 10, preferred=[4, 12]) == ([(0, 4), (4, 12), (12, 20), (20, 26)], False)
    # a message longer than a row keeps its first row of tokens; its rest is dropped
    assert split_points(30, [3, 25], 10) == ([(0, 3), (3, 13), (25, 30)], True)
    assert split_points(8, [], 10) == ([(0, 8)], False)


def test_long_conversations_split_at_messages_or_truncate(tmp_path):
    words = [" ".join(f"m{k}w{w}" for w in range(n)) for k, n in enumerate([3, 20, 5, 8, 2, 30, 4, 200, 6])]
    long = {"messages": [{"role": ("user", "assistant")[k % 2], "content": text} for k, text in enumerate(words)]}
    short = {"prompt": "hi", "completion": "ok"}
    write_chats(tmp_path / "chats.jsonl", [short, long, short])
    full = plain_render(long["messages"], False)
    seq = 299
    meta = prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "split", seq=seq, quiet=True)
    pieces = [bytes(ids).decode() for ids, _ in documents(tmp_path / "split")]
    pieces.remove(plain_render(as_messages(short), False))
    pieces.remove(plain_render(as_messages(short), False))
    assert all(len(p.encode()) <= seq + 1 and p.startswith("<|") for p in pieces) and len(pieces) > 2
    starts = sorted(full.index(p) for p in pieces)
    message_8 = plain_render(long["messages"][:7], False)  # the message of 200 words starts here
    assert any(p == full[len(message_8):len(message_8) + seq + 1] for p in pieces)  # kept its first row
    assert (meta["packed"]["split"], meta["packed"]["truncated"], meta["packed"]["conversations"]) == (1, 1, 3)
    # every other character is in exactly one piece, in order
    covered = sorted((full.index(p), full.index(p) + len(p)) for p in pieces)
    assert covered[0][0] == 0 and covered[-1][1] == len(full) and starts == [a for a, _ in covered]
    lost = sum(b - a for (_, a), (b, _) in zip(covered, covered[1:]))
    assert lost == len(plain_render(long["messages"][:8], False)) - len(message_8) - (seq + 1)

    meta = prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "truncate", seq=seq, long="truncate", quiet=True)
    texts = [bytes(ids).decode() for ids, _ in documents(tmp_path / "truncate")]
    assert sorted(texts) == sorted([plain_render(as_messages(short), False)] * 2 + [full[:seq + 1]])
    assert (meta["packed"]["split"], meta["packed"]["truncated"]) == (0, 1)


GOOD = json.dumps(CHATS[0])
BAD_LINES = [
    ('{"messages": [', "not JSON"),
    ('[1, 2]', "a chat line must be a JSON object with 'messages' (or 'prompt' and 'completion'), not a list"),
    ('{"text": "hi"}', "no 'messages' (nor 'prompt' and 'completion'); the line's keys are 'text'"),
    ('{"prompt": "hi"}', "'completion' must be a string (a prompt/completion line needs both)"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}',
     "messages[0] has role 'bot'; allowed: system, user, assistant"),
    ('{"messages": [{"role": "user", "content": ["hi"]}]}',
     "messages[0] (user) has 'content' of type list; it must be a string"),
    ('{"messages": [{"role": "user"}]}', "messages[0] (user) has 'content' of null (or missing)"),
    ('{"messages": []}', "an empty conversation ('messages' is [])"),
    ('{"messages": "hi"}', "'messages' must be a list"),
    ('{"messages": ["hi"]}', "messages[0] must be an object with 'role' and 'content'"),
    (r'{"prompt": "a\ud800", "completion": "b"}', "'\\ud800' is not a character (a lone surrogate"),
    # both forms on one line: neither is taken silently
    ('{"messages": [{"role": "user", "content": "hi"}], "prompt": "p", "completion": "c"}',
     "the line has both 'messages' and 'prompt'/'completion'; a chat line holds either 'messages' or 'prompt' and "
     "'completion', not both"),
    ('{"messages": [{"role": "user", "content": "hi"}], "completion": "c"}',
     "the line has both 'messages' and 'completion'; a chat line holds"),
]


@pytest.mark.parametrize("line,needle", BAD_LINES, ids=[n.split(" ")[0] + str(i) for i, (_, n) in
                                                         enumerate(BAD_LINES)])
def test_a_bad_line_is_named_by_file_and_line_and_nothing_is_written(tmp_path, line, needle):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(GOOD + "\n")
    (tmp_path / "in" / "b.jsonl").write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    with pytest.raises(ValueError) as err:
        prepare_chat([tmp_path / "in"], tmp_path / "out", seq=64, quiet=True)
    assert str(err.value).startswith(f"{tmp_path / 'in' / 'b.jsonl'}:3: ") and needle in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # nothing at --out, no temporary left


def test_a_bad_line_after_many_batches_leaves_nothing_either(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_module, "_BATCH_CONVERSATIONS", 3)
    lines = [GOOD] * 50 + ['{"messages": [{"role": "tool", "content": "x"}]}']
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"a.jsonl:51: messages\[0\] has role 'tool'; allowed: system, user"):
        prepare_chat([tmp_path / "a.jsonl"], tmp_path / "out", seq=64, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_tokenizers_without_the_special_tokens_the_template_needs(tmp_path):
    write_chats(tmp_path / "c.jsonl", CHATS)
    cases = [
        # ChatML's <|im_end|> is not a token: every turn would silently become plain text
        ({"chat_template": CHATML}, ("<|im_start|>",), None, "'<|im_end|>' (written by the chat_template of"),
        # the template writes eos_token, which nothing sets
        ({"chat_template": "{{ messages[0]['content'] + eos_token }}"}, (), None,
         "writes eos_token, which /"),
        ({"chat_template": "{{ messages[0]['content'] + eos_token }}"}, (), None,
         "/tokenizer_config.json does not set (or pass --eos TOKEN)"),
        ({"chat_template": "{{ bos_token + messages[0]['content'] }}", "bos_token": "<s>"}, (), None,
         "'<s>' (bos_token of"),
        # the plain template needs an end-of-sequence token
        (None, (), None, "the plain chat template ends each assistant turn with an end-of-sequence token, and none "
                         "is set; pass --eos TOKEN (this tokenizer has '<|endoftext|>')"),
        (None, (), "<eos>", "'<eos>' (the end of each assistant turn) is not a token of it"),
        ({"eos_token": "</s>"}, (), None, "'</s>' (the end of each assistant turn) is not a token of it"),
        ({"chat_template": [{"name": "tool_use", "template": CHATML}]}, (), None,
         "'chat_template' is a list of templates named 'tool_use'; one must be named 'default'"),
        ({"chat_template": "{% for m in messages %}"}, (), None, "its chat_template does not parse"),
    ]
    for i, (config, specials, eos, needle) in enumerate(cases):
        make_tokenizer(tmp_path / f"t{i}", config, specials)
        with pytest.raises(ValueError) as err:
            prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=64, tokenizer=tmp_path / f"t{i}" /
                         "tokenizer.json", eos=eos, quiet=True)
        assert needle in str(err.value), (i, str(err.value))
        assert "tokenizer" in str(err.value) and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="--eos '</s>' names a token of a tokenizer; byte-level data has none"):
        prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=64, eos="</s>", quiet=True)
    # a list of templates: the one named "default"
    make_tokenizer(tmp_path / "listed", {"chat_template": [{"name": "default", "template": CHATML}],
                                         "eos_token": "<|im_end|>"})
    meta = prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=127,
                        tokenizer=tmp_path / "listed" / "tokenizer.json", quiet=True)
    assert meta["packed"]["template"] == "tokenizer"


def test_templates_that_fail_or_do_not_render_incrementally(tmp_path):
    write_chats(tmp_path / "c.jsonl", CHATS[:2], blank_lines=False)
    strict = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages, please') }}"
              "{% endif %}" + CHATML)
    last = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}<|im_end|>{% endif %}{% endfor %}"
    for name, template, needle in [("strict", strict, "c.jsonl:1: the chat_template of"),
                                   ("last", last, "c.jsonl:1: the chat_template of")]:
        make_tokenizer(tmp_path / name, {"chat_template": template, "eos_token": "<|im_end|>"})
        with pytest.raises(ValueError) as err:
            prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=64, tokenizer=tmp_path / name /
                         "tokenizer.json", quiet=True)
        assert needle in str(err.value) and not (tmp_path / "out").exists()
        assert ("no system messages, please" if name == "strict" else "is not a prefix") in str(err.value)
    # --train-on all needs no incremental rendering (nothing split here)
    meta = prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=200, tokenizer=tmp_path / "last" /
                        "tokenizer.json", train_on="all", quiet=True)
    assert meta["packed"]["conversations"] == 2


def test_bad_arguments_and_an_existing_output(tmp_path):
    write_chats(tmp_path / "c.jsonl", CHATS)
    for kwargs, needle in [({"seq": None}, "--chat needs --seq N"), ({"seq": 0}, "--seq 0 is invalid: must be an int >= 1"),
                           ({"seq": 8, "train_on": "user"}, "--train-on 'user' is invalid; allowed: assistant, all"),
                           ({"seq": 8, "long": "drop"}, "--long 'drop' is invalid; allowed: split, truncate")]:
        with pytest.raises(ValueError, match=needle):
            prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", quiet=True, **kwargs)
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(ValueError, match=r"the inputs hold no conversations \(1 file"):
        prepare_chat([tmp_path / "empty.jsonl"], tmp_path / "out", seq=8, quiet=True)
    assert not (tmp_path / "out").exists()
    prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=8, quiet=True)
    before = (tmp_path / "out" / "tokens.bin").read_bytes()
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=8, quiet=True)
    (tmp_path / "bad.jsonl").write_text(GOOD + "\n{\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):  # the old corpus stays whole
        prepare_chat([tmp_path / "bad.jsonl"], tmp_path / "out", seq=8, overwrite=True, quiet=True)
    assert (tmp_path / "out" / "tokens.bin").read_bytes() == before
    assert prepare_chat([tmp_path / "c.jsonl"], tmp_path / "out", seq=9, overwrite=True, quiet=True)["tokens"] % 10 == 0


def test_cli_prints_the_summary_and_fails_with_one_line(tmp_path, chatml_tok):
    _, path = chatml_tok
    write_chats(tmp_path / "c.jsonl", CHATS)

    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    cli = [sys.executable, "-m", "fmoe.data", "prepare"]
    ok, bad = run_at_once([*cli, "--chat", tmp_path / "c.jsonl", "--tokenizer", path, "--seq", 127, "--out",
                           tmp_path / "out", "--quiet"],
                          [*cli, "--chat", tmp_path / "bad.jsonl", "--seq", 8, "--out", tmp_path / "o2", "--quiet"])
    assert ok.returncode == 0, ok.stderr
    meta = read_meta(tmp_path / "out")
    content = round(meta["packed"]["packing_efficiency"] * meta["tokens"])
    assert ok.stdout.startswith(f"fmoe.data: 4 conversations (0 split, 0 truncated), {content:,} tokens in "
                                f"{meta['packed']['rows']} rows of 128, ")
    assert ok.stdout.endswith(f"%, template {path.parent.resolve() / 'tokenizer_config.json'} -> {tmp_path / 'out'}\n")
    assert "trained on, packing " in ok.stdout
    assert bad.returncode == 1 and bad.stderr == (f"fmoe.data: {tmp_path / 'bad.jsonl'}:1: messages[0] has role "
                                                  "'robot'; allowed: system, user, assistant\n")
    # the other refusals, in-process (each one line, as SystemExit's message)
    for args, needle in [(["--chat", tmp_path / "c.jsonl"], "--chat needs --seq N"),
                         (["--chat", tmp_path / "c.jsonl", "--seq", 0], "--seq 0 is invalid"),
                         (["--chat", tmp_path / "c.jsonl", "--seq", 8, "--train-on", "user"],
                          "--train-on 'user' is invalid; allowed: assistant, all"),
                         ([tmp_path / "c.jsonl", "--seq", 8, "--long", "split"],
                          "--seq and --long only go with --chat"),
                         (["--chat", tmp_path / "c.jsonl", "--seq", 8, "--out", tmp_path / "out"],
                          f"--out {tmp_path / 'out'} exists; pass --overwrite")]:
        with pytest.raises(SystemExit) as err:
            prepare_module.main(["prepare", *map(str, args + ([] if "--out" in args else ["--out", tmp_path / "o2"])),
                                 "--quiet"])
        assert str(err.value).startswith("fmoe.data: ") and needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "o2").exists()


def test_a_packed_heldout_split_shorter_than_a_batch_is_one_batch_filled_with_rows_that_count_nothing(tmp_path):
    chats = varied_chats()
    write_chats(tmp_path / "chats.jsonl", chats)
    prepare_chat([tmp_path / "chats.jsonl"], tmp_path / "out", seq=127, quiet=True)
    corpus = open_corpus(tmp_path / "out", heldout_fraction=0.2)
    rows = heldout_rows(corpus, 127)
    assert rows >= 2
    batch = rows + 2 + rows % 2  # more than the split holds, even: it splits over 2 ranks
    whole = [heldout_set(corpus, rows, 127, 1)[0], *heldout_set(corpus, batch, 127, 1)]
    assert len(whole) == 2 and whole[1]["tokens"].shape == (batch, 128)
    for key in ("tokens", "loss_mask", "segments"):  # the rows there are, unchanged
        assert np.array_equal(whole[1][key][:rows], whole[0][key]), key
    assert whole[0]["loss_mask"].any() and not whole[1]["loss_mask"][rows:].any()
    halves = [heldout_set(corpus, batch, 127, 1, rank=r, world=2)[0] for r in range(2)]
    assert all(np.array_equal(np.concatenate([h[key] for h in halves]), whole[1][key]) for key in whole[1])
