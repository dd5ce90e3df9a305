"""Throughput of ``python -m fmoe.data prepare --chat`` (chat JSONL -> packed rows).

    .venv/bin/python benchmarks/prepare_chat_speed.py [--mb 50] [--seq 2048] [--repeat 2]

Writes ``--mb`` MB of synthetic chat JSONL (seeded: the same every run): conversations of
an optional system prompt and 1-4 user/assistant exchanges of words drawn from a Zipf-like
vocabulary, with punctuation, numbers and some non-ASCII words; one line in eight a
``{"prompt", "completion"}`` pair. Trains a byte-level BPE tokenizer (vocab 8k, with
``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>``) on a few MB of it with
``tokenizers`` in-process (nothing is downloaded), then times, best of ``--repeat``:

  (a) ``Tokenizer.encode_batch`` alone over the ChatML-rendered conversations, held in
      memory (the tokenizer's ceiling, offsets included, as prepare needs them);
  (b) ``prepare_chat`` with a ``tokenizer_config.json`` holding a ChatML
      ``chat_template`` (jinja2, incremental rendering for the assistant spans);
  (c) ``prepare_chat`` with the plain template (``--eos '<|endoftext|>'``);
  (d) ``prepare_chat`` byte-level (no tokenizer);

and prints MB/s of JSONL (1 MB = 1e6 bytes) and CPU seconds (every thread) for each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from itertools import accumulate
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fmoe.data.chat import prepare_chat  # noqa: E402

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
SPECIAL = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def vocabulary(rng: random.Random, n: int = 20000) -> tuple[list[str], list[float]]:
    """Pseudo-words (some non-ASCII) and their cumulative Zipf weights, as natural text has."""
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = []
    for i in range(n):
        word = "".join(rng.choice(letters[:10 + i % 16]) for _ in range(rng.randint(1, 9)))
        words.append(word + ("é" if i % 97 == 0 else "ü" if i % 89 == 0 else ""))
    return words, list(accumulate(1 / (rank + 1) for rank in range(n)))


def sentence(rng: random.Random, words, weights, lo: int, hi: int) -> str:
    picked = rng.choices(words, cum_weights=weights, k=rng.randint(lo, hi))
    picked[0] = picked[0].capitalize()
    if rng.random() < 0.2:
        picked.insert(rng.randrange(len(picked)), str(rng.randint(0, 10_000)))
    return " ".join(picked) + rng.choice(".?!.")


def conversation(rng: random.Random, words, weights) -> dict:
    def text(lo, hi):
        return " ".join(sentence(rng, words, weights, 4, 18) for _ in range(rng.randint(lo, hi)))

    if rng.random() < 0.125:
        return {"prompt": text(1, 4), "completion": text(1, 8)}
    messages = [{"role": "system", "content": text(1, 2)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        messages += [{"role": "user", "content": text(1, 4)},
                     {"role": "assistant", "content": text(1, 10) + ("\n\n" + text(1, 3) if rng.random() < 0.3 else "")}]
    return {"messages": messages}


def write_jsonl(path: Path, megabytes: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    words, weights = vocabulary(rng)
    size, lines = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            line = json.dumps(conversation(rng, words, weights), ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode())
            lines += 1
    return lines


def train_tokenizer(sample: list[str], path: Path, vocab: int = 8192):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer)
    tok.save(str(path))
    return tok


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds)."""
    w0, c0 = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - w0, cpu_seconds() - c0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50, help="MB of chat JSONL to write")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "chat.jsonl"
        t0 = time.perf_counter()
        lines = write_jsonl(data, args.mb)
        nbytes = data.stat().st_size
        print(f"input: {lines} conversations, {nbytes / 1e6:.1f} MB of jsonl (written in "
              f"{time.perf_counter() - t0:.1f} s); {os.cpu_count()} CPUs, "
              f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}")

        rows = [json.loads(line) for line in open(data, encoding="utf-8")]
        chats = [r.get("messages") or [{"role": "user", "content": r["prompt"]},
                                       {"role": "assistant", "content": r["completion"]}] for r in rows]
        rendered = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in chats]
        del rows, chats
        (tmp / "chatml").mkdir()
        (tmp / "plain").mkdir()
        t0 = time.perf_counter()
        train_tokenizer(rendered[::max(1, len(rendered) // 3000)], tmp / "chatml" / "tokenizer.json")
        print(f"tokenizer: BPE vocab 8192 trained in {time.perf_counter() - t0:.1f} s")
        (tmp / "plain" / "tokenizer.json").write_bytes((tmp / "chatml" / "tokenizer.json").read_bytes())
        (tmp / "chatml" / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))
        tok = Tokenizer.from_file(str(tmp / "chatml" / "tokenizer.json"))

        metas = {}

        def run(name, **kwargs):
            metas[name] = prepare_chat([data], tmp / "out", args.seq, overwrite=True, quiet=True, **kwargs)

        cases = {
            "encode_batch (ceiling)": lambda: tok.encode_batch(rendered, add_special_tokens=False),
            "prepare --chat (chat_template)": lambda: run("template", tokenizer=tmp / "chatml" / "tokenizer.json"),
            "prepare --chat (plain)": lambda: run("plain", tokenizer=tmp / "plain" / "tokenizer.json",
                                                  eos="<|endoftext|>"),
            "prepare --chat (bytes)": lambda: run("bytes"),
        }
        times = {name: [] for name in cases}
        for _ in range(args.repeat):  # interleaved: a passing load slows every case alike
            for name, fn in cases.items():
                times[name].append(timed(fn))

    for name, t in times.items():
        wall, cpu = min(t)
        print(f"{name:32s} {wall:7.2f} s  {nbytes / 1e6 / wall:7.2f} MB/s   (CPU {cpu:6.2f} s)")
    for name, meta in metas.items():
        packed = meta["packed"]
        print(f"  {name}: {meta['tokens']:,} positions in {packed['rows']} rows of {packed['row_tokens']}, "
              f"{packed['trained_tokens'] / (packed['packing_efficiency'] * meta['tokens']):.1%} trained on, "
              f"packing {packed['packing_efficiency']:.1%}, {packed['split']} split, {packed['truncated']} truncated")


if __name__ == "__main__":
    main()
