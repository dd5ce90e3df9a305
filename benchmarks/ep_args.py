"""Command-line flags shared by the expert-parallel benchmarks (the issue's layer config)."""

import argparse


def ep_layer_parser(steps: int) -> argparse.ArgumentParser:
    """D=2048, E=16 experts of F=1408, top-4, 4 layers, 8192 tokens per GPU per microbatch."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per microbatch")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=steps)
    return ap
