"""Where the GPU waits for the host, from a step's Chrome trace.

    python benchmarks/step_profile.py --shapes qwen3-moe-medium --trace /tmp/traces
    python benchmarks/trace_gaps.py /tmp/traces/qwen3-moe-medium.json [--top 15]

An idle gap is time between two kernels (memcpy and memset included) on the GPU. Each
gap is charged to what the host was doing when it launched the kernel that ends the gap:
the fmoe program action (``fmoe forward layers.N.attn``: the executor names its actions
while a profiler records; layer numbers and microbatches folded) and the innermost CPU
op. Also prints the host time spent in each kind of action, and the GPU's busy time by
kind of kernel (GEMMs, attention, collectives, Triton, copies, the rest) with the costliest
kernels. The profiler's own host
overhead inflates every host figure; compare the gaps between runs, not with a timed step.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re


def fold(name: str) -> str:
    """``fmoe forward layers.3.attn mb1`` -> ``fmoe forward layers.N.attn``."""
    return re.sub(r" mb\d+$", "", re.sub(r"layers\.\d+", "layers.N", name))


class Spans:
    """Host ranges sorted by start; ``at(ts)`` is the innermost one covering ``ts``."""

    def __init__(self, events: list):
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def at(self, ts: float, look_back: int = 400):
        i = bisect.bisect_right(self.starts, ts) - 1
        for j in range(i, max(i - look_back, -1), -1):  # the latest start still open at ts
            e = self.events[j]
            if e["ts"] + e.get("dur", 0) >= ts:
                return e
        return None


KERNEL_KINDS = (("collective", r"nccl"), ("attention", r"flash|fmha|attention|cudnn"),
                ("gemm", r"gemm|cutlass|xmma|nvjet|wgmma"), ("triton", r"^triton"),
                ("copy/memset", r"memcpy|memset"))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, low)), "other (aten)")


def busy_by_kind(kernels: list, top: int) -> None:
    """Kernel time by kind and the costliest kernels (overlapping streams both count)."""
    kinds, names = collections.Counter(), collections.Counter()
    for k in kernels:
        kinds[kernel_kind(k["name"])] += k["dur"]
        names[k["name"][:70]] += k["dur"]
    total = sum(kinds.values())
    print(f"GPU ms by kind of kernel ({total / 1e3:.1f} ms in all; streams overlap):")
    for name, us in kinds.most_common():
        print(f"  {us / 1e3:8.2f}  {100 * us / total:4.1f}%  {name}")
    print("GPU ms, the costliest kernels:")
    for name, us in names.most_common(top):
        print(f"  {us / 1e3:8.2f}  {name}")


def analyse(path: str, top: int, min_gap_us: float = 5.0) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        raise SystemExit(f"{path}: no GPU events (was the trace recorded with CUDA activity?)")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    actions = Spans([e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("fmoe ")])
    ops = Spans([e for e in events if e.get("cat") == "cpu_op"])

    by_action, by_op, idle = collections.Counter(), collections.Counter(), 0.0
    end = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        gap = k["ts"] - end
        if gap > min_gap_us:
            idle += gap
            launch = launches.get(k.get("args", {}).get("correlation"))
            ts = launch["ts"] if launch else k["ts"]  # Triton launches carry no runtime event
            action, op = actions.at(ts), ops.at(ts)
            by_action[fold(action["name"]) if action else "(outside the program)"] += gap
            by_op[op["name"][:60] if op else "?"] += gap
        end = max(end, k["ts"] + k["dur"])
    span = end - kernels[0]["ts"]
    print(f"{path}: GPU span {span / 1e3:.1f} ms, idle gaps (> {min_gap_us:g} us) {idle / 1e3:.1f} ms")
    print("idle ms, by the program action launching the kernel after the gap:")
    for name, us in by_action.most_common(top):
        print(f"  {us / 1e3:8.2f}  {name}")
    print("idle ms, by the CPU op launching it:")
    for name, us in by_op.most_common(top):
        print(f"  {us / 1e3:8.2f}  {name}")
    host, count = collections.Counter(), collections.Counter()
    for a in actions.events:
        host[fold(a["name"])] += a.get("dur", 0)
        count[fold(a["name"])] += 1
    print("host ms per kind of action (count):")
    for name, us in host.most_common(top):
        print(f"  {us / 1e3:8.2f}  x{count[name]:3d}  {name}")
    busy_by_kind(kernels, top)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="Chrome trace JSON files (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    for path in args.traces:
        analyse(path, args.top)


if __name__ == "__main__":
    main()
