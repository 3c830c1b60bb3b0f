"""Batch-invariant numerics (`LLM(batch_invariant=True)`): what it fixes, what it costs.

probe: which torch CPU ops give a row the same bits whatever else is in the call, per dtype; equivalence: greedy
eqspec/ragged/exspec at batch 8 against AR at batch 1 on SpecBench, mode off and on; pool-prefill: the same, mode
on, bfloat16, on issue 42's 96 short prompts (first lines of this Python's stdlib test files), at exspec's two
configurations, optionally on a simulated CPU whose bfloat16 kernel changes above --simulate-switch rows; cost:
tokens/s with the mode off and on, interleaved, both pairs (docs/benchmarks/batch-invariant.md). JSON and
markdown go to --out (default bench/results/batch_invariant).

    python -m bench.batch_invariant probe
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.common import (REPO, HelpFormatter, comma_list, command_line, file_sha256, fmt_spread, interleave,
                          log, machine_line, md_table, random_prompts, write_json)
from bench.pairs import pair_dirs

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "batch_invariant")
SPEC_METHODS = ("eqspec", "ragged", "exspec")


# ------------------------------------------------------------------------------------------------ probe
def _rows_alone_vs_batched(fn, X, sizes=(1, 2, 3, 4, 5, 8, 17, 48, 130, 1030), shifts=(0, 1, 3), alone=24,
                           tile=8):
    """Cases where a row of fn(X[s:s+M]) differs from that row alone: (M, shift) list, of how many. Every row of
    every call is compared, with the row in calls of `tile` rows (whose first `alone` rows are compared with each
    row alone): a kernel that rounds otherwise may change only a few elements of a large call."""
    ref = torch.cat([fn(X[i:i + 1].clone()) for i in range(alone)])
    tiled = torch.cat([fn(X[i:i + tile].clone()) for i in range(0, len(X), tile)])
    bad, total = ([(1, "tiles")] if not torch.equal(tiled[:alone], ref) else []), 1
    for M in sizes:
        for s in shifts:
            if s >= len(X):
                continue
            total += 1
            rows = fn(X[s:s + M].clone())
            if not torch.equal(rows, tiled[s:s + len(rows)]):
                bad.append((M, s))
    return bad, total


def isa_line() -> str:
    """The CPU's vector extensions that decide the libraries' kernels, and torch's dispatch level."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    have = [w for w in wanted if w in flags] or ["(no /proc/cpuinfo flags)"]
    return f"CPU flags {' '.join(have)}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def _elementwise_position(fn, x):
    """Elements where fn on a contiguous tensor and on a strided view (torch's scalar loop) differ."""
    pair = torch.stack([x, x], dim=1)  # [N, 2]
    return int((fn(pair[:, 0].contiguous()) != fn(pair[:, 0])).sum()), x.numel()


def _sdpa_case(dtype, pad, T, last, q, k, v):
    from specdec.kernels import bi_attention as ba

    Hkv, D = k.shape[1], k.shape[3]
    noise = torch.randn(1, Hkv, pad, D, generator=torch.Generator().manual_seed(pad)).to(dtype)
    kk = torch.cat([noise, k[:, :, :last + 1]], 2)
    vv = torch.cat([noise, v[:, :, :last + 1]], 2)
    qq = q[:, :, last - T + 1: last + 1]
    W = pad + last + 1
    c = torch.arange(W)
    cols = pad + torch.arange(last - T + 1, last + 1)
    mask = ((c[None] >= pad) & (c[None] <= cols[:, None]))[None]  # [1, T, W]
    bias = torch.where(mask, torch.zeros((), dtype=dtype), float("-inf"))[:, None]
    sdpa = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=bias, enable_gqa=True)[:, :, -1]
    ours = ba.bi_attention(qq, kk, vv, mask, backend="torch")[:, :, -1]
    return sdpa, ours


def probe() -> dict:
    """Measure which torch CPU paths give a row the same bits whatever else is in the call."""
    from specdec.kernels import bi_attention as ba
    from specdec.kernels import bi_matmul as bm
    from specdec.models.transformer import RMSNorm

    torch.manual_seed(0)
    results = {}
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        row = results[name] = {}
        W = torch.randn(640, 384).to(dtype)
        b = torch.randn(640).to(dtype)
        X = torch.randn(1040, 384).to(dtype)
        row["F.linear (M = B*T rows)"] = _rows_alone_vs_batched(lambda x: F.linear(x, W, b), X)
        row["linear, rows padded to 4 (MKL)"] = _rows_alone_vs_batched(lambda x: bm.padded_linear(x, W, b), X)
        if dtype == torch.float32 and bm.onednn_available():
            packed = bm.pack_weight(W)
            row["linear, oneDNN packed weight"] = _rows_alone_vs_batched(
                lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""), X)
        row["bi_linear (the mode)"] = _rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="torch"), X)
        threads = torch.get_num_threads()
        plan = bm.cpu_plan(dtype, threads, (640, 384))
        row["bi_linear's plan (cpu_plan)"] = (
            "as called" if plan == bm.RowPlan(threads, None) else "one thread" if plan.block is None
            else f"blocks of {plan.block} row(s), {plan.threads} thread(s)")
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        for transposed, what in ((True, "scores: rows x K^T view"), (False, "chunk outputs: probs x V")):
            ok = ba.bmm_keeps_rows(acc, bm.RowPlan(threads, None), 64, 64, transposed)
            row[f"bi_attention's bmm, {what}, up to 128 matrices x 200 rows (in float32; float64 for float64)"] = (
                [] if ok else [None], 1)
        keys = torch.randn(2, 64, 64).to(dtype)  # [batch, chunk, D]: what bi_attention multiplies, K^T as a view

        def scores(x):
            rows = torch.cat([x, x.new_zeros(bm.padded_rows(len(x)) - len(x), 64)])[None].expand(2, -1, -1)
            return torch.bmm(rows.contiguous(), keys.transpose(1, 2))[0, :len(x)]

        row["bmm rows x K^T view (batch 2), rows padded to 4"] = _rows_alone_vs_batched(
            scores, torch.randn(200, 64).to(dtype))
        norm = RMSNorm(384, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(384))
            row["RMSNorm (rows)"] = _rows_alone_vs_batched(norm, X * 3)
        logits = torch.randn(200, 4000).to(dtype) * 4
        row["softmax over V (rows)"] = _rows_alone_vs_batched(lambda x: x.float().softmax(-1), logits)
        row["log_softmax over V (rows)"] = _rows_alone_vs_batched(lambda x: x.float().log_softmax(-1), logits)
        x = (torch.randn(1 << 20) * 4).to(dtype)
        ops = (("silu", F.silu), ("sigmoid", torch.sigmoid), ("exp", torch.exp), ("cos", torch.cos),
               ("sin", torch.sin), ("x / (1 + exp(-x))", lambda t: t / (1 + torch.exp(-t))))
        for op_name, op in ops:
            row[f"{op_name}: vector loop vs scalar tail"] = _elementwise_position(op, x)
        if dtype == torch.bfloat16:  # every bfloat16 value
            every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            every = every[torch.isfinite(every)]
            row["silu: every bfloat16 input, vector vs scalar"] = _elementwise_position(F.silu, every)
        H, Hkv, D, L = 6, 2, 64, 300
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, h, L, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
        sdpa_bad = ours_bad = total = 0
        for last in (10, 70, 250):
            base_sdpa, base_ours = _sdpa_case(dtype, 0, 1, last, q, k, v)
            for pad in (0, 1, 5, 40):
                for T in (1, 2, 6):
                    if pad == 0 and T == 1:
                        continue
                    s, o = _sdpa_case(dtype, pad, T, last, q, k, v)
                    total += 1
                    sdpa_bad += not torch.equal(s, base_sdpa)
                    ours_bad += not torch.equal(o, base_ours)
        row["SDPA (query vs T, left padding)"] = ([None] * sdpa_bad, total)
        row["bi_attention (the mode)"] = ([None] * ours_bad, total)
    return results


def probe_table(results: dict) -> str:
    def cell(op, dtype):
        if op not in results[dtype]:
            return "-"
        if isinstance(results[dtype][op], str):
            return results[dtype][op]
        bad, total = results[dtype][op]
        n = bad if isinstance(bad, int) else len(bad)
        return "invariant" if n == 0 else f"**varies** ({n}/{total})"

    ops = dict.fromkeys(op for d in results for op in results[d])
    return md_table(["op", *results], ([op] + [cell(op, d) for d in results] for op in ops))


# ------------------------------------------------------------------------------------------ equivalence
def specbench_ids(path: str, tokenizer, num_prompts: int | None, max_prompt_tokens: int) -> tuple[list, int]:
    """Token ids of the first `num_prompts` prompts (all when None), each cut to its first
    `max_prompt_tokens` tokens; and how many were cut."""
    from specdec.prompts import read_prompts

    prompts = read_prompts(path)
    if num_prompts:
        prompts = prompts[:num_prompts]
    ids = [tokenizer.encode(p) for p in prompts]
    return [x[:max_prompt_tokens] for x in ids], sum(len(x) > max_prompt_tokens for x in ids)


def equivalence(args) -> dict:
    from specdec import LLM, SamplingParams
    from specdec.models import load_tokenizer
    from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET

    target, draft = args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT
    tokenizer = load_tokenizer(target)
    with open(os.path.join(target, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    max_prompt = context - args.max_tokens - args.k - 1
    if args.max_prompt_tokens:
        max_prompt = min(max_prompt, args.max_prompt_tokens)
    ids, cut = specbench_ids(args.prompts, tokenizer, args.num_prompts, max_prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    info = {"target": target, "draft": draft, "prompts": args.prompts,
            "target_sha256": file_sha256(os.path.join(target, "model.safetensors"), 16),
            "draft_sha256": file_sha256(os.path.join(draft, "model.safetensors"), 16), "num_prompts": len(ids),
            "max_prompt_tokens": max_prompt, "prompts_cut": cut, "max_tokens": args.max_tokens, "k": args.k,
            "batch_size": args.batch_size, "machine": machine_line(), "runs": []}
    for dtype in args.dtypes:
        for mode in args.modes:
            t0 = time.perf_counter()
            ar = LLM(target, method="ar", batch_size=1, dtype=dtype, batch_invariant=mode)
            ref = ar.generate(prompt_token_ids=ids, sampling_params=params)
            run = {"dtype": dtype, "batch_invariant": mode, "method": "ar", "batch_size": 1,
                   "tokens_per_s": ref.metrics.tokens_per_s, "seconds": time.perf_counter() - t0}
            info["runs"].append(run)
            log("equivalence", f"{dtype} mode={'on' if mode else 'off'} ar@1: {run['seconds']:.0f}s")
            for method in SPEC_METHODS:
                t0 = time.perf_counter()
                llm = LLM(target, draft, method=method, num_speculative_tokens=args.k, batch_size=args.batch_size,
                          dtype=dtype, batch_invariant=mode)
                outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
                mismatched = [o.index for o, r in zip(outs, ref) if o.token_ids != r.token_ids]
                run = {"dtype": dtype, "batch_invariant": mode, "method": method, "batch_size": args.batch_size,
                       "matches": len(ids) - len(mismatched), "of": len(ids), "mismatched": mismatched,
                       "acceptance": outs.metrics.acceptance_rate, "tokens_per_s": outs.metrics.tokens_per_s,
                       "seconds": time.perf_counter() - t0}
                info["runs"].append(run)
                log("equivalence", f"{dtype} mode={'on' if mode else 'off'} {method}@{args.batch_size}: "
                    f"{run['matches']}/{len(ids)} match AR@1 ({run['seconds']:.0f}s)")
    return info


def equivalence_table(info: dict) -> str:
    by = {(r["dtype"], r["batch_invariant"], r["method"]): r for r in info["runs"]}
    rows = [[dtype, "on" if mode else "off"] + [f"{by[dtype, mode, m]['matches']}/{by[dtype, mode, m]['of']}"
                                                 if (dtype, mode, m) in by else "-" for m in SPEC_METHODS]
            for dtype, mode in dict.fromkeys((r["dtype"], r["batch_invariant"]) for r in info["runs"])]
    return md_table(["dtype", "batch_invariant"] + [f"{m} == AR@1" for m in SPEC_METHODS], rows)


# ----------------------------------------------------------------------------------------- pool prefill
ISSUE42_PROMPT = "class TestEUCKRMap(multibytecodec_support.TestBase_Mapping,\n"
POOL_PREFILL_RUNS = (("exspec", 8, 5), ("exspec", 5, 3), ("eqspec", 8, 5), ("ragged", 8, 5))


def stdlib_prompts(count: int = 96) -> list[str]:
    """Issue 42's prompt (`ISSUE42_PROMPT`) at index 47 among the first `class`/`def` line (with its newline)
    of each of the first count - 1 `test_*.py` files of this Python's Lib/test, in name order."""
    import glob
    import sysconfig

    lines = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "test", "test_*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            line = next((x for x in f if x.startswith(("class ", "def "))), None)
        if line is not None:
            lines.append(line)
        if len(lines) == count - 1:
            break
    return lines[:47] + [ISSUE42_PROMPT] + lines[47:]


def simulated_switch(rows: int):
    """A stand-in for bi_matmul's CPU path on a CPU whose bfloat16 kernel sums otherwise in calls of more than
    `rows` rows: there, MKL's float32 GEMM of the upcast inputs, rounded once (other bfloat16 bits in about 1e-4
    of the outputs)."""
    from specdec.kernels import bi_matmul as bm

    real = bm._cpu_linear

    def kernel(x, weight, bias=None, packed=None):
        if x.dtype == torch.bfloat16 and x.shape[0] > rows:
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        return real(x, weight, bias, packed)

    return kernel


def pool_prefill(args) -> dict:
    from specdec import LLM, SamplingParams
    from specdec.kernels import bi_matmul as bm
    from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET

    if args.simulate_switch:
        bm._cpu_linear = simulated_switch(args.simulate_switch)
    largest = [0]
    reference = bm.bi_matmul_reference

    def counted(x, *rest):  # the largest call of each run (before bounded_linear splits it)
        largest[0] = max(largest[0], x.shape[0])
        return reference(x, *rest)

    bm.bi_matmul_reference = counted
    prompts = stdlib_prompts()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    info = {"machine": f"{machine_line()}; {isa_line()}", "simulate_switch": args.simulate_switch,
            "num_prompts": len(prompts), "max_tokens": args.max_tokens, "runs": []}
    t0 = time.perf_counter()
    ref = LLM(DEFAULT_TARGET, method="ar", batch_size=1, dtype="bfloat16", batch_invariant=True).generate(
        prompts, sampling_params=params)
    info["runs"].append({"method": "ar", "batch_size": 1, "k": None, "largest_call_rows": largest[0],
                         "seconds": time.perf_counter() - t0})
    for method, batch, k in POOL_PREFILL_RUNS:
        largest[0] = 0
        t0 = time.perf_counter()
        outs = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method=method, batch_size=batch, num_speculative_tokens=k,
                   dtype="bfloat16", batch_invariant=True).generate(prompts, sampling_params=params)
        mismatched = [(o.index, next(i for i, (a, b) in enumerate(zip(o.token_ids + [None], r.token_ids + [None]))
                                     if a != b)) for o, r in zip(outs, ref) if o.token_ids != r.token_ids]
        run = {"method": method, "batch_size": batch, "k": k, "matches": len(prompts) - len(mismatched),
               "of": len(prompts), "mismatched": mismatched, "largest_call_rows": largest[0],
               "seconds": time.perf_counter() - t0}
        info["runs"].append(run)
        log("pool-prefill", f"{method} B {batch} k {k}: {run['matches']}/{len(prompts)} match AR@1, largest call "
            f"{largest[0]} rows ({run['seconds']:.0f}s)")
    return info


def pool_prefill_table(info: dict) -> str:
    return md_table(["method", "B", "k", "== AR@1", "mismatched (prompt @ token)", "largest linear call (rows)"],
                    ([r["method"], r["batch_size"], r["k"] or "-", f"{r['matches']}/{r['of']}" if "of" in r else "-",
                      ", ".join(f"{i} @ {t}" for i, t in r.get("mismatched", [])) or "-", r["largest_call_rows"]]
                     for r in info["runs"]), right={5})


# ------------------------------------------------------------------------------------------------ cost
COST_CONFIGS = (("ar", 1), ("ar", 8), ("eqspec", 8), ("ragged", 8), ("exspec", 8))


def cost(args) -> dict:
    from specdec import LLM, SamplingParams
    from specdec.models import load_model, load_tokenizer

    info = {"machine": machine_line(), "rounds": args.rounds, "max_tokens": args.max_tokens, "k": args.k, "cells": []}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for pair in args.pairs:
        target, draft = pair_dirs(pair)
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        if pair == "default":
            prompts, _ = specbench_ids(args.prompts, load_tokenizer(target), args.cost_prompts,
                                       config["max_position_embeddings"] - args.max_tokens - args.k - 1)
        else:
            prompts = random_prompts(args.cost_prompts, config["vocab_size"])
        for dtype in args.dtypes:
            engines = {}
            for mode in (False, True):
                t_model, d_model = load_model(target, dtype=dtype), load_model(draft, dtype=dtype)
                for method, batch in COST_CONFIGS:
                    engines[mode, method, batch] = LLM(
                        t_model, d_model if method != "ar" else None, method=method, batch_size=batch,
                        num_speculative_tokens=args.k if method != "ar" else "auto", dtype=dtype,
                        batch_invariant=mode)
            for key, llm in engines.items():  # warm-up (and oneDNN weight packing) outside the timing
                llm.generate(prompt_token_ids=prompts[:2],
                             sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
            times = {}
            for method, batch in COST_CONFIGS:  # off and on interleaved, the order alternating per round
                n = args.cost_prompts_b1 if batch == 1 else len(prompts)
                times |= {(mode, method, batch): runs for mode, runs in interleave({
                    mode: lambda llm=engines[mode, method, batch], n=n: llm.generate(
                        prompt_token_ids=prompts[:n], sampling_params=params).metrics.tokens_per_s
                    for mode in (False, True)}, args.rounds, warmup=0).items()}
                log("cost", f"{pair} {dtype} {method}@{batch}: {args.rounds} rounds done")
            for method, batch in COST_CONFIGS:
                off, on = times[False, method, batch], times[True, method, batch]
                ratios = [a / b for a, b in zip(off, on)]
                cell = {"pair": pair, "dtype": dtype, "method": method, "batch_size": batch,
                        "tokens_per_s_off": statistics.median(off), "tokens_per_s_on": statistics.median(on),
                        "slowdown": statistics.median(ratios), "slowdown_min": min(ratios),
                        "slowdown_max": max(ratios), "slowdown_runs": ratios, "runs_off": off, "runs_on": on}
                info["cells"].append(cell)
                log("cost", f"{pair} {dtype} {method}@{batch}: off {cell['tokens_per_s_off']:.1f} tok/s, on "
                    f"{cell['tokens_per_s_on']:.1f} tok/s, slowdown {cell['slowdown']:.2f}x")
            del engines
    return info


def cost_table(info: dict) -> str:
    return md_table(
        ["pair", "dtype", "method @ batch", "tokens/s off", "tokens/s on", "slowdown (off/on), median (min–max)"],
        ([c["pair"], c["dtype"], f"{c['method']} @ {c['batch_size']}", f"{c['tokens_per_s_off']:.1f}",
          f"{c['tokens_per_s_on']:.1f}", fmt_spread(c["slowdown_runs"], "{:.2f}") + "x"] for c in info["cells"]),
        right={3, 4})


# ------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("what", choices=("probe", "equivalence", "pool-prefill", "cost"))
    p.add_argument("--prompts", default=SPEC_BENCH, help="SpecBench-style question.jsonl (first turns)")
    p.add_argument("--num-prompts", type=int, default=None, help="equivalence: the first N prompts (default all)")
    p.add_argument("--dtypes", type=comma_list(("bfloat16", "float32", "float64", "float16")),
                   default="bfloat16,float32", help="comma-separated")
    p.add_argument("--modes", type=comma_list(("off", "on")), default="off,on",
                   help="equivalence: batch_invariant off and/or on")
    p.add_argument("--target", default=None, help="equivalence: target checkpoint (default: the default pair)")
    p.add_argument("--draft", default=None, help="equivalence: draft checkpoint (default: the default pair)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="equivalence: cut prompts to this many tokens (default: what fits the context)")
    p.add_argument("-k", type=int, default=5, help="draft tokens per step")
    p.add_argument("--batch-size", type=int, default=8, help="equivalence: batch of the speculative methods")
    p.add_argument("--pairs", type=comma_list(("default", "synthetic")), default="default,synthetic",
                   help="cost: comma-separated, default and/or synthetic")
    p.add_argument("--cost-prompts", type=int, default=16, help="cost: prompts per batch-8 run")
    p.add_argument("--cost-prompts-b1", type=int, default=4, help="cost: prompts per batch-1 run")
    p.add_argument("--rounds", type=int, default=3, help="cost: interleaved rounds")
    p.add_argument("--simulate-switch", type=int, default=0, metavar="ROWS",
                   help="pool-prefill: bfloat16 calls of more than ROWS rows take another kernel (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    args = p.parse_args(argv)
    args.modes = [m == "on" for m in args.modes]
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    command = command_line("bench.batch_invariant", argv)
    t0 = time.perf_counter()
    if args.what == "probe":
        table = probe_table(probe())
        result = {"machine": f"{machine_line()}; {isa_line()}", "table": table}
    elif args.what == "pool-prefill":
        result = pool_prefill(args)
        table = pool_prefill_table(result)
    else:
        result = (equivalence if args.what == "equivalence" else cost)(args)
        table = (equivalence_table if args.what == "equivalence" else cost_table)(result)
    result.update(command=command, seconds=time.perf_counter() - t0)
    name, header = args.what, f"`{command}`\n\n{result['machine']}; {result['seconds']:.0f} s"
    if args.what == "equivalence":  # slices and single-dtype runs get their own files (runs may go in parallel)
        name += (f"-{args.num_prompts}" if args.num_prompts else "") + (
            f"-{args.dtypes[0]}" if len(args.dtypes) == 1 else "")
        header += (f"; target {result['target_sha256']}, draft {result['draft_sha256']} (sha256 of model.safetensors, "
                   f"first 16 hex); {result['num_prompts']} prompts, {result['prompts_cut']} cut to "
                   f"{result['max_prompt_tokens']} tokens")
    if args.what == "pool-prefill":
        name += (f"-switch{args.simulate_switch}" if args.simulate_switch else "") + f"-threads{args.threads}"
    write_json(os.path.join(args.out, f"{name}.json"), result)
    text = f"{header}\n\n{table}\n"
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
