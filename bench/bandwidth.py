"""DRAM read bandwidth, measured the way a decode step reads its weights: `torch.sum` over a float32 tensor far
larger than the caches. bench/peers.py calls `read_bandwidth()` beside its timings.

    python -m bench.bandwidth --mib 1024 --threads 2 --repeats 15
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def read_bandwidth(mib: int = 512, repeats: int = 9) -> dict:
    """Read bandwidth in GB/s of `torch.sum` over `mib` MiB of float32: {"median", "min", "max", "bytes"}.
    One untimed pass first (page faults, thread start-up); then `repeats` timed passes."""
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "bytes": x.numel() * 4,
            "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="DRAM read bandwidth probe: torch.sum over a large float32 tensor.")
    p.add_argument("--mib", type=int, default=512, help="tensor size in MiB (default 512: far beyond the caches)")
    p.add_argument("--repeats", type=int, default=9, help="timed passes (default 9); median and min-max reported")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.mib < 1 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        p.error("--mib, --repeats and --threads must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    r = read_bandwidth(args.mib, args.repeats)
    print(f"read bandwidth: {r['median']:.2f} GB/s median ({r['min']:.2f}-{r['max']:.2f}) over {args.repeats} "
          f"sums of {args.mib} MiB float32, {r['threads']} thread(s)")


if __name__ == "__main__":
    main()
