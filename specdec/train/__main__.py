"""`python -m specdec.train {small,feature}`: train a draft for a target. See docs/train.md and --help."""
from __future__ import annotations

from specdec.openmp import default_wait_policy

default_wait_policy()  # before anything imports torch

import argparse
import os
import sys
import sysconfig
from pathlib import Path

from specdec.flags import Parser, add_flag

KINDS = {
    "small": "a small Llama model distilled from the target's greedy continuations (the default pair's recipe; "
             "the target: a Llama checkpoint directory with a SentencePiece tokenizer.model)",
    "feature": "an EAGLE-style feature draft: one decoder layer reading the target's last hidden state, with a "
               "reduced vocabulary (the recipe of the shipped SmolLM2 draft; the target: a .gguf or checkpoint "
               "directory)",
}
TARGET_ARCH = "hidden=384,layers=8,heads=6,kv_heads=2,ffn=1024"
DRAFT_ARCH = "hidden=256,layers=2,heads=4,kv_heads=2,ffn=768"
# flag defaults that differ by kind (None in the parser: a flag the user gave is told from one left out)
KIND_DEFAULTS = {
    "small": {"minutes": 12.0, "lr": 3e-3, "batch": 16},
    "feature": {"minutes": 30.0, "lr": 5e-4, "batch": 8},
}
QUESTIONS_PER_MINUTE = 6  # feature: self-written questions per training minute when --questions is not given
# (about as long to write as to train on, on two shared CPU cores: 6 x 176 tokens at ~20 tokens/s per minute)


def positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser(kind: str | None = None) -> argparse.ArgumentParser:
    """The parser; given the `kind` on the command line, its --help lists that kind's flags and the shared ones
    (the other kind's are still parsed, to be refused by name: `check_args`)."""
    p = Parser(
        prog="python -m specdec.train", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Train a draft model for a target; the result is a directory that `python -m specdec.run "
                    "--draft DIR` and specdec.LLM(target, DIR) accept. Kinds:\n\n" +
                    "\n".join(f"  {k}: {v}" for k, v in KINDS.items()) + "\n\nSee docs/train.md.")
    p.add_argument("kind", choices=sorted(KINDS), help="the draft to train (see above)")

    both = p.add_argument_group("both kinds")
    add = both.add_argument
    add_flag(both, "target", type=Path, help="the target: a checkpoint directory or a .gguf (small: a Llama directory "
                                             "with tokenizer.model; with --train-target, where the trained target is "
                                             "saved)")
    add("--out", type=Path, required=True, help="the draft directory to write (its files are replaced)")
    add("--data", type=Path, action="append", metavar="FILE.jsonl",
        help='your training data, one JSON object a line: {"prompt": ...} (the target answers it) or {"text": '
             '...}; repeatable. feature: added to the self-written data (--questions 0: yours only); small: '
             "replaces the stdlib corpus")
    add_flag(both, "device")  # on a GPU the training forwards run under bfloat16 autocast
    add("--minutes", type=positive(float), help="training time budget; the step count is fitted to it "
                                                "(default: small 12, feature 30). Making the data comes before "
                                                "it, the evaluation after")
    add("--steps", type=positive(int), help="fixed training step count (overrides --minutes: a deterministic run)")
    add("--seed", type=int, default=0, help="base seed (data order, initialisation, noise)")
    add("--batch", type=positive(int), help="sequences per training step (default: small 16, feature 8)")
    add("--lr", type=positive(float), help="peak learning rate (default: small 3e-3, feature 5e-4)")
    add("--checkpoint", type=Path, metavar="FILE",
        help="the training state written every --checkpoint-every steps (default: OUT.train/checkpoint.pt)")
    add("--checkpoint-every", type=non_negative_int, default=100, help="steps between checkpoints (0: none)")
    add("--resume", action="store_true", help="continue from --checkpoint (after an interrupt): the same step, "
                                              "optimizer state, data order and RNG as if never stopped")
    add("--results", type=Path, help="every number of the run as JSON (default: OUT.train/results.json)")
    add("--plot", type=Path, help="acceptance by draft position, PNG (default: OUT.train/acceptance.png; skipped "
                                  "when matplotlib is missing)")
    add("--specbench", type=Path, help="also measure acceptance on this SpecBench question.jsonl (first turns)")
    add("--threads", type=positive(int), default=1,
        help="torch CPU threads (default 1: on a shared machine more threads than free cores run slower; the "
             "shipped drafts were trained with 2)")
    add("--no-progress", action="store_true", help="log lines instead of the progress bar")

    add = p.add_argument_group("feature only").add_argument
    add("--questions", type=non_negative_int,
        help=f"self-written questions per data round (0: none; default: {QUESTIONS_PER_MINUTE} per --minutes)")
    add("--data-rounds", type=positive(int), default=1,
        help="rounds of self-written data (round r asks with seed --seed + r; each cached)")
    add("--answer-tokens", type=positive(int), default=128, help="greedy answer length (self-written and --data "
                                                                 "prompts)")
    add("--cache", type=Path, default=Path(".cache/specdec-train"),
        help="cache folder of the self-written data and features")
    add("--layers", type=positive(int), default=1, help="draft decoder layers")
    add("--vocab-coverage", type=float, default=0.995,
        help="share of the training next tokens the draft vocabulary covers (1 = the full vocabulary)")
    add("--max-len", type=positive(int), default=256, help="training sequences are cut to this many tokens")
    add("--unroll", type=positive(int), default=2,
        help="training passes per step (2..: also on its own features, as at draft positions 2..)")
    add("--noise", type=float, default=0.05, help="Gaussian noise on the input features (x their std)")
    add("--eval-prompts", type=non_negative_int, default=16, help="prompts per acceptance evaluation (0: none)")
    add("--eval-k", type=positive(int), default=5, help="k of the acceptance evaluation")
    add("--eval-tokens", type=positive(int), default=64, help="new tokens per evaluation prompt")
    add("--target-name", help="the target's name written into the draft's config (default: its file name)")

    add = p.add_argument_group("small only: data").add_argument
    add("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
        help="stdlib directory whose *.py files are the corpus (without --data)")
    add("--holdout-every", type=positive(int), default=20, help="hold out texts whose sorted index divides by this")
    add("--max-chars", type=positive(int), default=8_000_000,
        help="cap on training characters (texts are trimmed, largest first, to fit)")
    add("--vocab-size", type=positive(int), default=4000, help="SentencePiece vocabulary size (--train-target)")
    add("--ctx", type=positive(int), default=256, help="training window length in tokens (BOS included)")
    add("--num-prompts", type=positive(int), default=32, help="held-out prompts to evaluate")
    add("--prompts-out", type=Path, help="also write the held-out prompts there, one per line")

    add = p.add_argument_group("small only: the target (trained here only with --train-target)").add_argument
    add("--train-target", action="store_true",
        help="train the tokenizer and the target first (the full default-pair recipe) and save them at --target")
    add("--target-arch", default=TARGET_ARCH, help="target shape: hidden, layers, heads, kv_heads, ffn")
    add("--minutes-target", type=positive(float), default=55.0, help="time budget that sets --target-steps")
    add("--target-steps", type=positive(int), help="fixed step count (overrides --minutes-target)")
    add("--batch-target", type=positive(int), default=8, help="windows per step")
    add("--lr-target", type=positive(float), default=3e-3, help="peak learning rate")
    add("--warmup-target", type=positive(int), default=50, help="linear warmup steps")
    add("--target-results", type=Path, metavar="FILE",
        help="the results file of the run that trained --target (its sha256 is checked): --doc then shows both "
             "runs (e.g. bench/default_pair/results.json)")
    add("--doc", type=Path, help="write the recipe and results as markdown (docs/default_pair.md's template)")

    add = p.add_argument_group("small only: greedy pool (sequence-level distillation data)").add_argument
    add("--minutes-pool", type=positive(float), default=8.0, help="time budget that sets --pool-seqs")
    add("--pool-seqs", type=positive(int), help="fixed sequence count (overrides --minutes-pool)")
    add("--pool-batch", type=positive(int), default=64, help="sequences generated together")
    add("--pool-new-tokens", type=positive(int), default=80, help="greedy target tokens per sequence")
    add("--pool-prefix-min", type=positive(int), default=8, help="shortest real prefix, BOS included")
    add("--pool-prefix-max", type=positive(int), default=96, help="longest real prefix, BOS included")
    add("--pool-top-k", type=positive(int), default=16, help="target probabilities stored per position")
    add("--pool-cache", type=Path, metavar="FILE",
        help="load the greedy pool from FILE (.npz) when it was made with the same target and settings, else "
             "generate it and save it there")

    add = p.add_argument_group("small only: the draft").add_argument
    add("--draft-arch", default=DRAFT_ARCH, help="draft shape: hidden, layers, heads, kv_heads, ffn")
    add("--warmup-draft", type=positive(int), default=30, help="linear warmup steps")
    add("--draft-init", choices=("random", "target"), default="random",
        help="random: transformers' init (seed + 1); target: copy the target's embedding, final norm, LM head and "
             "first layers (--draft-arch must then have the target's hidden, heads, kv_heads and ffn)")
    add("--distill-alpha", type=float, default=0.5,
        help="weight of the soft (top-k distribution) term; the rest is cross-entropy on the target's argmax")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay on weight matrices")
    add("--clip", type=positive(float), default=1.0, help="gradient-norm clipping")
    add("--log-every", type=positive(int), default=50, help="with --no-progress: a line every this many steps")
    add("--eval-windows", type=positive(int), default=256, help="held-out windows for the losses")
    add("-k", type=positive(int), default=5, help="draft tokens per speculative step (evaluation)")
    add("--new-tokens", type=positive(int), default=64, help="new tokens per evaluation prompt")
    add("--specbench-count", type=positive(int), default=48, help="SpecBench prompts used")
    if kind in KINDS:
        for group in p._action_groups:
            if group.title.startswith(tuple(f"{other} only" for other in KINDS if other != kind)):
                for action in group._group_actions:
                    action.help = argparse.SUPPRESS
    return p


# the flags only one kind reads, by group title prefix: given to the other kind they are an error
def kind_only_flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    owned = {"small": set(), "feature": set()}
    for group in parser._action_groups:
        for kind in owned:
            if group.title.startswith(f"{kind} only"):
                owned[kind] |= {a.dest for a in group._group_actions}
    return owned


def check_args(parser, args, argv) -> None:
    """One clear line (parser.error) per bad input; fills the kind's defaults and the derived paths."""
    given = {a.dest for a in parser._actions for s in a.option_strings if any(
        arg == s or arg.startswith(s + "=") for arg in argv)}
    other = "feature" if args.kind == "small" else "small"
    wrong = sorted(given & kind_only_flags(parser)[other])
    if wrong:
        flag = "--" + wrong[0].replace("_", "-") if wrong[0] != "k" else "-k"
        parser.error(f"{flag} is a flag of `{other}`, not of `{args.kind}`")
    for name, value in KIND_DEFAULTS[args.kind].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.target is None:
        parser.error("--target is required (a checkpoint directory or a .gguf)")
    if args.kind == "small" and args.train_target:
        if args.resume:
            parser.error("--resume continues the draft: run again without --train-target (the target trained "
                         f"before the interrupt is saved at --target {args.target})")
    elif not args.target.exists():
        parser.error(f"--target {args.target}: no such file or directory")
    elif args.kind == "small":
        for name in ("config.json", "model.safetensors", "tokenizer.model"):
            if not (args.target / name).is_file():
                parser.error(f"--target {args.target}: no {name} (small needs a Llama checkpoint directory with a "
                             "SentencePiece tokenizer.model; for a .gguf use `feature`)")
    elif args.target.is_dir() and not (args.target / "config.json").is_file():
        parser.error(f"--target {args.target}: no config.json (not a checkpoint directory)")
    for path in args.data or []:
        if not path.is_file():
            parser.error(f"--data {path}: file not found")
    if args.specbench is not None and not args.specbench.is_file():
        parser.error(f"--specbench {args.specbench}: file not found")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a directory")
    if args.kind == "small" and args.out.resolve() == args.target.resolve():
        parser.error("--out must differ from --target (the draft would replace the target's files)")
    work = args.out.with_name(args.out.name + ".train")
    args.checkpoint = args.checkpoint or work / "checkpoint.pt"
    args.results = args.results or work / "results.json"
    args.plot = args.plot or work / "acceptance.png"
    if args.resume and not args.checkpoint.is_file():
        parser.error(f"--resume: no checkpoint at {args.checkpoint} (give --checkpoint FILE)")
    from specdec.devices import resolve_device

    try:
        args.device = str(resolve_device(args.device, name="--device"))
    except ValueError as e:
        parser.error(str(e))
    if args.kind == "feature":
        if not 0 < args.vocab_coverage <= 1:
            parser.error(f"--vocab-coverage must be in (0, 1], got {args.vocab_coverage}")
        if args.questions is None:
            args.questions = max(32, round(QUESTIONS_PER_MINUTE * args.minutes))
        if args.questions == 0 and not args.data:
            parser.error("--questions 0 leaves no training data: give --data FILE.jsonl")
    else:
        check_small(parser, args)


def importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def check_small(parser, args) -> None:
    absent = [name for name, module in (("transformers", "transformers"), ("protobuf", "google.protobuf"))
              if not importable(module)]
    if absent:  # else the run fails when it saves the draft, after its pool and its training
        parser.error(f"small builds and saves its Llama models with transformers and protobuf; "
                     f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed: "
                     "pip install -e '.[train]'")
    if not args.stdlib.is_dir() and not args.data:
        parser.error(f"--stdlib {args.stdlib}: not a directory")
    if not 1 <= args.pool_prefix_min <= args.pool_prefix_max or args.pool_prefix_max + args.pool_new_tokens > args.ctx:
        parser.error("need 1 <= --pool-prefix-min <= --pool-prefix-max and --pool-prefix-max + --pool-new-tokens "
                     "<= --ctx")
    if args.target_results is not None and not args.target_results.is_file():
        parser.error(f"--target-results {args.target_results}: file not found (the target run's record)")
    if args.doc is not None and not args.train_target and args.target_results is None:
        parser.error("--doc without --train-target needs --target-results (the run that trained the target)")
    if not 0.0 <= args.distill_alpha <= 1.0:
        parser.error(f"--distill-alpha must be in [0, 1], got {args.distill_alpha}")
    from .llama_files import parse_arch

    for flag in ("target_arch", "draft_arch"):
        try:
            parse_arch(getattr(args, flag))
        except ValueError as err:
            parser.error(f"--{flag.replace('_', '-')}: {err}")
    # the names the results and docs/default_pair.md's template use for the draft's budget and batch
    args.minutes_draft, args.draft_steps = args.minutes, args.steps
    args.batch_draft, args.lr_draft = args.batch, args.lr


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(next((arg for arg in argv if arg in KINDS), None))
    args = parser.parse_args(argv)
    check_args(parser, args, argv)
    import torch

    from .loop import Interrupted

    torch.set_num_threads(args.threads)
    if args.kind == "small":
        from .small import run
    else:
        from .feature import run
    try:
        run(args, argv)
    except KeyboardInterrupt:
        print("interrupted before training started: no checkpoint was written", file=sys.stderr, flush=True)
        return 130
    except Interrupted as stop:
        where = (f"the checkpoint of step {stop.step} is kept at {stop.path}" if stop.step is not None
                 else "no checkpoint was written yet")
        print(f"interrupted: {where}; add --resume to the same command to continue", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
