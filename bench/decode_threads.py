"""What a second thread does to a decode step, by OpenMP wait policy (issue 41: "a second thread must never slow
a decode step").

One one-token forward of SmolLM2-135M at batch 1 after a `--context`-token prompt, as `LLM` runs it: float32
with packed weights (`f32`) and int4 (`int4`, batch-invariant as it loads). Each (engine, threads, policy)
runs in its own process (OpenMP reads its environment once, when torch loads it), the cells interleaved and
repeated; a cell reports the median step of `--steps` steps after a warm-up, and its spread over the rounds.

    python -m bench.decode_threads --rounds 3
    python -m bench.decode_threads --engines int4 --policies PASSIVE,ACTIVE,spin:20000 --threads 1,2

Policies: PASSIVE / ACTIVE (OMP_WAIT_POLICY), spin:N (GOMP_SPINCOUNT=N, no wait policy: libgomp spins N
times, then sleeps), default (neither set).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.common import HelpFormatter, comma_ints, comma_list, machine_line

DEFAULT_GGUF = ".cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf"


def cell(target: str, engine: str, threads: int, context: int, steps: int) -> float:
    """In this process: the median one-token step (seconds)."""
    import time

    import torch

    from specdec.models import load_model
    from specdec.models.numerics import packing_pays, warm_packed

    torch.set_num_threads(threads)
    model = load_model(target, quantize="int4" if engine == "int4" else None)
    model.packed_linear = engine == "f32" and packing_pays(model)
    warm_packed(model)
    cache = model.new_cache(1, context + steps + 8)
    model.forward(torch.randint(3, model.vocab_size, (1, context)), cache)
    x = torch.randint(3, model.vocab_size, (1, 1))
    for _ in range(5):
        model.forward(x, cache)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.forward(x, cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def environment(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.split(":", 1)[1]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    return env


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", default=DEFAULT_GGUF, help="the SmolLM2 .gguf file")
    p.add_argument("--engines", type=comma_list(("f32", "int4")), default=["f32", "int4"], help="what to time")
    p.add_argument("--threads", type=comma_ints, default=[1, 2], help="torch threads")
    p.add_argument("--policies", default="PASSIVE,ACTIVE", help="comma-separated: PASSIVE, ACTIVE, spin:N, default")
    p.add_argument("--context", type=int, default=200, help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, default=30, help="timed steps per cell")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        spec = json.loads(args.cell)
        print(json.dumps(cell(args.target, spec["engine"], spec["threads"], args.context, args.steps)))
        return
    cells = [(e, t, pol) for e in args.engines for t in args.threads for pol in args.policies.split(",")
             if t > 1 or pol == "PASSIVE"]  # one thread never waits: one policy is enough
    results: dict = {c: [] for c in cells}
    for r in range(args.rounds):
        for c in (cells if r % 2 == 0 else cells[::-1]):
            spec = json.dumps({"engine": c[0], "threads": c[1]})
            out = subprocess.run([sys.executable, "-m", "bench.decode_threads", "--cell", spec, "--target",
                                  args.target, "--context", str(args.context), "--steps", str(args.steps)],
                                 env=environment(c[2]), capture_output=True, text=True, check=True)
            results[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {c}: {results[c][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    print(f"`python -m bench.decode_threads {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print(machine_line() + "\n")
    print("| engine | threads | wait policy | step ms (median, min-max over rounds) | vs 1 thread |")
    print("|---|---|---|---|---|")
    for c in cells:
        med = statistics.median(results[c])
        one = statistics.median(results[(c[0], 1, "PASSIVE")]) if (c[0], 1, "PASSIVE") in results else None
        ratio = f"{one / med:.2f}x" if one else "-"
        print(f"| {c[0]} | {c[1]} | {c[2]} | {med * 1e3:.1f} ({min(results[c]) * 1e3:.1f}-{max(results[c]) * 1e3:.1f})"
              f" | {ratio} |")


if __name__ == "__main__":
    main()
