"""Throughput of ``python -m fmoe.data prepare`` against the tokenizer's own ceiling.

    .venv/bin/python benchmarks/prepare_speed.py [--mb 32] [--repeat 3] [--jsonl] [--root DIR]

Takes the ``*.py`` files of Python's standard library (``sys.base_prefix/lib/pythonX.Y``,
``site-packages`` left out; sorted, the first ``--mb`` MB of them), each file one
document (``--jsonl``: their paragraphs, split at blank lines, as the lines of one
``.jsonl`` file: many small documents), trains a byte-level BPE tokenizer (vocab 8k,
``<|endoftext|>``) on a few MB of the same text with ``tokenizers`` itself (nothing is
downloaded), then times, the cases interleaved, best of ``--repeat``:

  (a) ``Tokenizer.encode_batch`` alone, one call over the same documents read into
      memory beforehand (the ceiling; ``encode_batch_fast``, which skips the character
      offsets, is shown too);
  (b) ``fmoe.data.prepare.prepare`` end to end with that tokenizer (finding and reading
      the files, encoding, writing ``tokens.bin`` + ``meta.json``);
  (c) ``prepare`` in byte mode (no tokenizer);
  (d) the command, ``python -m fmoe.data prepare ... --tokenizer``, progress bar on:
      (b) plus starting Python and importing fmoe (and so torch), a fixed ~2-3 s;

and prints MB/s (of the input files' bytes, 1 MB = 1e6 bytes) and CPU seconds (every
thread) for each, and the ratio (b)/(a). Another job on the machine slows all cases, and
the ceiling and prepare differently: compare runs on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fmoe.data.prepare import prepare  # noqa: E402


def stdlib_files(root: Path, limit: int) -> list[Path]:
    """The ``*.py`` files under ``root``, sorted, ``site-packages`` and hidden folders left
    out, as many as fit in ``limit`` bytes."""
    files, total = [], 0
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if "site-packages" in parts or any(p.startswith(".") for p in parts) or not f.is_file():
            continue
        size = f.stat().st_size
        if total + size > limit:
            break
        files.append(f)
        total += size
    return files


def train_tokenizer(texts: list[str], path: Path, vocab: int = 8192):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return tok


def cpu_seconds() -> float:
    t = os.times()  # every thread of this process, and its finished children (the CLI)
    return t.user + t.system + t.children_user + t.children_system


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds)."""
    w0, c0 = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - w0, cpu_seconds() - c0


def main():
    base = {"base": sys.base_prefix, "installed_base": sys.base_prefix}  # not the venv's
    default_root = Path(sysconfig.get_paths(vars=base)["stdlib"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=default_root, help=f"where the *.py files come from ({default_root})")
    ap.add_argument("--mb", type=float, default=32, help="MB of *.py files to take")
    ap.add_argument("--jsonl", action="store_true", help="their paragraphs as the lines of one .jsonl file")
    ap.add_argument("--train-mb", type=float, default=4, help="MB of the documents the tokenizer is trained on")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    files = stdlib_files(args.root, int(args.mb * 1e6))
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.jsonl:
            docs = [p for t in texts for p in t.split("\n\n") if p.strip()]
            inputs = [tmp / "docs.jsonl"]
            with open(inputs[0], "w") as f:
                f.writelines(json.dumps({"text": p}) + "\n" for p in docs)
        else:
            docs, inputs = [t for t in texts if t.strip()], files
        nbytes = sum(p.stat().st_size for p in inputs)
        print(f"input: {len(files)} files under {args.root}, {len(docs)} documents, "
              f"{nbytes / 1e6:.1f} MB{' of jsonl' if args.jsonl else ''}; {os.cpu_count()} CPUs, "
              f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}")

        sample = docs[::max(1, round(sum(map(len, docs)) / (args.train_mb * 1e6)))]  # spread over the input
        size = sum(map(len, sample))
        t0 = time.perf_counter()
        train_tokenizer(sample, tmp / "tokenizer.json")
        print(f"tokenizer: BPE vocab 8192 trained on {size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))

        def run_prepare(tokenizer):
            prepare(inputs, tmp / "out", tokenizer=tokenizer, overwrite=True, quiet=True)

        cli = [sys.executable, "-m", "fmoe.data", "prepare", *map(str, inputs), "--out", str(tmp / "cli"),
               "--tokenizer", str(tmp / "tokenizer.json"), "--overwrite"]
        cases = {"encode_batch (ceiling)": lambda: tok.encode_batch(docs)}
        if hasattr(tok, "encode_batch_fast"):
            cases["encode_batch_fast"] = lambda: tok.encode_batch_fast(docs)
        cases["prepare --tokenizer"] = lambda: run_prepare(tmp / "tokenizer.json")
        cases["prepare (bytes)"] = lambda: run_prepare(None)
        cases["python -m fmoe.data (CLI)"] = lambda: subprocess.run(cli, check=True, stdout=subprocess.DEVNULL,
                                                                     stderr=subprocess.DEVNULL, cwd=ROOT)
        times = {name: [] for name in cases}
        tokens = 0
        for _ in range(args.repeat):  # interleaved: a passing load slows every case alike
            for name, fn in cases.items():
                times[name].append(timed(fn))
                if name == "prepare --tokenizer":
                    tokens = json.loads((tmp / "out" / "meta.json").read_text())["tokens"]

    rows = [(name, *min(t)) for name, t in times.items()]
    for name, wall, cpu in rows:
        print(f"{name:26s} {wall:7.2f} s  {nbytes / 1e6 / wall:7.2f} MB/s   (CPU {cpu:6.2f} s)")
    ceiling, ours = rows[0][1], next(w for n, w, _ in rows if n == "prepare --tokenizer")
    print(f"prepare --tokenizer / encode_batch: {ceiling / ours:.2f}x  ({tokens} tokens, "
          f"{nbytes / tokens:.2f} bytes/token)")


if __name__ == "__main__":
    main()
