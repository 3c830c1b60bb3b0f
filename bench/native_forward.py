"""The native CPU forward (issue 55; models/native.py, kernels/cpu/forward.cpp) on a quantized GGUF file: decode and
prefill against llama.cpp's own `llama-bench` on the same file, the forward of T new tokens on a 200-token prefix
before (the torch forward, `native_forward=False`) and after, the split of a decode step (the native call's layers
and head, Python around it, sampling), the ops a decode step dispatches from Python per layer, the weights read
against the machine's read bandwidth, and resident memory against the file.

    python -m bench.native_forward --target .cache/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --threads 2 \\
        --llama-bench PATH/llama-bench --output bench/results/native-qwen.json --plot docs/img/native-forward-qwen.png

Every comparison is interleaved (rounds rotate the methods), medians with min-max; `llama-bench` runs `-p 0 -n 64`
(decode: 64 tokens from an empty context) and `-p 200 -n 0` (prefill), ours the same shapes (`forward` of one token
64 times from an empty cache; of 200 tokens), each a fresh process's median of its own repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from bench.common import (comma_ints, fmt_spread, interleave, log, machine, machine_line, md_table, pyplot,
                          rss_mib, save_figure, spread, write_json, HelpFormatter)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", required=True, help="a quantized GGUF file (loaded as stored)")
    p.add_argument("--threads", type=comma_ints, default="2", help="comma-separated thread counts to run at")
    p.add_argument("--tokens", type=comma_ints, default="1,2,3,5,9,17",
                   help="new tokens per forward for the forward-by-T part")
    p.add_argument("--prefix", type=int, default=200, help="tokens already cached in the forward-by-T part")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds of every part")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens of the decode part (llama-bench -n)")
    p.add_argument("--prefill-tokens", type=int, default=200, help="tokens of the prefill part (llama-bench -p)")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary (built from the llama-cpp-python 0.3.36 sdist's "
                        "vendor/llama.cpp, -DGGML_NATIVE=ON -DLLAMA_CURL=OFF); none: ours alone")
    p.add_argument("--llama-args", default="", help="extra llama-bench arguments (e.g. '--repack 0')")
    p.add_argument("--skip-before", action="store_true", help="skip the torch forward (the 'before' column)")
    p.add_argument("--output", default=None, help="write every measurement as JSON here")
    p.add_argument("--plot", default=None, help="draw ms by T, before and after, to this PNG")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.prefix < 1 or args.decode_tokens < 1 or args.prefill_tokens < 1:
        p.error("--repeats, --prefix, --decode-tokens and --prefill-tokens must be >= 1")
    if args.llama_bench and not os.access(args.llama_bench, os.X_OK):
        p.error(f"--llama-bench {args.llama_bench}: not an executable file")
    return args


# ------------------------------------------------------------------------------------------------ ours
def weights_read_per_token(model) -> int:
    """Bytes of quantized weights a decode step reads: every linear layer and the head (not the embedding table,
    of which a step reads one row, unless it is the tied head)."""
    from specdec.models.quant import BlockLinear, QuantEmbedding

    layers = {id(m): m for m in model.modules() if isinstance(m, BlockLinear)}
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding) and embed.table is not model.lm_head:
        layers.pop(id(embed.table), None)
    return sum(m.weight_bytes for m in layers.values())


def time_decode(model, tokens: int, seed: int) -> float:
    """Tokens/s of `tokens` one-token forwards from an empty cache (llama-bench's tg: logits of the last token)."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(1, tokens + 1)
    ids = torch.randint(3, model.vocab_size, (tokens, 1, 1), generator=g)
    start = time.perf_counter()
    for t in range(tokens):
        model(ids[t], cache, logits="last")
    return tokens / (time.perf_counter() - start)


def time_prefill(model, tokens: int, seed: int) -> float:
    """Tokens/s of one forward of `tokens` tokens from an empty cache (llama-bench's pp)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.vocab_size, (1, tokens), generator=g)
    cache = model.new_cache(1, tokens)
    start = time.perf_counter()
    model(ids, cache, logits="last")
    return tokens / (time.perf_counter() - start)


def forward_by_t(model, tokens: list[int], prefix: int, repeats: int, before: bool) -> dict:
    """{(path, T): [ms per round]} of a forward of T tokens (every token's logits: a verify) on a `prefix`-token
    cache, the native and (with `before`) the torch forward interleaved."""
    from specdec.timing import PrefilledCache, random_tokens

    g = torch.Generator().manual_seed(0)
    vocab = model.vocab_size
    cache = PrefilledCache(model, random_tokens(1, prefix, vocab, g, "cpu"), prefix + max(tokens) + 1)
    inputs = {T: random_tokens(1, T, vocab, g, "cpu") for T in tokens}

    def call(native: bool, T: int):
        def run():
            model.native_forward = native
            ms = cache.time(inputs[T], "all") * 1000
            return ms
        return run

    calls = {("native", T): call(True, T) for T in tokens}
    if before:
        calls.update({("torch", T): call(False, T) for T in tokens})
    results = interleave(calls, repeats)
    model.native_forward = True
    return results


def step_split(model, prefix: int, repeats: int) -> dict:
    """A decode step on a `prefix`-token cache, split: the native call's embedding, layers and head (its own
    clock), Python around it (the rest of the forward's wall time), and sampling its logits (greedy argmax; a
    temperature / top-p draw through specdec.sampling)."""
    from specdec.sampling import process_logits, sample_race
    from specdec.timing import PrefilledCache, random_tokens

    g = torch.Generator().manual_seed(1)
    cache = PrefilledCache(model, random_tokens(1, prefix, model.vocab_size, g, "cpu"), prefix + 2)
    x = random_tokens(1, 1, model.vocab_size, g, "cpu")
    rows = {"wall": [], "embedding": [], "layers": [], "head": [], "python": [], "greedy": [], "sampled": []}
    for _ in range(repeats + 1):
        cache.rewind()
        start = time.perf_counter()
        logits = model(x, cache.cache, logits="last")[:, -1]  # [1, V]
        wall = time.perf_counter() - start
        native = model.native.timings()
        t0 = time.perf_counter()
        logits.argmax(-1)
        greedy = time.perf_counter() - t0
        t0 = time.perf_counter()
        probs = process_logits(logits, torch.tensor([0.8]), torch.tensor([0]), torch.tensor([0.9]))
        sample_race(probs, torch.empty_like(probs).exponential_())
        sampled = time.perf_counter() - t0
        for key, value in (("wall", wall), ("greedy", greedy), ("sampled", sampled), *native.items(),
                           ("python", wall - sum(native.values()))):
            rows[key].append(value * 1000)
    return {k: spread(v[1:]) for k, v in rows.items()}  # the first round warms up


# ---------------------------------------------------------------------------------------------- llama.cpp
def llama_bench(path: str, model: str, threads: int, prompt: int, gen: int, extra: str) -> float:
    """llama-bench's tokens/s for one run (`-r 1`) of `-p prompt -n gen` at `threads`."""
    cmd = [path, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r", "1", "-o", "json",
           *extra.split()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"bench.native_forward: {' '.join(cmd)} failed ({out.returncode}): "
                         f"{out.stderr.strip().splitlines()[-1:] or ''}")
    return float(json.loads(out.stdout)[0]["avg_ts"])


# ------------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    from bench.bandwidth import read_bandwidth
    from bench.op_count import step_ops
    from specdec.kernels import qmm_cpu
    from specdec.models import load_model

    record = {"machine": machine(), "command": "python -m bench.native_forward " + " ".join(argv or os.sys.argv[1:]),
              "target": args.target, "isa": qmm_cpu.host_isa(), "threads": {}}
    print(f"{machine_line(record['machine'])}; kernel: {record['isa']}\n`{record['command']}`\n")
    before_load = rss_mib()
    model = load_model(args.target)
    loaded = rss_mib()
    if model.native is None:
        raise SystemExit(f"bench.native_forward: {args.target} does not run the native forward: {model.native_reason}")
    file_mib = os.path.getsize(args.target) / 2**20
    record["memory"] = {"file_mib": file_mib, "rss_before_mib": before_load, "rss_loaded_mib": loaded,
                        "added_over_file": (loaded - before_load) / file_mib}
    ops = step_ops(model)
    record["ops_per_layer"] = sum(ops.values()) / model.cfg.num_layers
    record["ops"] = dict(ops)
    bytes_per_token = weights_read_per_token(model)
    record["bytes_per_token"] = bytes_per_token
    print(f"memory: the file {file_mib:.0f} MiB; resident {before_load:.0f} MiB before loading, {loaded:.0f} after "
          f"(+{(loaded - before_load) / file_mib:.2f}x the file); a decode step dispatches "
          f"{record['ops_per_layer']:.2f} ops a layer from Python ({dict(ops)}); reads {bytes_per_token / 1e6:.0f} MB\n")

    for threads in args.threads:
        torch.set_num_threads(threads)
        log("native", f"{threads} thread(s)")
        res = record["threads"][threads] = {}
        # decode and prefill, ours and llama.cpp's, interleaved
        calls = {"ours decode": lambda: time_decode(model, args.decode_tokens, 0),
                 "ours prefill": lambda: time_prefill(model, args.prefill_tokens, 0)}
        if args.llama_bench:
            calls["llama.cpp decode"] = lambda: llama_bench(args.llama_bench, args.target, threads, 0,
                                                            args.decode_tokens, args.llama_args)
            calls["llama.cpp prefill"] = lambda: llama_bench(args.llama_bench, args.target, threads,
                                                             args.prefill_tokens, 0, args.llama_args)
        runs = interleave(calls, args.repeats)
        bandwidth = [read_bandwidth(512, 5)["median"] for _ in range(2)]
        res["tokens_per_s"] = {name: spread(v) for name, v in runs.items()}
        res["bandwidth_gbs"] = statistics.median(bandwidth)
        split = res["split_ms"] = step_split(model, args.prefix, args.repeats)
        native_s = (split["layers"]["median"] + split["head"]["median"]) / 1000
        res["roofline_share"] = bytes_per_token / native_s / 1e9 / res["bandwidth_gbs"]
        by_t = forward_by_t(model, args.tokens, args.prefix, args.repeats, not args.skip_before)
        res["forward_ms"] = {f"{path} {T}": spread(v) for (path, T), v in by_t.items()}

        rows = []
        for kind in ("decode", "prefill"):
            ours = res["tokens_per_s"][f"ours {kind}"]
            peer = res["tokens_per_s"].get(f"llama.cpp {kind}")
            ratio = f"{ours['median'] / peer['median']:.2f}x" if peer else "–"
            rows.append([kind, fmt_spread(ours), fmt_spread(peer), ratio])
        print(f"### {threads} thread(s)\n")
        print(md_table(["tokens/s", "specdec (native)", "llama.cpp", "ratio"], rows, right=(1, 2, 3)))
        print(f"\nA decode step on a {args.prefix}-token prefix: wall {fmt_spread(split['wall'], '{:.2f}')} ms = native "
              f"layers {fmt_spread(split['layers'], '{:.2f}')} + head {fmt_spread(split['head'], '{:.2f}')} + "
              f"embedding {fmt_spread(split['embedding'], '{:.3f}')} + Python {fmt_spread(split['python'], '{:.3f}')}; "
              f"sampling its logits: greedy {fmt_spread(split['greedy'], '{:.3f}')} ms, temperature/top-p "
              f"{fmt_spread(split['sampled'], '{:.3f}')} ms. Weights read at "
              f"{bytes_per_token / native_s / 1e9:.1f} GB/s = {res['roofline_share']:.0%} of the "
              f"{res['bandwidth_gbs']:.1f} GB/s bench.bandwidth measures.\n")
        base = {path: res["forward_ms"].get(f"{path} {args.tokens[0]}") for path in ("native", "torch")}
        rows = []
        for T in args.tokens:
            row = [T]
            for path in ("native", "torch"):
                s = res["forward_ms"].get(f"{path} {T}")
                row += [fmt_spread(s, "{:.1f}"), f"{s['median'] / base[path]['median']:.2f}x"] if s else ["–", "–"]
            rows.append(row)
        print(md_table(["new tokens", "native ms", "x T=1", "torch (before) ms", "x T=1"], rows,
                       right=(0, 1, 2, 3, 4)) + "\n")
        if args.plot and threads == args.threads[-1]:
            plot(res["forward_ms"], args.tokens, args.plot, f"{os.path.basename(args.target)}, {threads} threads")
    if args.output:
        write_json(args.output, record)
        log("native", f"wrote {args.output}")


def plot(forward_ms: dict, tokens: list[int], path: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, label in (("torch", "before: torch forward"), ("native", "after: native forward")):
        ys = [forward_ms.get(f"{name} {T}") for T in tokens]
        if all(ys):
            ax.errorbar(tokens, [y["median"] for y in ys], yerr=[[y["median"] - y["min"] for y in ys],
                                                                  [y["max"] - y["median"] for y in ys]],
                        marker="o", capsize=3, label=label)
    ax.set_xlabel("new tokens T (a verify of T - 1 drafts)")
    ax.set_ylabel("forward ms (median, min-max)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    log("native", f"wrote {save_figure(fig, path)}")


if __name__ == "__main__":
    main()
