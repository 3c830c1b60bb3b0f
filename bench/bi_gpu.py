"""Issue #42 end to end on a GPU: what batch-invariant numerics cost and whether they are exact, on a
Vicuna-7B-shaped random bfloat16 pair built in GPU memory (hidden 4096, 32 layers, 32 heads, intermediate
11008, vocab 32000; the draft is the target's own first layer, the target's later layers damped so that the
draft predicts it well, as bench/pairs.py's synthetic pair does). Greedy, --max-tokens new tokens, fixed k.

    python -m bench.bi_gpu --out DIR            # about 3-4 minutes on an H200 (Triton compiles included)
    python -m bench.bi_gpu --out DIR --quick    # 4 layers, smaller grid: a smoke test (also runs on a CPU)

Three parts, in this order (each record is appended to DIR/bi_e2e.jsonl as it finishes; DIR/bi_e2e.md is
rewritten after each part, so a run cut short by --budget-s or a timeout keeps what it measured):
- cost: tokens/s of ar and eqspec at B 1, 8, 32 with the mode off and on (the best of --rounds, the modes
  interleaved); the bar is on / off >= 1/1.15 of the speed (issue #42);
- exactness: with the mode on, every method's (ar, eqspec, ragged, exspec) rows at B 1, 8, 32 against AR at
  B 1 with the mode on (the bar: 100%); --off-too also counts them with the mode off;
- auto: what `batch_invariant="auto"` (specdec/bi_mode.py) picks for eqspec at each B, and the cost it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from torch import nn

from bench.common import log, random_prompts

METHODS = ("ar", "eqspec", "ragged", "exspec")
TIMED = ("ar", "eqspec")


def llama_config(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


@torch.no_grad()
def build_pair(raw: dict, device, dtype=torch.bfloat16, init_std: float = 0.02, damping: float = 0.012,
               seed: int = 0):
    """(target, draft): a random Llama built on `device` without a checkpoint; the draft shares the target's
    embedding, first layer, final norm and head (so both are switched into a mode together)."""
    from specdec.models import ModelConfig, Transformer

    cfg = ModelConfig.from_dict(raw, source="bench.bi_gpu")
    with torch.device("meta"):
        target = Transformer(cfg, fused=True).to(dtype)
        draft = Transformer(dataclasses.replace(cfg, num_layers=1), fused=True).to(dtype)
    target = target.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in target.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # norm weights (a Llama has no biases)
        else:
            p.normal_(0.0, init_std, generator=g)
    for layer in target.layers[1:]:
        layer.self_attn.o_proj.weight.mul_(damping)
        layer.mlp.down_proj.weight.mul_(damping)
    draft.embed_tokens, draft.norm, draft.lm_head = target.embed_tokens, target.norm, target.lm_head
    draft.layers = nn.ModuleList([target.layers[0]])
    return target.eval(), draft.eval()


class Run:
    """The pair, the prompts, and an LLM per method; `generate(method, B, on, n)` sets the mode first (LLM's
    `batch_invariant=False` leaves model objects as they are, so the mode is set here for every call)."""

    def __init__(self, target, draft, prompts, k: int, max_tokens: int):
        from specdec import LLM, SamplingParams

        self.target, self.draft, self.prompts = target, draft, prompts
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.llms = {m: LLM(target, draft if m != "ar" else None, method=m, batch_size=1, dtype="bfloat16",
                            num_speculative_tokens=k if m != "ar" else "auto", batch_invariant=False,
                            window_size=64, check_invariants=False, cost_cache="")
                     for m in METHODS}
        self.warm = set()

    def mode(self, on: bool) -> None:
        self.target.batch_invariant = on
        self.draft.batch_invariant = on

    def generate(self, method: str, B: int, on: bool, n: int):
        from specdec import SamplingParams

        self.mode(on)
        if (method, B, on) not in self.warm:  # Triton compiles, cuBLAS heuristics, allocator: not timed
            self.llms[method].generate(prompt_token_ids=self.prompts[:B],
                                       sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), batch_size=B)
            self.warm.add((method, B, on))
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        out = self.llms[method].generate(prompt_token_ids=self.prompts[:n], sampling_params=self.params, batch_size=B)
        return out, out.metrics.tokens_per_s


def md(records: list[dict]) -> str:
    lines = ["# Issue #42 end to end (bench/bi_gpu.py)", ""]
    head = [r for r in records if r["part"] == "setup"]
    if head:
        lines += [f"{head[0]['device']}, torch {head[0]['torch']}, triton {head[0]['triton']}; pair: "
                  f"{head[0]['pair']}; k = {head[0]['k']}, {head[0]['max_tokens']} new tokens, greedy", ""]
    cost = [r for r in records if r["part"] == "cost"]
    if cost:
        lines += ["| method | B | tok/s off | tok/s on | time on / off | <= 1.15 |", "|---|---|---|---|---|---|"]
        for r in cost:
            lines.append(f"| {r['method']} | {r['B']} | {r['tok_s_off']:.1f} | {r['tok_s_on']:.1f} | "
                         f"{r['ratio']:.2f}x | {'yes' if r['ratio'] <= 1.15 else 'NO'} |")
        lines.append("")
    same = [r for r in records if r["part"] == "exactness"]
    if same:
        lines += ["| mode | method | B | rows equal to AR@1 |", "|---|---|---|---|"]
        for r in same:
            lines.append(f"| {'on' if r['on'] else 'off'} | {r['method']} | {r['B']} | {r['equal']}/{r['rows']} |")
        lines.append("")
    auto = [r for r in records if r["part"] == "auto"]
    if auto:
        lines += ["| auto, eqspec B | picks | cost measured | why |", "|---|---|---|---|"]
        for r in auto:
            cost_s = f"{r['cost']:.2f}x" if r["cost"] is not None else "-"
            lines.append(f"| {r['B']} | {'on' if r['on'] else 'off'} | {cost_s} | {r['reason']} |")
        lines.append("")
    skipped = [r for r in records if r["part"] == "skipped"]
    if skipped:
        lines += ["Skipped (budget): " + ", ".join(r["what"] for r in skipped), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4, help="draft tokens per step (fixed: the comparison is of numerics)")
    p.add_argument("--rounds", type=int, default=2, help="cost: timed runs per (method, B, mode); the best counts")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--damping", type=float, default=0.012)
    p.add_argument("--off-too", action="store_true", help="exactness with the mode off as well (AR@1 again)")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cells after this many seconds")
    p.add_argument("--quick", action="store_true", help="4 layers, hidden 512, B 1 and 4, 16 tokens: a smoke test")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    jsonl, mdpath = os.path.join(args.out, "bi_e2e.jsonl"), os.path.join(args.out, "bi_e2e.md")
    open(jsonl, "w").close()
    records: list[dict] = []
    t0 = time.perf_counter()

    def record(r: dict) -> None:
        records.append(r)
        with open(jsonl, "a") as f:
            f.write(json.dumps(r) + "\n")

    def flush() -> None:
        with open(mdpath, "w") as f:
            f.write(md(records) + "\n")

    def time_left() -> bool:
        return time.perf_counter() - t0 < args.budget_s

    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        raw = llama_config(4, 512, 8, 8, 1024, 32000)
        batches, args.max_tokens = [b for b in batches if b <= 4] or [1], min(args.max_tokens, 16)
        batches = sorted(set(batches) | {4})
    else:
        raw = llama_config(args.layers, 4096, 32, 32, 11008, 32000)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    target, draft = build_pair(raw, args.device, init_std=args.init_std, damping=args.damping)
    n_max = max(batches)
    prompts = random_prompts(max(n_max, 4), raw["vocab_size"], 16, 64, seed=1)
    run = Run(target, draft, prompts, args.k, args.max_tokens)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record({"part": "setup", "device": device, "torch": torch.__version__, "triton": triton_version, "k": args.k,
            "max_tokens": args.max_tokens, "pair": {k: raw[k] for k in ("hidden_size", "num_hidden_layers",
                                                                           "intermediate_size", "vocab_size")},
            "build_s": time.perf_counter() - t0})
    log("bi_gpu", f"pair built in {time.perf_counter() - t0:.1f}s on {device}")

    outputs: dict = {}  # (method, B, on) -> token ids per prompt index
    # --- cost
    for B in batches:
        for method in TIMED:
            if not time_left():
                record({"part": "skipped", "what": f"cost {method}@{B}"})
                continue
            n = max(B, 2)
            best = {False: 0.0, True: 0.0}
            for r in range(args.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    out, tok_s = run.generate(method, B, on, n)
                    best[on] = max(best[on], tok_s)
                    outputs[method, B, on] = [o.token_ids for o in out]
            record({"part": "cost", "method": method, "B": B, "prompts": n, "tok_s_off": best[False],
                    "tok_s_on": best[True], "ratio": best[False] / best[True]})
            log("bi_gpu", f"cost {method}@{B}: off {best[False]:.1f} on {best[True]:.1f} tok/s "
                f"({best[False] / best[True]:.2f}x)")
    flush()

    # --- exactness: every method at every B against AR@1, mode on (and off with --off-too)
    for on in ((True, False) if args.off_too else (True,)):
        if not time_left():
            record({"part": "skipped", "what": f"exactness mode {'on' if on else 'off'}"})
            continue
        reference, _ = run.generate("ar", 1, on, n_max)
        ref = [o.token_ids for o in reference]
        for B in batches:
            for method in METHODS:
                if not time_left():
                    record({"part": "skipped", "what": f"exactness {method}@{B}"})
                    continue
                n = max(B, 4) if B == 1 else B
                got = outputs.get((method, B, on))
                if got is None or len(got) < n:
                    out, _ = run.generate(method, B, on, n)
                    got = outputs[method, B, on] = [o.token_ids for o in out]
                equal = sum(a == b for a, b in zip(got[:n], ref[:n]))
                record({"part": "exactness", "on": on, "method": method, "B": B, "rows": n, "equal": equal})
                log("bi_gpu", f"exactness mode {'on' if on else 'off'} {method}@{B}: {equal}/{n} rows equal AR@1")
        flush()

    # --- auto: what batch_invariant="auto" picks for eqspec at each B
    from specdec import LLM

    for B in batches:
        if not time_left():
            record({"part": "skipped", "what": f"auto@{B}"})
            continue
        run.mode(False)
        llm = LLM(target, draft, method="eqspec", batch_size=B, num_speculative_tokens=args.k, dtype="bfloat16",
                  check_invariants=False, cost_cache="")
        choice = llm.batch_invariant_choice
        record({"part": "auto", "B": B, "on": choice.on, "cost": choice.cost, "reason": choice.reason})
    flush()
    log("bi_gpu", f"done in {time.perf_counter() - t0:.0f}s: {mdpath}")
    print(md(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
