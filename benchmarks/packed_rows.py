"""Packed documents against plain rows: the step's tokens/s and peak memory on one GPU.

    python benchmarks/packed_rows.py                              # coarse and qwen3-moe-medium
    python benchmarks/packed_rows.py --shapes coarse --docs 10 --steps 10

Per shape (``vs_peer.py``'s), compiled (``Plan(compile=True)``), bf16, a batch of
``--batch`` x ``--seq`` tokens, one step = ``fmoe.step`` + fused AdamW (donated):

- ``unpacked``: ``{"tokens"}``, plain causal attention (SDPA's flash kernel);
- ``packed, flex``: the same ids with ``segments`` cutting each row into ``--docs``
  documents of random lengths and a ``loss_mask`` keeping ~half of the targets:
  FlexAttention with the document block mask, RoPE per document;
- ``packed, sdpa mask`` (``--with-dense-mask``): the same batch through SDPA with the
  exact ``[B, 1, S, S]`` boolean mask (the CPU path), for reference.

Prints the median step, tokens/s, the ratio to ``unpacked`` and peak memory.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

import torch

import fmoe
from fsdp_step import lm_parser
from vs_peer import SHAPES


def parse():
    ap = lm_parser(microbatches=1)
    ap.add_argument("--shapes", nargs="+", default=["coarse", "qwen3-moe-medium"], choices=tuple(SHAPES))
    ap.add_argument("--docs", type=int, default=10, help="documents per row")
    ap.add_argument("--with-dense-mask", action="store_true", help="also the SDPA [S, S] mask path")
    ap.set_defaults(warmup=3, steps=10)
    return ap.parse_args()


def packed_batch(tokens_BS1: torch.Tensor, docs: int, seed: int = 0) -> dict:
    """``segments``: ``docs`` documents per row, cut at random positions; ``loss_mask``: ~half."""
    g = torch.Generator().manual_seed(seed)
    B, S1 = tokens_BS1.shape
    cuts = torch.zeros(B, S1, dtype=torch.long)
    for b in range(B):
        at = torch.randperm(S1 - 1, generator=g)[:docs - 1] + 1
        cuts[b, at] = 1
    mask = torch.rand(B, S1 - 1, generator=g) < 0.5
    return {"tokens": tokens_BS1, "segments": cuts.cumsum(1).to(tokens_BS1.device),
            "loss_mask": mask.to(tokens_BS1.device)}


def measure(params, batch, plan, args) -> tuple[float, float]:
    """Median seconds of step + update, and peak GiB."""
    opt = fmoe.adamw(lr=1e-4, weight_decay=0.1, plan=plan, fused=True, donate=True)
    state = opt.init(params)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fmoe.step(params, batch, plan)
        params, state = opt.update(out.grads, state, params)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def main():
    args = parse()
    torch.cuda.set_device(0)
    rows = []
    for shape in args.shapes:
        cfg = fmoe.ModelConfig(**SHAPES[shape]()).replace(aux_loss_coef=0.0)
        plan = fmoe.Plan(model=cfg, dtype="bfloat16", device="cuda", compile=True, microbatches=args.microbatches)
        tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1),
                               generator=torch.Generator().manual_seed(0)).cuda()
        modes = {"unpacked": {"tokens": tokens}, "packed, flex": packed_batch(tokens, args.docs)}
        if args.with_dense_mask:
            modes["packed, sdpa mask"] = modes["packed, flex"]
        base = None
        for name, batch in modes.items():
            params = fmoe.init(plan, seed=0)
            dense = mock.patch("fmoe.layers.attention._document_block_mask", lambda ids: None) \
                if name == "packed, sdpa mask" else contextlib.nullcontext()
            with dense:
                step_s, peak = measure(params, batch, plan, args)
            del params
            torch.cuda.empty_cache()
            tok_s = args.batch * args.seq / step_s
            base = base or (tok_s, peak)
            rows.append((shape, name, step_s * 1e3, tok_s, tok_s / base[0], peak, peak / base[1]))
            print(f"  done {shape} {name}: {step_s * 1e3:.1f} ms", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.batch} x {args.seq} tokens, "
          f"{args.docs} documents a packed row, compiled, bf16, fused AdamW; median of {args.steps} steps")
    print(f"{'shape':<18}{'mode':<20}{'ms/step':>9}{'tok/s':>10}{'x unpacked':>12}{'peak GiB':>10}{'x peak':>8}")
    for shape, name, ms, tok_s, ratio, peak, peak_ratio in rows:
        print(f"{shape:<18}{name:<20}{ms:>9.1f}{tok_s:>10.0f}{ratio:>12.3f}{peak:>10.2f}{peak_ratio:>8.3f}")


if __name__ == "__main__":
    main()
