"""`python -m specdec.draft_vocab build|coverage` (the package's docstring says what they do)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specdec.draft_vocab import (ASSETS, KEEP, MIN_COUNT, STDLIB_WEIGHT, corpus_prompts, count_tokens, coverage, ranking,
                                 table_path)


def stdlib_texts():
    """The Python standard library's sources (the files specdec's small draft trains on)."""
    import sysconfig

    from specdec.train.stdlib_corpus import stdlib_files

    for path in stdlib_files(Path(sysconfig.get_paths()["stdlib"])):
        try:
            yield path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def generated_texts(model_path: str, tokenizer, max_tokens: int):
    """A model's own answers to `corpus_prompts()` (chat-templated, greedy)."""
    from specdec import LLM, SamplingParams

    llm = LLM(model_path, method="ar", batch_size=8, cost_cache="")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in corpus_prompts()]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [o.text for o in outs]



def build(model: str, generate_with: str | None, max_tokens: int, out: Path) -> Path:
    from specdec.models import load_tokenizer
    from specdec.models.gguf import open_gguf

    tokenizer = load_tokenizer(model)
    vocab = len(open_gguf(model).metadata["tokenizer.ggml.tokens"]) if model.endswith(".gguf") else None
    stdlib = count_tokens(tokenizer, stdlib_texts())
    counts = {i: STDLIB_WEIGHT * n for i, n in stdlib.items()}
    sources = [f"the Python standard library's sources (weight {STDLIB_WEIGHT})"]
    if generate_with:
        for i, n in count_tokens(tokenizer, generated_texts(generate_with, tokenizer, max_tokens)).items():
            counts[i] = counts.get(i, 0.0) + n
        sources.append(f"{Path(generate_with).name}'s greedy answers ({max_tokens} tokens) to the "
                       f"{len(corpus_prompts())} corpus_prompts()")
    vocab = vocab or (max(counts) + 1)
    ranked = ranking(counts, vocab)[:KEEP]
    out.mkdir(parents=True, exist_ok=True)
    path = out / table_path(tokenizer.fingerprint()).name
    np.savez_compressed(path, ids=ranked.astype(np.uint32),
                        counts=np.array([counts.get(int(i), 0.0) for i in ranked], dtype=np.float64),
                        about=np.array(json.dumps({"tokenizer": tokenizer.fingerprint(), "sources": sources,
                                                   "tokens_counted": float(sum(counts.values())), "vocab": vocab,
                                                   "ranking": f"count >= {MIN_COUNT}, then id"})))
    return path



def main(argv=None) -> int:
    from specdec.flags import HelpFormatter
    from specdec import draft_vocab

    p = argparse.ArgumentParser(prog="python -m specdec.draft_vocab", description=draft_vocab.__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="count tokens and write the ranked table", formatter_class=HelpFormatter)
    b.add_argument("--model", required=True, help="a GGUF file or checkpoint directory: its tokenizer")
    b.add_argument("--generate-with", default=None, help="also count this model's answers to corpus_prompts()")
    b.add_argument("--max-tokens", type=int, default=256, help="tokens of each generated answer")
    b.add_argument("--out", default=str(ASSETS), help="the folder the table is written to")
    c = sub.add_parser("coverage", help="the share of a text's tokens each subset size covers",
                       formatter_class=HelpFormatter)
    c.add_argument("--model", required=True, help="a GGUF file or checkpoint directory: its tokenizer")
    c.add_argument("--texts", required=True, help="a JSONL file of {'text': ...} records (or a .txt file)")
    c.add_argument("--sizes", default="8192,16384,32768,65536", help="comma-separated subset sizes")
    args = p.parse_args(argv)
    if args.command == "build":
        path = build(args.model, args.generate_with, args.max_tokens, Path(args.out))
        print(f"wrote {path}")
        return 0
    path = Path(args.texts)
    if not path.is_file():
        p.error(f"--texts {path}: file not found")
    if path.suffix == ".jsonl":
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    else:
        texts = [path.read_text()]
    for size, share in coverage(args.model, texts, [int(s) for s in args.sizes.split(",")]).items():
        print(f"{size}: {share:.2%} of the tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
