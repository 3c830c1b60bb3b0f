"""The CPU matmul for quantized weights (kernels/qmm_cpu.py) against torch's weight-only kernels and a dense
bfloat16 `linear`, by rows; then a GGUF target's forward of 1, 2, 3, 5, 9, 17 tokens on top of a prefix, as
loaded (docs/benchmarks/qmm-cpu.md).

Part 1, one layer at a time (shapes N x K of Qwen2.5-1.5B by default, each in the type its Q4_K_M file holds):
ours on the GGUF blocks as stored, `_weight_int4pack_mm_for_cpu` (int4, groups of 32), `_weight_int8pack_mm`
(int8) and bfloat16 `F.linear` on random weights of the same shape, bfloat16 activations for torch's kernels.
Every call reads a different copy of the weight, cycling through enough copies to exceed 64 MB, so that the
weight streams from memory as it does in a model's forward (not from the last-level cache); the copies are
interleaved, the methods rotate every round, medians with their spread. Part 2: `specdec.timing.time_forward`
on the target as `load_model` gives it (no flags), interleaved over T.

    python -m bench.qmm_cpu --threads 2 --target .cache/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --output bench/results/qmm_cpu.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import (comma_ints, command_line, fmt_spread, interleave, log, machine, machine_line, md_table,
                          pyplot, rss_mib, save_figure, write_json)
from specdec.kernels import qmm_cpu
from specdec.models import load_model
from specdec.models.ggml_blocks import F16_FIELDS, TYPES, decompose, pack
from specdec.timing import PrefilledCache, random_tokens

# (name, N, K, block type) of Qwen2.5-1.5B-Instruct's Q4_K_M file
QWEN_SHAPES = [("q/o proj", 1536, 1536, "Q4_K"), ("k/v proj", 256, 1536, "Q4_K"), ("gate/up", 8960, 1536, "Q4_K"),
               ("down", 1536, 8960, "Q6_K"), ("head", 151936, 1536, "Q6_K")]
METHODS = ("ours", "torch int4", "torch int8", "dense bf16")
STREAM_BYTES = 64 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads (the kernel's too)")
    p.add_argument("--rows", type=comma_ints, default="1,2,4,8,16,32,64", help="comma-separated M of part 1")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds per (shape, rows) in part 1")
    p.add_argument("--skip-layers", action="store_true", help="skip part 1")
    p.add_argument("--target", default=None, help="a quantized GGUF file for part 2 (skipped without one)")
    p.add_argument("--tokens", type=comma_ints, default="1,2,3,5,9,17", help="new tokens per forward in part 2")
    p.add_argument("--prefix", type=int, default=200, help="tokens already in the cache in part 2")
    p.add_argument("--forward-repeats", type=int, default=7, help="timed rounds per T in part 2")
    p.add_argument("--output", default=None, help="write every measurement as JSON here")
    p.add_argument("--plot", default=None, help="draw part 1 (time by rows, each shape) to this PNG")
    return p.parse_args(argv)


def random_packed(qtype: str, n: int, k: int, seed: int):
    """A random GGUF tensor of `qtype` (random codes, moderate float16 scales), packed for the kernel."""
    bt = TYPES[qtype]
    rng = np.random.default_rng(seed)
    nb = k // bt.superblock
    raw = rng.integers(0, 256, (n, nb, bt.block_bytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.0, (n, nb)) * 2.0 ** -10).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    for at in F16_FIELDS[qtype]:
        raw[..., at: at + 2] = d
    return pack(decompose(raw.reshape(n, -1), qtype), qtype)


def copies_for(nbytes: int) -> int:
    return max(1, -(-STREAM_BYTES // nbytes))


def layer_rows(name: str, n: int, k: int, qtype: str, args) -> list[dict]:
    """Part 1 for one shape: {method: median ms} per row count."""
    log("layers", f"{name} {n} x {k} ({qtype}): building weight copies")
    tile_bytes = random_packed(qtype, 16, k, 0).nbytes  # one 16-row tile's
    ours = [random_packed(qtype, n, k, seed) for seed in range(copies_for(tile_bytes * n // 16))]
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    int4 = [(torch._convert_weight_to_int4pack_for_cpu(codes, 2), torch.randn(k // 32, n, 2).bfloat16())
            for _ in range(copies_for(n * k // 2))]
    int8 = [(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16())
            for _ in range(copies_for(n * k))]
    dense = [torch.randn(n, k).bfloat16() for _ in range(copies_for(2 * n * k))]
    out = []
    for m in args.rows:
        x = torch.randn(m, k)
        xb = x.bfloat16()
        turn = {method: 0 for method in METHODS}

        def cycle(method, pool, call):
            def run():
                item = pool[turn[method] % len(pool)]
                turn[method] += 1
                t0 = time.perf_counter()
                call(item)
                return time.perf_counter() - t0
            return run

        calls = {"ours": cycle("ours", ours, lambda p: qmm_cpu.qmm(x, p)),
                 "torch int4": cycle("torch int4", int4,
                                     lambda w: torch._weight_int4pack_mm_for_cpu(xb, w[0], 32, w[1])),
                 "torch int8": cycle("torch int8", int8, lambda w: torch._weight_int8pack_mm(xb, w[0], w[1])),
                 "dense bf16": cycle("dense bf16", dense, lambda w: F.linear(xb, w))}
        times = interleave(calls, args.repeats, warmup=2)
        out.append({"shape": name, "n": n, "k": k, "qtype": qtype, "rows": m,
                    **{method: [1e3 * t for t in times[method]] for method in METHODS}})
        log("layers", f"{name} M={m}: " + ", ".join(f"{method} {statistics.median(times[method]) * 1e3:.3f} ms"
                                                     for method in METHODS))
    return out


def layers_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        one = next(o for o in results if o["shape"] == r["shape"] and o["rows"] == 1)
        cells = [f"{r['shape']} {r['n']}x{r['k']} {r['qtype']}", str(r["rows"])]
        for method in METHODS:
            med = statistics.median(r[method])
            cells.append(f"{fmt_spread(r[method], '{:.3f}')} ({med / statistics.median(one[method]):.2f}x)")
        rows.append(cells)
    return md_table(["shape", "rows", *[f"{m} ms (x 1 row)" for m in METHODS]], rows, right=range(1, 6))


def plot_layers(results: list[dict], path: str, title: str) -> str:
    """Part 1 as one panel a shape: median ms against rows, each method, both axes logarithmic."""
    plt = pyplot()
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in results if r["shape"] == shape]
        for method in METHODS:
            ax.plot([r["rows"] for r in mine], [statistics.median(r[method]) for r in mine], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} {mine[0]['n']}x{mine[0]['k']} {mine[0]['qtype']}", fontsize=9)
        ax.set_xlabel("rows (M)")
    axes[0][0].set_ylabel("ms per call")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def forward_rows(args) -> tuple[list[dict], dict]:
    """Part 2: ({tokens, ms} per T, the process's resident memory before and after loading the target)."""
    before = rss_mib()
    model = load_model(args.target)
    memory = {"rss_before_mib": before, "rss_after_mib": rss_mib(), "file_mib": os.path.getsize(args.target) / 2**20,
              "weights_mib": sum(b.numel() * b.element_size() for b in (*model.buffers(), *model.parameters())) / 2**20}
    g = torch.Generator().manual_seed(0)
    prefix = random_tokens(1, args.prefix, model.vocab_size, g, "cpu")
    cache = PrefilledCache(model, prefix, args.prefix + max(args.tokens) + 1)
    xs = {t: random_tokens(1, t, model.vocab_size, g, "cpu") for t in args.tokens}
    with torch.no_grad():
        times = interleave({t: (lambda t=t: cache.time(xs[t])) for t in args.tokens}, args.forward_repeats, warmup=1)
    return [{"tokens": t, "ms": [1e3 * s for s in times[t]]} for t in args.tokens], memory


def forward_table(results: list[dict]) -> str:
    one = statistics.median(results[0]["ms"])
    return md_table(["new tokens", "forward ms", "x 1 token"],
                    [[str(r["tokens"]), fmt_spread(r["ms"]), f"{statistics.median(r['ms']) / one:.2f}"]
                     for r in results],
                    right=(0, 1, 2))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not qmm_cpu.available():
        raise SystemExit(f"bench.qmm_cpu: {qmm_cpu.unavailable_reason()}")
    record = {"command": command_line("bench.qmm_cpu", argv), "machine": machine(), "threads": args.threads,
              "isa": qmm_cpu.host_isa()}
    print(f"{machine_line()}; {args.threads} threads; kernel: {qmm_cpu.host_isa()}\n`{record['command']}`\n")
    with torch.no_grad():
        if not args.skip_layers:
            record["layers"] = [r for name, n, k, qtype in QWEN_SHAPES for r in layer_rows(name, n, k, qtype, args)]
            print(layers_table(record["layers"]) + "\n")
            if args.plot:
                print(f"plot: {plot_layers(record['layers'], args.plot, machine_line())}\n")
        if args.target:
            record["target"] = os.path.basename(args.target)
            record["forward"], memory = forward_rows(args)
            record["memory"] = memory
            print(f"{record['target']} as loaded: resident memory {memory['rss_before_mib']:.0f} MiB before loading, "
                  f"{memory['rss_after_mib']:.0f} after (+{memory['rss_after_mib'] - memory['rss_before_mib']:.0f}: "
                  f"{(memory['rss_after_mib'] - memory['rss_before_mib']) / memory['file_mib']:.2f}x the file's "
                  f"{memory['file_mib']:.0f}; weights {memory['weights_mib']:.0f} MiB)\n")
            print(f"forward on a {args.prefix}-token prefix:\n")
            print(forward_table(record["forward"]))
    if args.output:
        write_json(args.output, record)


if __name__ == "__main__":
    main()
