"""The one way from command-line flags to an engine: the engine flags every CLI shares
(`python -m specdec.run`, `--ray` replicas, `python -m specdec.serve`, the benchmarks) and the `LLM`
keyword arguments they mean. A flag added here reaches every entry point; none can drop one.
"""
from __future__ import annotations

import argparse
import os

from .prompts import DEFAULT_DRAFT, DEFAULT_TARGET

# the drafters that need no model (specdec.proposers.LOOKUPS, named here without importing torch: the CLIs
# parse their flags, and answer Ctrl-C, before the heavy modules load; tests/test_flags.py holds them equal)
LOOKUPS = ("ngram", "suffix")

METHODS = ("ar", "eqspec", "exspec", "ragged")


class Parser(argparse.ArgumentParser):
    """argparse's parser with a refusal of one line, `PROG: error: MESSAGE (PROG --help lists the flags)`, exit 2:
    argparse's own prints its usage block first (26 lines for specdec.run), burying the line that matters."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with '(default: X)' only where there is a plain default: a None or False default is said in the
    flag's own text (argparse's formatter printed '(default: None)' after 15 of specdec.run's flags)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
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


def k_value(text: str):
    """-k: "auto" or an int >= 1."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}") from None


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


# flag dest -> LLM keyword; every flag `add_engine_arguments` adds is here (tests/test_flags.py checks it)
ENGINE_KWARGS = {
    "method": "method", "batch_size": "batch_size", "num_speculative_tokens": "num_speculative_tokens",
    "max_speculative_tokens": "max_speculative_tokens", "window_size": "window_size", "dtype": "dtype",
    "device": "device", "check_weights": "check_weights", "check_invariants": "check_invariants",
    "compile": "compile", "packed_weights": "packed_weights", "batch_invariant": "batch_invariant",
    "profile": "profile", "lookup": "lookup", "lookup_min_match": "lookup_min_match", "ngram_min": "ngram_min",
    "ngram_max": "ngram_max", "suffix_store_tokens": "suffix_store_tokens", "quantize": "quantize",
    "draft_quantize": "draft_quantize", "cuda_graphs": "cuda_graphs", "prefix_cache_gb": "prefix_cache_gb",
    "prefill_chunk": "prefill_chunk",
}

QUANTIZE = ("int8", "int4")  # specdec.models.quant.FORMATS (tests/test_flags.py holds them equal)


def add_engine_arguments(p: argparse.ArgumentParser, batch_help: str = "rows decoded together") -> None:
    """The model and engine flags (--target, --draft, --method, -k, ...), shared by every CLI."""
    p.add_argument("--target", help="target checkpoint: a directory in HF format (config.json, model.safetensors, "
                   "tokenizer) or a .gguf file; default: the embedded default target")
    p.add_argument("--draft", help="draft checkpoint (directory or .gguf) sharing the target's tokenizer, a "
                   "feature-draft directory, or a drafter that needs no model: 'ngram' (prompt lookup in the row's own "
                   "text) or 'suffix' (suffix decoding over the row's text and recent outputs); default: the embedded "
                   "default draft, or with --target the draft specdec ships for that target (recognised by its "
                   "weights; SmolLM2-135M-Instruct), else 'suffix'")
    p.add_argument("--lookup", choices=LOOKUPS, help="beside a draft model: a row takes this lookup's drafts where "
                   "it has at least --lookup-min-match of them, else the model's")
    p.add_argument("--lookup-min-match", type=positive_int, default=2, help="with --lookup: the fewest looked-up "
                   "drafts (or k, if smaller) that replace the model's in a row")
    p.add_argument("--ngram-min", type=positive_int, default=1, help="ngram: the shortest suffix of a row that is "
                   "matched in its prompt + output")
    p.add_argument("--ngram-max", type=positive_int, default=4, help="ngram: the longest suffix matched (longer "
                   "matches are tried first)")
    p.add_argument("--suffix-store-tokens", type=non_negative_int, default=16384, help="suffix: tokens of recent "
                   "requests' outputs kept for drafting across requests (0: each request drafts from its own text "
                   "only; docs/api.md says what is kept)")
    p.add_argument("--method", choices=METHODS, default="eqspec", help="decoding strategy: ar = target only; "
                   "eqspec = left-padded, realign every step; exspec = same-length groups from a pool; "
                   "ragged = per-row offsets, never realign")
    p.add_argument("--batch-size", type=positive_int, default=8, help=batch_help)
    p.add_argument("-k", "--num-speculative-tokens", type=k_value, default="auto", help="draft tokens per step: "
                   "'auto' chooses k every step, from 0 (a step of the target alone) to --max-speculative-tokens, "
                   "from costs measured on this machine (cached under ~/.cache/specdec) and each request's "
                   "acceptance; or a fixed integer >= 1 (no draft at all: --method ar)")
    p.add_argument("--max-speculative-tokens", type=positive_int, default=8, help="the largest k that -k auto may "
                   "choose")
    p.add_argument("--window-size", type=positive_int, default=48, help="exspec: pool of live sequences")
    p.add_argument("--dtype", choices=("float64", "float32", "bfloat16", "float16"), default=None,
                   help="weights and activations (default float32; a quantized GGUF then keeps its blocks as "
                   "stored, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K, and --dtype asks for float weights)")
    p.add_argument("--quantize", choices=QUANTIZE, help="keep a float checkpoint's linear weights quantized: int4 "
                   "as Q4_1 blocks, int8 as Q8_0 (on the CPU; int4 in groups of 32 / int8 per channel on a GPU); "
                   "the embedding and head int8; --dtype is then the activations' (docs/api.md, 'Quantized "
                   "weights')")
    p.add_argument("--draft-quantize", choices=QUANTIZE, help="the same for the draft model (its own setting)")
    p.add_argument("--device", default="auto", help="auto (CUDA when a GPU is present, else the CPU), cpu, cuda "
                   "or cuda:N")
    p.add_argument("--check-weights", action="store_true", help="scan every loaded weight for NaN/inf (after "
                   "conversion to --dtype) and stop naming the file and key; the summary says how long it took")
    p.add_argument("--check-invariants", action="store_true", help="check cache/position/mask invariants after "
                   "every step (slow; raises naming the invariant, row and column)")
    p.add_argument("--compile", action="store_true", help="torch.compile the target and draft forwards (CUDA: with "
                   "CUDA graphs); the first steps of each shape compile (tens of seconds on a CPU, see docs/api.md)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: run decode and verify steps as CUDA graph replays, captured per rows bucket (1, 2, 4, "
                        "8, 16, 32) and step length on first use (docs/design.md, the forward). Default: on on CUDA; "
                        "refused elsewhere")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU float32: run steps of 1 to 64 token rows through oneDNN on linear weights packed "
                        "once (one extra copy of them; 1.2-1.5x faster multi-token forwards of the default pair, "
                        "docs/benchmarks/packed-weights.md). Default: on for float32 CPU models whose linear weights take at most "
                        "1 GiB")
    p.add_argument("--batch-invariant", nargs="?", type=batch_invariant_value, const=True, default="auto",
                   metavar="{auto,on,off}", help="batch-invariant numerics: a token's logits are the same bits "
                   "whatever else shares the forward, so greedy speculative output equals AR bit for bit in "
                   "bfloat16 and float32 too (slower; docs/design.md). Bare flag: on. Default auto: on for the "
                   "speculative methods on CUDA where a start-up measurement finds it costs at most 1.15x, else off")
    # checked by LLM (one line naming the flag), not by argparse (its usage text and error span several lines)
    p.add_argument("--prefix-cache-gb", type=float, metavar="GIB", help="keep the K/V of prompts and outputs "
                   "seen before, in at most this many GiB (least recently used dropped first): a prompt that begins "
                   "with one (the next turn of a chat) prefills only the rest (default: off; docs/serve.md)")
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS", help="prefill a prompt of more (uncached) "
                   "tokens than this in chunks of this many, one per engine step, while the running requests keep "
                   "decoding (default: at once)")
    p.add_argument("--profile", action="store_true", help="time every phase of every step (draft, verify, accept, "
                   "realign...) for the realign share and the JSON metrics; synchronises the device at each phase")


def checkpoint_pair(args) -> tuple[str, str | None, bool]:
    """(target, draft or None, whether it is the embedded default pair), checked to exist. The draft is None
    for AR, and for a --target without --draft: `LLM` then uses the draft specdec ships for that target
    (specdec/drafts.py), or says that it has none."""
    default_pair = args.target is None and args.draft is None
    if args.target is None and args.draft is not None and args.draft not in LOOKUPS:
        raise ValueError("--draft needs --target (or give neither: the embedded default pair)")
    target = args.target or DEFAULT_TARGET
    draft = None if args.method == "ar" else (args.draft or (DEFAULT_DRAFT if default_pair else None))
    if args.method == "ar" and getattr(args, "lookup", None) is not None:
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
    """The `LLM` keyword arguments the engine flags of `args` mean (target and draft included);
    `overrides` replace some (e.g. the device a Ray replica was placed on)."""
    target, draft, _ = checkpoint_pair(args)
    kwargs = {"target": target, "draft": draft}
    kwargs.update({kw: getattr(args, dest) for dest, kw in ENGINE_KWARGS.items()})
    kwargs.update(overrides)
    return kwargs


def build_llm(args, **overrides):
    """An `LLM` from the engine flags (the embedded default pair when neither --target nor --draft is given)."""
    from specdec import LLM

    return LLM(**engine_kwargs(args, **overrides))
