"""Quantized weights on the real model, side by side with llama.cpp on the same GGUF file: prefill and
decode timed apart, batch 1 and batch B, the roofline per format, and the quality each format costs.

Methods (`--methods`), each over the same chat-formatted SpecBench prompts and N new tokens (EOS ignored):
- `stored`, `f32`: specdec AR with the target as `LLM(path)` loads it (the file's blocks as stored, multiplied by
  kernels/qmm_cpu.py) and with `dtype="float32"` (dequantized to float32);
- `stored@suffix`, `stored@feature`: auto k on the stored target with the suffix drafter, and with the shipped
  feature draft for SmolLM2 (its weights borrowed from the target);
- `lcpp`, `lcpp-lookup`: llama.cpp through llama-cpp-python (optional: `pip install llama-cpp-python`,
  a ~15-minute build on 2 cores; docs/benchmarks/quantized.md says how to build and cache the wheel), the same file, the
  same threads, greedy; `lcpp-lookup` is its prompt-lookup decoding (`LlamaPromptLookupDecoding`).
  It runs sequences one at a time: at batch B its figure is the B sequences' total throughput.

Timing: each method is warmed up on one prompt; then `--repeats` rounds, the method order rotating every
round. Prefill = time to the first token (specdec: the request's TTFT; llama.cpp: `eval` of the prompt),
decode = the N - 1 tokens after it. At batch B the prompts are decoded B at a time (llama.cpp: one by one).
Quality (against the float32 load of the same file, `--quality` prompts): top-1 agreement and perplexity,
teacher-forced on the float32 model's greedy text, and the share of greedy outputs identical for N tokens.

    python -m bench.quantized                                 # the SmolLM2 Q4_1 file, 12 prompts, 64 tokens
    python -m bench.quantized --methods f32,stored,lcpp --num-prompts 4 --max-tokens 32 --repeats 1
    python -m bench.quantized --target .cache/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --methods stored,lcpp \
        --batch-sizes 1 --threads 2 --quality 0 --out bench/results/quantized-qwen
Results: bench/results/quantized/ (quantized.jsonl, quantized.md, quantized.png); the table is printed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

from bench.bandwidth import read_bandwidth
from bench.common import (REPO, HelpFormatter, command_line, comma_ints, comma_list, evenly_spaced, fmt_spread,
                          machine, machine_line, md_table, save_figure, write_jsonl)

DEFAULT_TARGET = os.path.join(REPO, ".cache", "real_model", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_PROMPTS = "/work/shared/data/spec_bench/question.jsonl"
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "quantized")
METHODS = ("f32", "stored", "stored@suffix", "stored@feature", "lcpp", "lcpp-lookup")
LOAD = {"f32": {"dtype": "float32"}, "stored": {}}  # LLM's loading arguments of each format


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="a GGUF file (llama.cpp reads the same one)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="SpecBench question.jsonl (first turns, chat template)")
    p.add_argument("--methods", type=comma_list(METHODS), default=list(METHODS), help="comma-separated")
    p.add_argument("--num-prompts", type=int, default=12, help="prompts, evenly spaced over the file")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--batch-sizes", type=comma_ints, default=[1, 8], help="comma-separated")
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    p.add_argument("--quality", type=int, default=12, help="prompts for the quality figures (0: skip)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    return p.parse_args(argv)


def chat_prompts(path: str, tokenizer, n: int) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        turns = [json.loads(line)["turns"][0] for line in f if line.strip()]
    texts = evenly_spaced(turns, n)
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]),
                             add_special_tokens=False) for t in texts]


def weight_bytes(model) -> int:
    """Bytes one decode step streams: every linear weight (quantized: codes and scales) once; the embedding
    only where it is the (tied) head."""
    from torch import nn

    from specdec.models.quant import QUANTIZED_LINEAR

    total = 0
    for module in {id(m): m for m in model.modules()}.values():
        if isinstance(module, QUANTIZED_LINEAR):
            total += module.weight_bytes
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


# ------------------------------------------------------------------------------------------ the runners
class Specdec:
    def __init__(self, method: str, target: str, tokenizer):
        from specdec import LLM
        from specdec.drafts import SHIPPED

        load = LOAD[method.split("@")[0]]
        draft = None
        kind = "ar"
        if method.endswith("@suffix"):
            kind, draft = "ragged", "suffix"
        elif method.endswith("@feature"):
            kind, draft = "ragged", str(SHIPPED / "smollm2-135m-instruct")
        self.llm = LLM(target, draft, method=kind, tokenizer=tokenizer, batch_size=1, **load)
        self.bytes = weight_bytes(self.llm.target)

    def run(self, prompts, batch_size: int, max_tokens: int) -> dict:
        from specdec import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        prefill = decode = 0.0
        outs = []
        if self.llm.suffix_store is not None:  # no prompt drafts from its own answer of an earlier round
            self.llm.suffix_store.clear()
        for first in range(0, len(prompts), batch_size):
            group = prompts[first: first + batch_size]
            got = self.llm.generate(prompt_token_ids=group, sampling_params=params, batch_size=batch_size)
            # the run's wall time without auto k's calibration (done once per prompt-length bucket: a
            # start-up cost, kept out of the request times too)
            wall = got.metrics.wall_time_s
            ttft = max(o.time_to_first_token_s for o in got)  # the group's prefill (all admitted together)
            prefill += ttft
            decode += wall - ttft
            outs += [o.token_ids for o in got]
        return {"wall": prefill + decode, "prefill": prefill, "decode": decode, "tokens": outs}


class LlamaCpp:
    """llama.cpp in a worker process (bench/llamacpp_worker.py: it cannot share a process with torch)."""

    def __init__(self, method: str, target: str, threads: int, context: int):
        import importlib.util
        import subprocess
        import sys

        if importlib.util.find_spec("llama_cpp") is None:
            raise ImportError("llama_cpp")
        lookup = ["--lookup", "10"] if method == "lcpp-lookup" else []
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "bench.llamacpp_worker", target, "--threads", str(threads), "--context",
             str(context), *lookup], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not json.loads(self.worker.stdout.readline()).get("ready"):
            raise RuntimeError("bench/llamacpp_worker.py did not start")
        self.bytes = None

    def run(self, prompts, batch_size: int, max_tokens: int) -> dict:
        self.worker.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.worker.stdin.flush()
        line = self.worker.stdout.readline()
        if not line:
            raise RuntimeError(f"bench/llamacpp_worker.py exited with {self.worker.wait()}")
        return json.loads(line)


# ------------------------------------------------------------------------------------------ quality
@torch.no_grad()
def quality(target: str, prompts, max_tokens: int, formats) -> dict:
    """Per format, against the float32 load: top-1 agreement and perplexity teacher-forced on the float32
    model's greedy continuation (prompt + N tokens), and the share of identical greedy outputs."""
    from specdec import LLM, SamplingParams
    from specdec.models import load_model

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ref_model = load_model(target, **LOAD["f32"])
    ref_out = [o.token_ids for o in LLM(ref_model, method="ar", batch_size=4).generate(
        prompt_token_ids=prompts, sampling_params=params)]
    texts = [p + o for p, o in zip(prompts, ref_out)]

    def scores(model):
        logits = [model(torch.tensor([t]), model.new_cache(1, len(t)))[0, len(p) - 1: -1]
                  for t, p in zip(texts, prompts)]  # [N, V] each: predictions of the continuation
        return logits

    ref_logits = scores(ref_model)
    result = {}
    for fmt in formats:
        model = ref_model if fmt == "f32" else load_model(target, **LOAD[fmt])
        logits = ref_logits if fmt == "f32" else scores(model)
        agree = nll = count = 0.0
        for lg, ref, t, p in zip(logits, ref_logits, texts, prompts):
            labels = torch.tensor(t[len(p):])
            agree += (lg.argmax(-1) == ref.argmax(-1)).sum().item()
            nll += torch.nn.functional.cross_entropy(lg.float(), labels, reduction="sum").item()
            count += len(labels)
        outs = ref_out if fmt == "f32" else [o.token_ids for o in LLM(model, method="ar", batch_size=4).generate(
            prompt_token_ids=prompts, sampling_params=params)]
        result[fmt] = {"top1_agreement": agree / count, "perplexity": math.exp(nll / count),
                                "identical_outputs": sum(a == b for a, b in zip(outs, ref_out)) / len(prompts)}
    return result


# ------------------------------------------------------------------------------------------ report
def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from specdec.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    prompts = chat_prompts(args.prompts, tokenizer, args.num_prompts)
    context = max(map(len, prompts)) + args.max_tokens + 16
    runners = {}
    for m in args.methods:
        if m.startswith("lcpp"):
            try:
                runners[m] = LlamaCpp(m, args.target, args.threads, context)
            except ImportError:
                print(f"bench/quantized.py: skipping {m}: llama-cpp-python is not installed (a bench-only extra)")
        else:
            runners[m] = Specdec(m, args.target, tokenizer)
    bandwidth = read_bandwidth()
    records = []
    for B in args.batch_sizes:
        for runner in runners.values():  # warm-up: first-call allocations, auto k's calibration
            runner.run(prompts[:min(B, len(prompts))], B, args.max_tokens)
        runs = {m: [] for m in runners}
        for rep in range(args.repeats):
            names = list(runners)
            for m in names[rep % len(names):] + names[: rep % len(names)]:
                runs[m].append(runners[m].run(prompts, B, args.max_tokens))
                print(f"B={B} round {rep + 1} {m}: {runs[m][-1]['wall']:.1f} s", flush=True)
        n = len(prompts)
        for m, rs in runs.items():
            decode = [n * (args.max_tokens - 1) / r["decode"] for r in rs]
            records.append({
                "method": m, "batch": B, "decode_tok_s": decode,
                "prefill_tok_s": [sum(map(len, prompts)) / r["prefill"] for r in rs],
                "e2e_tok_s": [n * args.max_tokens / r["wall"] for r in rs],
                "weight_bytes": runners[m].bytes, "tokens": rs[0]["tokens"]})
    for r in records:
        if r["weight_bytes"] and r["batch"] == 1 and "@" not in r["method"]:
            r["roofline_tok_s"] = bandwidth["median"] * 1e9 / r["weight_bytes"]
            r["roofline_share"] = statistics.median(r["decode_tok_s"]) / r["roofline_tok_s"]
    formats = [m for m in LOAD if m in runners]
    qual = quality(args.target, prompts[: args.quality], args.max_tokens, formats) if args.quality else {}
    report(args, records, bandwidth, qual)


def report(args, records, bandwidth, qual) -> None:
    os.makedirs(args.out, exist_ok=True)
    meta = {"kind": "meta", "command": command_line("bench.quantized"), "machine": machine(),
            "bandwidth_gb_s": bandwidth, "quality": qual}
    write_jsonl(os.path.join(args.out, "quantized.jsonl"), [meta] + [{k: v for k, v in r.items() if k != "tokens"}
                                                                     for r in records])
    base = {r["batch"]: statistics.median(r["decode_tok_s"]) for r in records if r["method"] == "f32"}
    lcpp = {r["batch"]: statistics.median(r["decode_tok_s"]) for r in records if r["method"] == "lcpp"}
    rows = []
    for r in records:
        med = statistics.median(r["decode_tok_s"])
        rows.append([r["method"], r["batch"], fmt_spread(r["decode_tok_s"]), fmt_spread(r["prefill_tok_s"], "{:.0f}"),
                     fmt_spread(r["e2e_tok_s"]), f"{med / base[r['batch']]:.2f}x" if r["batch"] in base else "–",
                     f"{med / lcpp[r['batch']]:.2f}x" if r["batch"] in lcpp else "–",
                     f"{r['weight_bytes'] / 1e6:.0f}" if r["weight_bytes"] else "–",
                     f"{r['roofline_tok_s']:.0f} ({r['roofline_share']:.0%})" if "roofline_tok_s" in r else "–"])
    lines = [f"`{meta['command']}`", "", machine_line(meta["machine"]),
             f"read bandwidth {bandwidth['median']:.1f} GB/s (min {bandwidth['min']:.1f}, max {bandwidth['max']:.1f})",
             "", md_table(["method", "batch", "decode tok/s", "prefill tok/s", "end-to-end tok/s", "decode vs f32",
                           "decode vs lcpp", "MB read / token", "roofline tok/s (share)"], rows)]
    if qual:
        lines += ["", md_table(["format", "top-1 agreement with f32", "perplexity", f"identical {args.max_tokens}-token "
                                "greedy outputs"], [[f, f"{q['top1_agreement']:.1%}", f"{q['perplexity']:.2f}",
                                                     f"{q['identical_outputs']:.0%}"] for f, q in qual.items()])]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "quantized.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(args.batch_sizes), figsize=(5 * len(args.batch_sizes), 3.5), squeeze=False)
    for ax, B in zip(axes[0], args.batch_sizes):
        sel = [r for r in records if r["batch"] == B]
        ax.bar([r["method"] for r in sel], [statistics.median(r["decode_tok_s"]) for r in sel])
        ax.set_title(f"decode tokens/s, batch {B}")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    save_figure(fig, os.path.join(args.out, "quantized.png"))


if __name__ == "__main__":
    main()
