"""What it costs to admit a request into a running EQSPEC batch: time and bytes copied, against the cache
size of the rows already running.

The running batch: `--rows` rows (32) of a tiny random target/draft pair (see `MODEL` / `DRAFT` below),
left-padded, whose sequences hold about `--lengths` tokens (each length is one measurement; the rows differ
by a few tokens so that they are really left-padded). One row that is neither the longest nor the last
finishes; then exactly what the engine runs between two steps is timed: the scheduler's `postprocess` (the
realignment after the step) and `admit` (prefill of one waiting request of `--prompt` tokens, putting it in
the batch, realigning). The running rows' caches are filled with random values instead of being prefilled
(a 2k-token prefill of 32 rows is not what is measured).

Bytes copied: every tensor operation outside the models' forwards is counted by a `TorchDispatchMode` as
the bytes it writes (the outputs of out-of-place operations, the written arguments of in-place ones; views
are free), so the count covers whatever the code under test does, before or after a change.

    python -m bench.admission                                  # this tree
    python -m bench.admission --tree /tmp/old --tree .         # another checkout first (e.g. a git worktree
                                                               # of the old commit), alternating, --repeats
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tiny random pair: llama family, float32
MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=32)
DRAFT = dict(MODEL, num_layers=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=32, help="rows of the running batch (its batch size)")
    p.add_argument("--lengths", default="512,2048", help="comma-separated: tokens per running row's sequence, "
                   "one measurement each")
    p.add_argument("--prompt", type=int, default=16, help="tokens of the newcomer's prompt")
    p.add_argument("--repeats", type=int, default=3, help="measurements per tree and length (median reported)")
    p.add_argument("--tree", action="append", help="a checkout of this repository to measure (repeatable; "
                   "default: this one); trees alternate")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", action="store_true", help="one JSON line per measurement instead of the table")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ one subprocess
def measure(rows: int, length: int, prompt: int, threads: int) -> dict:
    """In a subprocess whose sys.path puts the tree under test first."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.config import ModelConfig
    from models.transformer import Transformer
    from specdec.batch import DRAFT_LAG, DecodeContext
    from specdec.prefill import prefill
    from specdec.metrics import PhaseTimer, RunMetrics
    from specdec.models.cache import LEFT_PADDED
    from specdec.options import Options
    from specdec.request import Request
    from specdec.sampling import SamplingParams
    from specdec.schedulers import SCHEDULERS

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def model(shape):
        m = Transformer(ModelConfig(family="llama", **shape))
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
        return m.eval()

    target, draft = model(MODEL), model(DRAFT)
    k = 4
    options = Options.build(num_speculative_tokens=k)
    metrics = RunMetrics("eqspec", rows)
    ctx = DecodeContext(target, draft, options, MODEL["vocab_size"], torch.device("cpu"), metrics,
                        PhaseTimer(metrics, "cpu"), proposer=object())  # a proposer: k_max = k
    params = SamplingParams(max_tokens=length + 64, ignore_eos=True)
    requests = [Request(i, [1 + i % 200] * 8, params, frozenset()) for i in range(rows)]
    with torch.inference_mode():
        scheduler = SCHEDULERS["eqspec"](ctx, rows)
        capacity = length + 2 * prompt + 128  # room for the newcomer: no growth in columns
        batch = prefill(ctx, requests, LEFT_PADDED, capacity)
        batch = batch[0] if isinstance(batch, tuple) else batch  # (batch, first tokens) since the commit moved
        # grow every sequence to about `length` tokens (row i: length - 3 * i), caches of random values
        seqs = [length - 3 * i for i in range(rows)]
        for r, s in zip(requests, seqs):
            r.commit([5] * (s - r.sequence_length))
        longest = max(seqs) - 1
        for cache, lag in ((batch.target_cache, 1), (batch.draft_cache, DRAFT_LAG)):
            cache.k.normal_()
            cache.v.normal_()
            lengths = [s - lag for s in seqs]
            starts = [longest - (s - 1) for s in seqs]
            cache.set_rows(torch.tensor(starts), starts, torch.tensor(lengths), lengths)
        batch.seq_len = torch.tensor(seqs)
        batch.tokens[:, :] = 5
        scheduler.batch = batch
        finished = requests[rows // 3]
        finished.finish(time.perf_counter(), "abort")
        newcomer = Request(rows, [7] * prompt, params, frozenset())
        scheduler.waiting.append(newcomer)

        written = {"bytes": 0, "in_forward": 0, "by_op": {}}

        def count(func, nbytes):
            written["bytes"] += nbytes
            name = func.__name__
            written["by_op"][name] = written["by_op"].get(name, 0) + nbytes

        class CountWrites(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if written["in_forward"]:
                    return out
                schema = func._schema
                mutated = [a for a, arg in zip(args, schema.arguments) if arg.alias_info is not None
                           and arg.alias_info.is_write and isinstance(a, torch.Tensor)]
                if mutated:
                    count(func, sum(t.numel() * t.element_size() for t in mutated))
                elif not any(r.alias_info is not None for r in schema.returns):  # not a view
                    for t in out if isinstance(out, (tuple, list)) else (out,):
                        if isinstance(t, torch.Tensor):
                            count(func, t.numel() * t.element_size())
                return out

        forward_s = [0.0]

        def timed(forward):
            def run(*a, **kw):
                written["in_forward"] += 1
                t0 = time.perf_counter()
                try:
                    return forward(*a, **kw)
                finally:
                    forward_s[0] += time.perf_counter() - t0
                    written["in_forward"] -= 1
            return run

        target.forward, draft.forward = timed(target.forward), timed(draft.forward)
        with CountWrites():  # warm-up: the first dispatch under a mode imports torch._dynamo (seconds)
            torch.zeros(1)
        written.update(bytes=0, by_op={})
        cache_bytes = sum(c.k.numel() * c.k.element_size() * 2 for c in batch.caches())
        with CountWrites():
            started = time.perf_counter()
            scheduler.postprocess(batch)
            scheduler.admit()
            seconds = time.perf_counter() - started
    admitted = scheduler.batch
    assert newcomer in admitted.requests and finished not in admitted.requests and len(admitted) == rows
    ends = {s + n for s, n in zip(admitted.target_cache.host_start, admitted.target_cache.host_length)}
    assert len(ends) == 1, f"rows end at different columns: {sorted(ends)}"
    return {"rows": rows, "length": length, "prompt": prompt, "seconds": seconds,
            "seconds_outside_forward": seconds - forward_s[0], "bytes_written": written["bytes"],
            "batch_cache_bytes": cache_bytes,
            "largest_writes": dict(sorted(written["by_op"].items(), key=lambda kv: -kv[1])[:4])}


# -------------------------------------------------------------------------------------------------- driver
def run_cell(tree: str, cell: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "bench.admission", "--cell", json.dumps(cell)], cwd=tree, env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.cell:
        print(json.dumps(measure(**json.loads(args.cell))))
        return
    trees = [os.path.abspath(t) for t in (args.tree or [REPO])]
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict = {}
    for _ in range(args.repeats):
        for length in lengths:
            for tree in trees:  # alternating
                if not os.path.exists(os.path.join(tree, "bench", "admission.py")):
                    raise SystemExit(f"--tree {tree}: no bench/admission.py there (copy this file into it)")
                cell = dict(rows=args.rows, length=length, prompt=args.prompt, threads=args.threads)
                r = run_cell(tree, cell)
                if args.json:
                    print(json.dumps(dict(r, tree=tree)))
                results.setdefault((tree, length), []).append(r)
    if args.json:
        return
    print(f"EQSPEC admission: {args.rows} running rows, newcomer prompt {args.prompt} tokens; target "
          f"{MODEL['num_layers']} layers x {MODEL['num_kv_heads']} KV heads x {MODEL['head_dim']}, draft "
          f"{DRAFT['num_layers']} layer; float32; median of {args.repeats}")
    print("| tree | tokens per running row | batch's K/V (MiB) | admission ms | outside forwards ms | MiB written |")
    print("|---|---:|---:|---:|---:|---:|")
    for (tree, length), rs in results.items():
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        print(f"| {tree} | {length} | {rs[0]['batch_cache_bytes'] / 2**20:.0f} | {med('seconds') * 1e3:.1f} | "
              f"{med('seconds_outside_forward') * 1e3:.1f} | {med('bytes_written') / 2**20:.2f} |")


if __name__ == "__main__":
    main()
