"""Which prefix-cache structure suits the row-contiguous KV cache: a radix tree over token ids (what
specdec/prefix_cache.py is) or hashed blocks of b tokens (vLLM's automatic prefix caching: a block is found
by the hash of its tokens and its parent's, only whole blocks are cached).

A 10-turn chat on SmolLM2-135M's K/V shapes (30 layers, 3 K/V heads of 64, float32): turn t's prompt is the
previous prompt, the previous answer (64 tokens) and a new question (~130 tokens with the template), so
that the prompt grows to ~2,000 tokens; after each turn the prompt and answer are stored (the target cache
holds all but the answer's last token), and each turn looks its prompt up and copies the prefix into one
row of a `KVCache`. Timed per turn (medians over --repeats): lookup + copy, store; and counted: the tokens
the lookup finds, the rest being prefilled. A prefill token's cost is measured on the int4 target (a
128-token forward after a 1,000-token prefix), so the tokens a block cache cannot reuse (the match rounded
down to whole blocks) are priced in time too.

    python -m bench.prefix_cache                      # writes bench/results/prefix_cache.json, prints the table
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from bench.common import REPO, HelpFormatter, command_line, git_revision, machine_line

L, H, D = 30, 3, 64  # SmolLM2-135M's layers, K/V heads, head size
GGUF = os.path.join(os.environ.get("SPECDEC_TEST_CACHE") or os.path.join(REPO, ".cache", "real_model"),
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


def conversation(turns: int, answer: int, question: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) per turn: each prompt extends the previous prompt and answer."""
    rng = random.Random(seed)
    out, prompt = [], [1] + [rng.randrange(2, 49152) for _ in range(question)]
    for _ in range(turns):
        reply = [rng.randrange(2, 49152) for _ in range(answer)]
        out.append((list(prompt), reply))
        prompt = prompt + reply + [rng.randrange(2, 49152) for _ in range(question)]
    return out


class BlockCache:
    """Hashed blocks: block j of a sequence is keyed by (key of block j - 1, its b tokens); whole blocks only."""

    def __init__(self, block: int):
        self.block, self.blocks = block, {}

    def insert(self, tokens, kv) -> None:
        key = None
        for j in range(len(tokens) // self.block):
            key = (key, tuple(tokens[j * self.block:(j + 1) * self.block]))
            if key not in self.blocks:
                self.blocks[key] = kv[:, :, :, j * self.block:(j + 1) * self.block].clone()

    def fetch(self, tokens, cache, row) -> int:
        key, n = None, 0
        while n + self.block <= len(tokens) - 1:
            key = (key, tuple(tokens[n:n + self.block]))
            block = self.blocks.get(key)
            if block is None:
                break
            cache.kv[:, :, row, :, n:n + self.block].copy_(block)  # one slice copy per block
            n += self.block
        return n


def prefill_cost_s(threads: int) -> float:
    """Seconds per prompt token of the int4 target: a 128-token forward after a 1,000-token prefix."""
    from specdec import LLM

    torch.set_num_threads(threads)
    target = LLM(GGUF, method="ar", quantize="int4", batch_size=1).target
    cache = target.new_cache(1, 1200, "ragged")
    with torch.inference_mode():
        target.forward(torch.randint(2, 1000, (1, 1000)), cache, logits="last")
        times = []
        for _ in range(3):
            cache.set_rows(length=torch.tensor([1000]), host_length=[1000])
            start = time.perf_counter()
            target.forward(torch.randint(2, 1000, (1, 128)), cache, logits="last")
            times.append(time.perf_counter() - start)
    return statistics.median(times) / 128


def run(design: str, chat, repeats: int) -> list[dict]:
    from specdec.models.cache import KVCache
    from specdec.prefix_cache import PrefixCache

    rows = [{"turn": t + 1, "fetch_s": [], "store_s": [], "found": 0, "prompt": len(p)} for t, (p, _) in enumerate(chat)]
    for _ in range(repeats):
        store = PrefixCache(8 << 30) if design == "radix" else BlockCache(int(design.split("-")[1]))
        cache = KVCache.allocate(L, 1, H, 2400, D, torch.float32, "cpu")
        for row, (prompt, reply) in zip(rows, chat):
            start = time.perf_counter()
            found = store.fetch(prompt, cache, 0)
            found = found[0] if isinstance(found, tuple) else found
            row["fetch_s"].append(time.perf_counter() - start)
            row["found"] = found
            sequence = prompt + reply[:-1]  # what the target cache holds when the answer is done
            kv = torch.randn(L, 2, H, len(sequence), D)  # [L, 2, H, n, D] the row's columns
            start = time.perf_counter()
            store.insert(sequence, kv)
            row["store_s"].append(time.perf_counter() - start)
    return [{**r, "fetch_s": statistics.median(r["fetch_s"]), "store_s": statistics.median(r["store_s"])}
            for r in rows]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--designs", default="radix,blocks-16,blocks-32,blocks-64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "prefix_cache.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    chat = conversation(10, 64, 130)
    per_token = prefill_cost_s(args.threads) if os.path.exists(GGUF) else None
    results = {d: run(d, chat, args.repeats) for d in args.designs.split(",")}
    lines = [f"`{command_line('bench.prefix_cache')}` (git {git_revision()}; {machine_line()}; a prompt token "
             f"prefills in {per_token * 1e3:.2f} ms)" if per_token else "", "",
             "| design | turns 2-10: tokens found / prompt | lookup + copy ms (turn 10) | store ms (turn 10) | "
             "tokens left to prefill (turns 2-10) | their prefill s | lookup + copy + store + prefill s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for design, rows in results.items():
        later = rows[1:]
        found, prompt = sum(r["found"] for r in later), sum(r["prompt"] for r in later)
        left = prompt - found
        overhead = sum(r["fetch_s"] + r["store_s"] for r in later)
        prefill = left * per_token if per_token else float("nan")
        lines.append(f"| {design} | {found} / {prompt} | {rows[-1]['fetch_s'] * 1e3:.2f} | {rows[-1]['store_s'] * 1e3:.2f} "
                     f"| {left} | {prefill:.2f} | {overhead + prefill:.2f} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": command_line("bench.prefix_cache"), "git": git_revision(), "per_token_s": per_token,
                   "results": results, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
