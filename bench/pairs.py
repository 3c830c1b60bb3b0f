"""Benchmark pairs: the embedded default pair, and a synthetic target/draft pair whose *cost* resembles a 7B
target with a 68M draft: a deep random Llama (~113M parameters) whose layers above the first are damped, and
as its draft its own first layer (docs/benchmarks/throughput.md). Built with transformers where installed,
else by hand with torch + safetensors; reused from its cache folder while `pair.json` there records the recipe.

    python -m bench.pairs          # build (or reuse) the pair, print its recipe and target/draft cost ratio
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from bench.common import interleave
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.timing import PrefilledCache, random_tokens

DEFAULT_PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pair")
PAIR_NAMES = ("default", "synthetic", "tiny")


@dataclass(frozen=True)
class SyntheticPairSpec:
    hidden_size: int = 768
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    intermediate_size: int = 2048
    vocab_size: int = 8000
    max_position_embeddings: int = 4096
    draft_layers: int = 1  # the draft keeps the target's first `draft_layers` layers
    init_std: float = 0.06  # HF's default initializer_range is 0.02: larger gives peaked logits
    damping: float = 0.012  # scale of o_proj / down_proj in the layers the draft lacks
    seed: int = 0

    @classmethod
    def quick(cls) -> "SyntheticPairSpec":
        """A tiny pair for smoke tests (same recipe, seconds to build)."""
        return cls(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=1000)


def _llama_config(spec: SyntheticPairSpec, num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=spec.hidden_size, num_hidden_layers=num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size, max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, architectures=["LlamaForCausalLM"])


def _damp(layers, spec: SyntheticPairSpec) -> None:
    with torch.no_grad():
        for layer in layers[spec.draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(spec.damping)
            layer.mlp.down_proj.weight.mul_(spec.damping)


def _build_with_transformers(spec: SyntheticPairSpec, target_dir: str, draft_dir: str) -> tuple[int, int]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(spec.seed)
    target = LlamaForCausalLM(_llama_config(spec, spec.num_hidden_layers)).float().eval()
    _damp(target.model.layers, spec)
    draft = LlamaForCausalLM(_llama_config(spec, spec.draft_layers)).float().eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()}, strict=True)
    target.save_pretrained(target_dir, safe_serialization=True)
    draft.save_pretrained(draft_dir, safe_serialization=True)
    return sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters())


def _build_without_transformers(spec: SyntheticPairSpec, target_dir: str, draft_dir: str) -> tuple[int, int]:
    """The same recipe written by hand (HF key names, config.json, safetensors), for machines without
    transformers (e.g. the GPU check): N(0, init_std) linears and embedding, unit norms. Same distribution
    as the transformers build, not the same numbers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(spec.seed)
    E, I, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    D = E // spec.num_attention_heads
    Hq, Hkv = spec.num_attention_heads * D, spec.num_key_value_heads * D
    normal = lambda *shape: torch.randn(*shape, generator=g) * spec.init_std  # noqa: E731
    state = {"model.embed_tokens.weight": normal(V, E)}
    for i in range(spec.num_hidden_layers):
        damp = 1.0 if i < spec.draft_layers else spec.damping
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": normal(Hq, E), p + "self_attn.k_proj.weight": normal(Hkv, E),
            p + "self_attn.v_proj.weight": normal(Hkv, E), p + "self_attn.o_proj.weight": normal(E, Hq) * damp,
            p + "mlp.gate_proj.weight": normal(I, E), p + "mlp.up_proj.weight": normal(I, E),
            p + "mlp.down_proj.weight": normal(E, I) * damp,
            p + "input_layernorm.weight": torch.ones(E), p + "post_attention_layernorm.weight": torch.ones(E)})
    state["model.norm.weight"] = torch.ones(E)
    state["lm_head.weight"] = normal(V, E)

    def write(path, num_layers):
        os.makedirs(path, exist_ok=True)
        keep = {k: v.contiguous() for k, v in state.items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
        save_file(keep, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": E,
                  "intermediate_size": I, "num_hidden_layers": num_layers,
                  "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
                  "head_dim": D, "vocab_size": V, "max_position_embeddings": spec.max_position_embeddings,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
                  "attention_bias": False, "mlp_bias": False, "initializer_range": spec.init_std,
                  "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        return sum(v.numel() for v in keep.values())

    return write(target_dir, spec.num_hidden_layers), write(draft_dir, spec.draft_layers)


def build_synthetic_pair(out_dir: str, spec: SyntheticPairSpec = SyntheticPairSpec(), force: bool = False,
                         verbose: bool = True) -> tuple[str, str]:
    """Write (or reuse) `out_dir/target` and `out_dir/draft`; returns their paths."""
    target_dir, draft_dir = os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")
    recipe_path = os.path.join(out_dir, "pair.json")
    recipe = {"kind": "synthetic-damped-llama", "spec": asdict(spec)}
    if not force and os.path.exists(recipe_path):
        with open(recipe_path) as f:
            old = json.load(f)
        if old.get("kind") == recipe["kind"] and old.get("spec") == recipe["spec"] and all(
                os.path.exists(os.path.join(d, "model.safetensors")) for d in (target_dir, draft_dir)):
            if verbose:
                print(f"[pairs] reusing synthetic pair in {out_dir}", file=sys.stderr, flush=True)
            return target_dir, draft_dir

    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    use_hf = importlib.util.find_spec("transformers") is not None
    build = _build_with_transformers if use_hf else _build_without_transformers
    n_target, n_draft = build(spec, target_dir, draft_dir)
    recipe.update(builder="transformers" if use_hf else "torch+safetensors", target_params=n_target,
                  draft_params=n_draft)
    with open(recipe_path, "w") as f:
        json.dump(recipe, f, indent=2)
    if verbose:
        print(f"[pairs] built synthetic pair in {out_dir} with {recipe['builder']} "
              f"({time.perf_counter() - t0:.1f}s): target {n_target / 1e6:.1f}M params, "
              f"draft {n_draft / 1e6:.1f}M params", file=sys.stderr, flush=True)
    return target_dir, draft_dir


def pair_dirs(name: str, folder: str | None = None) -> tuple[str, str]:
    """(target, draft) checkpoint directories of a benchmark pair: 'default' (the embedded pair), 'synthetic'
    (the 113M/19M pair above) or 'tiny' (its toy version); the last two are built once into `folder`
    (default bench/results/pair, -tiny for the tiny one) and reused while their recipe matches."""
    if name == "default":
        return DEFAULT_TARGET, DEFAULT_DRAFT
    if name not in PAIR_NAMES:
        raise ValueError(f"unknown pair {name!r}; choose from {', '.join(PAIR_NAMES)}")
    spec = SyntheticPairSpec() if name == "synthetic" else SyntheticPairSpec.quick()
    return build_synthetic_pair(folder or DEFAULT_PAIR_DIR + ("-tiny" if name == "tiny" else ""), spec)


def pair_description(target_dir: str, draft_dir: str) -> dict:
    """Size of each model of a pair, from its config.json (and the synthetic recipe when there is one)."""
    def describe(path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return {"path": os.path.abspath(path), "architectures": cfg.get("architectures"),
                "hidden_size": cfg.get("hidden_size"), "num_hidden_layers": cfg.get("num_hidden_layers"),
                "vocab_size": cfg.get("vocab_size")}

    out = {"target": describe(target_dir), "draft": describe(draft_dir)}
    recipe = os.path.join(os.path.dirname(os.path.abspath(target_dir)), "pair.json")
    if os.path.exists(recipe):
        with open(recipe) as f:
            out["recipe"] = json.load(f)
    return out


@torch.inference_mode()
def cost_ratio(target, draft, batch_size: int = 8, repeats: int = 20) -> dict:
    """Time of one target forward vs one draft forward (batch `batch_size`, 1 new token after a 64-token
    prefix), the two interleaved forward by forward so that machine load hits both alike; medians."""
    g = torch.Generator().manual_seed(0)
    calls = {}
    for name, model in (("target", target), ("draft", draft)):
        prefilled = PrefilledCache(model, random_tokens(batch_size, 64, model.vocab_size, g, model.device), 66)
        x = random_tokens(batch_size, 1, model.vocab_size, g, model.device)  # [B, 1]
        calls[name] = lambda prefilled=prefilled, x=x: prefilled.time(x)
    times = interleave(calls, repeats, warmup=2)
    t, d = statistics.median(times["target"]), statistics.median(times["draft"])
    return {"batch_size": batch_size, "target_forward_s": t, "draft_forward_s": d, "ratio": t / d if d else 0.0}


def main(argv=None):
    p = argparse.ArgumentParser(description="Build (or reuse) the synthetic benchmark pair and print its "
                                            "recipe and target/draft cost ratio.")
    p.add_argument("--out", default=DEFAULT_PAIR_DIR, help="folder for target/ draft/ and pair.json")
    p.add_argument("--quick", action="store_true", help="tiny pair for smoke tests")
    p.add_argument("--force", action="store_true", help="rebuild even when a matching pair is cached")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the cost measurement")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SyntheticPairSpec.quick() if args.quick else SyntheticPairSpec()
    target_dir, draft_dir = build_synthetic_pair(args.out, spec, force=args.force)
    from specdec.models import load_model

    ratio = cost_ratio(load_model(target_dir), load_model(draft_dir))
    print(json.dumps({**pair_description(target_dir, draft_dir), "cost": ratio}, indent=2))


if __name__ == "__main__":
    main()
