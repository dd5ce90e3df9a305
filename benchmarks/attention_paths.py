"""The attention kernels ``attend`` can take for plain rows, forward + backward, timed on one GPU.

    python benchmarks/attention_paths.py                      # both cases at S = 4096
    python benchmarks/attention_paths.py --case mla --seq 8192 --batch 1

bf16, ``--batch`` rows of ``--seq`` positions, median over ``--steps`` of one
forward and backward (CUDA events, after ``--warmup``):

- ``mla``: q/k heads of 192 features, v heads of 128 (DeepSeek-V3's multi-head
  latent attention), 16 heads, plain causal:
  ``padded flash`` (v zero-padded to 192, SDPA's flash kernel,
  the output cut back), ``sdpa as is`` (what ``attend`` runs, v as it is: cuDNN first, else the
  memory-efficient kernel), ``sdpa cudnn`` (forced;
  skipped where cuDNN refuses the shape), ``flex causal`` (compiled FlexAttention
  under the cached causal block mask, value heads of 128 natively);
- ``gpt-oss``: heads of 64 features, 64 query heads over 8 kv heads, sinks and a
  window of 128: ``flex rows`` (what ``attend`` runs on CUDA) against
  ``written out`` (the ``[B, H, S, S]`` scores of the CPU's path; skipped past
  ``--max-dense-seq``) and ``sdpa causal`` (no sinks, no window: a lower bound).

Prints each variant's median milliseconds and its ratio to the first.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

attention = importlib.import_module("fmoe.layers.attention")  # also the name of a function in fmoe.layers
from fmoe.layers import block_masks  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", default=["mla", "gpt-oss"], choices=("mla", "gpt-oss"))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-dense-seq", type=int, default=2048,
                    help="longest S for the written-out scores (fp32 [B, 64, S, S] several times over)")
    return ap.parse_args()


def time_ms(fn, inputs, args) -> float:
    """Median milliseconds of ``fn(*inputs)`` and the backward of its sum."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    times = []
    for i in range(args.warmup + args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*leaves).float().sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def mla_variants(S: int):
    """``name -> fn(q, k, v)`` of plain causal attention with narrower value heads."""
    flex = attention._compiled_flex()

    def padded(q, k, v):
        return attention._sdpa(q, k, v, None, False, None)

    def as_is(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def flex_causal(q, k, v):
        return flex(q, k, v, block_mask=block_masks.row_block_mask(S, 0, q.device))

    return {"padded flash": padded, "sdpa as is": as_is, "sdpa cudnn": cudnn, "flex causal": flex_causal}


def gpt_oss_variants(S: int, window: int, dense: bool):
    """``name -> fn(q, k, v, sinks)`` of GQA attention with sinks and a window."""
    def flex_rows(q, k, v, sinks):
        return attention.attend(q, k, v, window=window, sinks_H=sinks)

    def written_out(q, k, v, sinks):
        mask = attention._mask(S, S, 0, None, window, q.device)
        o_BHSe, lse_BHS = attention._explicit_attend(q, k, v, mask, None)
        return attention.with_sinks(o_BHSe, lse_BHS, sinks)

    def sdpa_causal(q, k, v, sinks):
        return attention.attend(q, k, v)

    out = {"flex rows": flex_rows}
    if dense:
        out["written out"] = written_out
    out["sdpa causal"] = sdpa_causal
    return out


def report(title: str, variants: dict, inputs, args):
    print(title)
    first = None
    for name, fn in variants.items():
        try:
            ms = time_ms(fn, inputs, args)
        except RuntimeError as e:  # a kernel refusing the shape (cuDNN's limits)
            print(f"  {name:14s} skipped: {str(e).splitlines()[0][:100]}")
            continue
        first = first or ms
        print(f"  {name:14s} {ms:8.3f} ms  x{ms / first:.2f}")


def main():
    args = parse()
    B, S, bf16 = args.batch, args.seq, dict(device="cuda", dtype=torch.bfloat16)
    if "mla" in args.case:
        q, k, v = (torch.randn(B, 16, S, d, **bf16) for d in (192, 192, 128))
        report(f"mla: B={B} S={S} H=16 d=192 e=128", mla_variants(S), (q, k, v), args)
    if "gpt-oss" in args.case:
        q, k, v = (torch.randn(B, h, S, 64, **bf16) for h in (64, 8, 8))
        sinks = torch.randn(64, device="cuda")
        report(f"gpt-oss: B={B} S={S} H=64 K=8 d=64 window=128 sinks",
               gpt_oss_variants(S, 128, S <= args.max_dense_seq), (q, k, v, sinks), args)


if __name__ == "__main__":
    main()
