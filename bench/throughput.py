"""End-to-end throughput: every decoding method x every batch size on one target/draft pair, side by side.

Per batch size the methods run back to back (AR first) on the same prompts, greedy, `ignore_eos`, the same
number of new tokens; reported per (method, B): tokens/s, the speed-up over AR at batch 1 and at B, acceptance,
tokens per step, realign share, grouping rate, latency percentiles, greedy equivalence with AR at B, and the
pair's target/draft cost ratio before and after (docs/benchmarks/throughput.md). Writes
throughput-<random|equal>.csv/.jsonl/.md and PNG plots to --out (default bench/results/throughput).

    python -m bench.throughput --quick                           # smoke test: tiny pair, 2 batch sizes
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
import traceback

import torch

from bench.common import (REPO, HelpFormatter, checkpoint_tokenizer, comma_ints, command_line, evenly_spaced, k_text,
                          lengths_text, log, machine, md_table, parse_with_quick, quick_help, prompt_ids, pyplot,
                          random_prompts, read_jsonl, save_figure, shown, write_jsonl)
from bench.pairs import DEFAULT_PAIR_DIR, cost_ratio, pair_description, pair_dirs
from specdec import LLM, METHODS, SamplingParams
from specdec.flags import k_value
from specdec.prompts import read_prompts

DEFAULT_OUT = os.path.join(REPO, "bench", "results", "throughput")
BUILTIN_TEXT_PROMPTS = os.path.join(REPO, "specdec", "assets", "prompts.txt")
DEFAULT_METHODS = "ar,eqspec,ragged,exspec"
DEFAULT_BATCH_SIZES = "1,2,4,8,16"
QUICK = dict(pair="tiny", batch_sizes="1,4", num_prompts=4, max_tokens=32)
COLORS = {"ar": "C0", "eqspec": "C1", "ragged": "C2", "exspec": "C3"}  # one colour per method in every plot


def color_of(label: str, labels: list[str]) -> str:
    """The method's colour; METHOD:K variants take C4, C5, ... in the order they are listed."""
    if label in COLORS:
        return COLORS[label]
    variants = [m for m in labels if m not in COLORS]
    return f"C{4 + variants.index(label) % 6}"


# ---------------------------------------------------------------------------------------------- arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", default=None, help="target checkpoint directory (default: the --pair pair)")
    p.add_argument("--draft", default=None, help="draft checkpoint directory (required with --target)")
    p.add_argument("--pair", choices=("synthetic", "tiny"), default="synthetic",
                   help="built-in pair without --target (bench/pairs.py; 'tiny' with --quick)")
    p.add_argument("--pair-dir", default=None, help="cache folder of the built-in pair (default: "
                   f"{shown(DEFAULT_PAIR_DIR)}, -tiny for the tiny pair)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16", "float16"),
                   help="model dtype (equivalence vs AR is exact only in float64)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated methods, each optionally METHOD:K (K an integer or 'auto'; default -k), "
                        "e.g. 'ar,ragged:auto,ragged:3'; ar runs first at each batch size")
    p.add_argument("--batch-sizes", type=comma_ints, default=DEFAULT_BATCH_SIZES, help="comma-separated batch sizes")
    p.add_argument("-k", "--num-speculative-tokens", type=k_value, default="auto",
                   help="draft tokens per step: an integer or 'auto'")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="time the phases of every step (realign share); synchronises on CUDA")
    p.add_argument("--compile", action="store_true", help="LLM(compile=True); the warm-up pays the compilation")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=1, help="sweeps, interleaved; each cell reports the run with the "
                   "(upper) median tokens/s")
    p.add_argument("--prompts", default=None, help="prompt file (.jsonl or .txt), taken evenly spaced (default: "
                   "random ids of lengths 8-64 without a tokenizer, else specdec/assets/prompts.txt)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (default: the largest batch size)")
    p.add_argument("--equal-length", action="store_true", help="every prompt the median length: longer ones "
                   "truncated, shorter ones repeated")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="truncate longer prompts from files")
    p.add_argument("--out", default=None, help=f"output folder (default: {shown(DEFAULT_OUT)})")
    p.add_argument("--cost-repeats", type=int, default=20, help="forwards per model for the cost ratio")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--replot", default=None, metavar="JSONL", help="run nothing: re-render the table and plots "
                   "of earlier throughput-<mode>.jsonl files (comma-separated: merged into one) into --out, else "
                   "next to the first")
    p.add_argument("--quick", action="store_true", help=quick_help(QUICK, "smoke test"))
    args = parse_with_quick(p, QUICK, argv)
    args.out_given, args.out = args.out is not None, args.out or DEFAULT_OUT
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.variants = {}  # label -> (method, k)
    for label in args.methods:
        method, _, k = label.partition(":")
        if method not in METHODS:
            p.error(f"--methods: unknown method {method!r}; choose from {', '.join(METHODS)}")
        try:
            k = None if method == "ar" else k_value(k) if k else args.num_speculative_tokens
            args.variants[label] = (method, k)
        except argparse.ArgumentTypeError as err:
            p.error(f"--methods {label}: k {err}")
    if "ar" in args.methods:  # the baseline first, so every later method compares against it
        args.methods = ["ar"] + [m for m in args.methods if m != "ar"]
    args.num_prompts = args.num_prompts or max(args.batch_sizes)
    args.pair_dir = args.pair_dir or DEFAULT_PAIR_DIR + ("-tiny" if args.pair == "tiny" else "")
    if args.repeats < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--repeats, --num-prompts and --max-tokens must be >= 1")
    if not args.replot and max(args.batch_sizes) > args.num_prompts:
        log("throughput", f"warning: batch size {max(args.batch_sizes)} > --num-prompts {args.num_prompts}: "
            "those batches never fill")
    return args


# ---------------------------------------------------------------------------------------------- prompts
def build_prompts(args, tokenizer, vocab_size: int) -> tuple[list[list[int]], str]:
    """Token-id prompts and a one-line description of the prompt set."""
    if args.prompts is None and tokenizer is None:
        ids = random_prompts(args.num_prompts, vocab_size)
        source = f"built-in: {args.num_prompts} random-id prompts"
    else:
        path = args.prompts or BUILTIN_TEXT_PROMPTS
        ids, how = prompt_ids(evenly_spaced(read_prompts(path), args.num_prompts), tokenizer, vocab_size)
        ids = [x[: args.max_prompt_tokens] for x in ids]
        source = f"{shown(path)}: {args.num_prompts} prompts, {how}"
    if args.equal_length:
        L = int(statistics.median(len(x) for x in ids))
        ids = [(x * (L // len(x) + 1))[:L] for x in ids]
        source += f"; equal length {L} (truncated / padded by repetition)"
    source += f"; token lengths {lengths_text(ids)} (min / median / max)"
    return ids, source


# ---------------------------------------------------------------------------------------------- running
def make_llm(models, label: str, batch_size: int, args) -> LLM:
    method, k = args.variants[label]
    return LLM(target=models["target"], draft=models["draft"], method=method,
               num_speculative_tokens=5 if k is None else k, batch_size=batch_size, dtype=args.dtype,
               device=args.device, window_size=max(48, batch_size), tokenizer=models["tokenizer"],
               profile=args.profile, compile=args.compile)


def run_one(models, method: str, batch_size: int, prompts, args):
    """(outputs, None) or (None, note) when the method is not implemented / failed."""
    try:
        llm = make_llm(models, method, batch_size, args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate(prompt_token_ids=prompts, sampling_params=params), None
    except NotImplementedError as e:
        return None, f"skipped: not implemented ({e})"
    except Exception as e:  # keep the sweep going; the traceback goes to stderr
        traceback.print_exc()
        return None, f"error: {type(e).__name__}: {e}"


def record(label, batch_size, outs, note, runs_tps, args):
    method, k = args.variants[label]
    rec = {"method": label, "base_method": method, "k": k, "batch_size": batch_size, "status": note or "ok"}
    if outs is None:
        return rec
    return {**outs.metrics.as_dict(), **rec, "tokens_per_s_runs": runs_tps}


def load_pair(args):
    if args.target is None:
        args.target, args.draft = pair_dirs(args.pair, args.pair_dir)
    # one path-based LLM validates the pair (shared vocabulary/tokenizer); every run reuses its model objects
    probe = LLM(target=args.target, draft=args.draft, method="eqspec", num_speculative_tokens=1, batch_size=1,
                dtype=args.dtype, device=args.device)
    tokenizer = probe.tokenizer or checkpoint_tokenizer(args.target)
    return {"target": probe.target, "draft": probe.draft, "tokenizer": tokenizer, "vocab_size": probe.vocab_size}


def sweep(models, prompts, args):
    """Run every (method, batch size) `repeats` times; returns {(method, B): [(outs, note), ...]}."""
    from tqdm import tqdm

    runs: dict = {}
    outer = tqdm(total=args.repeats * len(args.batch_sizes) * len(args.methods), desc="sweep", unit="run",
                 dynamic_ncols=True, file=sys.stderr)
    for _ in range(args.repeats):
        for B in args.batch_sizes:
            for method in args.methods:
                outer.set_postfix_str(f"{method} B={B}")
                runs.setdefault((method, B), []).append(run_one(models, method, B, prompts, args))
                outer.update(1)
    outer.close()
    return runs


def summarise(runs, args, cost) -> list[dict]:
    rows = []
    for B in args.batch_sizes:
        for method in args.methods:
            ok = [(o, n) for o, n in runs[(method, B)] if o is not None]
            if not ok:
                rows.append(record(method, B, None, runs[(method, B)][0][1], [], args))
                continue
            tps = [o.metrics.tokens_per_s for o, _ in ok]
            median_run = sorted(ok, key=lambda r: r[0].metrics.tokens_per_s)[len(ok) // 2]
            rows.append(record(method, B, median_run[0], None, tps, args))
            rows[-1]["_outs"] = median_run[0]
    ok = {(r["method"], r["batch_size"]): r for r in rows if r["status"] == "ok"}
    ar1 = ok.get(("ar", 1))
    for r in rows:
        r["cost_ratio"] = cost["ratio"]
        if r["status"] != "ok":
            continue
        ar_b = ok.get(("ar", r["batch_size"]))
        r["speedup_vs_ar_b1"] = r["tokens_per_s"] / ar1["tokens_per_s"] if ar1 else None
        r["speedup_vs_ar_same_b"] = r["tokens_per_s"] / ar_b["tokens_per_s"] if ar_b else None
        r["equivalence_vs_ar"] = (sum(a.token_ids == b.token_ids for a, b in zip(r["_outs"], ar_b["_outs"]))
                                  / len(ar_b["_outs"]) if ar_b else None)
    for r in rows:
        r.pop("_outs", None)
    return rows


# ---------------------------------------------------------------------------------------------- reporting
def fmt(x, spec="{:.2f}", none="–"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return spec.format(x)


def markdown_table(rows, spec_methods=("eqspec", "ragged", "exspec")) -> str:
    def cells(r):
        if r["status"] != "ok":
            return [r["method"], r["batch_size"], r["status"]] + [""] * 9
        base, lat = r.get("base_method", r["method"]), r["latency_s"]
        spec = base in spec_methods
        return [r["method"], r["batch_size"], k_text(r.get("k"), r.get("k_histogram")), f"{r['tokens_per_s']:.1f}",
                fmt(r["speedup_vs_ar_b1"]), fmt(r["speedup_vs_ar_same_b"]),
                fmt(r["acceptance_rate"], "{:.1%}") if spec else "–", f"{r['mean_tokens_per_step']:.2f}",
                fmt(r["realign_share"], "{:.1%}") if spec else "–",
                fmt(r["grouping_rate"], "{:.1%}") if base == "exspec" else "–",
                f"{lat['p50']:.1f} / {lat['p95']:.1f} / {lat['p99']:.1f}", fmt(r["equivalence_vs_ar"], "{:.0%}")]

    return md_table(["method", "B", "k", "tokens/s", "× AR@1", "× AR@B", "acceptance", "tokens/step", "realign share",
                     "grouping", "latency p50 / p95 / p99 (s)", "equiv. vs AR@B"], map(cells, rows))


def plot(rows, args, tag: str) -> list[str]:
    plt = pyplot()
    ok = {m: [r for r in rows if r["method"] == m and r["status"] == "ok"] for m in args.methods}
    methods = [m for m in args.methods if ok[m]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in methods:
        for ax, key in zip(axes, ("tokens_per_s", "speedup_vs_ar_same_b")):
            ax.plot([r["batch_size"] for r in ok[m]], [r.get(key) for r in ok[m]], marker="o", label=m,
                    color=color_of(m, args.methods))
    axes[0].set_ylabel("tokens/s")
    axes[1].set_ylabel("speedup over AR at the same B")
    axes[1].axhline(1.0, color="gray", lw=0.8, ls="--")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"throughput ({tag}-length prompts, k={args.num_speculative_tokens}, {args.max_tokens} tokens, "
                 f"{args.dtype}, {args.device})", fontsize=10)
    paths = [save_figure(fig, os.path.join(args.out, f"throughput-{tag}.png"))]

    spec = [m for m in methods if m != "ar"]
    if spec:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        width = 0.8 / len(spec)
        xs = range(len(args.batch_sizes))
        for j, m in enumerate(spec):
            share = {r["batch_size"]: r["realign_share"] for r in ok[m]}
            values = [100 * share.get(b, 0.0) for b in args.batch_sizes]
            bars = ax.bar([x + j * width for x in xs], values, width, label=m, color=color_of(m, args.methods))
            ax.bar_label(bars, [f"{v:.1f}" for v in values], fontsize=7)
        ax.set_xticks([x + width * (len(spec) - 1) / 2 for x in xs], [str(b) for b in args.batch_sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("realign share of step time (%)")
        ax.set_title(f"realign share ({tag}-length prompts)", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
        paths.append(save_figure(fig, os.path.join(args.out, f"realign-{tag}.png")))
    return paths


def write_outputs(rows, meta, args, tag):
    """throughput-<tag>.jsonl (every row with the run's meta) and .csv (the scalar fields, nested ones flattened)."""
    base = os.path.join(args.out, f"throughput-{tag}")
    write_jsonl(base + ".jsonl", ({**r, "meta": meta} for r in rows))
    flat = []
    for r in rows:
        flat.append({k: v for k, v in r.items() if not isinstance(v, (dict, list))})
        for key in ("latency_s", "ttft_s", "phase_time_s"):
            flat[-1].update({f"{key[:-2]}_{name}_s": v for name, v in (r.get(key) or {}).items()})
        flat[-1].update(lengths=tag, max_tokens=args.max_tokens, dtype=args.dtype, device=args.device,
                        threads=meta["threads"])
    with open(base + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(dict.fromkeys(k for r in flat for k in r)))
        writer.writeheader()
        writer.writerows(flat)
    return base


def header(meta) -> str:
    c0, c1 = meta["cost_before"], meta["cost_after"]
    pair = meta["pair"]
    t, d = pair["target"], pair["draft"]
    return (f"target: {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']} "
            f"({meta['target_params'] / 1e6:.1f}M params); draft: {d['num_hidden_layers']} layer(s) "
            f"({meta['draft_params'] / 1e6:.1f}M params)  \n"
            f"target/draft cost ratio (one forward, batch 8, 1 token): {c0['ratio']:.1f} before, "
            f"{c1['ratio']:.1f} after the sweep  \n"
            f"prompts: {meta['prompts']}  \n"
            f"k = {meta['k']}, {meta['max_tokens']} new tokens, greedy, ignore_eos, {meta['dtype']} on "
            f"{meta['device']}{', compiled' if meta.get('compile') else ''}, {meta['threads']} thread(s), "
            f"repeats {meta['repeats']}"
            f"{', git ' + meta['git'] if meta.get('git') else ''}  \n"
            f"command: `{meta['command']}`")


def render(rows, meta, args, tag) -> str:
    """Markdown (header, table, image links) of a run; writes the .md and the plots into args.out."""
    md = header(meta) + "\n\n" + markdown_table(rows) + "\n"
    pngs = [] if args.no_plots else plot(rows, args, tag)
    if pngs:
        md += "\n" + "\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs) + "\n"
    with open(os.path.join(args.out, f"throughput-{tag}.md"), "w") as f:
        f.write(md)
    return md


def replot(args) -> None:
    """Re-render the markdown and plots of one run's JSONL, or of several runs of one sweep split over
    batch sizes (comma-separated JSONL files: rows concatenated, batch sizes merged, the first run's header)."""
    paths = args.replot.split(",")
    runs = [read_jsonl(path) for path in paths]
    records = [r for run in runs for r in run]
    meta = records[0]["meta"]
    rows = [{k: v for k, v in r.items() if k != "meta"} for r in records]
    for key in ("batch_sizes", "methods", "num_speculative_tokens", "max_tokens", "dtype", "device"):
        setattr(args, key, meta["args"][key])
    args.batch_sizes = sorted({r["batch_size"] for r in rows})
    if len(paths) > 1:
        rows.sort(key=lambda r: r["batch_size"])  # stable: each run's method order kept
        meta = dict(meta, command=" ; ".join(run[0]["meta"]["command"] for run in runs))
    if not args.out_given:
        args.out = os.path.dirname(os.path.abspath(paths[0]))
    os.makedirs(args.out, exist_ok=True)
    print(render(rows, meta, args, meta["lengths"]))


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        return replot(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    tag = "equal" if args.equal_length else "random"
    os.makedirs(args.out, exist_ok=True)
    t_start, started = time.perf_counter(), machine()

    models = load_pair(args)
    prompts, source = build_prompts(args, models["tokenizer"], models["vocab_size"])
    log("throughput", f"pair: {args.target} / {args.draft}")
    log("throughput", f"prompts: {source}")
    cost_before = cost_ratio(models["target"], models["draft"], repeats=args.cost_repeats)
    log("throughput", f"target/draft cost ratio: {cost_before['ratio']:.1f} ("
        f"{cost_before['target_forward_s'] * 1e3:.1f} ms vs {cost_before['draft_forward_s'] * 1e3:.1f} ms)")

    # untimed warm-up of every method: first-call allocations, lazy imports, kernel selection
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    warm_sizes = (1, 2) if args.compile else (2,)  # compiled: batch 1 has its own graphs (specialised)
    for method, B in ((m, b) for m in args.methods for b in warm_sizes):
        try:
            make_llm(models, method, B, args).generate(prompt_token_ids=prompts[:2], sampling_params=params)
        except Exception:  # reported by the sweep itself
            pass

    runs = sweep(models, prompts, args)
    cost_after = cost_ratio(models["target"], models["draft"], repeats=args.cost_repeats)
    cost = {"ratio": (cost_before["ratio"] + cost_after["ratio"]) / 2}
    rows = summarise(runs, args, cost)

    meta = {
        **started, "command": command_line("bench.throughput", argv),
        "pair": pair_description(args.target, args.draft),
        "target_params": sum(p.numel() for p in models["target"].parameters()),
        "draft_params": sum(p.numel() for p in models["draft"].parameters()),
        "cost_before": cost_before, "cost_after": cost_after, "prompts": source, "lengths": tag,
        "k": args.num_speculative_tokens, "max_tokens": args.max_tokens, "dtype": args.dtype, "compile": args.compile,
        "device": args.device, "repeats": args.repeats, "total_time_s": time.perf_counter() - t_start,
        "args": dict(vars(args)),
    }
    base = write_outputs(rows, meta, args, tag)
    print(render(rows, meta, args, tag))
    log("throughput", f"wrote {base}.csv/.jsonl/.md{'' if args.no_plots else ' and PNG plots'} in "
        f"{meta['total_time_s']:.0f}s")


if __name__ == "__main__":
    main()
