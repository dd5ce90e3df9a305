"""The experts' weights cast to FP8 per column: inductor's compiled torch code against
``fp8_kernels.quantize_columns_KN`` (the same bits), on the coarse and fine shapes.

    python benchmarks/quantize_columns.py

Each ``[E, K, N]`` weight (fc1, fc2 of ``vs_peer.py``'s shapes) is cast as ``fp8._quantize``
casts it eager; CUDA events, median of 50 calls after 5.
"""

from __future__ import annotations

import statistics

import torch

from fmoe.layers import fp8_kernels
from fmoe.layers.fp8 import E4M3_MAX, TINY, _compiled, quantize_columns

SHAPES = {"coarse fc1": (16, 2048, 2816), "coarse fc2": (16, 1408, 2048),
          "fine fc1": (64, 2048, 1408), "fine fc2": (64, 704, 2048)}


def median_ms(f, x: torch.Tensor, calls: int = 50) -> float:
    for _ in range(5):
        f(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    if not torch.cuda.is_available():
        raise SystemExit("quantize_columns.py: needs a CUDA GPU (the kernels are Triton's)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| weight `[E, K, N]` | inductor | Triton | speed-up |")
    print("| --- | ---: | ---: | ---: |")
    for name, shape in SHAPES.items():
        x = (0.02 * torch.randn(shape, device="cuda")).bfloat16()
        compiled = median_ms(_compiled(quantize_columns), x)
        triton = median_ms(lambda w: fp8_kernels.quantize_columns_KN(w, E4M3_MAX, TINY), x)
        print(f"| {name} `{list(shape)}` | {compiled:.3f} ms | {triton:.3f} ms | {compiled / triton:.2f}x |")


if __name__ == "__main__":
    main()
