"""Scale-out on Ray: 2 replicas x 1 torch thread (`specdec.distributed.stream_job`, what `specdec.run --ray`
runs) against 1 process x 2 torch threads on the same prompts, and what Ray costs to start, repeated back to
back (docs/benchmarks/ray.md). Prints markdown tables; --out also writes the raw measurements as JSON.

    python -m bench.distributed --num-prompts 64 --repeats 3
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from bench.common import HelpFormatter, command_line, fmt_spread, machine_line, md_table, write_json
from specdec import LLM, SamplingParams, distributed
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET, read_prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="target checkpoint")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft checkpoint")
    p.add_argument("--num-prompts", type=int, default=64, help="the built-in prompts, cycled to this many")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (ignore_eos)")
    p.add_argument("--method", default="eqspec", help="decoding method")
    p.add_argument("--batch-size", type=int, default=8, help="rows decoded together, per process")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=5, help="draft tokens per step")
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.add_argument("--block-size", type=int, default=16, help="prompts per Ray block")
    p.add_argument("--repeats", type=int, default=3, help="back-to-back repeats of both sides")
    p.add_argument("--out", help="write the raw measurements as JSON here")
    return p.parse_args(argv)


def llm_kwargs(args, device="cpu") -> dict:
    return dict(target=args.target, draft=args.draft, method=args.method,
                num_speculative_tokens=args.num_speculative_tokens, batch_size=args.batch_size, dtype=args.dtype,
                device=device)


def run_single(args, prompts: list[str]) -> dict:
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(args))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    generate_s = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in out)
    return {"load_s": load_s, "generate_s": generate_s, "tokens": tokens, "token_ids": [o.token_ids for o in out]}


def run_ray_job(ray, args, prompts: list[str], max_tokens: int, block_size: int) -> dict:
    chunks, total = distributed.plan_chunks(prompts, None, None, block_size)
    placement = distributed.place_replicas("cpu", 2, ray.cluster_resources(), strict=True, blocks=len(chunks))
    replica_kwargs = dict(llm_kwargs=llm_kwargs(args), threads=1,
                          sampling=dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    job = distributed.stream_job(ray, chunks, total, replica_kwargs, placement, progress=False, samples=total)
    wall_s = time.perf_counter() - t0
    assert job.errors == 0 and len(job.samples) == total
    return {"wall_s": wall_s, "first_block_s": job.first_block_s, "tokens": job.metrics.generated_tokens,
            "decode_tps": job.decode_tokens_per_s, "utilisation": job.utilisation,
            "token_ids": [row["token_ids"] for row in job.samples]}


def one_repeat(ray, args, prompts: list[str]) -> dict:
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
             logging_level=logging.ERROR)
    init_s = time.perf_counter() - t0
    try:
        empty = run_ray_job(ray, args, prompts[:2], max_tokens=1, block_size=1)  # one block per replica
        job = run_ray_job(ray, args, prompts, args.max_tokens, args.block_size)
    finally:
        ray.shutdown()
    single = run_single(args, prompts)
    assert job["tokens"] == single["tokens"] == len(prompts) * args.max_tokens
    same = sum(a == b for a, b in zip(job.pop("token_ids"), single.pop("token_ids"))) / len(prompts)
    tokens = single["tokens"]
    return {
        "ray_init_s": init_s, "empty_job_s": empty["wall_s"], "ray_job_s": job["wall_s"],
        "ray_first_block_s": job["first_block_s"], "single_load_s": single["load_s"],
        "single_generate_s": single["generate_s"], "tokens": tokens, "same_tokens": same,
        "single_tps": tokens / single["generate_s"],
        "single_tps_with_load": tokens / (single["load_s"] + single["generate_s"]),
        "ray_tps": tokens / job["wall_s"], "ray_decode_tps": job["decode_tps"], "ray_utilisation": job["utilisation"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    ray = distributed.import_ray()
    base = read_prompts(DEFAULT_PROMPTS)
    prompts = [base[i % len(base)] for i in range(args.num_prompts)]
    command = command_line("bench.distributed", argv)
    started = machine_line()
    load_before = os.getloadavg()
    repeats = []
    for r in range(args.repeats):
        repeats.append(one_repeat(ray, args, prompts))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v:.2f}" for k, v in repeats[-1].items()),
              file=sys.stderr, flush=True)
    load_after = os.getloadavg()

    def col(name):
        return [x[name] for x in repeats]

    ratio_e2e = [x["ray_tps"] / x["single_tps"] for x in repeats]
    ratio_decode = [x["ray_decode_tps"] / x["single_tps"] for x in repeats]
    print(f"`{command}`\n")
    print(f"{args.num_prompts} prompts x {args.max_tokens} new tokens (ignore_eos), {args.method}, batch "
          f"{args.batch_size}, k {args.num_speculative_tokens}, {args.dtype}; pair {args.target} / {args.draft}; "
          f"Ray blocks of {args.block_size} prompts; {args.repeats} repeats, median (min-max). "
          f"ray {ray.__version__}; {started}, {load_after[0]:.1f} after.\n")
    print(md_table(["", "tokens/s", "ratio to 1 process x 2 threads (same repeat)"], [
        ["1 process x 2 threads (generate)", fmt_spread(col("single_tps")), 1],
        ["1 process x 2 threads (load + generate)", fmt_spread(col("single_tps_with_load")), ""],
        ["2 Ray replicas x 1 thread, end to end (job wall)", fmt_spread(col("ray_tps")),
         fmt_spread(ratio_e2e, "{:.2f}")],
        ["2 Ray replicas x 1 thread, while decoding (tokens / replicas' generate time)",
         fmt_spread(col("ray_decode_tps")), fmt_spread(ratio_decode, "{:.2f}")]]) + "\n")
    print(md_table(["Ray start-up", "seconds"], ([label, fmt_spread(col(key), spec)] for label, key, spec in (
        ("ray.init, local instance (2 CPUs, no dashboard)", "ray_init_s", "{:.2f}"),
        ("empty job (2 prompts x 1 token: replicas start, load the pair)", "empty_job_s", "{:.2f}"),
        ("first block of the ray job", "ray_first_block_s", "{:.2f}"),
        ("(replicas decoding, share of the ray job)", "ray_utilisation", "{:.0%}"),
        ("single process: LLM load", "single_load_s", "{:.2f}")))))
    print(f"\nrequests with the same tokens as the single run: {fmt_spread(col('same_tokens'), '{:.0%}')}")
    if args.out:
        write_json(args.out, {"command": command, "args": vars(args), "load": [load_before, load_after],
                              "repeats": repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
