"""How many ops a decode step dispatches: the forward's own count, per layer (issue 41's measure).

Counted with torch.profiler on the CPU: every op the dispatcher sees (`aten::`, `mkldnn::`, ...) called from
Python, an op inside another one not counted again. A step of B rows and T new tokens after a prompt of
`context` tokens; the count is the same whatever the weights (the forward never branches on values).

    python -m bench.op_count --target .cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m bench.op_count --target DIR --quantize int4 --batch-size 8 --tokens 4
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch


def count_ops(fn) -> Counter:
    """Top-level dispatcher ops run by fn(): name -> calls (an op called inside another op is not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = Counter()
    for event in prof.events():
        if "::" not in event.name:
            continue
        parent = event.cpu_parent
        while parent is not None and "::" not in parent.name:
            parent = parent.cpu_parent
        if parent is None:
            ops[event.name] += 1
    return ops


def step_ops(model, rows: int = 1, tokens: int = 1, context: int = 20) -> Counter:
    """The ops of one forward of `tokens` new tokens per row after a `context`-token prefill of `rows` rows
    (ragged cache, warmed up by one step first)."""
    g = torch.Generator().manual_seed(0)
    vocab = model.vocab_size
    cache = model.new_cache(rows, context + 2 * tokens + 1)
    model.forward(torch.randint(3, vocab, (rows, context), generator=g), cache)
    model.forward(torch.randint(3, vocab, (rows, 1), generator=g), cache)  # warm: tables, packed weights
    step = torch.randint(3, vocab, (rows, tokens), generator=g)
    return count_ops(lambda: model.forward(step, cache))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="checkpoint directory or .gguf file")
    p.add_argument("--dtype", default="float32", help="activations' dtype")
    p.add_argument("--quantize", choices=("int8", "int4"), help="keep the weights quantized")
    p.add_argument("--packed", choices=("on", "off"), default="on",
                   help="packed float32 weights (what LLM uses by default on the CPU)")
    p.add_argument("--batch-size", type=int, default=1, help="rows of the step")
    p.add_argument("--tokens", type=int, default=1, help="new tokens per row (1: decode; k + 1: a verify)")
    p.add_argument("--context", type=int, default=20, help="tokens already cached per row")
    args = p.parse_args(argv)
    from specdec.models import load_model
    from specdec.models.numerics import packing_pays

    model = load_model(args.target, dtype=args.dtype, quantize=args.quantize)
    model.packed_linear = args.packed == "on" and packing_pays(model)
    ops = step_ops(model, args.batch_size, args.tokens, args.context)
    total, layers = sum(ops.values()), model.cfg.num_layers
    print(f"{total} ops in a step of {args.batch_size} row(s) x {args.tokens} token(s): {total / layers:.1f} per "
          f"layer ({layers} layers; packed {model.packed_linear}, batch-invariant {model.batch_invariant})")
    for name, calls in ops.most_common():
        print(f"  {calls:5d}  {name}")


if __name__ == "__main__":
    main()
