"""The native CPU forward for our Transformer: where a model qualifies, its whole step (embedding, layers, final
norm, head) runs as one C++ call (kernels/forward_cpu.py over kernels/cpu/forward.cpp) instead of the torch
modules' ops.

A model qualifies where its weights are quantized blocks on the CPU and its structure is one the native code
knows: the activations float32; every projection of every layer, and the head, a `BlockLinear` (a GGUF's blocks as
stored, or --quantize's); the embedding a block table or a float32 one; a plain Transformer (Llama, Qwen2 with its
q/k/v biases, Qwen3 with q/k norms, GLM-4's extra norms and partial interleaved RoPE; not a feature draft, whose
input mixes in the target's hidden states). Otherwise the torch forward runs, and `bind` says why in one line.

The model object stays the one source of its weights: the C++ model points into the modules' current tensors and
is bound again whenever they may change (`Transformer.choose_kernels`: at load, `.to()`, `load_state_dict`, a
copy), and keeps them referenced while it lives.
"""
from __future__ import annotations

from torch import nn
import torch

from specdec.kernels import forward_cpu, qmm_cpu

from .quant import BlockLinear, QuantEmbedding


def _linear_parts(modules) -> tuple[list, list] | None:
    """[(first row, Packed)] and [bias or None] of `modules` (BlockLinears taking one input) stacked by rows, or
    None if one is not a BlockLinear."""
    parts, biases, row = [], [], 0
    for module in modules:
        if not isinstance(module, BlockLinear):
            return None
        for first, packed in module.parts:
            parts.append((row + first, packed))
            biases.append(None if module.bias is None else module.bias.detach()[first:first + packed.n])
        row += module.out_features
    return parts, biases


def _linear_bias(modules, biases, parts) -> torch.Tensor | None:
    """The float32 bias [N] of stacked modules: one module's own, or the parts' biases stacked (zeros where a part
    has none); None where none has one."""
    if all(b is None for b in biases):
        return None
    if len(modules) == 1 and modules[0].bias.dtype == torch.float32:
        return modules[0].bias.detach()
    n = sum(p.n for _, p in parts)
    out = torch.zeros(n, dtype=torch.float32)
    for (row, p), b in zip(parts, biases):
        if b is not None:
            out[row:row + p.n] = b.float()
    return out


def why_not(model) -> str | None:
    """Why `model` (a plain models/transformer.py Transformer: the caller's check) does not run the native forward
    (one line), or None where it qualifies."""
    if not qmm_cpu.available():
        return qmm_cpu.unavailable_reason()
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"activations {model.dtype} on {model.device} (the native forward runs float32 on the CPU)"
    if not isinstance(model.lm_head, BlockLinear):
        return "the head is not in quantized blocks"
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
        projections += [attn.o_proj, mlp.down_proj]
        projections += [mlp.gate_up_proj] if mlp.fused else [mlp.gate_proj, mlp.up_proj]
        if not all(isinstance(p, BlockLinear) for p in projections):
            return f"layer {i} has projections that are not in quantized blocks"
    embed = model.embed_tokens
    if not (isinstance(embed, QuantEmbedding) and isinstance(embed.table, BlockLinear)) \
            and not (isinstance(embed, nn.Embedding) and embed.weight.dtype == torch.float32):
        return f"the embedding ({type(embed).__name__}) is neither quantized blocks nor float32"
    return None


def bind(model) -> forward_cpu.NativeModel:
    """The C++ model over `model`'s current weights (`why_not(model)` must be None). Raises NativeBindError naming
    a tensor the native forward cannot read."""
    cfg = model.cfg
    E, H, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    native = forward_cpu.NativeModel(E, H, Hkv, D, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size,
                                     cfg.rotary_dim, cfg.rope_interleaved, cfg.rms_norm_eps)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_up_proj] if mlp.fused else [mlp.gate_proj, mlp.up_proj]
        for slot, modules, name in ((forward_cpu.QKV, qkv, "self_attn.qkv"), (forward_cpu.O, [attn.o_proj], "o_proj"),
                                    (forward_cpu.GATE_UP, gate_up, "mlp.gate_up"),
                                    (forward_cpu.DOWN, [mlp.down_proj], "mlp.down_proj")):
            parts, biases = _linear_parts(modules)
            native.add_linear(i, slot, parts, _linear_bias(modules, biases, parts), f"layers.{i}.{name}")
        norms = [(forward_cpu.ATTN_NORM, layer.input_layernorm, E), (forward_cpu.MLP_NORM,
                                                                      layer.post_attention_layernorm, E)]
        if cfg.qk_norm:
            norms += [(forward_cpu.Q_NORM, attn.q_norm, D), (forward_cpu.K_NORM, attn.k_norm, D)]
        if cfg.sandwich_norms:
            norms += [(forward_cpu.ATTN_POST_NORM, layer.post_self_attn_layernorm, E),
                      (forward_cpu.MLP_POST_NORM, layer.post_mlp_layernorm, E)]
        for slot, norm, length in norms:
            native.set_vector(i, slot, norm.weight.detach(), length, f"layers.{i} norm weight")
    native.set_vector(-1, forward_cpu.FINAL_NORM, model.norm.weight.detach(), E, "norm.weight")
    parts, biases = _linear_parts([model.lm_head])
    native.add_linear(-1, forward_cpu.HEAD, parts, _linear_bias([model.lm_head], biases, parts), "lm_head")
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding):
        native.add_linear(-1, forward_cpu.EMBED, embed.table.parts, None, "embed_tokens")
    else:
        native.set_vector(-1, forward_cpu.EMBED_FLOAT, embed.weight.detach(), 0, "embed_tokens.weight")
    return native.finish()
