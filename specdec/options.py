"""Every engine option, declared once: three dataclasses (how the models are loaded and run, how speculation
runs, the cache and scheduler), each field with its rule, its command-line flag and its help. `LLM(**kwargs)`,
the command lines (specdec/flags.py builds their flags from these fields), the server, Ray replicas and
`specdec.train` all build `Options` from here; each value is checked once, by its field's rule, where the
dataclass is built. Imports no torch: the CLIs parse their flags before the heavy modules load."""
from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass, field, fields, replace

AUTO = "auto"
METHODS = ("ar", "eqspec", "exspec", "ragged")
SPECULATIVE = ("eqspec", "exspec", "ragged")  # specdec.schedulers.SPECULATIVE (tests/test_flags.py holds them equal)
LOOKUPS = ("ngram", "suffix")  # specdec.proposers.LOOKUPS (held equal likewise)
QUANTIZE = ("int8", "int4")  # specdec.models.quant.FORMATS (held equal likewise)
KERNEL_BACKENDS = ("auto", "triton", "torch")  # specdec.kernels.dispatch.BACKENDS (held equal likewise)
DTYPES = ("float64", "float32", "bfloat16", "float16")
GIB = 1 << 30  # the prefix cache's budget unit (prefix_cache_gb)


def positions_needed(prompt_tokens: int, max_tokens: int, k_max: int) -> int:
    """Cache columns (and positions) a request needs: its prompt, max_tokens generated, and a verify pass of
    k_max drafts in flight after its last token. The capacity rule, in one place."""
    return prompt_tokens + max_tokens + k_max + 1


# the GGUF block types a load keeps as stored (models/ggml_blocks.py TYPES; tests/test_flags.py holds the two equal)
STORED_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                      "IQ4_XS")

CHAT_MAX_TOKENS = 2048  # a chat answer's default cap (its KV cache is allocated for its length: Qwen 1.5B's whole
# 32k context would be ~3.7 GB a turn)


def tokens_left(context: int, prompt_tokens: int, k_max: int) -> int:
    """The most new tokens a prompt of `prompt_tokens` can have within `context` positions (< 1: the prompt
    alone does not fit)."""
    return context - positions_needed(prompt_tokens, 0, k_max)


def chat_answer_tokens(context: int, prompt_tokens: int, k_max: int) -> int:
    """The chat's default answer length: until EOS, capped by the context and by CHAT_MAX_TOKENS (< 1: the prompt
    alone does not fit)."""
    return min(CHAT_MAX_TOKENS, tokens_left(context, prompt_tokens, k_max))


def option(default, help: str, kind: str, *, least=None, auto: bool = False, optional: bool = False,
           choices: tuple = (), flag: tuple[str, ...] = (), metavar: str | None = None, rule: str | None = None,
           valid=None):
    """A dataclass field with its rule and flag. kind: "int", "float", "bool" (a store_true flag), "tristate"
    (True / False / None: --x / --no-x), "choice" (one of `choices`), "path" (text), "dtype", "device",
    "batch_invariant" (True / False / "auto"). least: the smallest int or float; auto: "auto" is also a value;
    optional: None is also a value (the flag's absence). flag: the option strings (default --the-name).
    valid: a further test of a value of the kind (then `rule` says what the value must be); rule: what the value
    must be, as the messages say it (default: derived from the above)."""
    meta = dict(help=help, kind=kind, least=least, auto=auto, optional=optional, choices=choices, flag=flag,
                metavar=metavar, rule=rule, valid=valid)
    return field(default=default, metadata=meta)


def flag_names(f) -> tuple[str, ...]:
    """A field's option strings: -k/--num-speculative-tokens, --batch-size, ..."""
    return f.metadata["flag"] or ("--" + f.name.replace("_", "-"),)


def describe(meta) -> str:
    """What a field's values must be, as every message says it: "an integer >= 1", "'auto' or ..."."""
    if meta["rule"]:
        return meta["rule"]
    kind, least = meta["kind"], meta["least"]
    if kind == "int":
        text = "an integer" + (f" >= {least}" if least is not None else "")
    elif kind == "float":
        text = "a number" + (f" >= {least}" if least is not None else "")
    elif kind == "choice":
        text = "one of " + ", ".join(repr(c) for c in meta["choices"])
    elif kind == "bool":
        text = "True or False"
    elif kind == "tristate":
        return "True, False or None"
    elif kind == "batch_invariant":
        return f"True, False or {AUTO!r}"
    elif kind == "dtype":
        text = "one of " + ", ".join(DTYPES) + " or a torch floating-point dtype"
    else:
        text = "a string" if kind == "path" else "a device name"
    if meta["auto"]:
        text = f"{AUTO!r} or {text}"
    if meta["optional"]:
        text += " or None"
    return text


def _valid(meta, value) -> bool:
    if value is None:
        return meta["optional"] or meta["kind"] == "tristate"
    if meta["auto"] and value == AUTO:
        return True
    kind, least = meta["kind"], meta["least"]
    if kind in ("int", "float"):
        number = numbers.Integral if kind == "int" else numbers.Real
        if isinstance(value, bool) or not isinstance(value, number) or math.isnan(value):
            return False
        return (least is None or value >= least) and (meta["valid"] is None or meta["valid"](value))
    if kind == "choice":
        return isinstance(value, str) and value in meta["choices"]
    if kind in ("bool", "tristate"):
        return isinstance(value, bool)
    if kind == "batch_invariant":
        return isinstance(value, bool) or value == AUTO
    if kind == "dtype":
        return (isinstance(value, str) and value in DTYPES) or getattr(value, "is_floating_point", False) is True
    if kind == "path":
        return isinstance(value, str)
    return isinstance(value, str) or type(value).__name__ == "device"  # "device": torch.device too


def check_value(f, value) -> None:
    """Refuse a value outside field `f`'s rule: one line naming the option and its flag."""
    if not _valid(f.metadata, value):
        raise ValueError(f"{f.name} ({'/'.join(flag_names(f))}) must be {describe(f.metadata)}, got {value!r}")


class Checked:
    """Each field checked by its rule when the dataclass is built (the one place an option is validated)."""

    def __post_init__(self):
        for f in fields(self):
            if self.applies(f.name):
                check_value(f, getattr(self, f.name))

    def applies(self, name: str) -> bool:
        """Whether option `name` means anything with the others (an option that does not is not checked)."""
        return True


@dataclass(frozen=True)
class LoadOptions(Checked):
    """How the models are loaded and run."""
    dtype: object = option(None, "weights and activations. Not given: a float checkpoint runs in float32, and a "
                           "quantized GGUF keeps its blocks as stored (" + "/".join(STORED_BLOCK_TYPES) + ") with "
                           "float32 activations; any --dtype, float32 too, asks for float weights (a GGUF's blocks "
                           "dequantized). float16/bfloat16 on a CPU run much slower than float32 (a warning says by "
                           "how much)", "dtype", optional=True)
    device: object = option(AUTO, "auto (CUDA when a GPU is present, else the CPU), cpu, cuda or cuda:N", "device")
    quantize: str | None = option(None, "keep a float checkpoint's linear weights quantized: int4 as Q4_1 blocks, "
                                  "int8 as Q8_0 (on the CPU; int4 in groups of 32 / int8 per channel on a GPU); the "
                                  "embedding and head int8; --dtype is then the activations' (docs/api.md, "
                                  "'Quantized weights'). A quantized GGUF needs none: its "
                                  + "/".join(STORED_BLOCK_TYPES) + " blocks are kept as stored", "choice",
                                  choices=QUANTIZE, optional=True)
    draft_quantize: str | None = option(None, "the same for the draft model (its own setting)", "choice",
                                        choices=QUANTIZE, optional=True)
    check_weights: bool = option(False, "scan every loaded weight for NaN/inf (after conversion to --dtype) and "
                                 "stop naming the file and key; the summary says how long it took", "bool")
    packed_weights: bool | None = option(None, "CPU float32: run steps of 1 to 64 token rows through oneDNN on "
                                         "linear weights packed once (one extra copy of them; 1.2-1.5x faster "
                                         "multi-token forwards of the default pair, docs/benchmarks/packed-weights.md)."
                                         " Default: on for float32 CPU models whose linear weights take at most "
                                         "1 GiB", "tristate")
    native_forward: bool | None = option(None, "CPU: run each step of a model whose weights are quantized blocks (a "
                                         "GGUF as stored, or --quantize) as one native C++ call (kernels/cpu/"
                                         "forward.cpp: every layer, the final norm and the head, batch-invariant by "
                                         "construction); --no-native-forward runs the torch modules' ops instead. "
                                         "Default: on where the model qualifies (the summary says which forward runs "
                                         "and why)", "tristate")
    batch_invariant: object = option(AUTO, "batch-invariant numerics: a token's logits are the same bits whatever "
                                     "else shares the forward, so greedy speculative output equals AR bit for bit in "
                                     "bfloat16 and float32 too (slower; docs/design.md). Bare flag: on. Default auto: "
                                     "on for the speculative methods on CUDA where a start-up measurement finds it "
                                     "costs at most 1.15x, else off. A quantized target (a GGUF as stored, or "
                                     "--quantize) always runs batch-invariant numerics (it loads with them on; its "
                                     "native forward is invariant by construction): off changes nothing there",
                                     "batch_invariant", metavar="{auto,on,off}")
    kernel_backend: str = option(AUTO, "the Triton kernels or their torch references: auto (Triton on CUDA, torch "
                                 "elsewhere), triton (on CPU tensors only under TRITON_INTERPRET=1, slowly) or torch",
                                 "choice", choices=KERNEL_BACKENDS)
    compile: bool = option(False, "torch.compile the target and draft forwards (inductor's kernels; CUDA graphs are "
                           "--cuda-graphs'); the first steps of each shape compile (tens of seconds on a CPU, see "
                           "docs/api.md)", "bool")
    cuda_graphs: bool | None = option(None, "CUDA: run decode and verify steps as CUDA graph replays, captured per "
                                      "rows bucket (1, 2, 4, 8, 16, 32) and step length on first use (docs/design.md, "
                                      "the forward). Default: on on CUDA (off with --compile); refused elsewhere",
                                      "tristate")
    cost_cache: str | None = option(None, "the JSON file of start-up measurements (auto k's forward costs, "
                                    "batch-invariant cost) reused by later runs on this host (default: "
                                    "~/.cache/specdec/costs.json, under $XDG_CACHE_HOME if set; '' keeps none)",
                                    "path", optional=True, metavar="FILE")


@dataclass(frozen=True)
class SpeculationOptions(Checked):
    """How speculation runs: the method, k, and the drafters that need no model."""
    method: str = option("eqspec", "decoding strategy: ar = target only; eqspec = left-padded, realign every step; "
                         "exspec = same-length groups from a pool; ragged = per-row offsets, never realign",
                         "choice", choices=METHODS)
    num_speculative_tokens: object = option(AUTO, "draft tokens per step: 'auto' chooses k every step, from 0 (a "
                                            "step of the target alone) to --max-speculative-tokens, from costs "
                                            "measured on this machine (cached, see --cost-cache) and each request's "
                                            "acceptance; or a fixed integer >= 1 (no draft at all: --method ar)",
                                            "int", least=1, auto=True, flag=("-k", "--num-speculative-tokens"),
                                            metavar="{auto,N}")
    max_speculative_tokens: int = option(8, "the largest k that -k auto may choose", "int", least=1)
    lookup: str | None = option(AUTO, "beside a draft model: a row takes this lookup's drafts where it has at least "
                                "--lookup-min-match of them (and they have been accepted as often as the model's), "
                                "and the draft model runs only for the rows without: free drafts first. auto: "
                                "suffix beside a draft model, none otherwise; none: the model drafts every row",
                                "choice", choices=LOOKUPS + ("none",), auto=True, optional=True)
    draft_vocab: object = option(AUTO, "the draft's head restricted to the N most frequent tokens of the count that "
                                 "ships for its tokenizer (FR-Spec: a cheaper draft step; exact, the target verifies "
                                 "every token; specdec/draft_vocab.py): auto (49152 where a count ships and the "
                                 "draft was loaded from a file), N, or 0 for the full head", "int", least=0, auto=True,
                                 metavar="{auto,N}")
    draft_confidence: object = option(AUTO, "a row stops drafting when the chance that its drafts so far are all "
                                      "accepted (the product of the draft's calibrated top probabilities) falls below "
                                      "this: auto prices it every step from the measured costs and acceptance (-k "
                                      "auto; 0 with a fixed k), a number in [0, 1] fixes it, 0 never stops early",
                                      "float", least=0, auto=True, valid=lambda x: x <= 1, metavar="{auto,P}",
                                      rule="'auto' or a number in [0, 1]")
    lookup_min_match: int = option(2, "with --lookup: the fewest looked-up drafts (or k, if smaller) that replace "
                                   "the model's in a row", "int", least=1)
    ngram_min: int = option(1, "ngram: the shortest suffix of a row that is matched in its prompt + output", "int",
                            least=1)
    ngram_max: int = option(4, "ngram: the longest suffix matched (longer matches are tried first)", "int", least=1)
    suffix_store_tokens: int = option(16384, "suffix: tokens of recent requests' outputs kept for drafting across "
                                      "requests (0: each request drafts from its own text only; docs/api.md says "
                                      "what is kept)", "int", least=0)

    def applies(self, name: str) -> bool:
        return name != "num_speculative_tokens" or self.speculative  # AR has no k

    def __post_init__(self):
        super().__post_init__()
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")

    @property
    def speculative(self) -> bool:
        return self.method in SPECULATIVE

    @property
    def k(self):
        """k as the strategies read it: 0 for AR, else the int or "auto"."""
        return self.num_speculative_tokens if self.speculative else 0

    @property
    def auto_k(self) -> bool:
        return self.k == AUTO

    @property
    def k_max(self) -> int:
        """The most drafts any step may propose (sizes the caches)."""
        return self.max_speculative_tokens if self.auto_k else int(self.k)


@dataclass(frozen=True)
class SchedulerOptions(Checked):
    """The batch, the caches and the scheduler's pool."""
    batch_size: int = option(8, "rows decoded together", "int", least=1)
    window_size: int = option(48, "exspec: live sequences in the pool (>= --batch-size)", "int", least=1)
    max_wait_steps: int = option(8, "exspec: no row waits more steps than this", "int", least=0)
    realign_cost_ratio: float = option(0.175, "exspec: one row's realignment time over a step's fixed cost "
                                       "(docs/exspec.md); sets which same-length groups are worth a step. 0: only "
                                       "groups as large as a mixed batch; inf: any group", "float", least=0)
    fold_shift: bool = option(False, "exspec: write a mixed batch's rows at their left-padded columns while "
                              "gathering them, instead of realigning the batch buffer afterwards", "bool")
    prefix_cache_gb: float | None = option(None, "keep the K/V of prompts and outputs seen before, in at most this "
                                           "many GiB (least recently used dropped first): a prompt that begins with "
                                           "one (the next turn of a chat) prefills only the rest (default: off; "
                                           "docs/serve.md)", "float", optional=True, metavar="GIB",
                                           rule="a number of GiB > 0 (leave it unset for no prefix cache)",
                                           valid=lambda gb: 0 < gb < math.inf and int(gb * GIB) >= 1)
    prefill_chunk: int | None = option(None, "prefill a prompt of more (uncached) tokens than this in chunks of this "
                                       "many, one per engine step, while the running requests keep decoding "
                                       "(default: at once)", "int", least=1, optional=True, metavar="TOKENS")
    profile: bool = option(False, "time every phase of every step (draft, verify, accept, realign...) for the "
                           "realign share and the JSON metrics; synchronises the device at each phase", "bool")
    check_invariants: bool = option(False, "check cache/position/mask invariants after every step (slow; raises "
                                    "naming the invariant, row and column)", "bool")


GROUPS = {"speculation": SpeculationOptions, "scheduler": SchedulerOptions, "load": LoadOptions}


def option_field(name: str):
    """The field of option `name` (its rule, flag and help in `.metadata`)."""
    return next(f for f in all_fields() if f.name == name)


def all_fields() -> list:
    """Every option's field, in flag order (speculation, scheduler, load)."""
    return [f for cls in GROUPS.values() for f in fields(cls)]


@dataclass(frozen=True)
class Options:
    """An engine's options: `Options.build(batch_size=4, method="ragged", ...)` routes each keyword to its group."""
    load: LoadOptions = field(default_factory=LoadOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)

    def __post_init__(self):
        if self.speculation.method == "exspec" and self.scheduler.window_size < self.scheduler.batch_size:
            raise ValueError(f"window_size ({self.scheduler.window_size}) must be >= batch_size "
                             f"({self.scheduler.batch_size}) for exspec")

    @classmethod
    def build(cls, base: "Options | None" = None, **kwargs) -> "Options":
        """`base` (default: the defaults) with the named options replaced; an unknown name is refused naming the
        closest option."""
        base = base or cls()
        routed: dict[str, dict] = {group: {} for group in GROUPS}
        names = {f.name: group for group, c in GROUPS.items() for f in fields(c)}
        for name, value in kwargs.items():
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else " (docs/api.md lists the options)"
                raise TypeError(f"unknown option {name!r}{hint}")
            routed[names[name]][name] = value
        groups = {group: replace(getattr(base, group), **values) for group, values in routed.items()}
        return cls(**groups)

    def as_kwargs(self) -> dict:
        """Every option by name (what `Options.build` takes)."""
        return {f.name: getattr(getattr(self, group), f.name) for group, c in GROUPS.items() for f in fields(c)}

