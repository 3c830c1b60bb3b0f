"""specdec's methods against transformers' batched `generate` and assisted generation, side by side: same
prompts, exactly N new tokens each, greedy, same dtype and threads, every method warmed up and then timed
--repeats times interleaved. Methods, pairs and how to read the table: docs/benchmarks/against-transformers.md.
Writes peers.jsonl, peers.md (also printed) and peers-<pair>.png to --out (default bench/results/peers).

    python -m bench.peers --quick                                     # smoke test: tiny pair, seconds
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from bench.bandwidth import read_bandwidth
from bench.common import (REPO, HelpFormatter, checkpoint_tokenizer, comma_ints, comma_list, command_line,
                          evenly_spaced, file_sha256, fmt_spread, interleave, k_text, lengths_text, log, machine,
                          md_table, parse_with_quick, quick_help, prompt_ids, pyplot, read_jsonl, save_figure, shown,
                          spread, write_jsonl)
from bench.pairs import DEFAULT_PAIR_DIR, pair_dirs
from specdec import LLM, METHODS, SamplingParams
from specdec.drafts import shipped_draft
from specdec.models import is_gguf, load_model
from specdec.models.feature_draft import is_feature_draft, load_feature_draft
from specdec.prompts import DEFAULT_PROMPTS, read_prompts

DEFAULT_OUT = os.path.join(REPO, "bench", "results", "peers")
MISSING_TRANSFORMERS = 'bench/peers.py: transformers is not installed: pip install -e ".[test]"'
PAIRS = ("default", "synthetic", "tiny", "target")  # "target": --target (and --draft)
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEFAULT_METHODS = ("hf-ar,hf-assisted:5,hf-assisted:default,ar,eqspec:auto,eqspec:5,ragged:auto,ragged:5,"
                   "exspec:auto,exspec:5,ar+compile,eqspec:auto+compile")
QUICK = dict(pairs="tiny", dtypes="float32", batch_sizes="1,2", num_prompts="2", max_tokens="6", repeats=1,
             methods="hf-ar,hf-assisted:5,ar,eqspec:auto,ragged:3")
AUTO_K_MAX = 8  # LLM's default max_speculative_tokens: what "auto" may propose (sizes the context check)


# ---------------------------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class Variant:
    """One compared method: `engine` "specdec" (method ar/eqspec/ragged/exspec) or "hf" (ar/assisted/lookup)."""

    label: str
    engine: str
    method: str
    k: int | str | None = None  # specdec: int or "auto"; hf-assisted: int or "default"; hf-lookup: int
    compile: bool = False

    def runs_at(self, batch_size: int) -> bool:
        return not (self.engine == "hf" and self.method in ("assisted", "lookup") and batch_size != 1)

    @property
    def speculative(self) -> bool:
        return self.method != "ar"


def parse_variant(label: str) -> Variant:
    """'hf-ar', 'hf-assisted:5', 'hf-assisted:default', 'hf-lookup:3', 'ar', 'ragged' (= ragged:auto),
    'ragged:5', 'eqspec:auto+compile', 'ar+compile'. Raises ValueError naming the label."""
    text = label.strip()
    compiled = text.endswith("+compile")
    name, _, k = text.removesuffix("+compile").partition(":")
    count = int(k) if k.isdigit() and int(k) >= 1 else None
    if name == "hf-ar" and not k and not compiled:
        return Variant("hf-ar", "hf", "ar")
    if name == "hf-lookup" and count and not compiled:
        return Variant(f"hf-lookup:{count}", "hf", "lookup", count)
    if name == "hf-assisted" and (count or k == "default") and not compiled:
        return Variant(f"hf-assisted:{k if k == 'default' else count}", "hf", "assisted", count or k)
    if name == "ar" and not k:
        return Variant("ar+compile" if compiled else "ar", "specdec", "ar", None, compiled)
    if name in METHODS and name != "ar" and (count or k in ("", "auto")):
        k = count or "auto"
        return Variant(f"{name}:{k}" + ("+compile" if compiled else ""), "specdec", name, k, compiled)
    raise ValueError(f"--methods {label!r}: choose from hf-ar, hf-assisted:K, hf-assisted:default, hf-lookup:N, ar, "
                     f"{', '.join(m for m in METHODS if m != 'ar')} (with ':K' or ':auto'), each but hf-* with "
                     f"'+compile'")


def per_config(text: str, flag: str, pairs, dtypes) -> dict[tuple[str, str], int]:
    """A value for every (pair, dtype): '16' (all), or comma-separated 'N', 'PAIR=N', 'PAIR/DTYPE=N' (the most
    specific wins), e.g. '16,synthetic/bfloat16=4'. Raises ValueError naming the flag."""
    values: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.rpartition("=")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{flag} {text!r}: values must be integers >= 1")
        name, _, dtype = key.partition("/")
        if key and (name not in PAIRS or (dtype and dtype not in DTYPES)):
            raise ValueError(f"{flag} {text!r}: unknown key {key!r} (PAIR or PAIR/DTYPE, pairs {', '.join(PAIRS)})")
        values[key] = int(value)
    out = {}
    for pair in pairs:
        for dtype in dtypes:
            value = values.get(f"{pair}/{dtype}", values.get(pair, values.get("")))
            if value is None:
                raise ValueError(f"{flag} {text!r}: no value for the {pair} pair in {dtype}")
            out[(pair, dtype)] = value
    return out


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--pairs", type=comma_list(PAIRS), default="default,synthetic",
                   help=f"comma-separated, of {', '.join(PAIRS)} (bench/pairs.py; 'target': --target)")
    p.add_argument("--pair-dir", default=None, help="cache folder of the synthetic/tiny pairs, one sub-folder each "
                   f"(default: {shown(DEFAULT_PAIR_DIR)}[-tiny], shared with bench/throughput.py)")
    p.add_argument("--target", default=None, help="benchmark this checkpoint (HF directory or .gguf) as the pair "
                   "'target' instead of --pairs")
    p.add_argument("--draft", default=None, help="with --target: its draft (default: the draft specdec ships for it, "
                   "if any; without one only ar, hf-ar, hf-lookup and ar+compile run)")
    p.add_argument("--dtypes", type=comma_list(DTYPES), default="float32,bfloat16", help="comma-separated model dtypes")
    p.add_argument("--batch-sizes", type=comma_ints, default="1,8,16", help="comma-separated batch sizes")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated: hf-ar, hf-assisted:K (constant K), hf-assisted:default, hf-lookup:N "
                        "(prompt lookup), specdec's ar/eqspec/ragged/exspec with ':auto' or ':K' (bare = auto), "
                        "'+compile' for LLM(compile=True)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target's chat template")
    p.add_argument("--prompts", default=None, help=f"prompt file, .jsonl or .txt (default: {shown(DEFAULT_PROMPTS)}), "
                   "taken evenly spaced; pairs without a tokenizer read UTF-8 bytes (id = byte + 3)")
    p.add_argument("--num-prompts", default="16", help="prompts per run: N, or per pair / pair and dtype, the most "
                   "specific winning, e.g. '16,synthetic/bfloat16=4'")
    p.add_argument("--max-tokens", default="64", help="new tokens per prompt, every method: N or per pair like "
                   "--num-prompts")
    p.add_argument("--max-prompt-tokens", default="128", help="truncate longer prompts (and to what the context "
                   "leaves): N or per pair like --num-prompts")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every method")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of every method at every batch size")
    p.add_argument("--out", default=None, help=f"output folder (default: {shown(DEFAULT_OUT)})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--replot", default=None, metavar="JSONL", help="run nothing: re-render peers.md and the plots "
                   "of an earlier peers.jsonl (into --out, else next to it)")
    p.add_argument("--quick", action="store_true", help=quick_help(QUICK, "smoke test"))
    args = parse_with_quick(p, QUICK, argv)
    if args.replot:
        args.out = args.out or os.path.dirname(os.path.abspath(args.replot))
        return args
    args.out = args.out or DEFAULT_OUT
    try:
        if args.draft and not args.target:
            raise ValueError("--draft needs --target")
        for flag, path in (("--target", args.target), ("--draft", args.draft), ("--prompts", args.prompts)):
            if path and not os.path.exists(path):
                raise ValueError(f"{flag} {path}: no such file or directory")
        if args.target:
            args.pairs = ["target"]
        if "target" in args.pairs and not args.target:
            raise ValueError("--pairs target needs --target CHECKPOINT")
        args.variants = [parse_variant(m) for m in args.methods.split(",") if m.strip()]
        if not args.variants or len({v.label for v in args.variants}) != len(args.variants):
            raise ValueError(f"--methods {args.methods!r}: empty, or a method listed twice")
        # without --draft, the draft shipped for the target (load_pair finds it once the target is loaded)
        args.needs_draft = ([v.label for v in args.variants if v.speculative and v.method != "lookup"]
                            if args.target and not args.draft else [])
        for flag in ("num_prompts", "max_tokens", "max_prompt_tokens"):
            setattr(args, flag, per_config(str(getattr(args, flag)), "--" + flag.replace("_", "-"), args.pairs,
                                           args.dtypes))
        if args.repeats < 1 or (args.threads is not None and args.threads < 1):
            raise ValueError("--repeats and --threads must be >= 1")
    except ValueError as err:
        p.error(str(err))
    return args


def require_transformers():
    """transformers is a test/bench-only dependency: without it, one line and exit status 2."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(MISSING_TRANSFORMERS, file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------- models
@dataclass
class Pair:
    """One pair in one dtype: specdec's eager models (shared by every eager specdec method), transformers' models."""

    name: str
    dtype: str
    target_dir: str
    draft_dir: str
    target: object
    draft: object
    hf_target: object
    hf_draft: object
    tokenizer: object
    pad_token_id: int
    max_context: int
    info: dict = field(default_factory=dict)


def load_pair(name: str, dtype: str, args) -> Pair:
    if name == "target":
        target_dir, draft_dir = args.target, args.draft
    else:
        target_dir, draft_dir = pair_dirs(name, os.path.join(args.pair_dir, name) if args.pair_dir else None)
    torch_dtype = getattr(torch, dtype)
    target = load_model(target_dir, dtype=dtype, device="cpu")
    if draft_dir is None and name == "target" and args.needs_draft:
        found = shipped_draft(target)
        if found is None:
            raise SystemExit(f"bench/peers.py: --methods {', '.join(args.needs_draft)} need a draft: give --draft, "
                             f"or use ar/hf-ar/hf-lookup")
        draft_dir = args.draft = str(found)  # the next dtype's load_pair reads it
    draft = None if draft_dir is None else load_draft(draft_dir, target, dtype)
    hf_target = hf_load(target_dir, torch_dtype)
    # a feature draft reads our target's hidden states: transformers cannot run it (hf-assisted needs a plain draft)
    hf_draft = None if draft_dir is None or is_feature_draft(draft_dir) else hf_load(draft_dir, torch_dtype)
    pad = hf_target.config.pad_token_id
    pad = 0 if pad is None else int(pad)
    for m in (hf_target, hf_draft):
        if m is not None:
            m.generation_config = no_eos_config(pad)
    tokenizer = checkpoint_tokenizer(target_dir)
    max_context = min(m.cfg.max_position_embeddings for m in (target, draft) if m is not None)
    info = {
        "target_dir": os.path.relpath(target_dir, REPO),
        "draft_dir": None if draft_dir is None else os.path.relpath(draft_dir, REPO),
        "target_sha256": file_sha256(weights_file(target_dir)),
        "draft_sha256": None if draft_dir is None else file_sha256(weights_file(draft_dir)),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": None if draft is None else sum(p.numel() for p in draft.parameters()),
        "target_layers": target.cfg.num_layers, "draft_layers": None if draft is None else draft.cfg.num_layers,
        "hidden_size": target.cfg.hidden_size, "vocab_size": target.vocab_size, "max_context": max_context,
        "hf_attn_implementation": hf_target.config._attn_implementation,
        "target_weight_bytes": streamed_weight_bytes(target),
    }
    return Pair(name, dtype, target_dir, draft_dir, target, draft, hf_target, hf_draft, tokenizer, pad,
                max_context, info)


def load_draft(path: str, target, dtype: str):
    """specdec's draft: a feature draft on `target` (models/feature_draft.py), or a checkpoint."""
    return load_feature_draft(path, target) if is_feature_draft(path) else load_model(path, dtype=dtype, device="cpu")


def hf_load(path: str, torch_dtype):
    """transformers' model of a checkpoint directory or a .gguf file (dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM

    if is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                    gguf_file=os.path.basename(path), dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()


def weights_file(path: str) -> str:
    return path if is_gguf(path) else os.path.join(path, "model.safetensors")


def streamed_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied head counted once), except an
    untied input embedding, of which a step reads only its tokens' rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() drops tied duplicates
    if not model.cfg.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def build_prompts(pair: Pair, num_prompts: int, max_tokens: int, args) -> tuple[list[list[int]], str]:
    """Token-id prompts (the same ids for every method) and a one-line description."""
    path = args.prompts or DEFAULT_PROMPTS
    texts = evenly_spaced(read_prompts(path), num_prompts)
    if args.chat:
        if pair.tokenizer is None or pair.tokenizer.chat_template is None:
            raise ValueError(f"--chat: the {pair.name} pair's tokenizer has no chat template")
        texts = [pair.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    ids, how = prompt_ids(texts, pair.tokenizer, pair.target.vocab_size)
    how += ", chat template" if args.chat else ""
    room = pair.max_context - max_tokens - AUTO_K_MAX - 2  # what auto k's verify pass may need on top
    if room < 1:
        raise ValueError(f"--max-tokens {max_tokens} leaves no room for a prompt in the {pair.name} pair's "
                         f"context of {pair.max_context}")
    limit = min(args.max_prompt_tokens[pair.name, pair.dtype], room)
    ids = [x[:limit] for x in ids]
    return ids, (f"{shown(path)}: {num_prompts} prompts ({how}), truncated to {limit} tokens; lengths "
                 f"{lengths_text(ids)} (min / median / max)")


# ---------------------------------------------------------------------------------------------- running
@dataclass
class Run:
    seconds: float
    tokens: list[list[int]]
    metrics: object = None  # a speculative specdec run's RunMetrics
    recalibrated: bool = False  # auto k re-measured its costs during the run


class Runner:
    """Runs one variant on one pair: `run(prompts, B, N)` returns a Run (outputs in prompt order)."""

    def __init__(self, variant: Variant, pair: Pair, max_batch_size: int = 1):
        self.variant, self.pair = variant, pair
        self.window_size = max(48, max_batch_size)  # EXSPEC's pool holds the largest batch
        self.llm = None
        if variant.engine == "specdec":
            if variant.compile:  # its own copies: LLM(compile=True) compiles the model objects it is given
                target = load_model(pair.target_dir, dtype=pair.dtype, device="cpu")
                self.models = (target, None if pair.draft_dir is None else load_draft(pair.draft_dir, target,
                                                                                       pair.dtype))
            else:  # every eager method shares the pair's models
                self.models = (pair.target, pair.draft)
            self.llm = self._new_llm(compile=variant.compile)

    def _new_llm(self, compile: bool) -> LLM:
        v = self.variant
        return LLM(target=self.models[0], draft=self.models[1], method=v.method,
                   num_speculative_tokens=5 if v.k is None else v.k, batch_size=1, dtype=self.pair.dtype,
                   device="cpu", window_size=self.window_size, tokenizer=self.pair.tokenizer, compile=compile,
                   check_invariants=False, cost_cache="")

    def warm_up(self, prompts, batch_size: int, max_tokens: int) -> float:
        """Untimed run(s) before the timed ones; returns their seconds. A compiled variant runs a full batch (every
        graph gets built), and with k = "auto" once more in a fresh LLM, calibrating on compiled forwards."""
        v = self.variant
        t0 = time.perf_counter()
        n = min(batch_size, len(prompts)) if v.compile else min(batch_size, 2)
        warm = near_median(prompts, n)
        self.run(warm, batch_size, max_tokens)
        if v.compile and v.k == "auto":
            self.llm = self._new_llm(compile=False)  # compile=False: keep the compiled forwards, compile nothing new
            self.run(warm, batch_size, max_tokens)
        return time.perf_counter() - t0

    def run(self, prompts, batch_size: int, max_tokens: int) -> Run:
        if self.variant.engine == "hf":
            return self._hf_generate(prompts, batch_size, max_tokens)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        chooser = getattr(self.llm, "chooser", None)
        key = getattr(chooser, "key", None)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params, batch_size=batch_size)
        seconds = time.perf_counter() - t0
        tokens = _exact_length([list(o.token_ids) for o in outs], max_tokens, self.variant.label)
        return Run(seconds, tokens, outs.metrics if self.variant.speculative else None,
                   key is not None and getattr(chooser, "key", None) != key)

    @torch.inference_mode()
    def _hf_generate(self, prompts, batch_size, max_tokens) -> Run:
        """transformers' generate on left-padded batches (hf-ar), with prompt lookup, or with the draft as its
        assistant model (hf-lookup, hf-assisted: batch 1, so no padding)."""
        config = no_eos_config(self.pair.pad_token_id, do_sample=False, max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens,
                               prompt_lookup_num_tokens=self.variant.k if self.variant.method == "lookup" else None)
        assistant = {}
        if self.variant.method == "assisted":
            self.pair.hf_draft.generation_config = assistant_config(self.variant.k, self.pair.pad_token_id)
            assistant = {"assistant_model": self.pair.hf_draft}
        batches = [left_pad(prompts[i:i + batch_size], self.pair.pad_token_id)
                   for i in range(0, len(prompts), batch_size)]
        tokens = []
        t0 = time.perf_counter()
        for input_ids, mask in batches:
            out = self.pair.hf_target.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                                               **assistant)
            tokens += out[:, input_ids.shape[1]:].tolist()  # [b, N]
        return Run(time.perf_counter() - t0, _exact_length(tokens, max_tokens, self.variant.label))


def _exact_length(tokens, n, label):
    bad = [i for i, t in enumerate(tokens) if len(t) != n]
    if bad:
        raise RuntimeError(f"{label}: prompt {bad[0]} got {len(tokens[bad[0]])} new tokens, not {n}")
    return tokens


def left_pad(prompts, pad_id: int):
    """input_ids [b, L] left-padded with pad_id and attention_mask [b, L] (1 on real tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def no_eos_config(pad_id: int, **fields):
    """A GenerationConfig without EOS (nothing stops early, min_new_tokens suppresses nothing)."""
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=None, pad_token_id=pad_id, bos_token_id=None, **fields)


def assistant_config(k, pad_id: int):
    """The assistant's GenerationConfig (transformers reads the schedule from the assistant model): K constant
    tokens with confidence stopping off, or transformers' defaults ("default": every field left unset)."""
    if k == "default":
        return no_eos_config(pad_id)
    return no_eos_config(pad_id, num_assistant_tokens=int(k), num_assistant_tokens_schedule="constant",
                         assistant_confidence_threshold=0.0)


def hf_assisted_defaults() -> dict:
    """What `hf-assisted:default` runs with (transformers' global defaults) and whether the threshold adapts."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig(), "_get_default_generation_params", dict)()
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {**{key: defaults.get(key) for key in keys},
            "threshold_refit_with_sklearn": importlib.util.find_spec("sklearn") is not None}


def near_median(prompts, n: int):
    """The n prompts whose lengths are closest to the median: a warm-up in auto k's context bucket."""
    median = statistics.median(len(p) for p in prompts)
    return sorted(prompts, key=lambda p: abs(len(p) - median))[:n]


def hf_reference(pair: Pair, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    """transformers' greedy output at batch 1, every prompt (untimed; also warms transformers up)."""
    t0 = time.perf_counter()
    run = Runner(Variant("hf-ar", "hf", "ar"), pair).run(prompts, 1, max_tokens)
    return run.tokens, time.perf_counter() - t0


def bench_pair(pair: Pair, prompts, max_tokens: int, args, progress) -> tuple[list[dict], dict]:
    """Warm up and time every variant at every batch size; returns the summary rows and this config's info."""
    load_before = os.getloadavg()
    bandwidth_before = read_bandwidth()
    progress(f"{pair.name}/{pair.dtype}: read bandwidth {bandwidth_before['median']:.1f} GB/s (bench/bandwidth.py)")
    reference, ref_s = hf_reference(pair, prompts, max_tokens)
    progress(f"{pair.name}/{pair.dtype}: transformers' batch-1 reference in {ref_s:.1f}s")
    runners = {}
    for v in args.variants:
        t0 = time.perf_counter()
        runners[v.label] = Runner(v, pair, max(args.batch_sizes))
        if time.perf_counter() - t0 > 1:
            progress(f"{pair.name}/{pair.dtype}: built {v.label} in {time.perf_counter() - t0:.1f}s")
    rows = []
    for B in (b for b in args.batch_sizes if b <= len(prompts)):  # a larger batch would never fill
        active = [v for v in args.variants if v.runs_at(B)]
        warmup = {}
        for v in active:  # untimed: allocations, auto k's calibration at this B, compilation
            warmup[v.label] = runners[v.label].warm_up(prompts, B, max_tokens)
            progress(f"{pair.name}/{pair.dtype} B={B}: warmed up {v.label} in {warmup[v.label]:.1f}s")
        runs = interleave({v.label: lambda v=v: runners[v.label].run(prompts, B, max_tokens) for v in active},
                          args.repeats, warmup=0)  # the order rotating every repeat
        progress(f"{pair.name}/{pair.dtype} B={B}: " + ", ".join(
            f"{v.label} {len(prompts) * max_tokens / statistics.median(r.seconds for r in runs[v.label]):.0f}"
            for v in active) + " tok/s (median)")
        rows += summarise(pair, B, active, runs, warmup, reference, len(prompts) * max_tokens)
    bandwidth_after = read_bandwidth()
    bandwidth = statistics.median([bandwidth_before["median"], bandwidth_after["median"]])
    for row in rows:  # the roofline of the AR rows: weight bytes streamed per second, against the measured bandwidth
        if row["base_method"] == "ar":
            streamed = row["tokens_per_s"]["median"] / row["batch_size"] * pair.info["target_weight_bytes"] / 1e9
            row.update(weight_gb_per_s=streamed, bandwidth_fraction=streamed / bandwidth)
    info = {"pair": pair.name, "dtype": pair.dtype, **pair.info, "max_tokens": max_tokens,
            "batch_sizes": [b for b in args.batch_sizes if b <= len(prompts)],
            "num_prompts": len(prompts), "reference_s": ref_s, "loadavg_before": list(load_before),
            "bandwidth_gb_per_s_before": bandwidth_before, "bandwidth_gb_per_s_after": bandwidth_after,
            "loadavg_after": list(os.getloadavg())}
    return rows, info


# ---------------------------------------------------------------------------------------------- summary
def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarise(pair: Pair, B: int, active, runs, warmup, reference, total_tokens: int) -> list[dict]:
    base = runs.get("hf-ar")
    rows = []
    for v in active:
        rs = runs[v.label]
        tps = [total_tokens / r.seconds for r in rs]
        first = rs[0].tokens
        row = {
            "type": "row", "pair": pair.name, "dtype": pair.dtype, "batch_size": B, "method": v.label,
            "engine": v.engine, "base_method": v.method, "k": v.k, "compile": v.compile,
            "tokens_per_s": spread(tps), "tokens_per_s_runs": tps, "seconds_runs": [r.seconds for r in rs],
            "speedup_vs_hf_ar": (spread([t * base[i].seconds / total_tokens for i, t in enumerate(tps)])
                                 if base else None),
            "exact_match_vs_hf_b1": sum(a == b for a, b in zip(first, reference)) / len(reference),
            "prefix_match_vs_hf_b1": statistics.mean(common_prefix(a, b) / len(b) for a, b in zip(first, reference)),
            "same_tokens_every_repeat": all(r.tokens == first for r in rs),
            "warmup_s": warmup[v.label], "recalibrated_runs": sum(r.recalibrated for r in rs),
        }
        m = sorted(rs, key=lambda r: r.seconds)[len(rs) // 2].metrics  # the median run's
        if m is not None:
            hist = {int(k): n for k, n in m.k_histogram.items()}
            steps = sum(hist.values())
            row.update(acceptance_rate=m.acceptance_rate,
                       tokens_per_step=(m.accepted_drafts + m.row_steps) / m.row_steps if m.row_steps else None,
                       k_histogram={str(k): n for k, n in sorted(hist.items())},
                       mean_k=sum(k * n for k, n in hist.items()) / steps if steps else None)
        rows.append(row)
    return rows


def k_cell(row) -> str:
    if row["engine"] == "hf" and row["base_method"] == "lookup":
        return f"prompt lookup {row['k']}"
    if row["engine"] == "hf" and row["base_method"] != "ar":
        return "transformers default" if row["k"] == "default" else f"{row['k']} constant"
    return k_text(row["k"], row.get("k_histogram"))


def table(rows) -> str:
    def cells(r):
        acc, recal = r.get("acceptance_rate"), r["recalibrated_runs"]
        return [r["batch_size"], r["method"] if r["engine"] == "specdec" else f"*{r['method']}*", k_cell(r),
                fmt_spread(r["tokens_per_s"]), fmt_spread(r["speedup_vs_hf_ar"], "{:.2f}"),
                f"{r['exact_match_vs_hf_b1']:.0%}" + ("" if r["same_tokens_every_repeat"] else " (varies)"),
                f"{r['prefix_match_vs_hf_b1']:.0%}",
                "–" if acc is None else f"{acc:.0%}" + (f" ({r['tokens_per_step']:.2f}/step)"
                                                       if r.get("tokens_per_step") else ""),
                f"{r['warmup_s']:.1f}" + (f" ({recal} recalibrated)" if recal else ""),
                "–" if r.get("weight_gb_per_s") is None else
                f"{r['weight_gb_per_s']:.1f} ({r['bandwidth_fraction']:.0%})"]

    return md_table(["B", "method", "k", "tokens/s median (min–max)", "× hf-ar@B median (min–max)",
                     "exact vs HF@1", "prefix vs HF@1", "acceptance", "warm-up s", "weights GB/s (of bandwidth)"],
                    map(cells, rows))


def headline(rows) -> list[str]:
    """Per batch size: specdec's fastest variant against transformers' fastest at that batch size."""
    out = []
    for B in sorted({r["batch_size"] for r in rows}):
        at = [r for r in rows if r["batch_size"] == B]
        ours = [r for r in at if r["engine"] == "specdec"]
        theirs = [r for r in at if r["engine"] == "hf"]
        if not ours or not theirs:
            continue
        best = max(ours, key=lambda r: r["tokens_per_s"]["median"])
        peer = max(theirs, key=lambda r: r["tokens_per_s"]["median"])
        ratio = best["tokens_per_s"]["median"] / peer["tokens_per_s"]["median"]
        out.append(f"B = {B}: fastest specdec `{best['method']}` {best['tokens_per_s']['median']:.1f} tok/s vs "
                   f"fastest transformers `{peer['method']}` {peer['tokens_per_s']['median']:.1f} tok/s: "
                   f"**{ratio:.2f}×**")
    return out


def config_header(info: dict) -> str:
    draft = ("no draft" if info["draft_dir"] is None else
             f"draft {info['draft_dir']} ({info['draft_params'] / 1e6:.1f}M, {info['draft_layers']} layer(s), "
             f"sha256 {info['draft_sha256']})")
    bandwidth = ""
    if "bandwidth_gb_per_s_before" in info:
        bandwidth = (f"read bandwidth (bench/bandwidth.py) {info['bandwidth_gb_per_s_before']['median']:.1f} GB/s "
                     f"before, {info['bandwidth_gb_per_s_after']['median']:.1f} GB/s after; weights streamed per "
                     f"step {info['target_weight_bytes'] / 1e6:.0f} MB  \n")
    return (f"target {info['target_dir']} ({info['target_params'] / 1e6:.1f}M params, {info['target_layers']} layers, "
            f"sha256 {info['target_sha256']}), {draft}  \n{bandwidth}"
            f"prompts: {info['prompts']}; {info['max_tokens']} new tokens each, greedy, no EOS stop  \n"
            f"load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in info['loadavg_before'])} before, "
            f"{'/'.join(f'{x:.1f}' for x in info['loadavg_after'])} after")


def render(rows, meta) -> str:
    md = [f"command: `{meta['command']}`  ",
          f"git {meta['git'] or '?'}, torch {meta['torch']}, transformers {meta['transformers']}, python "
          f"{meta['python']}, {meta['threads']} thread(s) of {meta['cpu_count']} CPUs, repeats {meta['repeats']}, "
          f"{meta['date']}  ",
          f"hf-assisted:default = transformers' defaults {json.dumps(meta['hf_assisted_default'])}"]
    for info in meta["configs"]:
        sub = [r for r in rows if r["pair"] == info["pair"] and r["dtype"] == info["dtype"]]
        md += ["", f"#### {info['pair']} pair, {info['dtype']}", "", config_header(info), ""]
        md += [f"- {line}" for line in headline(sub)] + ["", table(sub)]
    return "\n".join(md) + "\n"


def plot(rows, meta, out_dir) -> list[str]:
    plt = pyplot()
    paths = []
    for pair in dict.fromkeys(info["pair"] for info in meta["configs"]):
        dtypes = [i["dtype"] for i in meta["configs"] if i["pair"] == pair]
        sizes = sorted({r["batch_size"] for r in rows if r["pair"] == pair})
        fig, axes = plt.subplots(len(dtypes), len(sizes), figsize=(3.6 * len(sizes), 0.5 + 0.32 * 14 * len(dtypes)),
                                 squeeze=False)
        for i, dtype in enumerate(dtypes):
            for j, B in enumerate(sizes):
                ax = axes[i][j]
                sub = [r for r in rows if r["pair"] == pair and r["dtype"] == dtype and r["batch_size"] == B]
                med = [r["tokens_per_s"]["median"] for r in sub]
                err = [[m - r["tokens_per_s"]["min"] for m, r in zip(med, sub)],
                       [r["tokens_per_s"]["max"] - m for m, r in zip(med, sub)]]
                colors = ["0.45" if r["engine"] == "hf" else ("C3" if r["compile"] else "C0") for r in sub]
                ax.barh(range(len(sub)), med, xerr=err, color=colors, capsize=2)
                ax.set_yticks(range(len(sub)), [r["method"] for r in sub], fontsize=7)
                ax.invert_yaxis()
                hf = next((r for r in sub if r["method"] == "hf-ar"), None)
                if hf:
                    ax.axvline(hf["tokens_per_s"]["median"], color="k", lw=0.8, ls="--")
                ax.set_title(f"{dtype}, B = {B}", fontsize=9)
                ax.set_xlabel("tokens/s (median, min–max)", fontsize=8)
                ax.tick_params(axis="x", labelsize=7)
                ax.grid(alpha=0.3, axis="x")
        fig.suptitle(f"{pair} pair: specdec (blue; compiled red) vs transformers (grey; dashed: hf-ar)", fontsize=10)
        paths.append(save_figure(fig, os.path.join(out_dir, f"peers-{pair}.png")))
    return paths


# ---------------------------------------------------------------------------------------------- main
def write_report(rows, meta, args) -> str:
    """peers.md (and the plots) into args.out; returns the markdown."""
    md = render(rows, meta)
    pngs = [] if args.no_plots else plot(rows, meta, args.out)
    md += "".join(f"\n![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in pngs)
    with open(os.path.join(args.out, "peers.md"), "w") as f:
        f.write(md)
    return md


def replot(args) -> None:
    records = read_jsonl(args.replot)
    meta = next(r for r in records if r.get("type") == "meta")
    os.makedirs(args.out, exist_ok=True)
    print(write_report([r for r in records if r.get("type") == "row"], meta, args))


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        return replot(args)
    require_transformers()
    import transformers

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    compiling = any(v.compile for v in args.variants)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    progress = functools.partial(log, "peers")
    meta = {"type": "meta", **machine(), "command": command_line("bench.peers", argv),
            "transformers": transformers.__version__, "repeats": args.repeats, "batch_sizes": args.batch_sizes,
            "methods": [v.label for v in args.variants], "loadavg_start": list(os.getloadavg()),
            "hf_assisted_default": hf_assisted_defaults(), "configs": []}
    rows = []
    for name in args.pairs:
        for dtype in args.dtypes:
            progress(f"loading the {name} pair in {dtype}")
            if compiling:
                torch._dynamo.reset()  # drop the previous configuration's compiled graphs
            pair = load_pair(name, dtype, args)
            prompts, source = build_prompts(pair, args.num_prompts[name, dtype],
                                           args.max_tokens[name, dtype], args)
            progress(f"{name}/{dtype}: {source}")
            skipped = [b for b in args.batch_sizes if b > len(prompts)]
            if skipped:
                progress(f"{name}/{dtype}: skipping batch size(s) {skipped}: more than the {len(prompts)} prompts")
            pair_rows, info = bench_pair(pair, prompts, args.max_tokens[name, dtype], args, progress)
            info["prompts"] = source
            rows += pair_rows
            meta["configs"].append(info)
            del pair
    meta["loadavg_end"] = list(os.getloadavg())
    meta["total_time_s"] = time.perf_counter() - t_start
    write_jsonl(os.path.join(args.out, "peers.jsonl"), [meta] + rows)
    print(write_report(rows, meta, args))
    progress(f"wrote peers.jsonl, peers.md{'' if args.no_plots else ' and PNGs'} to {args.out} in "
             f"{meta['total_time_s']:.0f}s")


if __name__ == "__main__":
    main()
