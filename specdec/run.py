"""`python -m specdec.run`: batch speculative decoding from the command line.

With no arguments it runs the embedded default pair (a small target and a much smaller draft trained on
the Python standard library) on built-in held-out prompts with EQSPEC and automatic k, prints samples, a
summary table with the speed-up over AR (both warmed up first, at batch 1 and at the batch size), and
checks the output against AR decoding.
"""
from __future__ import annotations

from specdec.openmp import apply_threads, default_wait_policy

default_wait_policy()  # before anything imports torch

import argparse
import contextlib
import os
import signal
import sys
import threading

from .distributed import add_arguments as add_ray_arguments, wants_ray
from .flags import (SEED_MAX, HelpFormatter, Parser, add_chat_arguments, add_engine_arguments, add_sampling_arguments,
                    add_threads_argument, build_llm, check_sampling_flags, checkpoint_pair, k_max_of, positive_int)
from .preflight import check_max_tokens
from .options import CHAT_MAX_TOKENS, chat_answer_tokens
from .output import JsonlOutput, check_paths
from .prompts import DEFAULT_PROMPTS, read_chat_template, read_prompts, set_chat_template
from .summary import metrics_row, summary_table, weights_summary


DESCRIPTION = ("Batch speculative decoding (exact EQSPEC / EXSPEC / ragged) on HF checkpoints of Llama/Vicuna, Qwen3 "
               "and GLM-4 and GGUF files of Llama, Qwen2/Qwen2.5 and Qwen3 (quantized blocks kept as stored). Without "
               "--target/--draft it uses the embedded default pair.")
DEFAULT_MAX_TOKENS = 64  # --max-tokens without --chat (with --chat: until EOS, capped by the context and 2048)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.run", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_engine_arguments(p)
    add_threads_argument(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable). Without --prompt and --prompts: the "
                   "built-in held-out prompts (specdec/assets/prompts.txt), or with --chat the interactive chat")
    p.add_argument("--prompts", metavar="FILE", help="prompt file: .txt one prompt per line (\\n = newline, "
                   "# = comment), or .jsonl with a 'prompt' field or SpecBench-style 'turns'")
    p.add_argument("--num-prompts", type=positive_int, help="use only the first N prompts")
    add_sampling_arguments(p, f"new tokens per prompt at most (default: {DEFAULT_MAX_TOKENS}; with --chat: until the "
                           f"answer ends (EOS), capped by the context and by {CHAT_MAX_TOKENS})")
    p.add_argument("--output", metavar="FILE.jsonl", help="one JSON line per request (prompt, text, token ids, "
                   "accepted counts, latency: the text and tokens are reproducible, greedy or with --seed; k, "
                   "acceptance and timings vary from run to run, as auto k measures costs: docs/api.md), streamed "
                   "to a hidden temporary beside FILE as requests finish and renamed into place, in prompt order, "
                   "when the run succeeds (on a late failure or an interrupt the partial file of finished requests, "
                   "whole JSON lines, is kept and named). Symlinks are written through; /dev/stdout, devices and "
                   "FIFOs are streamed to directly, in completion order")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="also run AR decoding, report the exact-match rate and the speed-up "
                   "(default: on with the embedded pair, off otherwise)")
    p.add_argument("--metrics", metavar="FILE.json", help="write the run's metrics (and the AR comparison's) as JSON: "
                   "tokens/s, acceptance, the histogram of chosen k, predicted vs measured step time, latencies")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template (or "
                   "--chat-template's) as a user turn; without --prompt/--prompts: the interactive chat of python -m "
                   "specdec.chat (streamed answers, the conversation kept in a prefix cache, /reset, Ctrl-C stops an "
                   "answer)")
    add_chat_arguments(p)
    p.add_argument("--samples", type=int, default=3, help="generated samples to print")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_ray_arguments(p)
    return p


def check_chat_flags(args) -> None:
    """--system and --chat-template go with --chat (the latter read now: a bad file is refused before loading);
    the interactive chat (--chat without prompts) writes no files and compares nothing."""
    for flag, value in (("--system", args.system), ("--chat-template", args.chat_template)):
        if value is not None and not args.chat:
            raise ValueError(f"{flag} goes with --chat (it shapes the chat template's prompt)")
        if value is not None and wants_ray(args):
            raise ValueError(f"{flag} is not passed to --ray replicas (they use the checkpoint's chat template)")
    if args.chat_template:
        read_chat_template(args.chat_template)
    if args.chat and not args.prompt and not args.prompts:
        given = [flag for flag, value in (("--output", args.output), ("--metrics", args.metrics),
                                          ("--compare-ar", args.compare_ar), ("--num-prompts", args.num_prompts),
                                          ("--ray", wants_ray(args))) if value]
        if given:
            raise ValueError(f"{given[0]} needs prompts (--prompt/--prompts): --chat without them is the interactive "
                             f"chat, which writes no files")


def check_seed_range(seed: int | None, prompts: int) -> None:
    """Request i uses seed + i: the last request's seed must still be a seed. Says what the user typed."""
    if seed is not None and seed + prompts - 1 > SEED_MAX:
        raise ValueError(f"--seed {seed}: request i uses seed + i, and with {prompts} prompts the last seed would "
                         f"pass the largest seed (2**64 - 1); use a --seed of at most {SEED_MAX - prompts + 1}")


def run(args, sink: JsonlOutput | None = None) -> int:
    """One CLI run; `sink` (opened by `main` before anything is loaded) receives the --output lines."""
    from specdec import SamplingParams

    from .devices import resolve_device

    target, draft, default_pair = checkpoint_pair(args)
    if wants_ray(args):  # scale-out on Ray: docs/distributed.md
        from .distributed import run_distributed
        return run_distributed(args, sink)
    device = resolve_device(args.device, name="--device")
    prompts = list(args.prompt or [])
    if args.prompts:
        prompts += read_prompts(args.prompts)
    if not prompts:
        prompts = read_prompts(DEFAULT_PROMPTS)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    compare = default_pair if args.compare_ar is None else args.compare_ar

    llm = build_llm(args, device=device)
    threads = apply_threads(args.threads, llm.target, llm.startup, llm.specs[0])
    if llm.tokenizer is None:
        raise ValueError(f"--target {target}: no tokenizer (tokenizer.model, tokenizer.json or GGUF tokenizer metadata), "
                         "cannot encode text prompts")
    if args.chat_template:
        set_chat_template(llm.tokenizer, args.chat_template)
    if args.chat:
        from .chat import chat_messages, chat_prompt_ids

        ids = [chat_prompt_ids(llm.tokenizer, chat_messages(args.system, p), "--chat") for p in prompts]
    else:
        ids = llm.encode(prompts)
    check_seed_range(args.seed, len(ids))
    k_max = llm.options.speculation.k_max  # with --chat and no --max-tokens: each answer until EOS, within the context
    params = [SamplingParams(max_tokens=args.max_tokens or max(1, chat_answer_tokens(llm.max_context, len(p), k_max)),
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=None if args.seed is None else args.seed + i)
              for i, p in enumerate(ids)]
    show = not args.no_progress
    ar = None
    if compare and args.method != "ar":  # AR with the same (already loaded) target, warmed up like the rest
        ar = build_llm(args, target=llm.target, draft=None, method="ar", device=llm.device, tokenizer=llm.tokenizer)
        warm_up([llm, ar], ids, params, args.batch_size)
        forget_answers(llm)  # the warm-up's answers are the first prompts' first tokens: no drafting from them
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
        if min(args.batch_size, len(ids)) > 1:  # batch 1 too: the speed-up a single user sees
            n = min(len(ids), BATCH1_PROMPTS)
            ar1 = ar.generate(prompt_token_ids=ids[:n], sampling_params=params[:n], use_tqdm=show, batch_size=1)
            forget_answers(llm)  # these prompts were answered by the run above: a lookup must not draft from that
            spec1 = llm.generate(prompt_token_ids=ids[:n], sampling_params=params[:n], use_tqdm=show, batch_size=1)
            rows = [(ar1.metrics, None), (spec1.metrics, ar1.metrics.tokens_per_s)] + rows

    if default_pair and args.samples > 0:
        print(TOY_PAIR)
    for o in list(outputs)[: max(args.samples, 0)]:
        print(f"--- request {o.index} ({len(o.token_ids)} tokens, {o.finish_reason})")
        prompt = o.prompt + ("\n" if args.chat else "")  # a chat answer is a new turn, not a continuation
        print(prompt + "\033[1m" + (o.text or "") + "\033[0m" if sys.stdout.isatty() else prompt + (o.text or ""))
    print()
    print(summary_table([metrics_row(m, args.num_speculative_tokens, ar_tps) for m, ar_tps in rows]))
    if len(rows) == 4:
        print(f"(batch-1 rows: the first {min(len(ids), BATCH1_PROMPTS)} prompts; every method warmed up before timing)")
    repeats = repeated_prompts(ids)
    if repeats and llm.suffix_store is not None and "suffix" in (llm.drafter, llm.options.speculation.lookup):
        print(f"({repeats} of the prompts {'repeats' if repeats == 1 else 'repeat'} an earlier one: suffix drafts "
              f"from the answers this run already gave, as a server would; each timed run starts with an empty store)")
    if args.metrics:
        write_metrics(args.metrics, [m for m, _ in rows])
    m = outputs.metrics
    if llm.chooser is not None and m.measured_step_s:
        off = "; ".join(f"{n} {why}" for why, n in sorted(m.k0_reasons.items(), key=lambda kv: -kv[1]))
        off = f" (k = 0 steps, by why: {off})" if off else ""
        print(f"k chosen per step: {dict(sorted(m.k_histogram.items()))}{off}"
              + f"; cost model predicted {m.predicted_step_s:.2f} s of step time, measured {m.measured_step_s:.2f} s")
    print(f"\n{plural(m.num_requests, 'request')}, {plural(m.generated_tokens, 'token')} in {m.wall_time_s:.2f} s; "
          f"target forwards {m.target_forwards}, draft forwards {m.draft_forwards}; {weights_summary(llm, args)}, "
          f"device {device_summary(llm.device, args.device)}, {threads}")
    for line in llm.startup.summary_lines():  # its one figure, then what it timed (or read from its cache)
        print(line)
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


TOY_PAIR = ("(the embedded pair is a toy: a 15.7M-parameter target and a 3.6M-parameter draft trained for about an "
            "hour on the Python standard library, to show the method on real text; they write plausible-looking, "
            "repetitive Python, not useful code. --target a real model for real answers: README.md, 'A real model')")
BATCH1_PROMPTS = 8  # prompts of the batch-1 comparison rows (--compare-ar with --batch-size > 1)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def forget_answers(llm) -> None:
    """Empty the suffix store (the answers of earlier runs): a timed run must not draft a prompt from its
    own answer, decoded moments before by the warm-up or the other side of the comparison."""
    if llm.suffix_store is not None:
        llm.suffix_store.clear()


def repeated_prompts(ids) -> int:
    """How many prompts repeat an earlier one, token for token."""
    return len(ids) - len({tuple(p) for p in ids})


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
    line = f"specdec.run: error: {err}"
    partial = getattr(err, "specdec_partial", None)
    if partial is not None:
        line += f"; the {partial[1]} request(s) finished before the error are in {partial[0]}"
    return line


def main(argv=None) -> int:
    sink = None
    previous = None
    if hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        args = build_parser().parse_args(argv)
        if sys.stdout is None:  # started with stdout closed (`>&-`)
            keep_stdout_closed_safely(args)
        target, draft, _ = checkpoint_pair(args)
        check_sampling_flags(args)
        check_chat_flags(args)
        if args.chat and not args.prompt and not args.prompts:  # the interactive chat (python -m specdec.chat)
            from .chat import chat

            return chat(args, "specdec.run")
        if args.max_tokens is None and not args.chat:
            args.max_tokens = DEFAULT_MAX_TOKENS
        if args.max_tokens is not None:  # against the context, from the checkpoints' files: before any weights load
            check_max_tokens(args.max_tokens, k_max_of(args), target, draft)
        check_paths(args.output, args.metrics, [args.prompts, target, draft])
        sink = JsonlOutput.open(args.output) if args.output else None
        with sink if sink is not None else contextlib.nullcontext():
            return run(args, sink)
    except (ValueError, TypeError, OSError) as err:  # CheckpointError is a ValueError
        if isinstance(err, BrokenPipeError):  # stdout went away: say nothing more on it at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(error_line(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specdec.run: interrupted (Ctrl-C){sink.note('the interrupt') if sink else ''}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"specdec.run: terminated (SIGTERM){sink.note('the interrupt') if sink else ''}", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def keep_stdout_closed_safely(args) -> None:
    """Started with stdout closed: --output /dev/stdout has nowhere to go; otherwise descriptor 1 gets
    /dev/null, so that no file opened later lands on it, and what would be printed is dropped."""
    if args.output and os.path.abspath(args.output) in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"):
        raise OSError(f"--output {args.output}: standard output is closed")
    null = os.open(os.devnull, os.O_WRONLY)
    if null != 1:
        os.dup2(null, 1)
        os.close(null)
    sys.stdout = open(1, "w", closefd=False)


if __name__ == "__main__":
    sys.exit(main())
