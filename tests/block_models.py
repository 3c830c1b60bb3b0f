"""Tiny Transformers whose weights are random GGUF blocks of chosen types, built directly (no file): what the
native forward's tests run (tests/test_native_forward.py). Each weight's float16 scale fields are drawn in a narrow
range and scaled so that the dequantized weights have a chosen spread: random bytes elsewhere (every code, every
6-bit scale and min) keep the blocks general, and the forward stays finite.

The families: "llama" (plain), "qwen2" (q/k/v biases), "qwen3" (q/k RMSNorm), "glm4" (post-sublayer norms, partial
interleaved RoPE, attention biases): every structure models/native.py binds."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdec.models.config import ModelConfig
from specdec.models.ggml_blocks import F16_FIELDS, TYPES, decompose, pack, dequantize
from specdec.models.quant import BlockLinear, QuantEmbedding
from specdec.models.transformer import Transformer

# a layer's projections and their block types: q/k/v as three parts (v of another type, as Q4_K_M files have it),
# gate/up as two
MIXED = {"q": "Q4_K", "k": "Q5_0", "v": "Q6_K", "o": "Q8_0", "gate": "Q4_1", "up": "Q5_K", "down": "Q4_0",
         "head": "Q6_K", "embed": "Q5_1"}
# the 2- and 3-bit K types and IQ4's non-linear 4-bit ones, mixed as MIXED mixes the others (q/k/v of three types,
# gate/up of two)
LOW_BITS = {"q": "Q2_K", "k": "IQ4_NL", "v": "Q3_K", "o": "IQ4_XS", "gate": "Q3_K", "up": "Q2_K", "down": "IQ4_XS",
            "head": "Q2_K", "embed": "IQ4_NL"}


def raw_blocks(rng, qtype: str, n: int, k: int, std: float) -> np.ndarray:
    """n rows of k weights of GGUF type `qtype` (uint8 [n, bytes]) whose dequantized values have about `std`."""
    bt = TYPES[qtype]
    nb = k // bt.superblock
    raw = rng.integers(0, 256, (n, nb, bt.block_bytes), dtype=np.uint8)
    fields = {at: rng.uniform(0.5, 1.0, (n, nb)) for at in F16_FIELDS[qtype]}

    def fill(scale: float):
        for at, v in fields.items():
            raw[..., at:at + 2] = (v * scale).astype(np.float16).view(np.uint8).reshape(n, nb, 2)

    fill(1.0)
    w = dequantize(pack(decompose(raw.reshape(n, -1), qtype), qtype))
    fill(std / max(float(w.std()), 1e-12))
    return raw.reshape(n, -1)


def block_linear(rng, qtypes: list[str], rows: list[int], k: int, bias: bool = False) -> BlockLinear:
    """A BlockLinear of parts of `qtypes` with `rows` rows each (k inputs); weights of std ~ 1 / sqrt(k)."""
    parts, first = [], 0
    for qtype, n in zip(qtypes, rows):
        raw = raw_blocks(rng, qtype, n, k, 1.0 / np.sqrt(k))
        parts.append((first, pack(decompose(raw, qtype), qtype)))
        first += n
    b = torch.from_numpy(rng.normal(0, 0.1, first).astype(np.float32)) if bias else None
    return BlockLinear(parts, b)


def config(family: str = "llama", layers: int = 2, vocab: int = 300, **overrides) -> ModelConfig:
    """hidden 256, MLP 512, 4 heads of 64, 2 KV heads (every K a multiple of 256: the K types' super-blocks)."""
    base = dict(family="qwen3" if family == "qwen3" else ("glm4" if family == "glm4" else "llama"),
                vocab_size=vocab, hidden_size=256, intermediate_size=512, num_layers=layers, num_heads=4,
                num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                eos_token_ids=(2,))
    if family == "qwen2":
        base.update(attention_bias=True)
    elif family == "qwen3":
        base.update(qk_norm=True)
    elif family == "glm4":
        base.update(attention_bias=True, sandwich_norms=True, partial_rotary_factor=0.5, rope_interleaved=True,
                    fused_gate_up=True)
    base.update(overrides)
    return ModelConfig(**base)


def block_model(family: str = "llama", seed: int = 0, qtypes: dict | None = None, tied: bool = False,
                **overrides) -> Transformer:
    """A Transformer of `config(family, ...)` whose projections, head and embedding are random blocks of
    `qtypes` (default MIXED; LOW_BITS; one type for every weight where `qtypes` is a string), loaded as the GGUF loader
    leaves a quantized model (batch-invariant mode on)."""
    types = dict(MIXED) if qtypes is None else ({k: qtypes for k in MIXED} if isinstance(qtypes, str) else qtypes)
    cfg = dataclasses.replace(config(family, **overrides), tie_word_embeddings=tied)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    E, H, Hkv, D, I, V = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, \
        cfg.vocab_size
    model = Transformer(cfg, fused=True)
    with torch.no_grad():
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = block_linear(rng, [types["q"], types["k"], types["v"]], [H * D, Hkv * D, Hkv * D], E,
                                         bias=cfg.attention_bias)
            attn.o_proj = block_linear(rng, [types["o"]], [E], H * D)
            mlp.gate_up_proj = block_linear(rng, [types["gate"], types["up"]], [I, I], E)
            mlp.down_proj = block_linear(rng, [types["down"]], [E], I)
        for name, module in model.named_modules():
            if name.endswith("norm") or name.endswith("layernorm"):
                module.weight.copy_(1.0 + 0.2 * torch.randn(module.weight.shape, generator=g))
        head = block_linear(rng, [types["head"]], [V], E)
        model.lm_head = head
        table = head if tied else block_linear(rng, [types["embed"]], [V], E)
        model.embed_tokens = QuantEmbedding(table, torch.float32)
    model.quantize = "gguf"
    model.batch_invariant = True  # as models/quant.py's finish_loading leaves a quantized model (binds the native)
    return model.eval()
