"""Soak: many short requests through one engine (each method in its own subprocess), the process's RSS and the
tokens/s of every --every finished requests; a second round after dropping the first's outputs shows a leak as
RSS growth (docs/benchmarks/soak.md).

    python -m bench.soak --methods ragged --requests 500
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import REPO, HelpFormatter, command_line, machine_line, md_table, rss_mib, write_json


def soak(method: str, n: int, every: int, max_tokens: int, max_prompt: int, batch_size: int, k: int,
         rounds: int) -> dict:
    import torch

    from specdec import LLM, SamplingParams
    from specdec.prompts import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET, read_prompts

    llm = LLM(target=DEFAULT_TARGET, draft=DEFAULT_DRAFT, method=method, num_speculative_tokens=k,
              batch_size=batch_size, dtype="float32", device="cpu", check_invariants=False)
    texts = read_prompts(DEFAULT_PROMPTS)
    ids = [llm.tokenizer.encode(t)[:max_prompt] for t in texts]
    prompts = [ids[i % len(ids)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=i) for i in range(n)]
    llm.generate(prompt_token_ids=prompts[:16], sampling_params=params[:16])  # warm-up
    gc.collect()
    samples = [{"finished": 0, "rss_mib": rss_mib(), "t": time.perf_counter(), "tokens": 0}]
    state = {"finished": 0, "tokens": 0}

    def on_output(o) -> None:
        state["finished"] += 1
        state["tokens"] += len(o.token_ids)
        if state["finished"] % every == 0:
            samples.append({"finished": state["finished"], "rss_mib": rss_mib(), "t": time.perf_counter(),
                            "tokens": state["tokens"]})

    for _ in range(rounds):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, on_output=on_output)
        assert [o.index for o in outs] == list(range(n))
        del outs
        gc.collect()
    slices = [{"finished": b["finished"], "rss_mib": round(b["rss_mib"], 1),
               "tokens_per_s": round((b["tokens"] - a["tokens"]) / (b["t"] - a["t"]), 1)}
              for a, b in zip(samples, samples[1:])]
    return {"method": method, "requests": n, "rss_start_mib": round(samples[0]["rss_mib"], 1),
            "rss_after_gc_mib": round(rss_mib(), 1), "slices": slices, "torch_threads": torch.get_num_threads(),
            "load_avg": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--methods", default="ragged,exspec", help="comma-separated, each in its own subprocess")
    p.add_argument("--requests", type=int, default=2000, help="requests per round, all given to one generate call")
    p.add_argument("--rounds", type=int, default=2, help="run the N requests this many times in one engine")
    p.add_argument("--every", type=int, default=250, help="sample RSS and tokens/s every N finished requests")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (ignore_eos)")
    p.add_argument("--max-prompt", type=int, default=32, help="prompt tokens at most")
    p.add_argument("--batch-size", type=int, default=8, help="rows decoded together")
    p.add_argument("-k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--out", help="also write the JSON results here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(soak(args.one, args.requests, args.every, args.max_tokens, args.max_prompt,
                              args.batch_size, args.k, args.rounds)))
        return

    print(f"command: {command_line('bench.soak')}")
    print(machine_line(), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    results = []
    for method in args.methods.split(","):
        cmd = [sys.executable, "-m", "bench.soak", *sys.argv[1:], "--one", method]  # this run's flags, one method
        started = time.perf_counter()
        out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        r["wall_s"] = round(time.perf_counter() - started, 1)
        results.append(r)
        tps = [s["tokens_per_s"] for s in r["slices"]]
        print(f"\n{method}: {args.rounds} x {r['requests']} requests in {r['wall_s']} s (load average at the end "
              f"{r['load_avg']})")
        print(md_table(["requests finished", "RSS MiB", "tokens/s in the slice"],
                       [["0 (after warm-up)", r["rss_start_mib"], "-"]] +
                       [[s["finished"], s["rss_mib"], s["tokens_per_s"]] for s in r["slices"]]))
        per_round = len(r["slices"]) // args.rounds
        ends = [r["slices"][(i + 1) * per_round - 1]["rss_mib"] for i in range(args.rounds)]
        trend = statistics.median(tps[-per_round:]) / statistics.median(tps[:per_round])
        print(f"RSS after warm-up {r['rss_start_mib']}, after the first slice {r['slices'][0]['rss_mib']}, at the end "
              f"of each round {ends} MiB (after gc {r['rss_after_gc_mib']}); tokens/s median "
              f"{statistics.median(tps):.1f} (range {min(tps)}-{max(tps)}), median of the last {per_round} slices / "
              f"median of the first {per_round}: {trend:.2f}", flush=True)
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
