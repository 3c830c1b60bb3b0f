"""Prefill tokens/s by prompt length, the first pass over a length and the same length repeated: our model
(float32 as `LLM` runs it, with packed weights where `numerics.packing_pays`; int4 as `quantize="int4"` loads
it, batch-invariant) against transformers loading the same GGUF, interleaved.

One prefill is one forward of a [1, L] prompt into a fresh cache, logits of the last token only (what a
request's first step costs). "first" is the first forward of that exact length in the process (every
repeat uses new lengths, L + the repeat's offset, so each first pass meets a shape never seen before);
"again" is the same length straight after. Every engine is warmed up on other lengths first, so "first"
measures what a new prompt shape costs, not the process's first forward.

    python -m bench.prefill --lengths 100,300,700 --repeats 3 --threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import HelpFormatter, comma_ints, comma_list, fmt_spread, machine, machine_line, md_table, \
    write_jsonl

DEFAULT_GGUF = ".cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINES = ("f32", "int4", "hf")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", default=DEFAULT_GGUF, help="a .gguf file (transformers loads the same file)")
    p.add_argument("--engines", type=comma_list(ENGINES), default=list(ENGINES),
                   help="f32: ours in float32; int4: ours with quantize='int4'; hf: transformers in float32")
    p.add_argument("--lengths", type=comma_ints, default=[100, 300, 700], help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds; round r prefills lengths L + r * --offset (new shapes every round)")
    p.add_argument("--offset", type=int, default=1, help="tokens added to every length per round")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="write one JSONL record per (engine, length, pass) here")
    return p


def ours(path: str, quantize: str | None):
    """A prefill call of our model as `LLM` would load it."""
    from specdec.models import load_model
    from specdec.models.numerics import packing_pays

    model = load_model(path, dtype="float32", quantize=quantize)
    if quantize is None and packing_pays(model):
        model.packed_linear = True

    def prefill(ids: torch.Tensor) -> None:
        cache = model.new_cache(1, ids.shape[1] + 64)  # room for the answer, as a request's cache has
        model(ids, cache, logits="last")
    return prefill


def transformers_model(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path), dtype=torch.float32).eval()

    def prefill(ids: torch.Tensor) -> None:
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)
    return prefill


def timed(fn, ids) -> float:
    t0 = time.perf_counter()
    fn(ids)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    loaders = {"f32": lambda: ours(args.target, None), "int4": lambda: ours(args.target, "int4"),
               "hf": lambda: transformers_model(args.target)}
    engines = {name: loaders[name]() for name in args.engines}
    gen = torch.Generator().manual_seed(0)
    longest = max(args.lengths) + args.repeats * args.offset
    tokens = torch.randint(3, 40000, (1, longest), generator=gen)  # [1, longest]
    warm = sorted({max(1, L // 2 + 7) for L in args.lengths} | {longest + 13})  # lengths never timed
    for fn in engines.values():
        for L in warm:
            fn(torch.randint(3, 40000, (1, L), generator=gen))
    times = {}  # (engine, L, pass) -> [seconds per round]
    names = list(engines)
    for rep in range(args.repeats):
        for L in args.lengths:
            ids = tokens[:, : L + rep * args.offset]  # [1, L'] a length this process has not seen
            for name in names[rep % len(names):] + names[: rep % len(names)]:  # rotate the order
                times.setdefault((name, L, "first"), []).append(timed(engines[name], ids))
                times.setdefault((name, L, "again"), []).append(timed(engines[name], ids))
    meta = machine()
    records, rows = [], []
    for L in args.lengths:
        for name in names:
            first, again = times[(name, L, "first")], times[(name, L, "again")]
            ratio = [f / a for f, a in zip(first, again)]
            vs_hf = ([h / a for h, a in zip(times[("hf", L, "again")], again)]
                     if "hf" in engines and name != "hf" else None)
            rows.append([L, name, fmt_spread([L / t for t in first], "{:.0f}"), fmt_spread([L / t for t in again], "{:.0f}"),
                         fmt_spread(ratio, "{:.2f}"), fmt_spread(vs_hf, "{:.2f}")])
            for kind, values in (("first", first), ("again", again)):
                records.append({"engine": name, "length": L, "pass": kind, "seconds": values,
                                "tokens_per_s": statistics.median(L / t for t in values), "threads": args.threads,
                                **{f"machine_{k}": v for k, v in meta.items()}})
    print(machine_line(meta))
    print(md_table(["prompt tokens", "engine", "first pass tok/s", "again tok/s", "first / again (time)",
                    "× hf (again)"], rows))
    if args.out:
        write_jsonl(args.out, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
