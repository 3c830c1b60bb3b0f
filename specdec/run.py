"""`python -m specdec.run`: batch speculative decoding from the command line.

With no arguments it runs the embedded default pair (a small target and a much smaller draft trained on
the Python standard library) on built-in held-out prompts with EQSPEC and automatic k, prints samples, a
summary table with the speed-up over AR (both warmed up first, at batch 1 and at the batch size), and
checks the output against AR decoding.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading

from .devices import resolve_device
from .distributed import add_arguments as add_ray_arguments, wants_ray
from .output import JsonlOutput
from .prompts import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET, read_prompts

METHODS = ("ar", "eqspec", "exspec", "ragged")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def k_value(text: str):
    """-k: "auto" or an int >= 1."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specdec.run",
        description="Batch speculative decoding (exact EQSPEC / EXSPEC / ragged) on Llama/Vicuna, Qwen3 and "
                    "GLM-4 checkpoints. Without --target/--draft it uses the embedded default pair.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", help="target checkpoint directory (HF format: config.json, model.safetensors, "
                   "tokenizer); default: the embedded default target")
    p.add_argument("--draft", help="draft checkpoint directory sharing the target's tokenizer; default: the "
                   "embedded default draft")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="prompt file: .txt one prompt per line (\\n = newline, "
                   "# = comment), or .jsonl with a 'prompt' field or SpecBench-style 'turns'")
    p.add_argument("--num-prompts", type=positive_int, help="use only the first N prompts")
    p.add_argument("--method", choices=METHODS, default="eqspec", help="decoding strategy: ar = target only; "
                   "eqspec = left-padded, realign every step; exspec = same-length groups from a pool; "
                   "ragged = per-row offsets, never realign")
    p.add_argument("--batch-size", type=positive_int, default=8, help="rows decoded together")
    p.add_argument("-k", "--num-speculative-tokens", type=k_value, default="auto", help="draft tokens per step: "
                   "'auto' chooses k in 0..--max-speculative-tokens every step from costs measured on this machine "
                   "(cached under ~/.cache/specdec) and each request's acceptance (0 = a step without the draft); "
                   "or a fixed integer")
    p.add_argument("--max-speculative-tokens", type=positive_int, default=8, help="the largest k that -k auto may "
                   "choose")
    p.add_argument("--window-size", type=positive_int, default=48, help="exspec: pool of live sequences")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (rejection sampling "
                   "keeps the target's distribution exactly)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, help="base seed; request i uses seed + i (sampling only)")
    p.add_argument("--dtype", choices=("float64", "float32", "bfloat16", "float16"), default="float32",
                   help="weights and activations")
    p.add_argument("--device", default="auto", help="auto (CUDA when a GPU is present, else the CPU), cpu, cuda "
                   "or cuda:N")
    p.add_argument("--check-weights", action="store_true", help="scan every loaded weight for NaN/inf (after "
                   "conversion to --dtype) and stop naming the file and key; the summary says how long it took")
    p.add_argument("--output", metavar="FILE.jsonl", help="one JSON line per request (prompt, text, token ids, "
                   "accepted counts, latency), streamed to a hidden temporary beside FILE as requests finish and "
                   "renamed into place, in prompt order, when the run succeeds (on a late failure the partial file "
                   "is kept and named). Symlinks are written through; /dev/stdout, devices and FIFOs are streamed "
                   "to directly, in completion order")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="also run AR decoding, report the exact-match rate and the speed-up "
                   "(default: on with the embedded pair, off otherwise)")
    p.add_argument("--check-invariants", action="store_true", help="check cache/position/mask invariants after "
                   "every step (slow; raises naming the invariant, row and column)")
    p.add_argument("--compile", action="store_true", help="torch.compile the target and draft forwards (CUDA: with "
                   "CUDA graphs); the first steps of each shape compile (tens of seconds on a CPU, see docs/api.md)")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU float32: run steps of two or more token rows through oneDNN on linear weights packed "
                        "once (one extra copy of them; 1.2-1.5x faster multi-token forwards of the default pair, "
                        "docs/benchmarks.md). Default: on for float32 CPU models whose linear weights take at most "
                        "1 GiB")
    p.add_argument("--batch-invariant", action="store_true", help="batch-invariant numerics: a token's logits are "
                   "the same bits whatever else shares the forward, so greedy speculative output equals AR bit for "
                   "bit in bfloat16 and float32 too (slower; docs/design.md)")
    p.add_argument("--profile", action="store_true", help="time every phase of every step (draft, verify, accept, "
                   "realign...) for the realign share and the JSON metrics; synchronises the device at each phase")
    p.add_argument("--metrics", metavar="FILE.json", help="write the run's metrics (and the AR comparison's) as JSON: "
                   "tokens/s, acceptance, the histogram of chosen k, predicted vs measured step time, latencies")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--samples", type=int, default=3, help="generated samples to print")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_ray_arguments(p)
    return p


def encode_prompts(llm, prompts: list[str], chat: bool) -> list[list[int]]:
    if not chat:
        return [llm.tokenizer.encode(p) for p in prompts]
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                 add_special_tokens=False) for p in prompts]


def summary_table(rows: list[dict]) -> str:
    header = ["method", "batch", "k", "tokens/s", "acceptance", "tokens/step", "realign share", "speed-up vs AR"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['acceptance']} | "
                     f"{r['tokens_per_step']:.2f} | {r['realign_share']} | {r['speedup']} |")
    return "\n".join(lines)


def k_summary(metrics, k_setting) -> str:
    """The k a run used: fixed, or "auto" with the mean chosen k and the share of steps without the draft."""
    if metrics.method == "ar":
        return "-"
    if k_setting != "auto":
        return str(k_setting)
    steps = sum(metrics.k_histogram.values())
    if not steps:
        return "auto"
    mean = sum(k * n for k, n in metrics.k_histogram.items()) / steps
    return f"auto: {mean:.1f} ({metrics.k_histogram.get(0, 0) / steps:.0%} k=0)"


def metrics_row(metrics, k_setting, ar_tps: float | None) -> dict:
    speculative = metrics.method != "ar"
    return {"method": metrics.method, "batch_size": metrics.batch_size, "k": k_summary(metrics, k_setting),
            "tokens_per_s": metrics.tokens_per_s,
            "acceptance": f"{metrics.acceptance_rate:.1%}" if speculative and metrics.proposed_drafts else "-",
            "tokens_per_step": metrics.mean_tokens_per_step,
            "realign_share": f"{metrics.realign_share:.1%}" if metrics.profiled and speculative else "-",
            "speedup": f"{metrics.tokens_per_s / ar_tps:.2f}x" if ar_tps else "-"}


def check_sampling_flags(args) -> None:
    """The sampling flags, refused as SamplingParams would refuse them but naming the flag."""
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 and finite (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:  # NaN fails this too
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")


def run(args, sink: JsonlOutput | None = None) -> int:
    """One CLI run; `sink` (opened by `main` before anything is loaded) receives the --output lines."""
    import torch

    from specdec import LLM, SamplingParams

    default_pair = args.target is None and args.draft is None
    if (args.target is None) != (args.draft is None) and args.method != "ar":
        raise ValueError("give both --target and --draft, or neither (the embedded default pair)")
    target = args.target or DEFAULT_TARGET
    draft = None if args.method == "ar" else (args.draft or DEFAULT_DRAFT)
    for name, path in (("--target", target), ("--draft", draft)):
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"{name} {path}: checkpoint directory not found")
    check_sampling_flags(args)
    if wants_ray(args):  # scale-out on Ray: docs/distributed.md
        from .distributed import run_distributed
        return run_distributed(args, target, draft, sink)
    device = resolve_device(args.device, name="--device")
    prompts = list(args.prompt)
    if args.prompts:
        prompts += read_prompts(args.prompts)
    if not prompts:
        prompts = read_prompts(DEFAULT_PROMPTS)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    compare = default_pair if args.compare_ar is None else args.compare_ar

    llm = LLM(target, draft, method=args.method, num_speculative_tokens=args.num_speculative_tokens,
              max_speculative_tokens=args.max_speculative_tokens, batch_size=args.batch_size, dtype=args.dtype,
              device=device, window_size=args.window_size, check_invariants=args.check_invariants,
              check_weights=args.check_weights, compile=args.compile, profile=args.profile,
              batch_invariant=args.batch_invariant, packed_weights=args.packed_weights)
    if llm.tokenizer is None:
        raise ValueError(f"--target {target}: no tokenizer.model or tokenizer.json, cannot encode text prompts")
    ids = encode_prompts(llm, prompts, args.chat)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=None if args.seed is None else args.seed + i)
              for i in range(len(ids))]
    show = not args.no_progress
    ar = None
    if compare and args.method != "ar":  # AR with the same (already loaded) target, warmed up like the rest
        ar = LLM(llm.target, method="ar", batch_size=args.batch_size, device=llm.device, tokenizer=llm.tokenizer,
                 check_invariants=args.check_invariants, profile=args.profile)
        warm_up([llm, ar], ids, params, args.batch_size)
    stream = None if sink is None else (lambda o: sink.write(o, prompts[o.index]))
    outputs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=show, on_output=stream)
    for o, text in zip(outputs, prompts):
        o.prompt = text
    if sink is not None:
        sink.commit(outputs, prompts)
    rows = [(outputs.metrics, None)]  # (metrics, AR tokens/s at the same batch size)
    reference = None
    if ar is not None:
        reference = ar.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=show)
        rows = [(reference.metrics, None), (outputs.metrics, reference.metrics.tokens_per_s)]
        if args.batch_size > 1:  # batch 1 too: the speed-up a single user sees
            n = min(len(ids), BATCH1_PROMPTS)
            ar1 = ar.generate(prompt_token_ids=ids[:n], sampling_params=params[:n], use_tqdm=show, batch_size=1)
            spec1 = llm.generate(prompt_token_ids=ids[:n], sampling_params=params[:n], use_tqdm=show, batch_size=1)
            rows = [(ar1.metrics, None), (spec1.metrics, ar1.metrics.tokens_per_s)] + rows

    for o in list(outputs)[: max(args.samples, 0)]:
        print(f"--- request {o.index} ({len(o.token_ids)} tokens, {o.finish_reason})")
        print(o.prompt + "\033[1m" + (o.text or "") + "\033[0m" if sys.stdout.isatty() else o.prompt + (o.text or ""))
    print()
    print(summary_table([metrics_row(m, args.num_speculative_tokens, ar_tps) for m, ar_tps in rows]))
    if ar is not None and args.batch_size > 1:
        print(f"(batch-1 rows: the first {min(len(ids), BATCH1_PROMPTS)} prompts; every method warmed up before timing)")
    if args.metrics:
        write_metrics(args.metrics, [m for m, _ in rows])
    m = outputs.metrics
    if llm.chooser is not None and m.measured_step_s:
        print(f"k chosen per step: {dict(sorted(m.k_histogram.items()))}; cost model predicted "
              f"{m.predicted_step_s:.2f} s of step time, measured {m.measured_step_s:.2f} s")
    print(f"\n{m.num_requests} requests, {m.generated_tokens} tokens in {m.wall_time_s:.2f} s; "
          f"target forwards {m.target_forwards}, draft forwards {m.draft_forwards}; dtype {args.dtype}, "
          f"device {device_summary(llm.device, args.device)}, torch threads {torch.get_num_threads()}")
    if args.check_weights:
        seconds = sum(getattr(model, "weights_check_s", None) or 0.0 for model in (llm.target, llm.draft))
        print(f"Weights checked finite (no NaN/inf) in {seconds:.2f} s")
    if reference is not None:
        same = sum(o.token_ids == r.token_ids for o, r in zip(outputs, reference))
        kind = "exact-match" if args.temperature == 0 else "identical samples (sampling: not expected)"
        print(f"Check against AR decoding: {same}/{len(outputs)} {kind} ({same / len(outputs):.1%})")
    if sink is not None:
        print(f"{'streamed' if sink.stream else 'wrote'} {len(outputs)} requests to {args.output}")
    return 0


BATCH1_PROMPTS = 8  # prompts of the batch-1 comparison rows (--compare-ar with --batch-size > 1)


def warm_up(llms, ids, params, batch_size: int) -> None:
    """A short generate per LLM and batch size, outside the timed runs: first-call costs (allocations,
    auto-k calibration, compilation) are not charged to whichever method happens to run first."""
    from specdec import SamplingParams

    few = [SamplingParams(max_tokens=min(8, p.max_tokens), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          seed=p.seed, ignore_eos=True) for p in params[:2]]
    for llm in llms:
        for b in sorted({1, batch_size}):
            llm.generate(prompt_token_ids=ids[:2], sampling_params=few, batch_size=b)


def write_metrics(path: str, metrics) -> None:
    import json

    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump([m.as_dict() for m in metrics], f, indent=1)
    except OSError as err:
        raise OSError(f"--metrics {path}: cannot write ({err.strerror or err})") from None


def device_summary(device, requested: str) -> str:
    return f"{device} (auto)" if requested.strip().lower() == "auto" else str(device)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` blocks and the --output cleanup run."""


def raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
    raise Terminated()


def error_line(err: BaseException) -> str:
    """The one stderr line for an error; says where the requests finished before it were kept, if anywhere."""
    line = f"specdec: error: {err}"
    partial = getattr(err, "specdec_partial", None)
    if partial is not None:
        line += f"; the {partial[1]} request(s) finished before the error are in {partial[0]}"
    return line


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from specdec.models import CheckpointError

    previous = None
    if hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with JsonlOutput.open(args.output) if args.output else contextlib.nullcontext() as sink:
            return run(args, sink)
    except (CheckpointError, ValueError, TypeError, OSError) as err:
        if isinstance(err, BrokenPipeError):  # stdout went away: say nothing more on it at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(error_line(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specdec: interrupted (Ctrl-C){cleanup_note(args)}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"specdec: terminated (SIGTERM){cleanup_note(args)}", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def cleanup_note(args) -> str:
    return f"; --output {args.output} left as it was (its temporary files removed)" if args.output else ""


if __name__ == "__main__":
    sys.exit(main())
