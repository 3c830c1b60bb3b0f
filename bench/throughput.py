"""End-to-end throughput: every decoding method x every batch size, on one target/draft pair, side by side.

For each batch size B (in order) every method runs the same prompt set with greedy decoding,
`ignore_eos=True` and a fixed number of new tokens, so all methods generate the same number of tokens and
their tokens/s compare directly. Methods run back to back inside one batch size (AR first), which keeps
the comparisons that matter -- speculation vs AR at the same B -- measured side by side under the same
machine load. Reported per (method, B):

- tokens/s; speedup over AR at batch 1 and over AR at the same batch size;
- acceptance rate (accepted / proposed drafts), mean tokens per row per target forward;
- realign share (realign time / step time), grouping rate (EXSPEC: steps that needed no realignment);
- p50/p95/p99 request latency (all prompts are submitted at t = 0, so it includes queueing);
- greedy equivalence vs AR at the same batch size: the fraction of requests whose token ids equal AR's
  (in float32 near-tied logits may flip between the k+1-token verify pass and the 1-token AR pass; in
  float64 it should be 1.0);
- the pair's target/draft cost ratio: one target forward vs one draft forward, batch 8, 1 new token,
  measured before and after the sweep.

Without --target/--draft the synthetic pair of bench/pairs.py is built (or reused) in --pair-dir: a
~113M-parameter, 16-layer random Llama whose upper layers are damped, and as the draft its own first layer
(see bench/pairs.py). Without --prompts the built-in prompt set is random token ids of lengths 8-64 (or
the held-out text prompts of specdec/assets/prompts.txt when the target has a tokenizer).

Outputs in --out (file names carry the prompt-length mode, `random` or `equal`):
throughput-<mode>.csv / .jsonl / .md, throughput-<mode>.png (tokens/s vs B), realign-<mode>.png; the
markdown table is also printed to stdout, progress bars go to stderr.

    python -m bench.throughput                                   # defaults (long on a small CPU)
    python -m bench.throughput --threads 1 --batch-sizes 1,4,16 --num-prompts 16
    python -m bench.throughput --equal-length                    # same prompt length: EXSPEC's best case
    python -m bench.throughput --prompts /work/shared/data/spec_bench/question.jsonl --target T --draft D
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
                          lengths_text, machine, md_table, parse_with_quick, prompt_ids, random_prompts,
                          read_jsonl, save_figure, shown, write_jsonl)
from bench.pairs import DEFAULT_PAIR_DIR, cost_ratio, pair_description, pair_dirs
from specdec import LLM, SamplingParams
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
    p = argparse.ArgumentParser(
        description="Throughput of every decoding method (ar, eqspec, ragged, exspec) at every batch size on "
                    "one target/draft pair, greedy, ignore_eos, methods side by side per batch size. Writes "
                    "CSV, JSONL, a markdown table and PNG plots to --out; prints the table.",
        formatter_class=HelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--target", default=None,
                   help="target checkpoint directory (HF format). Default: the synthetic pair (see --pair)")
    g.add_argument("--draft", default=None, help="draft checkpoint directory (required with --target)")
    g.add_argument("--pair", choices=("synthetic", "tiny"), default="synthetic",
                   help="which built-in pair to use without --target/--draft: 'synthetic' (~113M-param "
                        "16-layer damped random Llama + its own first layer as draft, bench/pairs.py) or "
                        "'tiny' (same recipe, toy size, for smoke tests; the default with --quick)")
    g.add_argument("--pair-dir", default=None,
                   help="cache folder of the built-in pair (built once, reused while its recipe matches). "
                        f"Default: {os.path.relpath(DEFAULT_PAIR_DIR, REPO)} (suffix -tiny for the tiny pair)")
    g.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16", "float16"),
                   help="model dtype (equivalence vs AR is exact only in float64)")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (torch.set_num_threads); default: torch's choice. "
                        "Use 1 on a busy machine")

    g = p.add_argument_group("sweep")
    g.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated methods, each optionally with its own k as METHOD:K (K an integer or "
                        "'auto'), e.g. 'ar,ragged:auto,ragged:1,ragged:3,ragged:5'; without ':K' the method "
                        "uses -k. 'ar' is the baseline and always runs first at each batch size when listed. A "
                        "method that raises NotImplementedError is skipped with a note")
    g.add_argument("--batch-sizes", type=comma_ints, default=DEFAULT_BATCH_SIZES,
                   help=f"comma-separated batch sizes ({QUICK['batch_sizes']} with --quick)")
    g.add_argument("-k", "--num-speculative-tokens", type=k_value, default="auto",
                   help="draft tokens per step: an integer, or 'auto' (chosen every step by the cost model)")
    g.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="time the phases of every step (realign share, phase split); synchronises on CUDA")
    g.add_argument("--compile", action="store_true",
                   help="LLM(compile=True): torch.compile the forwards (CUDA graphs on a GPU); the warm-up "
                        "generation pays the compilation, outside the timed region")
    g.add_argument("--max-tokens", type=int, default=128,
                   help=f"new tokens per request ({QUICK['max_tokens']} with --quick)")
    g.add_argument("--window-size", type=int, default=48,
                   help="EXSPEC pool size (raised to the batch size where smaller)")
    g.add_argument("--repeats", type=int, default=1,
                   help="run the whole sweep this many times (interleaved); each cell reports the run with the "
                        "median tokens/s (the upper median for an even count: the faster of 2), all runs' "
                        "tokens/s are kept in the JSONL")

    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", default=None,
                   help="prompt file: a SpecBench-style .jsonl (first element of 'turns', or a 'prompt'/'text' "
                        "field) or a .txt with one prompt per line (lines starting with '#' are skipped, the two "
                        "characters \\n stand for a newline). Prompts are taken evenly spaced across the file. "
                        "Text is tokenized with the target's tokenizer, or as UTF-8 bytes (id = byte + 3) when "
                        "it has none. Default: built-in prompts (random ids of lengths 8-64 for a pair without "
                        "tokenizer, specdec/assets/prompts.txt otherwise)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests per (method, batch size) run (default: the largest batch size; "
                        f"{QUICK['num_prompts']} with --quick)")
    g.add_argument("--equal-length", action="store_true",
                   help="give every prompt the same token length (--prompt-len): longer ones truncated, shorter "
                        "ones padded by repeating their own tokens. Default: random (natural) lengths")
    g.add_argument("--prompt-len", type=int, default=None,
                   help="the common length for --equal-length (default: the median prompt length)")
    g.add_argument("--min-prompt-len", type=int, default=8, help="shortest built-in random-id prompt")
    g.add_argument("--max-prompt-len", type=int, default=64, help="longest built-in random-id prompt")
    g.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="truncate longer prompts (from files) to this many tokens")
    g.add_argument("--seed", type=int, default=0, help="seed of the built-in random prompts")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help=f"output folder (default: {shown(DEFAULT_OUT)})")
    g.add_argument("--cost-repeats", type=int, default=20,
                   help="forwards timed per model for the target/draft cost ratio")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--replot", default=None, metavar="JSONL",
                   help="run nothing: re-render the markdown table and plots of an earlier run from its "
                        "throughput-<mode>.jsonl (into --out if given, else next to the file); several "
                        "comma-separated files (one sweep run in parts, e.g. small and large batch sizes) "
                        "merge into one table and plot")
    g.add_argument("--quick", action="store_true",
                   help=f"tiny smoke run (CI / GPU script): tiny pair unless --target/--pair given, batch sizes "
                        f"{QUICK['batch_sizes']}, {QUICK['num_prompts']} prompts, {QUICK['max_tokens']} tokens "
                        f"(explicit flags still win)")
    args = parse_with_quick(p, QUICK, argv)
    args.out_given, args.out = args.out is not None, args.out or DEFAULT_OUT
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    from specdec import METHODS

    args.variants = {}  # label -> (method, k)
    for label in args.methods:
        method, _, k = label.partition(":")
        if method not in METHODS:
            p.error(f"unknown method {method!r} in --methods; choose from {list(METHODS)}")
        try:
            k = None if method == "ar" else (k_value(k) if k else args.num_speculative_tokens)
            args.variants[label] = (method, k)
        except argparse.ArgumentTypeError as err:
            p.error(f"--methods {label}: k {err}")
    if "ar" in args.methods:  # the baseline first, so every later method compares against it
        args.methods = ["ar"] + [m for m in args.methods if m != "ar"]
    if args.num_prompts is None:
        args.num_prompts = max(args.batch_sizes)
    if args.pair_dir is None:
        args.pair_dir = DEFAULT_PAIR_DIR + ("-tiny" if args.pair == "tiny" else "")
    if args.repeats < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--repeats, --num-prompts and --max-tokens must be >= 1")
    if not args.replot and max(args.batch_sizes) > args.num_prompts:
        print(f"[throughput] warning: batch size {max(args.batch_sizes)} > --num-prompts {args.num_prompts}: "
              f"those batches never fill", file=sys.stderr)
    return args


# ---------------------------------------------------------------------------------------------- prompts
def build_prompts(args, tokenizer, vocab_size: int) -> tuple[list[list[int]], str]:
    """Token-id prompts and a one-line description of the prompt set."""
    if args.prompts is None and tokenizer is None:
        ids = random_prompts(args.num_prompts, vocab_size, args.min_prompt_len, args.max_prompt_len, args.seed)
        source = f"built-in: {args.num_prompts} random-id prompts, lengths {args.min_prompt_len}-{args.max_prompt_len}"
    else:
        path = args.prompts or BUILTIN_TEXT_PROMPTS
        ids, how = prompt_ids(evenly_spaced(read_prompts(path), args.num_prompts), tokenizer, vocab_size)
        ids = [x[: args.max_prompt_tokens] for x in ids]
        source = f"{shown(path)}: {args.num_prompts} prompts, {how}"
    if args.equal_length:
        L = args.prompt_len or int(statistics.median(len(x) for x in ids))
        ids = [(x * (L // len(x) + 1))[:L] for x in ids]
        source += f"; equal length {L} (truncated / padded by repetition)"
    source += f"; token lengths {lengths_text(ids)} (min / median / max)"
    return ids, source


# ---------------------------------------------------------------------------------------------- running
def make_llm(models, label: str, batch_size: int, args) -> LLM:
    method, k = args.variants[label]
    return LLM(target=models["target"], draft=models["draft"], method=method,
               num_speculative_tokens=5 if k is None else k, batch_size=batch_size, dtype=args.dtype,
               device=args.device, window_size=max(args.window_size, batch_size), tokenizer=models["tokenizer"],
               profile=args.profile, compile=args.compile)


def run_one(models, method: str, batch_size: int, prompts, args, use_tqdm=True):
    """(outputs, None) or (None, note) when the method is not implemented / failed."""
    try:
        llm = make_llm(models, method, batch_size, args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=use_tqdm), None
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
    m = outs.metrics
    d = m.as_dict()
    rec.update({
        "tokens_per_s": m.tokens_per_s, "tokens_per_s_runs": runs_tps, "acceptance_rate": m.acceptance_rate,
        "mean_tokens_per_step": m.mean_tokens_per_step, "realign_share": m.realign_share,
        "grouping_rate": m.grouping_rate, "latency_s": m.latency_percentiles("latency"),
        "ttft_s": m.latency_percentiles("ttft"), "wall_time_s": m.wall_time_s,
        "generated_tokens": m.generated_tokens, "num_requests": m.num_requests, "steps": m.steps,
        "target_forwards": m.target_forwards, "draft_forwards": m.draft_forwards,
        "phase_time_s": d["phase_time_s"], "k_histogram": d["k_histogram"],
        "predicted_step_s": m.predicted_step_s, "measured_step_s": m.measured_step_s,
    })
    return rec


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
    total = args.repeats * len(args.batch_sizes) * len(args.methods)
    outer = tqdm(total=total, desc="sweep", unit="run", position=0, dynamic_ncols=True, file=sys.stderr)
    skipped: dict = {}  # method -> (None, note) once it raised NotImplementedError
    for _ in range(args.repeats):
        for B in args.batch_sizes:
            for method in args.methods:
                outer.set_postfix_str(f"{method} B={B}")
                if method in skipped:
                    runs.setdefault((method, B), []).append(skipped[method])
                else:
                    outs, note = run_one(models, method, B, prompts, args)
                    if note and note.startswith("skipped"):
                        skipped[method] = (None, note)
                        tqdm.write(f"[throughput] {method}: {note}", file=sys.stderr)
                    runs.setdefault((method, B), []).append((outs, note))
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
    by = {(r["method"], r["batch_size"]): r for r in rows}
    ar1 = by.get(("ar", 1))
    for r in rows:
        r["cost_ratio"] = cost["ratio"]
        if r["status"] != "ok":
            continue
        ar_b = by.get(("ar", r["batch_size"]))
        r["speedup_vs_ar_b1"] = (r["tokens_per_s"] / ar1["tokens_per_s"]
                                 if ar1 and ar1["status"] == "ok" else None)
        r["speedup_vs_ar_same_b"] = (r["tokens_per_s"] / ar_b["tokens_per_s"]
                                     if ar_b and ar_b["status"] == "ok" else None)
        if ar_b and ar_b["status"] == "ok":
            ref = [o.token_ids for o in ar_b["_outs"]]
            mine = [o.token_ids for o in r["_outs"]]
            r["equivalence_vs_ar"] = sum(a == b for a, b in zip(mine, ref)) / len(ref)
        else:
            r["equivalence_vs_ar"] = None
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    methods = [m for m in args.methods if any(r["method"] == m and r["status"] == "ok" for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in methods:
        pts = [(r["batch_size"], r["tokens_per_s"], r.get("speedup_vs_ar_same_b")) for r in rows
               if r["method"] == m and r["status"] == "ok"]
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m, color=color_of(m, args.methods))
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=m, color=color_of(m, args.methods))
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
    paths.append(save_figure(fig, os.path.join(args.out, f"throughput-{tag}.png")))

    spec = [m for m in methods if m != "ar"]
    if spec:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        width = 0.8 / len(spec)
        xs = range(len(args.batch_sizes))
        for j, m in enumerate(spec):
            share = {r["batch_size"]: r["realign_share"] for r in rows if r["method"] == m and r["status"] == "ok"}
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


CSV_FIELDS = ["method", "batch_size", "status", "tokens_per_s", "speedup_vs_ar_b1", "speedup_vs_ar_same_b",
              "acceptance_rate", "mean_tokens_per_step", "realign_share", "grouping_rate", "latency_p50_s",
              "latency_p95_s", "latency_p99_s", "ttft_p50_s", "equivalence_vs_ar", "wall_time_s", "generated_tokens",
              "num_requests", "steps", "target_forwards", "draft_forwards", "draft_s", "verify_s", "accept_s",
              "realign_s", "other_s", "cost_ratio", "lengths", "k", "max_tokens", "dtype", "device", "threads"]


def write_outputs(rows, meta, args, tag):
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"throughput-{tag}")
    write_jsonl(base + ".jsonl", ({**r, "meta": meta} for r in rows))
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            flat = dict(r)
            for key, src in (("latency", "latency_s"), ("ttft", "ttft_s")):
                for q, v in (r.get(src) or {}).items():
                    flat[f"{key}_{q}_s"] = v
            for ph, v in (r.get("phase_time_s") or {}).items():
                flat[f"{ph}_s"] = v
            flat.update(lengths=tag, max_tokens=args.max_tokens, dtype=args.dtype,
                        device=args.device, threads=meta["threads"])
            w.writerow(flat)
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
    records, commands = [], []
    for path in paths:
        run = read_jsonl(path)
        records += run
        commands.append(run[0]["meta"]["command"])
    meta = records[0]["meta"]
    rows = [{k: v for k, v in r.items() if k != "meta"} for r in records]
    for key in ("batch_sizes", "methods", "num_speculative_tokens", "max_tokens", "dtype", "device"):
        setattr(args, key, meta["args"][key])
    args.batch_sizes = sorted({r["batch_size"] for r in rows})
    if len(paths) > 1:
        rows.sort(key=lambda r: r["batch_size"])  # stable: each run's method order kept
        meta = dict(meta, command=" ; ".join(commands))
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
    print(f"[throughput] pair: {args.target} / {args.draft}", file=sys.stderr, flush=True)
    print(f"[throughput] prompts: {source}", file=sys.stderr, flush=True)
    cost_before = cost_ratio(models["target"], models["draft"], repeats=args.cost_repeats)
    print(f"[throughput] target/draft cost ratio: {cost_before['ratio']:.1f} "
          f"({cost_before['target_forward_s'] * 1e3:.1f} ms vs {cost_before['draft_forward_s'] * 1e3:.1f} ms)",
          file=sys.stderr, flush=True)

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
        "args": {k: v for k, v in vars(args).items()},
    }
    base = write_outputs(rows, meta, args, tag)
    print(render(rows, meta, args, tag))
    print(f"[throughput] wrote {base}.csv/.jsonl/.md" + ("" if args.no_plots else " and PNG plots") +
          f" in {meta['total_time_s']:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
