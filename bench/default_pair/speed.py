"""The default pair in specdec's runtime: per-forward wall time of target and draft at batch 1, and AR vs a
speculative method (tokens/s, acceptance, exact match) at the given batch sizes.

    python -m bench.default_pair.speed --threads 2 --repeats 5 --batch-sizes 1,8

Several drafts can be compared against the same target in one run (`--draft A --draft B`, `-k auto`): every
draft gets its own forward-time row and its own speculative LLM, and each repetition runs AR and every
speculative LLM back to back, the order rotating, so the ratios are measured side by side.

Forward times: our `Transformer` (specdec.models.load_model) prefills one held-out prompt, then one forward of
T new tokens is timed on a fresh copy of that cache (T = 1: a decode or draft step; T = k + 1: a verify), the
repetitions of target and draft interleaved. End to end: every LLM is built and warmed up (one generate on
two prompts) before timing; then each repetition runs AR and the speculative method back to back on all the
prompts, the order alternating, and medians (min-max) are printed with the machine's load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import command_line, fmt_spread, interleave, k_text, machine_line
from specdec.flags import k_value
from specdec.prompts import read_prompts
from specdec.timing import PrefilledCache

REPO = Path(__file__).resolve().parents[2]

ASSETS = REPO / "specdec/assets"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.default_pair.speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(ASSETS / "default_pair/target"), help="target checkpoint directory")
    p.add_argument("--draft", action="append", help="draft checkpoint directory; give it again to compare several "
                   "drafts in one run (default: the shipped draft)")
    p.add_argument("--prompts", default=str(ASSETS / "prompts.txt"), help="prompt file (.txt or .jsonl)")
    p.add_argument("--num-prompts", type=int, default=32, help="first N prompts")
    p.add_argument("--method", default="eqspec", help="speculative method compared with ar")
    p.add_argument("-k", type=k_value, default=5, help="draft tokens per step, or 'auto' (the runtime chooses k)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (medians reported)")
    p.add_argument("--forward-repeats", type=int, default=50, help="timed forwards per model and T")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    p.add_argument("--dtype", default="float32", help="runtime dtype")
    p.add_argument("--skip-forwards", action="store_true", help="end-to-end table only")
    args = p.parse_args(argv)
    args.draft = args.draft or [str(ASSETS / "default_pair/draft")]
    args.verify_tokens = (5 if args.k == "auto" else args.k) + 1  # the timed verify forward: k + 1 tokens
    return args


def draft_names(drafts: list[str]) -> list[str]:
    """Short unique labels for the drafts (the directory path when the last parts clash)."""
    short = [Path(d).name for d in drafts]
    return short if len(set(short)) == len(short) else [str(Path(d)) for d in drafts]


def med(values: list[float]) -> str:
    return fmt_spread(values, "{:.2f}")


def forward_times(args, prompt_ids: list[int]) -> dict:
    """ms per forward of T new tokens at batch 1 after the prompt, target and draft interleaved."""
    from specdec.models import load_model

    models = {"target": load_model(args.target, dtype=args.dtype)}
    models |= {f"draft {n}": load_model(d, dtype=args.dtype) for n, d in zip(draft_names(args.draft), args.draft)}
    prompt = torch.tensor([prompt_ids])  # [1, P]
    calls = {}
    for name, model in models.items():
        prefilled = PrefilledCache(model, prompt, prompt.shape[1] + args.verify_tokens)
        for T in (1, args.verify_tokens):
            new = torch.randint(3, model.vocab_size, (1, T))  # [1, T]
            calls[(name, T)] = lambda prefilled=prefilled, new=new: 1e3 * prefilled.time(new)
    return interleave(calls, args.forward_repeats, warmup=3)


def end_to_end(args, prompts: list[str], batch_size: int) -> dict:
    from specdec import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llms = {"ar": LLM(target=args.target, method="ar", batch_size=batch_size, dtype=args.dtype)}
    for name, draft in zip(draft_names(args.draft), args.draft):
        llms[name] = LLM(target=args.target, draft=draft, method=args.method, num_speculative_tokens=args.k,
                         batch_size=batch_size, dtype=args.dtype)
    for llm in llms.values():
        llm.generate(prompts[:2], params, use_tqdm=False)

    def run(llm):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0), outs

    runs = interleave({name: lambda llm=llm: run(llm) for name, llm in llms.items()}, args.repeats, warmup=0)
    names = list(llms)
    ar_ids = [o.token_ids for o in runs["ar"][0][1]]
    ar_tps = [r[0] for r in runs["ar"]]
    rows = {}
    for name in names[1:]:
        outs = runs[name][0][1]
        m = outs.metrics
        tps = [r[0] for r in runs[name]]
        rows[name] = {"ar": ar_tps, "spec": tps, "speedups": [s / a for s, a in zip(tps, ar_tps)],
                      "acceptance": m.acceptance_rate, "tokens_per_step": m.mean_tokens_per_step,
                      "k_histogram": m.k_histogram,
                      "exact": sum(o.token_ids == a for o, a in zip(outs, ar_ids)), "prompts": len(prompts)}
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = read_prompts(args.prompts)[: args.num_prompts]
    from specdec.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    print(command_line("bench.default_pair.speed", argv))
    print(f"{args.dtype}; {machine_line()}\n")
    if not args.skip_forwards:
        times = forward_times(args, tokenizer.encode(prompts[0]))
        T = args.verify_tokens
        print(f"| model | ms per forward, 1 new token | ms per forward, {T} new tokens | target / model, 1 token |\n"
              f"|---|---:|---:|---:|")
        t1 = statistics.median(times[("target", 1)])
        for name in dict.fromkeys(n for n, _ in times):
            print(f"| {name} | {med(times[(name, 1)])} | {med(times[(name, T)])} | "
                  f"{t1 / statistics.median(times[(name, 1)]):.1f}x |")
        print()
    print(f"| batch | draft | k | ar tokens/s | {args.method} tokens/s | speed-up | acceptance | tokens/step | "
          f"exact vs ar |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        for name, r in end_to_end(args, prompts, batch_size).items():
            k = k_text(args.k, r["k_histogram"])
            print(f"| {batch_size} | {name} | {k} | {med(r['ar'])} | {med(r['spec'])} | {med(r['speedups'])}x | "
                  f"{r['acceptance']:.3f} | {r['tokens_per_step']:.2f} | {r['exact']}/{r['prompts']} |", flush=True)
    print(f"\nload average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
