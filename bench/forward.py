"""Forward pass: our Transformer against transformers' LlamaForCausalLM on the same random Llama checkpoint:
per (batch, new tokens per step), both prefill the same prompts, then decode steps on top of that prefix are
timed, interleaved, the cache rewound after each (docs/benchmarks/forward.md). Prints a markdown table.

    python -m bench.forward --quick          # tiny model, a smoke test that the script runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

from bench.common import HelpFormatter, command_line, interleave, machine, machine_line, md_table, write_json
from specdec.models import load_model
from specdec.timing import PrefilledCache

FULL_MODEL = dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
                  intermediate_size=1536, vocab_size=32000)
QUICK_MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=1000)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                   help="torch intra-op CPU threads (torch.set_num_threads) used by both models")
    p.add_argument("--repeats", type=int, default=30,
                   help="timed steps per (batch, new tokens) pair and model; the median is reported")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                   help="weights, activations and KV cache dtype of both models")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (rows per step)")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[1, 6],
                   help="new tokens per row per step (1 = plain decode, k+1 = a speculative verify)")
    p.add_argument("--prefill", type=int, default=200, help="prompt tokens per row cached before the timed steps")
    p.add_argument("--capacity", type=int, default=256, help="columns of our preallocated KV cache")
    p.add_argument("--device", default="cpu", help="torch device for both models")
    p.add_argument("--out", default=None, help="also write the settings, header and rows to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: a tiny 2-layer model, prefill 32, 3 repeats (numbers not meaningful)")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill, args.repeats, args.capacity = 32, 3, 64
    if args.prefill + max(args.new_tokens) > args.capacity:
        p.error(f"--prefill {args.prefill} + max --new-tokens {max(args.new_tokens)} exceeds --capacity "
                f"{args.capacity}")
    return args


def build_checkpoint(path: str, quick: bool) -> int:
    """Save a random Llama checkpoint to `path`; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**(QUICK_MODEL if quick else FULL_MODEL), max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


class HFPrefilled(PrefilledCache):
    """transformers' model with a `DynamicCache` after `prompt`; rewinding crops it back to the prefix."""

    def __init__(self, model, prompt):
        from transformers import DynamicCache

        self.model, self.device, self.prefix = model, prompt.device, prompt.shape[1]
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(prompt, cache=self.cache, use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def step(self, x, logits="all"):
        return self.model(x, cache=self.cache, use_cache=True).logits  # [B, T, V]

    def rewind(self):
        extra = self.cache.get_seq_length() - self.prefix
        if extra:
            self.cache.crop(-extra)  # transformers 5: a negative count of tokens to drop


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    started = machine()
    dtype = getattr(torch, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_checkpoint(tmp, args.quick)
        ours_model = load_model(tmp, dtype=args.dtype, device=args.device)
        hf_model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(args.device).eval()
        attn = getattr(hf_model.config, "_attn_implementation", "?")
        g = torch.Generator().manual_seed(0)
        vocab = hf_model.config.vocab_size
        for B in args.batch:
            prompts = torch.randint(3, vocab, (B, args.prefill), generator=g).to(args.device)
            for T in args.new_tokens:
                new = torch.randint(3, vocab, (B, T), generator=g).to(args.device)
                ours = PrefilledCache(ours_model, prompts, args.capacity)
                hf = HFPrefilled(hf_model, prompts)
                err = (ours.forward(new).float() - hf.forward(new).float()).abs().max().item()
                times = interleave({"ours": lambda: ours.time(new), "hf": lambda: hf.time(new)}, args.repeats,
                                   warmup=1 if args.quick else 3)
                t_ours, t_hf = statistics.median(times["ours"]), statistics.median(times["hf"])
                rows.append(dict(batch=B, new_tokens=T, prefix=args.prefill, ours_ms=1e3 * t_ours,
                                 hf_ms=1e3 * t_hf, ratio_ours_over_hf=t_ours / t_hf, speedup=t_hf / t_ours,
                                 max_abs_logit_diff=err))
                print(f"B={B} T={T}: ours {1e3 * t_ours:.2f} ms, HF {1e3 * t_hf:.2f} ms", file=sys.stderr)

    header = (f"`{command_line('bench.forward', argv)}`: Llama {n_params / 1e6:.1f}M params, {args.dtype}, device "
              f"{args.device}, prefix {args.prefill} tokens, our cache {args.capacity} columns, HF "
              f"attn_implementation={attn}, median of {args.repeats}; transformers "
              f"{__import__('transformers').__version__}; {machine_line(started)}")
    print(header + "\n")
    print(md_table(["batch", "new tokens/row", "ours ms/step", "HF ms/step", "ours/HF", "speedup (HF/ours)",
                    "max abs dlogit"],
                   ([r["batch"], r["new_tokens"], f"{r['ours_ms']:.2f}", f"{r['hf_ms']:.2f}",
                     f"{r['ratio_ours_over_hf']:.2f}", f"{r['speedup']:.2f}x", f"{r['max_abs_logit_diff']:.1e}"]
                    for r in rows), right=range(7)))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_json(args.out, dict(settings=vars(args), params=n_params, header=header, rows=rows))
    return rows


if __name__ == "__main__":
    main()
