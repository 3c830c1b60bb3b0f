"""The one flag table: the model and engine flags every command line shares (`python -m specdec.run`, `--ray`
replicas, `python -m specdec.serve`, `python -m specdec.train`, the benchmarks), made from the fields of
specdec/options.py (each option's flag, rule and help are declared there once) plus --target, --draft and
--threads. A field added there is a flag everywhere, and reaches every entry point; none can drop one.
"""
from __future__ import annotations

import argparse
import math
import os

from .options import AUTO, DTYPES, LOOKUPS, Options, all_fields, check_value, describe, flag_names, option_field
from .prompts import CHAT_TEMPLATE_HELP, DEFAULT_DRAFT, DEFAULT_TARGET

class Parser(argparse.ArgumentParser):
    """argparse's parser with a refusal of one line, `NAME: error: MESSAGE (`PROG --help` lists the flags)`, exit 2
    (argparse's own prints its usage block first, 26 lines for specdec.run, burying the line that matters). NAME
    is the program's module (`specdec.run`), the prefix of every error the program prints, argparse's or its own."""

    def error(self, message: str):
        self.exit(2, f"{program_name(self.prog)}: error: {message} (`{self.prog} --help` lists the flags)\n")


def program_name(prog: str) -> str:
    """`python -m specdec.run` -> `specdec.run`: how a program names itself in its errors."""
    return prog.removeprefix("python -m ")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with '(default: X)' only where there is a plain default the flag's own text does not say: a None
    or False default is said in the text (argparse's formatter printed '(default: None)' after 15 of specdec.run's
    flags, some after a sentence giving the default). A default of 0 or 0.0 is a plain default (`0.0 in (None,
    False)` is true in Python: --temperature and --top-k showed none)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    return _integer(text, 0)


def port_number(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {value}")
    return value


def threads_value(text: str) -> str:
    """--threads: "auto" or an int >= 1 (as text: `openmp.apply_threads` reads it)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return str(positive_int(text))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}") from None


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """--threads, the process's torch CPU threads (not an LLM argument: torch's thread count is the process's)."""
    p.add_argument("--threads", type=threads_value, default="auto", metavar="{auto,N}", help="torch CPU threads. "
                   "auto (default): before the first request, a batch-1 decode step of the target is timed at 1, "
                   "half and all of the cores (a few hundred ms) and the fastest count kept (more threads only if "
                   "3%% faster), so a second thread never slows decoding as measured at start-up: on a quiet "
                   "2-core machine two threads, with a core busy elsewhere one; N: exactly N. Idle threads spin "
                   "briefly before they sleep (GOMP_SPINCOUNT=10000) unless the environment sets OMP_WAIT_POLICY "
                   "or GOMP_SPINCOUNT (docs/api.md, \"CPU threads\")")


def batch_invariant_value(text: str):
    """--batch-invariant's value: "auto", or on/off (true/false, yes/no, 1/0) -> True/False."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"must be auto, on or off, got {text!r}")


def option_type(f):
    """The flag's text -> the option's value, refused by the field's own rule (one line: 'must be an integer >=
    1, got 'two'')."""
    meta = f.metadata

    def convert(text: str):
        if meta["auto"] and text.strip().lower() == AUTO:
            return AUTO
        try:
            value = int(text) if meta["kind"] == "int" else float(text)
            check_value(f, value)  # not a number, or outside the rule: the same words
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {describe(meta)}, got {text!r}") from None
        return value

    convert.__name__ = f.name  # argparse names the type in some messages
    return convert


def option_argument(f, help: str | None = None) -> tuple[tuple[str, ...], dict]:
    """The `add_argument` call of option field `f`: (option strings, keyword arguments)."""
    meta, kind = f.metadata, f.metadata["kind"]
    kw = dict(dest=f.name, default=f.default, help=help or meta["help"])
    if meta["metavar"]:
        kw["metavar"] = meta["metavar"]
    if kind == "bool":
        kw["action"] = "store_true"
    elif kind == "tristate":
        kw["action"] = argparse.BooleanOptionalAction
    elif kind == "batch_invariant":
        kw.update(nargs="?", type=batch_invariant_value, const=True)
    elif kind in ("int", "float"):
        kw["type"] = option_type(f)
    elif kind == "choice":
        kw["choices"] = meta["choices"]
    elif kind == "dtype":
        kw["choices"] = DTYPES
    return flag_names(f), kw

# the flags that are not options: what the models are (--target, --draft) and the process's threads
TARGET_HELP = ("target checkpoint: a directory in HF format (config.json, model.safetensors, tokenizer) or a .gguf "
               "file; default: the embedded default target")
DRAFT_HELP = ("draft checkpoint (directory or .gguf) sharing the target's tokenizer, a feature-draft directory, or a "
              "drafter that needs no model: 'ngram' (prompt lookup in the row's own text) or 'suffix' (suffix decoding "
              "over the row's text and recent outputs); default: the embedded default draft, or with --target the "
              "draft specdec ships for that target (recognised by its weights; SmolLM2-135M-Instruct), else 'suffix'")


def k_value(text: str):
    """-k's text -> "auto" or an int >= 1 (the option's own rule), for benchmarks with a -k of their own."""
    return option_type(option_field("num_speculative_tokens"))(text)


def add_flag(p, name: str, help: str | None = None, **overrides) -> None:
    """One flag of the table by its dest (--target, --draft, --threads or an option's field name) on parser or
    group `p`; `help` replaces its text (a command's own wording of the same flag), `overrides` its keywords."""
    if name == "threads":
        add_threads_argument(p)
        return
    if name in ("target", "draft"):
        names, kw = (f"--{name}",), dict(help=TARGET_HELP if name == "target" else DRAFT_HELP)
        if help:
            kw["help"] = help
    else:
        names, kw = option_argument(option_field(name), help)
    kw.update(overrides)
    p.add_argument(*names, **kw)


def add_engine_arguments(p: argparse.ArgumentParser, batch_help: str | None = None,
                         helps: dict[str, str] | None = None) -> None:
    """The model and engine flags (--target, --draft, --method, -k, ...), shared by every CLI: every option.
    `batch_help` / `helps` (option name -> text): a command's own wording of what it does with a flag."""
    helps = dict(helps or {}, **({"batch_size": batch_help} if batch_help else {}))
    add_flag(p, "target")
    add_flag(p, "draft")
    for f in all_fields():
        add_flag(p, f.name, helps.get(f.name))


def checkpoint_pair(args) -> tuple[str, str | None, bool]:
    """(target, draft or None, whether it is the embedded default pair), checked to exist. The draft is None
    for AR, and for a --target without --draft: `LLM` then uses the draft specdec ships for that target
    (specdec/drafts.py), or says that it has none."""
    default_pair = args.target is None and args.draft is None
    if args.target is None and args.draft is not None and args.draft not in LOOKUPS:
        raise ValueError("--draft needs --target (or give neither: the embedded default pair)")
    target = args.target or DEFAULT_TARGET
    draft = None if args.method == "ar" else (args.draft or (DEFAULT_DRAFT if default_pair else None))
    if args.method == "ar" and getattr(args, "lookup", None) in LOOKUPS:  # "auto" (the default) means none there
        raise ValueError("--lookup goes with a speculative --method (and a draft model)")
    for name, path in (("--target", target), ("--draft", draft)):
        if path is None or (name == "--draft" and path in LOOKUPS):
            continue
        if str(path).endswith(".gguf"):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name} {path}: GGUF file not found")
        elif os.path.isfile(path):
            raise FileNotFoundError(f"{name} {path}: a file that is not a .gguf; give a checkpoint directory (HF "
                                    f"safetensors) or a .gguf file")
        elif not os.path.isdir(path):
            raise FileNotFoundError(f"{name} {path}: checkpoint directory not found")
    return target, draft, default_pair


def engine_kwargs(args, **overrides) -> dict:
    """The `LLM` keyword arguments the engine flags of `args` mean (target, draft and every option);
    `overrides` replace some (e.g. the device a Ray replica was placed on)."""
    target, draft, _ = checkpoint_pair(args)
    kwargs = {"target": target, "draft": draft}
    kwargs.update({f.name: getattr(args, f.name) for f in all_fields()})
    kwargs.update(overrides)
    return kwargs


def build_llm(args, **overrides):
    """An `LLM` from the engine flags (the embedded default pair when neither --target nor --draft is given)."""
    from specdec import LLM

    return LLM(**engine_kwargs(args, **overrides))


# ------------------------------------------------------------------------- shared by specdec.run and specdec.chat
def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens_help: str) -> None:
    """--max-tokens (default None: the command's own default, said in `max_tokens_help`) and the sampling flags,
    shared by specdec.run and specdec.chat."""
    p.add_argument("--max-tokens", type=positive_int, help=max_tokens_help)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (rejection sampling "
                   "keeps the target's distribution exactly)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, help="make sampling reproducible: request i uses seed + i and gets exactly the "
                   "tokens of target-only AR sampling with that seed, whatever -k (auto too), batch size, method or "
                   "replica (bitwise in float64; float32/bfloat16 with --batch-invariant). Without it, sampled "
                   "requests are rejection-sampled: exact in distribution, not reproducible")


def add_chat_arguments(p: argparse.ArgumentParser, what: str = "--chat") -> None:
    """--chat-template and --system, shared by specdec.run (`what`: with --chat) and specdec.chat."""
    p.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP.format(what=what))
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation" +
                   (f" (with {what})" if what.startswith("--") else ""))


SEED_MAX = (1 << 64) - 1  # the largest seed torch.Generator takes


def check_sampling_flags(args) -> None:
    """The sampling flags, refused as SamplingParams would refuse them but naming the flag."""
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 and finite (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:  # NaN fails this too
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.seed is not None and not -(1 << 63) <= args.seed <= SEED_MAX:
        raise ValueError(f"--seed must be an integer in [-2**63, 2**64 - 1], got {args.seed}")


def k_max_of(args) -> int:
    """The most drafts a step may have in flight with these flags (0 for AR), by the options' own rule."""
    return Options.build(method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                         max_speculative_tokens=args.max_speculative_tokens).speculation.k_max
