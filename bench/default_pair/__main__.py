"""Train specdec's default target/draft pair: `python -m bench.default_pair` from the repository root. See
__init__.py for the recipe and --help for every flag."""
from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from bench.common import command_line

from . import __doc__ as RECIPE
from .pipeline import REPO

TARGET_ARCH = "hidden=384,layers=8,heads=6,kv_heads=2,ffn=1024"
DRAFT_ARCH = "hidden=256,layers=2,heads=4,kv_heads=2,ffn=768"


def positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.default_pair", description=RECIPE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument_group("outputs").add_argument
    add("--out", type=Path, default=REPO / "specdec/assets/default_pair",
        help="folder for the target/ and draft/ checkpoint directories (default: the shipped pair)")
    add("--prompts-out", type=Path, default=REPO / "specdec/assets/prompts.txt",
        help="held-out prompts, one per line, newlines written as \\n (default: the shipped prompts)")
    add("--doc", type=Path, default=REPO / "docs/default_pair.md", help="recipe and results (markdown)")
    add("--results", type=Path, default=REPO / "bench/default_pair/results.json",
        help="every number of the run, as JSON (the shipped pair's run is kept there)")
    add("--report-only", action="store_true", help="train nothing: write --doc again from the --results file")

    add = p.add_argument_group("draft-only retrain (keep a trained target)").add_argument
    add("--reuse-target", type=Path, metavar="DIR",
        help="train only the draft: load the saved target and its tokenizer from DIR (e.g. "
             "specdec/assets/default_pair/target) instead of training them; DIR is not written. The prompts file "
             "is left as it is. The target's numbers in --doc come from --target-results")
    add("--target-results", type=Path, default=REPO / "bench/default_pair/results.json",
        help="with --reuse-target: the results file of the run that trained that target (its sha256 is checked)")
    add("--pool-cache", type=Path, metavar="FILE",
        help="with --reuse-target: load the greedy pool from FILE (.npz) when it was made with the same target "
             "and pool settings, else generate it and save it there (pilots on one pool)")

    add = p.add_argument_group("data").add_argument
    add("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]), help="stdlib directory to read")
    add("--holdout-every", type=positive(int), default=20, help="hold out files whose sorted index divides by this")
    add("--max-chars", type=positive(int), default=8_000_000,
        help="cap on training characters (files are trimmed, largest first, to fit)")
    add("--vocab-size", type=positive(int), default=4000, help="SentencePiece vocabulary size")
    add("--ctx", type=positive(int), default=256, help="training window length in tokens (BOS included)")
    add("--num-prompts", type=positive(int), default=32, help="held-out prompts to write and evaluate")

    add = p.add_argument_group("target").add_argument
    add("--target-arch", default=TARGET_ARCH, help="target shape: hidden, layers, heads, kv_heads, ffn")
    add("--minutes-target", type=positive(float), default=55.0, help="time budget that sets --target-steps")
    add("--target-steps", type=positive(int), help="fixed step count (overrides --minutes-target)")
    add("--batch-target", type=positive(int), default=8, help="windows per step")
    add("--lr-target", type=positive(float), default=3e-3, help="peak learning rate")
    add("--warmup-target", type=positive(int), default=50, help="linear warmup steps")

    add = p.add_argument_group("greedy pool (sequence-level distillation data)").add_argument
    add("--minutes-pool", type=positive(float), default=8.0, help="time budget that sets --pool-seqs")
    add("--pool-seqs", type=positive(int), help="fixed sequence count (overrides --minutes-pool)")
    add("--pool-batch", type=positive(int), default=64, help="sequences generated together")
    add("--pool-new-tokens", type=positive(int), default=80, help="greedy target tokens per sequence")
    add("--pool-prefix-min", type=positive(int), default=8, help="shortest real prefix, BOS included")
    add("--pool-prefix-max", type=positive(int), default=96, help="longest real prefix, BOS included")
    add("--pool-top-k", type=positive(int), default=16, help="target probabilities stored per position")

    add = p.add_argument_group("draft").add_argument
    add("--draft-arch", default=DRAFT_ARCH, help="draft shape: hidden, layers, heads, kv_heads, ffn")
    add("--minutes-draft", type=positive(float), default=12.0, help="time budget that sets --draft-steps")
    add("--draft-steps", type=positive(int), help="fixed step count (overrides --minutes-draft)")
    add("--batch-draft", type=positive(int), default=16, help="pool sequences per step")
    add("--lr-draft", type=positive(float), default=3e-3, help="peak learning rate")
    add("--warmup-draft", type=positive(int), default=30, help="linear warmup steps")
    add("--draft-init", choices=("random", "target"), default="random",
        help="random: transformers' init (seed + 1); target: copy the target's embedding, final norm, LM head and "
             "first layers (--draft-arch must then have the target's hidden, heads, kv_heads and ffn)")
    add("--distill-alpha", type=float, default=0.5,
        help="weight of the soft (top-k distribution) term; the rest is cross-entropy on the target's argmax")

    add = p.add_argument_group("both models").add_argument
    add("--seed", type=int, default=0, help="base seed (model inits, data orders, pool prefixes)")
    add("--threads", type=positive(int), default=2, help="torch / sentencepiece CPU threads")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay on weight matrices")
    add("--clip", type=positive(float), default=1.0, help="gradient-norm clipping")
    add("--log-every", type=positive(int), default=50, help="progress line every this many steps")

    add = p.add_argument_group("evaluation").add_argument
    add("--eval-windows", type=positive(int), default=256, help="held-out windows for the losses")
    add("-k", type=positive(int), default=5, help="draft tokens per speculative step")
    add("--new-tokens", type=positive(int), default=64, help="new tokens per prompt")
    add("--specbench", type=Path, help="also measure acceptance on this SpecBench question.jsonl (first turns)")
    add("--specbench-count", type=positive(int), default=48, help="SpecBench prompts used")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report_only:
        if not args.results.is_file():
            parser.error(f"--results {args.results}: file not found (run the trainer first)")
        from .report import rewrite

        rewrite(args.results, args.doc)
        return 0
    if not args.stdlib.is_dir():
        parser.error(f"--stdlib {args.stdlib}: not a directory")
    if args.specbench is not None and not args.specbench.is_file():
        parser.error(f"--specbench {args.specbench}: file not found")
    if not 1 <= args.pool_prefix_min <= args.pool_prefix_max or args.pool_prefix_max + args.pool_new_tokens > args.ctx:
        parser.error("need 1 <= --pool-prefix-min <= --pool-prefix-max and --pool-prefix-max + --pool-new-tokens "
                     "<= --ctx")
    if args.reuse_target is not None:
        for name in ("config.json", "model.safetensors", "tokenizer.model"):
            if not (args.reuse_target / name).is_file():
                parser.error(f"--reuse-target {args.reuse_target}: no {name} (not a saved target directory)")
        if not args.target_results.is_file():
            parser.error(f"--target-results {args.target_results}: file not found (the target run's record)")
    elif args.pool_cache is not None:
        parser.error("--pool-cache needs --reuse-target (a pool is only reusable for a fixed, saved target)")
    if not 0.0 <= args.distill_alpha <= 1.0:
        parser.error(f"--distill-alpha must be in [0, 1], got {args.distill_alpha}")
    from .checkpoint import parse_arch

    for flag in ("target_arch", "draft_arch"):
        try:
            parse_arch(getattr(args, flag))
        except ValueError as err:
            parser.error(f"--{flag.replace('_', '-')}: {err}")
    command = command_line("bench.default_pair", argv)
    from .pipeline import run

    run(args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
