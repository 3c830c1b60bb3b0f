"""Packed float32 linear weights on the CPU (`LLM(packed_weights=...)`): one linear layer, `F.linear` against
oneDNN on a weight packed once, and the default target's forward with packing off and on, interleaved
(docs/benchmarks/packed-weights.md). Prints markdown tables.

    python -m bench.packed_linear --threads 2 --repeats 300
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from bench.common import REPO, comma_ints, command_line, fmt_spread, interleave, machine_line, md_table, stopwatch
from specdec.models import load_model, numerics
from specdec.timing import time_forward

TARGET = os.path.join(REPO, "specdec", "assets", "default_pair", "target")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=300, help="timed calls per layer shape and implementation")
    p.add_argument("--forward-repeats", type=int, default=30, help="timed forwards per (B, T, packing)")
    p.add_argument("--in-features", type=int, default=384, help="K of the single layer")
    p.add_argument("--out-features", type=int, default=1536, help="N of the single layer")
    p.add_argument("--rows", type=comma_ints, default="1,2,3,4,6,8,16,48", help="comma-separated M of the single layer")
    p.add_argument("--target", default=TARGET, help="checkpoint for part 2")
    return p.parse_args(argv)


def layer_table(args) -> str:
    weight = torch.randn(args.out_features, args.in_features)  # [N, K]
    packed = numerics.pack_weight(weight)
    rows = []
    for m in args.rows:
        x = torch.randn(m, args.in_features)  # [M, K]
        times = interleave({"mkl": stopwatch(lambda: F.linear(x, weight)),
                            "packed": stopwatch(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                                            [], ""))},
                           args.repeats, warmup=20)
        a, b = (1e6 * statistics.median(times[name]) for name in ("mkl", "packed"))
        rows.append([m, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x"])
    return md_table(["M", "F.linear (us)", "packed oneDNN (us)", "F.linear / packed"], rows, right=range(4))


def forward_table(args) -> str:
    model = load_model(args.target, dtype="float32")
    times: dict = {}
    shapes = [(1, 1), (1, 2), (1, 6), (8, 1), (8, 6)]
    for _ in range(args.forward_repeats):
        for packed in (False, True):
            model.packed_linear = packed
            for B, T in shapes:
                t, _ = time_forward(model, B, T, 64, 1)
                times.setdefault((B, T, packed), []).append(t * 1e3)
    rows = [[B, T, fmt_spread(times[B, T, False]), fmt_spread(times[B, T, True]),
             f"{statistics.median(times[B, T, False]) / statistics.median(times[B, T, True]):.2f}x"] for B, T in shapes]
    return md_table(["B", "T", "unpacked (ms)", "packed (ms)", "unpacked / packed"], rows, right=range(5))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if numerics.pack_weight(torch.zeros(8, 8)) is None:
        sys.exit("this torch build has no oneDNN packed linear on this CPU: nothing to compare")
    print(f"`{command_line('bench.packed_linear', argv)}`; float32; {machine_line()}\n")
    print(f"One linear layer, K = {args.in_features}, N = {args.out_features}, median of {args.repeats} calls:\n")
    print(layer_table(args))
    print(f"\nTarget forward ({os.path.relpath(args.target, REPO)}), T new tokens per row after 64, median "
          f"(min-max) of {args.forward_repeats}:\n")
    print(forward_table(args))


if __name__ == "__main__":
    main()
