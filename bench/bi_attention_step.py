"""The CPU batch-invariant attention (`kernels/bi_attention.py`'s torch path) before and after issue 41's lean
step: the attention call alone, and the whole int4 decode step of SmolLM2, in one process, interleaved.

`before` is the path as it was (commit 73b3370), kept verbatim as the oracle of
tests/test_bi_attention_lean.py and imported from there; `after` is this tree's; `sdpa` is what the
ordinary mode runs (not batch-invariant), for scale.

- `calls`: one layer's call, SmolLM2-135M's shape (H 9, H_kv 3, D 64), the model's inputs (q a strided view of
  the rotated projections, K and V views of one layer cache wider than W), at (B, T, W) in {1, 8} x {1, 6} x
  {200, 1000}, float32 and bfloat16; rows from column 0 (the ragged layout; a one-row left-padded cache too)
  and, with `--layouts ragged,left`, left-padded rows of other lengths (the gather path). The plan is made
  once (a forward's layers share it); its cost is the `plan` column (once per forward).
- `ops`: the ops of that decode step (`bench.op_count`'s count: top-level dispatcher ops), before and after.
- `step`: `model.forward` of one token at batch 1 after a `--context`-token prompt on the int4 load of the GGUF
  file, the context held (the row's length reset after every step), `before`/`after`/`sdpa` rotating.

Every figure: the median over `--repeats` interleaved rounds (each round the variants in a shuffled order,
a block of calls of about `--block` seconds), with the min-max spread over the rounds. A round's figure is
the median of its calls' wall times (`--clock call`, the default: on a shared machine a call that other jobs
interrupt is an outlier, not a shift), or its block's wall or CPU time per call (`--clock wall`, `cpu`). One
torch thread unless `--threads`.

    python -m bench.bi_attention_step calls
    python -m bench.bi_attention_step step --context 200,1000
    python -m bench.bi_attention_step all --quick
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import time

import torch

from bench.common import REPO, comma_ints, comma_list, fmt_spread, machine, machine_line, md_table

DEFAULT_TARGET = os.path.join(REPO, ".cache", "real_model", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2 = dict(H=9, Hkv=3, D=64)


def oracle():
    """tests/test_bi_attention_lean.py, whose `oracle_chunk_plan` / `oracle_attention` are the old path."""
    path = os.path.join(REPO, "tests", "test_bi_attention_lean.py")
    spec = importlib.util.spec_from_file_location("bi_attention_oracle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLOCKS = ("call", "wall", "cpu")
CLOCK = "call"  # `--clock`


def interleaved(variants: dict, repeats: int, block_s: float, seed: int = 0) -> dict:
    """name -> [seconds per call] over `repeats` rounds; each round runs every variant's block of calls (as
    many as take about `block_s`, from the warm-up), the variants in a shuffled order. A round's figure (CLOCK):
    the median of its calls' wall times ("call"), or the block's wall ("wall") or CPU ("cpu") time per call."""
    order, times, calls = list(variants), {name: [] for name in variants}, {}
    rng = random.Random(seed)
    for name, fn in variants.items():  # warm: probes, layouts, allocations; then the block's size
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        calls[name] = max(2, min(1000, round(block_s / ((time.perf_counter() - t0) / 3))))
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fn, n = variants[name], calls[name]
            if CLOCK == "call":
                each = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    each.append(time.perf_counter() - t0)
                times[name].append(statistics.median(each))
                continue
            clock = time.thread_time if CLOCK == "cpu" else time.perf_counter
            t0 = clock()
            for _ in range(n):
                fn()
            times[name].append((clock() - t0) / n)
    return times


def us(values) -> str:
    return fmt_spread([v * 1e6 for v in values], "{:.0f}")


def model_inputs(B, T, W, H, Hkv, D, dtype, layout, seed=0):
    """q [B, H, T, D] (a strided view, as the model's), k/v [B, H_kv, W, D] (views of one [2, B, H_kv, W + 64, D]
    cache) and the step's mask: every row from column 0 ("ragged", rows of other lengths) or ending at W
    ("left", left-padded: rows of other lengths, so other first keys; at B = 1 no padding)."""
    from specdec.kernels.positions import step_plan_reference

    g = torch.Generator().manual_seed(seed)
    NH = H + 2 * Hkv
    rot = torch.randn(B, T, NH, D, generator=g).to(dtype)
    q = rot.as_strided((B, H, T, D), (T * NH * D, D, NH * D, 1))
    kv = torch.randn(2, B, Hkv, W + 64, D, generator=g).to(dtype)
    k, v = kv[0, :, :, :W], kv[1, :, :, :W]
    length = torch.randint(W // 2, W - T + 1, (B,), generator=g)
    length[0] = W - T
    start = torch.zeros(B, dtype=torch.int64) if layout == "ragged" else W - T - length
    _, _, mask = step_plan_reference(start, length, torch.full((B,), T), T, layout == "left", W)
    return q, k, v, mask


def run_calls(args, old) -> list[list]:
    from bench.op_count import count_ops
    from specdec.kernels import bi_attention as ba

    H, Hkv, D = SMOLLM2["H"], SMOLLM2["Hkv"], SMOLLM2["D"]
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for layout in args.layouts:
            for B in args.batch:
                for T in args.tokens:
                    for W in args.width:
                        q, k, v, mask = model_inputs(B, T, W, H, Hkv, D, dtype, layout)
                        acc = torch.float64 if dtype == torch.float64 else torch.float32
                        first = ba.first_keys(mask)
                        new_plan = ba.chunk_plan(mask, first, H // Hkv, Hkv, W, workspace=ba.Workspace())
                        old_plan = old.oracle_chunk_plan(mask, first, H // Hkv, Hkv, W, workspace=ba.Workspace())
                        bias = torch.where(mask, torch.zeros((), dtype=dtype), float("-inf"))[:, None]
                        out_new = ba.bi_attention_reference(q, k, v, mask, first, new_plan)
                        assert torch.equal(out_new, old.oracle_attention(q, k, v, mask, first, old_plan))
                        variants = {
                            "before": lambda: old.oracle_attention(q, k, v, mask, first, old_plan),
                            "after": lambda: ba.bi_attention_reference(q, k, v, mask, first, new_plan),
                            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, attn_mask=bias, enable_gqa=True),
                            # once per forward: the plan (after: and the first layer's views of the buffers)
                            "plan before": lambda: old.oracle_chunk_plan(mask, first, H // Hkv, Hkv, W),
                            "plan after": lambda: ba._layout(
                                ba.chunk_plan(mask, first, H // Hkv, Hkv, W, workspace=new_plan.workspace),
                                B, Hkv, T, D, acc, q.device, ba.CHUNK, k, v, ba._kv_pair(k, v, W)),
                        }
                        ops = [sum(count_ops(variants[v]).values()) for v in ("before", "after")]
                        t = interleaved(variants, args.repeats, args.block)
                        blocks = len(next(iter(new_plan.layouts.values())).buffers.blocks)
                        path = ("copy" if new_plan.from_zero else "gather") + (f" ({blocks} blocks)" if blocks > 1 else "")
                        rows.append([dtype_name, layout, B, T, W, path, f"{ops[0]} → {ops[1]}", us(t["before"]),
                                     us(t["after"]),
                                     f"{statistics.median(t['before']) / statistics.median(t['after']):.1f}x",
                                     us(t["sdpa"]), us(t["plan before"]), us(t["plan after"])])
                        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def run_step(args, old) -> list[list]:
    from specdec.kernels import bi_attention as ba
    from specdec.models import load_model, numerics

    model = load_model(args.target, quantize="int4")
    assert model.batch_invariant, "the int4 load should run batch-invariant"
    new_plan, new_reference = numerics.chunk_plan, ba.bi_attention_reference
    rows = []
    for context in args.context:
        g = torch.Generator().manual_seed(context)
        cache = model.new_cache(1, context + 8)
        model.forward(torch.randint(3, model.vocab_size, (1, context), generator=g), cache)
        token = torch.randint(3, model.vocab_size, (1, 1), generator=g)
        length, host = cache.length, list(cache.host_length)

        def step(version):
            def run():
                if version == "before":
                    numerics.chunk_plan, ba.bi_attention_reference = old.oracle_chunk_plan, old.oracle_attention
                model.batch_invariant = version != "sdpa"
                try:
                    with torch.no_grad():
                        logits = model.forward(token, cache)
                finally:
                    numerics.chunk_plan, ba.bi_attention_reference = new_plan, new_reference
                    model.batch_invariant = True
                    cache.set_rows(length=length, host_length=host)  # the same context every step
                return logits
            return run

        logits = {v: step(v)() for v in ("before", "after")}
        assert torch.equal(logits["before"], logits["after"]), "before and after must give the same logits"
        t = interleaved({v: step(v) for v in ("before", "after", "sdpa")}, args.repeats, args.block)
        rows.append([context, fmt_spread([x * 1e3 for x in t["before"]], "{:.2f}"),
                     fmt_spread([x * 1e3 for x in t["after"]], "{:.2f}"),
                     f"{(statistics.median(t['before']) - statistics.median(t['after'])) * 1e3:.2f}",
                     fmt_spread([x * 1e3 for x in t["sdpa"]], "{:.2f}")])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def run_ops(args, old) -> list[list]:
    """The ops of one decode step (bench.op_count's count) with the old and the new attention, per context."""
    from bench.op_count import step_ops
    from specdec.kernels import bi_attention as ba
    from specdec.models import load_model, numerics

    model = load_model(args.target, quantize="int4")
    new_plan, new_reference = numerics.chunk_plan, ba.bi_attention_reference
    rows = []
    for context in args.context:
        counts = {}
        for version in ("before", "after"):
            if version == "before":
                numerics.chunk_plan, ba.bi_attention_reference = old.oracle_chunk_plan, old.oracle_attention
            try:
                counts[version] = sum(step_ops(model, 1, 1, context).values())
            finally:
                numerics.chunk_plan, ba.bi_attention_reference = new_plan, new_reference
        layers = model.cfg.num_layers
        rows.append([context, counts["before"], f"{counts['before'] / layers:.1f}", counts["after"],
                     f"{counts['after'] / layers:.1f}"])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("what", choices=("calls", "step", "ops", "all"))
    p.add_argument("--dtypes", type=comma_list(("float32", "bfloat16", "float64")), default=["float32", "bfloat16"])
    p.add_argument("--layouts", type=comma_list(("ragged", "left")), default=["ragged"])
    p.add_argument("--batch", type=comma_ints, default=[1, 8])
    p.add_argument("--tokens", type=comma_ints, default=[1, 6])
    p.add_argument("--width", type=comma_ints, default=[200, 1000])
    p.add_argument("--block", type=float, default=0.03, help="seconds per timed block (calls or steps)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds")
    p.add_argument("--target", default=DEFAULT_TARGET, help="the GGUF file of `step`")
    p.add_argument("--context", type=comma_ints, default=[200], help="prompt tokens before the timed steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=CLOCKS, default="call",
                   help="a round's figure: the median of its calls' wall times (a call that other jobs interrupt is an "
                        "outlier: the default), or the block's wall or CPU time per call")
    p.add_argument("--quick", action="store_true", help="a few rounds, short blocks (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.block = 3, 0.005
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = args.clock
    old = oracle()
    print(machine_line(machine()) + f"; timed by {args.clock} time")
    if args.what in ("calls", "all"):
        rows = run_calls(args, old)
        print(md_table(["dtype", "layout", "B", "T", "W", "after stages by", "ops", "before µs", "after µs",
                        "speed-up", "SDPA µs", "plan before µs", "plan after µs"], rows, right=range(2, 13)))
    if args.what in ("step", "all"):
        rows = run_step(args, old)
        print(md_table(["context", "before ms", "after ms", "saved ms", "SDPA (mode off) ms"], rows,
                       right=range(0, 5)))
    if args.what in ("ops", "all"):
        rows = run_ops(args, old)
        print(md_table(["context", "ops before", "per layer", "ops after", "per layer"], rows, right=range(0, 5)))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
