"""Drafting without a trained draft, on a real model: decode tokens/s of our AR, `ngram`, `suffix`, the
feature draft and the feature draft with a lookup beside it, by SpecBench category, at batch 1
(interleaved: every prompt runs every method in turn, `--repeats` rounds; medians with their spread).

Decode is timed apart from prefill: per request (batch 1), (tokens - 1) / (latency - time to first token).
Multi-turn second turns ("mt-turn2"): the first turn's answer is written by our AR (greedy), then the
second turn is asked with it in the chat. Auto k's calibration is outside every timing (it happens at an
LLM's first `generate`, which the warm-up does). The suffix store starts empty every round, so a prompt
never drafts from its own earlier answer; within a round it holds the earlier prompts' outputs, as a
server's would.

`--workload repeats`: requests that repeat patterns (a few instruction templates, each asked with several
inputs), suffix with the cross-request store against suffix on each request's own text, and AR.

    python -m bench.lookup --target .cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --specbench ../shared/data/spec_bench/question.jsonl --per-category 2 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from specdec import LLM, SamplingParams
from specdec.drafts import shipped_draft
from specdec.models import load_model, load_tokenizer

CATEGORIES = ("summarization", "rag", "translation", "qa", "math_reasoning", "mt-turn2")
METHODS = ("ar", "ngram", "suffix", "suffix-own", "feature", "feature+suffix", "feature+ngram")
TEMPLATES = (  # --workload repeats: each asked with every input
    "Extract the person's name, age and city from this text and answer with JSON only, keys name, age, city: {}",
    "Write a Python function that returns the {} of a list of numbers, with a docstring and one example.",
    "Summarize in one sentence, then list three keywords: {}",
    "Translate into French, keeping the formatting: {}")
INPUTS = (
    ("Maria Lopez, 34, moved to Lisbon last spring.", "sum", "The city council met on Tuesday to vote on the new "
     "bike lanes; after a long debate the plan passed.", "The meeting starts at nine."),
    ("Tom Becker is 51 and lives in Hamburg.", "mean", "Researchers found that the lake's water level rose by "
     "two metres in a decade, threatening nearby farms.", "Please close the door."),
    ("Aiko, aged 27, works in Osaka.", "median", "The company reported higher sales but lower profits, citing "
     "rising costs of shipping.", "The train is late again."),
    ("Peter Novak (45) from Prague.", "maximum", "A new species of frog was discovered in the rainforest by a "
     "team of students.", "I would like a cup of tea."),
    ("Sara Cohen, 19, studies in Haifa.", "variance", "The library will stay open until midnight during the "
     "exam period.", "Where is the station?"))
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint (directory or .gguf)")
    p.add_argument("--specbench", required=True, help="SpecBench question.jsonl")
    p.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated categories")
    p.add_argument("--methods", default="ar,ngram,suffix,feature,feature+suffix",
                   help="comma-separated: " + ", ".join(METHODS) + " (suffix-own: suffix without the cross-request store)")
    p.add_argument("--per-category", type=int, default=2, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip prompts longer than this")
    p.add_argument("--method", default="eqspec", help="specdec method of the speculative rows")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds over every prompt")
    p.add_argument("--batch-size", type=int, default=1, help="1: every prompt alone, decode timed per request; "
                   "B > 1: all prompts in one run of B rows per method (mixed categories), decode tokens/s = "
                   "tokens after the first / (wall time - prefill time)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--quantize", choices=("int8", "int4"), default=None, help="the target's weights kept quantized "
                   "(int4: a Q4_0/Q4_1 file's blocks as stored); default float32. The feature draft is the one "
                   "shipped for the float32 load of the same file")
    p.add_argument("--workload", choices=("specbench", "repeats"), default="specbench", help="specbench: by "
                   "category; repeats: templates asked with several inputs (what the suffix store buys)")
    p.add_argument("--out", default="bench/results/lookup.jsonl", help="JSONL of every timed request")
    return p


def chat_ids(tokenizer, turns: list[dict]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(turns), add_special_tokens=False)


def load_questions(path: str, categories, per_category: int) -> dict[str, list[dict]]:
    wanted: dict[str, list[dict]] = {c: [] for c in categories}
    with open(path, encoding="utf-8") as f:
        for line in f:
            q = json.loads(line)
            key = "mt-turn2" if q["category"] in MT_BENCH and len(q["turns"]) > 1 else q["category"]
            if key in wanted and len(wanted[key]) < per_category:
                wanted[key].append(q)
    return wanted


def build_prompts(args, tokenizer, ar: LLM) -> list[tuple[str, list[int]]]:
    prompts = []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for category, questions in load_questions(args.specbench, args.categories.split(","), args.per_category).items():
        for q in questions:
            turns = [{"role": "user", "content": q["turns"][0]}]
            if category == "mt-turn2":
                first = ar.generate(prompt_token_ids=[chat_ids(tokenizer, turns)], sampling_params=params)[0]
                turns += [{"role": "assistant", "content": tokenizer.decode(first.token_ids)},
                          {"role": "user", "content": q["turns"][1]}]
            ids = chat_ids(tokenizer, turns)
            if len(ids) <= args.max_prompt_tokens:
                prompts.append((category, ids))
    return prompts


def repeat_prompts(tokenizer) -> list[tuple[str, list[int]]]:
    """Every template with every input, template by template's input round (interleaved templates)."""
    return [(f"template {t}", chat_ids(tokenizer, [{"role": "user", "content": template.format(inputs[t])}]))
            for inputs in INPUTS for t, template in enumerate(TEMPLATES)]


def make_llms(args, target, tokenizer, feature) -> dict[str, LLM]:
    # packed_weights=True: a float32 model object is packed once, as LLM(path) does by default (a verify of
    # several tokens costs little more than one decode step only with packed float32 weights)
    common = dict(target=target, tokenizer=tokenizer, batch_size=args.batch_size, device="cpu", cost_cache="",
                  packed_weights=args.quantize is None, quantize=args.quantize,
                  profile=args.batch_size > 1)  # profile: prefill timed apart
    llms = {}
    for name in args.methods.split(","):
        if name == "ar":
            llms[name] = LLM(method="ar", **common)
        elif name in ("ngram", "suffix"):
            llms[name] = LLM(draft=name, method=args.method, **common)
        elif name == "suffix-own":  # suffix decoding without the cross-request store
            llms[name] = LLM(draft="suffix", suffix_store_tokens=0, method=args.method, **common)
        elif name == "feature":
            llms[name] = LLM(draft=feature, method=args.method, **common)
        elif name.startswith("feature+"):
            llms[name] = LLM(draft=feature, lookup=name.split("+")[1], method=args.method, **common)
        else:
            raise SystemExit(f"bench/lookup.py: --methods: unknown method {name!r}; choose from {', '.join(METHODS)}")
    return llms


def decode_rate(out) -> float:
    seconds = out.latency_s - out.time_to_first_token_s
    return (len(out.token_ids) - 1) / seconds if seconds > 0 else float("nan")


def spread(values) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})" if values else "-"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype="float32", device="cpu", quantize=args.quantize)
    tokenizer = load_tokenizer(args.target)
    feature = shipped_draft(target)  # a quantized load is recognised by the file's weights too
    llms = make_llms(args, target, tokenizer, feature)
    ar = llms.get("ar") or LLM(target=target, tokenizer=tokenizer, method="ar", batch_size=1, device="cpu",
                               quantize=args.quantize)
    prompts = build_prompts(args, tokenizer, ar) if args.workload == "specbench" else repeat_prompts(tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = [ids for _, ids in prompts[: args.batch_size]]
    for llm in llms.values():  # warm-up: calibration of auto k (at the batch size), first shapes
        llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows, reference = [], {}
    with open(args.out, "w", encoding="utf-8") as f:
        for repeat in range(args.repeats):
            for llm in llms.values():  # no prompt drafts from its own answer of an earlier round
                if llm.suffix_store is not None:
                    llm.suffix_store.clear()
            if args.batch_size > 1:
                for name, llm in llms.items():  # interleaved
                    outs = llm.generate(prompt_token_ids=[ids for _, ids in prompts], sampling_params=params)
                    m = outs.metrics
                    tokens = [o.token_ids for o in outs]
                    exact = reference.setdefault(-1, tokens) == tokens
                    row = {"category": f"batch {args.batch_size}", "prompt": -1, "repeat": repeat, "method": name,
                           "decode_tokens_per_s": (m.generated_tokens - m.first_tokens)
                           / (m.wall_time_s - m.phase_time_s["prefill"]),
                           "acceptance": m.acceptance_rate, "tokens_per_step": m.mean_tokens_per_step,
                           "k_histogram": {str(k): n for k, n in sorted(m.k_histogram.items())}, "exact_vs_first": exact}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    print(f"batch {args.batch_size} {name:15} {row['decode_tokens_per_s']:6.1f} tok/s "
                          f"acc {row['acceptance']:.2f} exact {exact}", file=sys.stderr, flush=True)
                continue
            for i, (category, ids) in enumerate(prompts):
                for name, llm in llms.items():  # interleaved
                    outs = llm.generate(prompt_token_ids=[ids], sampling_params=params)
                    out, m = outs[0], outs.metrics
                    exact = reference.setdefault(i, out.token_ids) == out.token_ids
                    row = {"category": category, "prompt": i, "repeat": repeat, "method": name,
                           "prompt_tokens": len(ids), "decode_tokens_per_s": decode_rate(out),
                           "acceptance": m.acceptance_rate, "tokens_per_step": m.mean_tokens_per_step,
                           "exact_vs_first": exact}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    print(f"{category:15} {i:2} {name:15} {row['decode_tokens_per_s']:6.1f} tok/s "
                          f"acc {row['acceptance']:.2f} exact {exact}", file=sys.stderr, flush=True)
    names = list(llms)
    print(f"| category | {' | '.join(names)} | " + " | ".join(f"{n} / ar" for n in names if n != "ar") + " |")
    print("|---" * (2 * len(names)) + "|")
    categories = [f"batch {args.batch_size}"] if args.batch_size > 1 else [*dict.fromkeys(c for c, _ in prompts), "all"]
    for category in categories:
        picked = [r for r in rows if category in ("all", r["category"])]
        rate = {n: [r["decode_tokens_per_s"] for r in picked if r["method"] == n] for n in names}
        ratios = []
        for n in names:
            if n == "ar" or "ar" not in rate:
                continue
            pairs = [(r["decode_tokens_per_s"], a["decode_tokens_per_s"]) for r in picked if r["method"] == n
                     for a in picked if a["method"] == "ar" and a["prompt"] == r["prompt"] and a["repeat"] == r["repeat"]]
            ratios.append(f"{statistics.median(x / y for x, y in pairs):.2f}x")
        acc = {n: statistics.mean(r["acceptance"] for r in picked if r["method"] == n) for n in names if n != "ar"}
        cells = [spread(rate[n]) + (f" (acc {acc[n]:.2f})" if n in acc else "") for n in names]
        print(f"| {category} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    exact = all(r["exact_vs_first"] for r in rows)
    print(f"\nevery output identical to the first method's: {exact}; {len(prompts)} prompts x {args.repeats} repeats, "
          f"{args.max_tokens} tokens, batch {args.batch_size}, {args.threads} threads, speculative rows: {args.method}, "
          f"auto k")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
