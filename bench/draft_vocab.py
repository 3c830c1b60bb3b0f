"""The draft's head restricted to the most frequent tokens (issue 56; specdec/draft_vocab.py): on text the count never
saw (the target's own greedy answers to SpecBench prompts), the share of tokens each subset covers, the draft's
agreement with the target token by token (teacher-forced: the greedy acceptance a draft has where its previous
drafts were accepted) with the full head and each subset, and the draft step's time against the target's.

    python -m bench.draft_vocab --target .cache/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --draft .cache/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --per-category 2 --max-tokens 128 \\
        --output bench/results/draft-vocab.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench.common import HelpFormatter, comma_ints, log, machine, machine_line, md_table, write_json

SPEC_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                          "spec_bench", "question.jsonl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", required=True, help="the target GGUF file")
    p.add_argument("--draft", required=True, help="the draft GGUF file (the same tokenizer)")
    p.add_argument("--questions", default=SPEC_BENCH, help="SpecBench's question.jsonl (fields category, turns)")
    p.add_argument("--per-category", type=int, default=2, help="prompts per SpecBench category")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of each target answer")
    p.add_argument("--sizes", type=comma_ints, default="8192,16384,32768,65536", help="subset sizes")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=15, help="timed decode steps per head")
    p.add_argument("--answers", default=None, metavar="JSON",
                   help="reuse the target's answers of an earlier run's --output (the same prompts) instead of "
                        "generating them")
    p.add_argument("--output", default=None, help="write every measurement as JSON here")
    args = p.parse_args(argv)
    if not os.path.isfile(args.questions):
        p.error(f"--questions {args.questions}: file not found")
    return args


def spec_bench_prompts(path: str, per_category: int) -> list[tuple[str, str]]:
    """(category, first turn) of the first `per_category` questions of every category, in file order."""
    taken: dict[str, int] = {}
    out = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            if taken.get(q["category"], 0) < per_category:
                taken[q["category"]] = taken.get(q["category"], 0) + 1
                out.append((q["category"], q["turns"][0]))
    return out


@torch.no_grad()
def agreement(model, sequences: list[tuple[list[int], list[int]]], target_tokens: list[list[int]]) -> float:
    """Teacher-forced: the share of answer positions where `model`'s argmax equals the target's token."""
    hit = total = 0
    for (prompt, answer), want in zip(sequences, target_tokens):
        ids = torch.tensor([prompt + answer[:-1]])
        logits = model(ids, model.new_cache(1, ids.shape[1]))[0, len(prompt) - 1:]  # [len(answer), V]
        hit += int((logits.argmax(-1) == torch.tensor(want)).sum())
        total += len(want)
    return hit / max(total, 1)


def decode_ms(model, repeats: int) -> float:
    from specdec.timing import PrefilledCache, random_tokens

    g = torch.Generator().manual_seed(0)
    cache = PrefilledCache(model, random_tokens(1, 200, model.vocab_size, g, "cpu"), 202)
    x = random_tokens(1, 1, model.vocab_size, g, "cpu")
    cache.time(x, "last")
    return statistics.median(cache.time(x, "last") for _ in range(repeats)) * 1000


def main(argv=None) -> None:
    args = parse_args(argv)
    from specdec import LLM, SamplingParams, draft_vocab
    from specdec.models import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    record = {"machine": machine(), "command": "python -m bench.draft_vocab " + " ".join(argv or os.sys.argv[1:])}
    print(f"{machine_line(record['machine'])}\n`{record['command']}`\n")
    tokenizer = load_tokenizer(args.target)
    prompts = spec_bench_prompts(args.questions, args.per_category)
    chat = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]),
                             add_special_tokens=False) for _, t in prompts]
    if args.answers:
        with open(args.answers) as f:
            texts = json.load(f)["texts"]
        answers = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if len(answers) != len(chat):
            raise SystemExit(f"bench.draft_vocab: --answers {args.answers} has {len(answers)} answers for "
                             f"{len(chat)} prompts")
    else:
        log("draft-vocab", f"the target answers {len(chat)} SpecBench prompts ({args.max_tokens} tokens, greedy)")
        llm = LLM(args.target, method="ar", batch_size=4, cost_cache="")
        outs = llm.generate(prompt_token_ids=chat, sampling_params=SamplingParams(max_tokens=args.max_tokens))
        answers = [o.token_ids for o in outs]
        texts = [o.text for o in outs]
        del llm
    counted = [t for a in answers for t in a]
    sizes = [s for s in args.sizes]
    rows, results = [], {}
    full = load_model(args.draft)
    target_ms = decode_ms(load_model(args.target), args.repeats)
    base = {"coverage": 1.0, "agreement": agreement(full, list(zip(chat, answers)), answers),
            "draft_ms": decode_ms(full, args.repeats)}
    results["full"] = base
    for size in sizes:
        ids = draft_vocab.subset(tokenizer, size, full.vocab_size)
        if ids is None:
            raise SystemExit(f"bench.draft_vocab: no token count ships for {args.draft}'s tokenizer")
        inside = set(ids.tolist())
        model = load_model(args.draft)
        model.restrict_head(ids)
        results[size] = {"coverage": sum(t in inside for t in counted) / len(counted),
                         "agreement": agreement(model, list(zip(chat, answers)), answers),
                         "draft_ms": decode_ms(model, args.repeats)}
        log("draft-vocab", f"{size}: {results[size]}")
    for name, r in results.items():
        rows.append([name, f"{r['coverage']:.2%}", f"{r['agreement']:.2%}",
                     f"{(r['agreement'] - base['agreement']) * 100:+.2f}", f"{r['draft_ms']:.1f}",
                     f"{r['draft_ms'] / target_ms:.2f}x"])
    print(md_table(["draft head", "coverage of the target's tokens", "draft = target token (teacher-forced)",
                    "points vs full", "draft step ms", "x target step"], rows, right=(1, 2, 3, 4, 5)))
    print(f"\nThe target's step: {target_ms:.1f} ms (one token on a 200-token prefix, {args.threads} threads); "
          f"{len(counted)} answer tokens of {len(chat)} prompts ({args.per_category} per SpecBench category).")
    record.update(results={str(k): v for k, v in results.items()}, target_ms=target_ms, texts=texts)
    if args.output:
        write_json(args.output, record)


if __name__ == "__main__":
    main()
