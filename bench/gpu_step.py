"""Issue #41 end to end on a GPU: the decode step's speed against the HBM roofline and against transformers, on
a Vicuna-7B-shaped random bfloat16 pair built in GPU memory (no download: bench/bi_gpu.py's `build_pair`;
the draft is the target's own first layer, the later layers damped so the draft agrees often).

    python -m bench.gpu_step --out DIR            # about 4 minutes on an H200
    python -m bench.gpu_step --out DIR --quick    # 4 layers, hidden 512: a smoke test (also runs on a CPU)

Per cell (engine, B): tokens/s of --max-tokens new tokens per prompt (greedy, EOS ignored, random-id prompts of
64-192 tokens; the best of --rounds after a warm-up, the engines interleaved), for every specdec method (ar,
eqspec, exspec, ragged, auto k; CUDA graphs as `LLM` runs them by default, and `ar` without them) and
transformers' `generate` and assisted generation (B 1) on the same weights. For AR at B 1, from torch.profiler
over a few steps: CUDA kernels per decode step (and per layer), the GPU-busy share of the step (kernel time /
wall time), and the share of the HBM roofline (weight bytes / bandwidth over the step's time). Records go to
DIR/gpu_step.jsonl as they finish; DIR/gpu_step.md is rewritten after each part (a run cut short keeps them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.bi_gpu import build_pair, llama_config
from bench.common import log, random_prompts

METHODS = ("ar", "eqspec", "exspec", "ragged")
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # nominal bandwidth by device name


def bandwidth(device_name: str) -> float | None:
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in device_name), None)


def hf_model(target, raw: dict):
    """transformers' LlamaForCausalLM over the target's weights (views of its tensors: no copy)."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = target.cfg
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",)}))
    H, Hkv, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    state = {"model.embed_tokens.weight": target.embed_tokens.weight, "model.norm.weight": target.norm.weight,
             "lm_head.weight": target.lm_head.weight}
    for i, layer in enumerate(target.layers):
        qkv = layer.self_attn.qkv_proj.weight
        gate_up = layer.mlp.gate_up_proj.weight
        prefix = f"model.layers.{i}."
        state.update({prefix + "self_attn.q_proj.weight": qkv[:H * D],
                      prefix + "self_attn.k_proj.weight": qkv[H * D:(H + Hkv) * D],
                      prefix + "self_attn.v_proj.weight": qkv[(H + Hkv) * D:],
                      prefix + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                      prefix + "mlp.gate_proj.weight": gate_up[:I], prefix + "mlp.up_proj.weight": gate_up[I:],
                      prefix + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                      prefix + "input_layernorm.weight": layer.input_layernorm.weight,
                      prefix + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    hf.load_state_dict({k: nn.Parameter(v, requires_grad=False) for k, v in state.items()}, assign=True)
    with torch.device(target.device):  # the rotary embedding's buffers (not in the state dict)
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)
    return hf.eval()


def hf_draft(hf, target, raw: dict):
    """The draft for assisted generation: the HF target's first layer, norm and head (shared modules)."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        draft = LlamaForCausalLM(LlamaConfig(**{**{k: v for k, v in raw.items() if k != "architectures"},
                                                "num_hidden_layers": 1}))
    draft.model.embed_tokens, draft.model.norm, draft.lm_head = hf.model.embed_tokens, hf.model.norm, hf.lm_head
    draft.model.layers = nn.ModuleList([hf.model.layers[0]])
    draft.model.rotary_emb = hf.model.rotary_emb
    return draft.eval()


def hf_tokens_per_s(model, prompts, max_tokens: int, B: int, assistant=None) -> float:
    """transformers' greedy `generate` over `prompts`, B at a time (left-padded): generated tokens / second."""
    device = model.device
    done, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), B):
        group = prompts[i:i + B]
        width = max(len(p) for p in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, p in enumerate(group):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        kw = {"assistant_model": assistant} if assistant is not None else {}
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kw)
        done += (out.shape[1] - width) * len(group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return done / (time.perf_counter() - t0)


def profile_ar(llm, prompt: list[int], steps: int) -> dict:
    """Kernels per decode step and the GPU-busy share of a decode step, from torch.profiler: a run of 1 token
    (the prefill) subtracted from a run of steps + 1 tokens."""
    from torch.profiler import ProfilerActivity, profile

    from specdec import SamplingParams

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def measured(tokens: int):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)  # warm (graphs captured)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=[prompt], sampling_params=params)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(kernels), sum(e.device_time for e in kernels) / 1e6, wall

    k1, busy1, wall1 = measured(1)
    kn, busyn, walln = measured(steps + 1)
    step_wall = (walln - wall1) / steps
    return {"kernels_per_step": (kn - k1) / steps, "step_ms": step_wall * 1e3,
            "gpu_busy": (busyn - busy1) / (walln - wall1) if kn > k1 else None}


def md(records: list[dict]) -> str:
    lines = ["# Issue #41: the decode step on a GPU (bench/gpu_step.py)", ""]
    head = [r for r in records if r["part"] == "setup"]
    if head:
        h = head[0]
        lines += [f"{h['device']}, torch {h['torch']}; pair {h['pair']}; {h['max_tokens']} new tokens, greedy; "
                  f"weights {h['weight_gb']:.1f} GB, roofline at B 1: {h['roofline_tok_s'] or '-'} tok/s", ""]
    speed = [r for r in records if r["part"] == "speed"]
    if speed:
        batches = sorted({r["B"] for r in speed})
        engines = list(dict.fromkeys(r["engine"] for r in speed))
        lines += ["| engine | " + " | ".join(f"B {b} tok/s" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for e in engines:
            cells = {r["B"]: r for r in speed if r["engine"] == e}
            lines.append(f"| {e} | " + " | ".join(f"{cells[b]['tok_s']:.1f}" if b in cells else "-"
                                                  for b in batches) + " |")
        lines.append("")
    prof = [r for r in records if r["part"] == "profile"]
    for r in prof:
        share = f"{r['roofline_share']:.0%}" if r.get("roofline_share") is not None else "-"
        busy = f"{r['gpu_busy']:.0%}" if r.get("gpu_busy") is not None else "-"
        lines.append(f"AR B 1 ({r['engine']}): {r['kernels_per_step']:.0f} kernels a step "
                     f"({r['kernels_per_layer']:.1f} a layer), GPU busy {busy}, HBM roofline share {share}")
    skipped = [r for r in records if r["part"] == "skipped"]
    if skipped:
        lines += ["", "Skipped (budget): " + ", ".join(r["what"] for r in skipped)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--rounds", type=int, default=2, help="timed runs per cell (the best counts)")
    p.add_argument("--layers", type=int, default=32, help="target layers")
    p.add_argument("--budget-s", type=float, default=270.0, help="stop starting new cells after this many seconds")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate and assisted generation")
    p.add_argument("--quick", action="store_true", help="4 layers, hidden 512, B 1 and 4, 16 tokens: a smoke test")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    jsonl, mdpath = os.path.join(args.out, "gpu_step.jsonl"), os.path.join(args.out, "gpu_step.md")
    open(jsonl, "w").close()
    records: list[dict] = []
    t0 = time.perf_counter()

    def record(r: dict) -> None:
        records.append(r)
        with open(jsonl, "a") as f:
            f.write(json.dumps(r) + "\n")
        with open(mdpath, "w") as f:
            f.write(md(records))

    def time_left() -> bool:
        return time.perf_counter() - t0 < args.budget_s

    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        raw = llama_config(4, 512, 8, 8, 1024, 32000)
        batches, args.max_tokens = sorted({b for b in batches if b <= 4} | {1, 4}), min(args.max_tokens, 16)
    else:
        raw = llama_config(args.layers, 4096, 32, 32, 11008, 32000)
    from specdec import LLM, SamplingParams

    target, draft = build_pair(raw, args.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    bw = bandwidth(device)
    roofline = round(bw / weight_bytes, 1) if bw else None
    record({"part": "setup", "device": device, "torch": torch.__version__, "max_tokens": args.max_tokens,
            "pair": {k: raw[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")},
            "weight_gb": weight_bytes / 1e9, "roofline_tok_s": roofline, "build_s": time.perf_counter() - t0})
    log("gpu_step", f"pair built in {time.perf_counter() - t0:.1f}s on {device}")
    prompts = random_prompts(max(batches) * 2, raw["vocab_size"], 64, 192, seed=1)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engines = {m: LLM(target, draft if m != "ar" else None, method=m, batch_size=max(batches), dtype="bfloat16",
                      check_invariants=False, cost_cache="", batch_invariant=False) for m in METHODS}
    if args.device == "cuda":
        engines["ar (no CUDA graphs)"] = LLM(target, method="ar", batch_size=max(batches), dtype="bfloat16",
                                             check_invariants=False, cost_cache="", batch_invariant=False,
                                             cuda_graphs=False)
    hf = hf_draft_model = None
    if not args.no_hf:
        hf = hf_model(target, raw)
        hf_draft_model = hf_draft(hf, target, raw)

    def run_ours(name: str, B: int) -> float:
        llm = engines[name]
        graphs = name != "ar (no CUDA graphs)" and args.device == "cuda"
        for model in (target, draft):  # the LLMs share the models: each run sets what it runs with
            model.use_graphs(graphs)
        llm.generate(prompt_token_ids=prompts[:B], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                     batch_size=B)  # warm: this shape's graphs, auto k's costs
        out = llm.generate(prompt_token_ids=prompts[:max(B, 2)], sampling_params=params, batch_size=B)
        return out.metrics.tokens_per_s

    for B in batches:
        cells = list(engines)
        if hf is not None:
            cells.append("transformers generate")
            if B == 1:
                cells.append("transformers assisted")
        best: dict[str, float] = {}
        for r in range(args.rounds):
            for name in (cells if r % 2 == 0 else cells[::-1]):
                if not time_left():
                    continue
                if name == "transformers generate":
                    tok_s = hf_tokens_per_s(hf, prompts[:max(B, 2)], args.max_tokens, B)
                elif name == "transformers assisted":
                    tok_s = hf_tokens_per_s(hf, prompts[:2], args.max_tokens, 1, hf_draft_model)
                else:
                    tok_s = run_ours(name, B)
                best[name] = max(best.get(name, 0.0), tok_s)
        for name in cells:
            if name in best:
                record({"part": "speed", "engine": name, "B": B, "tok_s": best[name]})
                log("gpu_step", f"{name} @ B {B}: {best[name]:.1f} tok/s")
            else:
                record({"part": "skipped", "what": f"{name}@{B}"})

    for name in ("ar", "ar (no CUDA graphs)"):
        if name in engines and time_left():
            for model in (target, draft):
                model.use_graphs(name == "ar" and args.device == "cuda")
            stats = profile_ar(engines[name], prompts[0], 16)
            ar_speed = next((r["tok_s"] for r in records if r.get("engine") == name and r.get("B") == 1), None)
            share = ar_speed / roofline if roofline and ar_speed else None
            record({"part": "profile", "engine": name, **stats, "roofline_share": share,
                    "kernels_per_layer": stats["kernels_per_step"] / raw["num_hidden_layers"]})
    log("gpu_step", f"done in {time.perf_counter() - t0:.0f}s: {mdpath}")
    print(md(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
