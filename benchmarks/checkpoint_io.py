"""How fast ``fmoe.save`` writes and ``fmoe.load`` reads back a checkpoint, by writer threads.

    python benchmarks/checkpoint_io.py                      # ~0.5B params into /dev/shm, 1 and 4 threads
    python benchmarks/checkpoint_io.py --dim 1024 --threads 1 2 --dir /tmp

One process, on the CPU: the model's fp32 params and AdamW state (fp32 moments, so 12
bytes a parameter) saved with ``--threads`` writer threads and as many hashing threads
(what ``io_threads()`` gives a rank: its share of the cores, at most 8; 1 is how every
save ran before). The save's time includes its checksums of the
written files. The load is verified, so it reads every file once more for the checksums.
Each figure is the median of ``--repeats`` runs, and each run starts from a fresh
directory.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import fmoe
from fmoe.checkpoint import api as checkpoint_api
from fmoe.checkpoint import files as checkpoint_files
from fmoe.params import param_count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    cfg = fmoe.ModelConfig(vocab=32000, dim=args.dim, layers=args.layers, heads=8, experts=args.experts, topk=2,
                           ffn=2 * args.dim)
    plan = fmoe.Plan(model=cfg)
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=1e-3)
    state = opt.init(params)
    gib = 12 * param_count(cfg) / 2**30
    print(f"{param_count(cfg) / 1e9:.2f}B params, {gib:.2f} GiB of params and moments, into {args.dir}")
    print("| writer threads | save s | save GiB/s | load s (verified) | load GiB/s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for threads in args.threads:
        # what a rank with that share of the cores gets, for its writes and its hashing
        checkpoint_api.io_threads = checkpoint_files.io_threads = lambda threads=threads: threads
        saves, loads = [], []
        for _ in range(args.repeats):
            path = Path(args.dir) / "fmoe-checkpoint-io"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            fmoe.save(path, plan, params, opt_state=state, step=1)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fmoe.load(path, plan)
            loads.append(time.perf_counter() - t0)
            shutil.rmtree(path, ignore_errors=True)
        save, load = statistics.median(saves), statistics.median(loads)
        print(f"| {threads} | {save:.2f} | {gib / save:.2f} | {load:.2f} | {gib / load:.2f} |")


if __name__ == "__main__":
    main()
