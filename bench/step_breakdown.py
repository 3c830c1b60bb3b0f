"""Where a decoding step's time goes: model forwards vs everything else, before and after the step rewrite,
eager and compiled, side by side.

For each code version (`before`: a git revision, run from a temporary export of it; `after`: this working
tree, eager; `compiled`: this tree with `LLM(compile=True)`), each pair (the embedded default pair, the
synthetic pair of bench/pairs.py), batch size and method (ar, eqspec, ragged; fixed k), one subprocess
loads the models, warms every cell up, then runs every cell; the versions alternate, `--repeats` times.
Inside a run every call of the target's and the draft's `forward` is timed (on the CPU a forward's wall
time is its compute), so

    non-forward share = 1 - (time inside forwards) / (generate wall time)

is the share of the step spent on everything else: sampling, acceptance, bookkeeping, realignment, Python.
Reported per cell: tokens/s (median and spread over the repeats) and the non-forward share (median).

    python -m bench.step_breakdown                                   # default pair + synthetic pair
    python -m bench.step_breakdown --pairs default --repeats 3 --before 5fd8984
    python -m bench.step_breakdown --cell '{...}'                    # internal: one subprocess's work

Results: bench/results/step_breakdown/ (JSONL + markdown); the table is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "step_breakdown")
VERSIONS = ("before", "after", "compiled")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pairs", default="default,synthetic", help="comma-separated: default (the embedded pair), "
                   "synthetic (bench/pairs.py, built once into bench/results/pair)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--methods", default="ar,eqspec,ragged", help="comma-separated methods")
    p.add_argument("--versions", default=",".join(VERSIONS), help="comma-separated subset of before,after,compiled")
    p.add_argument("--before", default="5fd8984", help="git revision of the 'before' code")
    p.add_argument("-k", type=int, default=5, help="fixed k of the speculative methods")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per cell (synthetic pair: half)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    p.add_argument("--threads", type=int, default=1, help="torch threads in every run")
    p.add_argument("--repeats", type=int, default=2, help="runs of every version, alternating")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ one subprocess
def run_cells(spec: dict) -> list[dict]:
    """In a subprocess whose sys.path puts the version's code first: every (B, method) cell of one pair."""
    import torch

    from specdec import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    target, draft = spec["target"], spec["draft"]
    first = LLM(target, draft, method="eqspec", num_speculative_tokens=spec["k"], batch_size=1, dtype=spec["dtype"],
                device="cpu", check_invariants=False, **({"compile": True} if spec["compiled"] else {}))
    models = {"target": first.target, "draft": first.draft}
    spent = {"forward": 0.0}
    for model in models.values():  # time every forward call
        inner = model.forward

        def timed(*args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent["forward"] += time.perf_counter() - t0

        model.forward = timed
    tokenizer = first.tokenizer
    if tokenizer is not None:
        from specdec.prompts import DEFAULT_PROMPTS, read_prompts

        prompts = [tokenizer.encode(p) for p in read_prompts(DEFAULT_PROMPTS)][: spec["num_prompts"]]
    else:
        import random

        rng = random.Random(0)
        vocab = first.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(spec["num_prompts"])]
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
    extra = {"compile": True} if spec["compiled"] else {}

    def make(method, B):
        kw = dict(method=method, batch_size=B, dtype=spec["dtype"], device="cpu", check_invariants=False, **extra)
        if method == "ar":
            return LLM(models["target"], tokenizer=tokenizer, **kw)
        return LLM(models["target"], models["draft"], num_speculative_tokens=spec["k"], tokenizer=tokenizer,
                   window_size=max(48, B), **kw)

    cells = [(m, B) for B in spec["batch_sizes"] for m in spec["methods"]]
    llms = {cell: make(*cell) for cell in cells}
    for (method, B), llm in llms.items():  # warm-up: allocations, compilation
        llm.generate(prompt_token_ids=prompts[: max(2, B)],
                     sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
    rows = []
    for (method, B), llm in llms.items():
        spent["forward"] = 0.0
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        m = outs.metrics
        rows.append({"method": method, "batch_size": B, "tokens_per_s": m.tokens_per_s, "wall_s": m.wall_time_s,
                     "forward_s": spent["forward"], "non_forward_share": 1 - spent["forward"] / m.wall_time_s,
                     "steps": m.steps, "acceptance": m.acceptance_rate if method != "ar" else None,
                     "token_ids": [o.token_ids for o in outs]})
    return rows


# ------------------------------------------------------------------------------------------------ driver
def export_revision(rev: str) -> str:
    """The code of `rev` in a temporary folder, importable as `specdec` (models/ and kernels/ linked in)."""
    folder = tempfile.mkdtemp(prefix=f"specdec-{rev}-")
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    for sub in ("models", "kernels"):
        os.symlink(os.path.join(folder, sub), os.path.join(folder, "specdec", sub))
    return folder


def run_subprocess(spec: dict, code_root: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=code_root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(spec["threads"]))
    script = os.path.abspath(__file__)
    result = subprocess.run([sys.executable, script, "--cell", json.dumps(spec)], env=env, capture_output=True,
                            text=True, cwd=code_root)
    if result.returncode:
        raise RuntimeError(f"{spec['version']} {spec['pair']} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarise(records: list[dict]) -> list[dict]:
    from bench.common import spread

    groups: dict = {}
    for r in records:
        groups.setdefault((r["pair"], r["batch_size"], r["method"], r["version"]), []).append(r)
    rows = []
    for (pair, B, method, version), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                                 VERSIONS.index(kv[0][3]))):
        rows.append({"pair": pair, "batch_size": B, "method": method, "version": version,
                     "tokens_per_s": spread([r["tokens_per_s"] for r in rs]),
                     "non_forward_share": statistics.median(r["non_forward_share"] for r in rs),
                     "steps": rs[0]["steps"], "runs": len(rs)})
    by = {(r["pair"], r["batch_size"], r["method"], r["version"]): r for r in rows}
    for r in rows:
        base = by.get((r["pair"], r["batch_size"], r["method"], "before"))
        r["vs_before"] = r["tokens_per_s"]["median"] / base["tokens_per_s"]["median"] if base else None
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    from bench.common import fmt_spread, md_table

    table = md_table(["pair", "B", "method", "code", "tokens/s (median, min-max)", "× before", "non-forward share"],
                     ([r["pair"], r["batch_size"], r["method"], r["version"], fmt_spread(r["tokens_per_s"]),
                       f"{r['vs_before']:.2f}" if r["vs_before"] else "–", f"{r['non_forward_share']:.1%}"]
                      for r in rows))
    return f"command: `{meta['command']}`  \n{meta['machine']}  \n\n{table}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cell:
        print(json.dumps(run_cells(json.loads(args.cell))))
        return 0
    # not in --cell: its `bench` may be another version
    from bench.common import command_line, machine_line, write_jsonl
    from bench.pairs import pair_dirs

    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    roots = {"after": REPO, "compiled": REPO}
    if "before" in versions:
        roots["before"] = export_revision(args.before)
    os.makedirs(args.out, exist_ok=True)
    started, records = machine_line(), []
    for repeat in range(args.repeats):
        for pair in args.pairs.split(","):
            target, draft = pair_dirs(pair)
            for version in versions:
                spec = {"version": version, "pair": pair, "target": target, "draft": draft, "k": args.k,
                        "batch_sizes": [int(b) for b in args.batch_sizes.split(",")],
                        "methods": args.methods.split(","), "compiled": version == "compiled",
                        "num_prompts": args.num_prompts if pair == "default" else max(2, args.num_prompts // 2),
                        "max_tokens": args.max_tokens, "dtype": args.dtype, "threads": args.threads}
                t0 = time.perf_counter()
                for row in run_subprocess(spec, roots[version]):
                    records.append({**row, "pair": pair, "version": version, "repeat": repeat})
                print(f"[step_breakdown] repeat {repeat} {pair} {version}: {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
    reference = {}  # every version should emit the tokens of the first eager 'after' run (float32: near-ties may flip)
    for r in records:
        if r["version"] == "after":
            reference.setdefault((r["pair"], r["batch_size"], r["method"]), r["token_ids"])
    for r in records:
        ref = reference.get((r["pair"], r["batch_size"], r["method"]))
        r["same_tokens_as_after"] = None if ref is None else r.pop("token_ids") == ref
        r.pop("token_ids", None)
    rows = summarise(records)
    meta = {"command": command_line("bench.step_breakdown", argv),
            "machine": f"{started}; {args.threads} thread(s) per run, {args.dtype}, k = {args.k}, "
                       f"{args.max_tokens} tokens"}
    write_jsonl(os.path.join(args.out, "step_breakdown.jsonl"), records)
    table = markdown(rows, meta)
    with open(os.path.join(args.out, "step_breakdown.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
