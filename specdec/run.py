"""`python -m specdec.run`: batch speculative decoding from the command line.

With no arguments it runs the embedded default pair (a ~10M-parameter target and a ten-times-smaller
draft trained on the Python standard library) on built-in held-out prompts with EQSPEC, prints samples,
a summary table with the speed-up over AR, and checks the output against AR decoding.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from .prompts import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET, read_prompts

METHODS = ("ar", "eqspec", "exspec", "ragged")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
    p.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=5, help="draft tokens per step")
    p.add_argument("--window-size", type=positive_int, default=48, help="exspec: pool of live sequences")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (rejection sampling "
                   "keeps the target's distribution exactly)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, help="base seed; request i uses seed + i (sampling only)")
    p.add_argument("--dtype", choices=("float64", "float32", "bfloat16", "float16"), default="float32",
                   help="weights and activations")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--output", metavar="FILE.jsonl", help="write one JSON line per request (prompt, text, token "
                   "ids, accepted counts, latency); written only when the run succeeds")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="also run AR decoding, report the exact-match rate and the speed-up "
                   "(default: on with the embedded pair, off otherwise)")
    p.add_argument("--check-invariants", action="store_true", help="check cache/position/mask invariants after "
                   "every step (slow; raises naming the invariant, row and column)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--samples", type=int, default=3, help="generated samples to print")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def encode_prompts(llm, prompts: list[str], chat: bool) -> list[list[int]]:
    if not chat:
        return [llm.tokenizer.encode(p) for p in prompts]
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                 add_special_tokens=False) for p in prompts]


def summary_table(rows: list[dict]) -> str:
    header = ["method", "batch", "tokens/s", "acceptance", "tokens/step", "realign share", "speed-up vs AR"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['acceptance']} | "
                     f"{r['tokens_per_step']:.2f} | {r['realign_share']:.1%} | {r['speedup']} |")
    return "\n".join(lines)


def metrics_row(metrics, speculative: bool, ar_tps: float | None) -> dict:
    return {"method": metrics.method, "batch_size": metrics.batch_size, "tokens_per_s": metrics.tokens_per_s,
            "acceptance": f"{metrics.acceptance_rate:.1%}" if speculative else "-",
            "tokens_per_step": metrics.mean_tokens_per_step, "realign_share": metrics.realign_share,
            "speedup": f"{metrics.tokens_per_s / ar_tps:.2f}x" if ar_tps else "-"}


def write_jsonl(path: str, outputs) -> None:
    """All or nothing: write to a temporary file beside `path`, then rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".specdec-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for o in outputs:
                f.write(json.dumps({"index": o.index, "prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                                    "prompt_token_ids": o.prompt_token_ids, "finish_reason": o.finish_reason,
                                    "accepted_counts": o.accepted_counts, "latency_s": round(o.latency_s, 6),
                                    "time_to_first_token_s": round(o.time_to_first_token_s, 6)}) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run(args) -> int:
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
    if args.output:
        out_dir = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(out_dir):
            raise FileNotFoundError(f"--output {args.output}: directory {out_dir} does not exist")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    prompts = list(args.prompt)
    if args.prompts:
        prompts += read_prompts(args.prompts)
    if not prompts:
        prompts = read_prompts(DEFAULT_PROMPTS)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    compare = default_pair if args.compare_ar is None else args.compare_ar

    llm = LLM(target, draft, method=args.method, num_speculative_tokens=args.num_speculative_tokens,
              batch_size=args.batch_size, dtype=args.dtype, device=args.device, window_size=args.window_size,
              check_invariants=args.check_invariants)
    if llm.tokenizer is None:
        raise ValueError(f"--target {target}: no tokenizer.model or tokenizer.json, cannot encode text prompts")
    ids = encode_prompts(llm, prompts, args.chat)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=None if args.seed is None else args.seed + i)
              for i in range(len(ids))]
    show = not args.no_progress
    outputs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=show)
    for o, text in zip(outputs, prompts):
        o.prompt = text
    rows = [outputs.metrics]
    reference = None
    if compare and args.method != "ar":
        ar = LLM(target, method="ar", batch_size=args.batch_size, dtype=args.dtype, device=args.device)
        reference = ar.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=show)
        rows.insert(0, reference.metrics)

    for o in list(outputs)[: max(args.samples, 0)]:
        print(f"--- request {o.index} ({len(o.token_ids)} tokens, {o.finish_reason})")
        print(o.prompt + "\033[1m" + (o.text or "") + "\033[0m" if sys.stdout.isatty() else o.prompt + (o.text or ""))
    ar_tps = reference.metrics.tokens_per_s if reference is not None else None
    print()
    print(summary_table([metrics_row(m, m.method != "ar", ar_tps) for m in rows]))
    m = outputs.metrics
    print(f"\n{m.num_requests} requests, {m.generated_tokens} tokens in {m.wall_time_s:.2f} s; "
          f"target forwards {m.target_forwards}, draft forwards {m.draft_forwards}; dtype {args.dtype}, "
          f"device {args.device}, torch threads {torch.get_num_threads()}")
    if reference is not None:
        same = sum(o.token_ids == r.token_ids for o, r in zip(outputs, reference))
        kind = "exact-match" if args.temperature == 0 else "identical samples (sampling: not expected)"
        print(f"Check against AR decoding: {same}/{len(outputs)} {kind} ({same / len(outputs):.1%})")
    if args.output:
        write_jsonl(args.output, outputs)
        print(f"wrote {len(outputs)} requests to {args.output}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from specdec.models import CheckpointError

    try:
        return run(args)
    except (CheckpointError, ValueError, FileNotFoundError, TypeError) as err:
        print(f"specdec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
