"""Streaming text costs O(new tokens) per step: one streamed request's step time at an early output token and
near the end, text detokenized every step (the server) and not (`generate`), interleaved, on the embedded
target (its 256-position limit raised on the loaded object: only the cost is measured).

    python -m bench.detokenize --tokens 2000 --repeats 3
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from bench.common import HelpFormatter, fmt_spread, md_table
from specdec import LLM, SamplingParams
from specdec.models import load_model, load_tokenizer
from specdec.prompts import DEFAULT_TARGET


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--tokens", type=int, default=2000, help="output tokens of the request")
    p.add_argument("--early", type=int, default=100, help="the early output token compared")
    p.add_argument("--window", type=int, default=20, help="steps around each token whose times are pooled")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each mode")
    p.add_argument("--method", default="ar", help="specdec method")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p


def step_times(llm: LLM, tokens: int, stream_text: bool) -> dict[int, float]:
    """Output length after each step -> that step's seconds (one request, fed one step at a time)."""
    engine = llm.engine(batch_size=1, stream_text=stream_text)
    engine.add_request("def fibonacci(n):", SamplingParams(max_tokens=tokens, ignore_eos=True))
    times, emitted = {}, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        deltas = engine.step()
        seconds = time.perf_counter() - t0
        emitted = max((d.num_output_tokens for d in deltas), default=emitted)
        times[emitted] = seconds
    return times


def around(times: dict[int, float], token: int, window: int) -> float:
    near = [t for n, t in times.items() if abs(n - token) <= window // 2]
    return statistics.median(near)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(DEFAULT_TARGET, dtype="float32", device="cpu")
    target.cfg = dataclasses.replace(target.cfg, max_position_embeddings=args.tokens + 64)  # see the docstring
    llm = LLM(target, method=args.method, tokenizer=load_tokenizer(DEFAULT_TARGET), batch_size=1, device="cpu",
              num_speculative_tokens=3 if args.method != "ar" else 0, cost_cache="")
    step_times(llm, 200, True)  # warm-up
    late = args.tokens - args.window
    results = {True: [], False: []}
    for _ in range(args.repeats):
        for stream_text in (True, False):  # interleaved
            times = step_times(llm, args.tokens, stream_text)
            results[stream_text].append((around(times, args.early, args.window), around(times, late, args.window)))
    print(md_table(["text per step", f"step at token {args.early} (ms)", f"step at token {late} (ms)", "ratio"],
                   (["yes (streaming)" if stream_text else "no (generate)",
                     f"{statistics.median(e for e, _ in runs) * 1e3:.2f}",
                     f"{statistics.median(end for _, end in runs) * 1e3:.2f}",
                     fmt_spread([end / e for e, end in runs], "{:.2f}")]
                    for stream_text, runs in results.items())))
    print(f"\none request, {args.method}, {args.tokens} tokens, {args.repeats} interleaved runs, {args.threads} "
          f"thread(s); medians of the {args.window} steps around each token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
