"""Coupled vs rejection sampling (specdec/sampling.py) on one pair: acceptance, tokens per step and tokens/s
(wall and per CPU-second) per temperature and k, each arm with its own warmed-up LLM, interleaved repeats
(docs/benchmarks/samplers.md). Prints a markdown table.

    python -m bench.samplers --temperatures 0.7,1.0 --top-p 0.9 -k 5 --repeats 5 --threads 1
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

import specdec.sampling as sampling
from bench.common import HelpFormatter, command_line, fmt_spread, interleave, machine_line, md_table
from specdec import LLM, SamplingParams
from specdec.flags import k_value
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET, read_prompts

SAMPLERS = {"coupled": lambda p: not p.greedy, "rejection": lambda p: False}


@contextlib.contextmanager
def sampler(name: str):
    """Every sampling row of the runs inside uses `name`'s sampler."""
    original = sampling.coupled
    sampling.coupled = SAMPLERS[name]
    try:
        yield
    finally:
        sampling.coupled = original


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.samplers", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="target checkpoint directory (default: the shipped pair)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft checkpoint directory")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt file (.txt or .jsonl)")
    p.add_argument("--num-prompts", type=int, default=16, help="first N prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (ignore_eos)")
    p.add_argument("--method", default="eqspec", help="speculative method")
    p.add_argument("-k", type=k_value, action="append", help="draft tokens per step or 'auto'; repeatable "
                   "(default: 5 and auto)")
    p.add_argument("--batch-size", type=int, default=8, help="rows decoded together")
    p.add_argument("--temperatures", default="0.7,1.0", help="comma-separated temperatures")
    p.add_argument("--top-p", type=float, default=0.9, help="top-p of every request")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per arm (medians reported)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--dtype", default="float32", help="runtime dtype")
    p.add_argument("--cost-cache", default="", help="auto k's cost cache file ('' (default): calibrate each LLM)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ks = args.k or [5, "auto"]
    prompts = read_prompts(args.prompts)[: args.num_prompts]
    rows, machine = [], machine_line()
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, top_p=args.top_p, seed=i,
                                 ignore_eos=True) for i in range(len(prompts))]
        for k in ks:
            llms = {}
            for name in SAMPLERS:  # built and warmed up (auto k: calibrated) before any timing
                llms[name] = LLM(args.target, args.draft, method=args.method, num_speculative_tokens=k,
                                 batch_size=args.batch_size, dtype=args.dtype, check_invariants=False,
                                 cost_cache=args.cost_cache)
                with sampler(name):
                    llms[name].generate(prompts[:2], SamplingParams(max_tokens=8, temperature=temperature, seed=0))

            def run(name):
                def call():
                    with sampler(name):
                        start, cpu_start = time.perf_counter(), time.process_time()
                        m = llms[name].generate(prompts, params).metrics
                        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                    print(f"T={temperature} k={k} {name}: {m.generated_tokens / seconds:.1f} tokens/s, "
                          f"acceptance {m.acceptance_rate:.3f}", file=sys.stderr)
                    return dict(speed=m.generated_tokens / seconds, cpu_speed=m.generated_tokens / cpu_seconds,
                                acceptance=m.acceptance_rate, tokens_per_step=m.mean_tokens_per_step,
                                mean_k=sum(n * c for n, c in m.k_histogram.items()) / max(m.steps, 1))
                return call

            results = interleave({name: run(name) for name in SAMPLERS}, args.repeats, warmup=0)
            ratio = {key: [c[key] / r[key] for c, r in zip(results["coupled"], results["rejection"])]
                     for key in ("speed", "cpu_speed")}  # per repetition
            for name, runs in results.items():
                col = {key: [x[key] for x in runs] for key in runs[0]}
                rows.append((temperature, k, name, fmt_spread(col["acceptance"], "{:.3f}"),
                             fmt_spread(col["tokens_per_step"], "{:.2f}"), fmt_spread(col["mean_k"], "{:.2f}"),
                             fmt_spread(col["speed"]), fmt_spread(ratio["speed"], "{:.3f}") if name == "coupled"
                             else "1", fmt_spread(col["cpu_speed"]),
                             fmt_spread(ratio["cpu_speed"], "{:.3f}") if name == "coupled" else "1"))
    print(f"```\n{command_line('bench.samplers', argv)}\n```\n")
    print(f"{machine}\n")
    print(md_table(["temperature", "k", "sampler", "acceptance", "tokens/step", "mean k", "tokens/s (wall)",
                    "vs rejection", "tokens per CPU-s", "vs rejection"], rows, right={0, 3, 4, 5, 6, 7, 8, 9}))


if __name__ == "__main__":
    main()
