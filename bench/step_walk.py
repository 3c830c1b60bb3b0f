"""The functions one engine step passes through: every function of this project's files (specdec/, models/,
kernels/) called during one decode step of the embedded default pair, in first-call order, with its calls in
that step. docs/design.md's step walk quotes its counts (functions, calls, files), before and after a change.

    python -m bench.step_walk                       # eqspec, k = 3, 2 rows
    python -m bench.step_walk --method ragged --json walk.json
    PYTHONPATH=/tmp/old python -m bench.step_walk   # an old checkout (its specdec/models, specdec/kernels linked)

Comprehensions and generator expressions (`<locals>.<listcomp>`) are counted apart: they are not functions a
reader follows. The step timed is the third: the first prefills, the second runs a step with every buffer
already allocated.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="eqspec", choices=("ar", "eqspec", "exspec", "ragged"), help="the strategy")
    p.add_argument("-k", type=int, default=3, help="drafts per step (fixed)")
    p.add_argument("--rows", type=int, default=2, help="requests decoding together")
    p.add_argument("--json", metavar="FILE", help="also write the walk as JSON")
    return p.parse_args(argv)


def walk(method: str, k: int, rows: int) -> Counter:
    """Calls per project function (`path:qualname`) during one decode step."""
    import specdec
    from specdec import LLM, SamplingParams
    from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET

    root = os.path.dirname(os.path.dirname(os.path.abspath(specdec.__file__)))
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT if method != "ar" else None, method=method, batch_size=rows,
              num_speculative_tokens=k if method != "ar" else 0, dtype="float32", cost_cache="",
              check_invariants=False)
    engine = llm.engine(stream_text=False)
    for i in range(rows):
        engine.add_request(llm.tokenizer.encode(f"def f{i}(a, b):"), SamplingParams(max_tokens=32))
    engine.step()
    engine.step()
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(root) and "/tests/" not in path and "/bench/" not in path:
                calls[f"{os.path.relpath(path, root)}:{frame.f_code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return calls


def main(argv=None) -> None:
    args = parse_args(argv)
    calls = walk(args.method, args.k, args.rows)
    named = {f: n for f, n in calls.items() if "<locals>.<" not in f}
    for f, n in calls.items():
        print(f"{n:5d}  {f}")
    files = {f.split(":")[0] for f in named}
    inner = sum(calls.values()) - sum(named.values())  # calls of comprehensions
    print(f"\n{args.method}, k = {args.k}, {args.rows} rows: {len(named)} functions, {sum(named.values())} calls, "
          f"{len(files)} files (+ {len(calls) - len(named)} comprehensions, {inner} calls)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"method": args.method, "k": args.k, "rows": args.rows, "calls": dict(calls)}, f, indent=1)


if __name__ == "__main__":
    main()
