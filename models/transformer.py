"""Our minimal decoder-only transformer for Llama/Vicuna, Qwen3 and GLM-4 checkpoints.

`forward(input_ids [B, T], cache)` derives positions, write columns and the attention mask from the
cache's per-row `start`/`length`, so one code path serves prefill of prompts of different lengths and
steps of T >= 1 new tokens per row, in both cache layouts. Module names mirror HF's state-dict keys
(with the `model.` prefix dropped) so weights load by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels.kv_append import kv_append
from specdec.kernels.positions import StepPlan

from .cache import KVCache
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # HF order: normalise in float32, cast back, then scale (it matters for parity)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x):  # NeoX / Llama: (x1, x2) -> (-x2, x1) on the two halves
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):  # GLM-4 interleaved: (x0, x1), (x2, x3).. -> (-x1, x0), (-x3, x2)..
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x, cos, sin, interleaved: bool):
    """x: [B, H, T, D]; cos/sin: [B, 1, T, R] with R <= D; dims R.. pass through unrotated."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = x_rot * cos + (rotate_pairs(x_rot) if interleaved else rotate_half(x_rot)) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(E, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(E, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(E, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, E, bias=cfg.attention_out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def fuse_(self) -> None:
        """Replace q/k/v_proj by one `qkv_proj` (one matmul instead of three); HF names are kept for loading."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                          device=parts[0].weight.device, dtype=parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = fused

    def qkv(self, x, cos, sin):
        """q [B, H, T, D], k [B, H_kv, T, D] (both normed as the family says, rotated) and v [B, H_kv, T, D]."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin, cfg.rope_interleaved)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin, cfg.rope_interleaved)  # [B, H_kv, T, D]
        return q, k, v.transpose(1, 2)

    def forward(self, x, cos, sin, k_cache, v_cache, plan: StepPlan, attn_bias, first_column):
        """attn_bias: [B, 1, T, W] additive mask; first_column: the shared write column when every row
        writes the same contiguous columns (left-padded layout), else None (scatter per row)."""
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if first_column is None:
            kv_append(k_cache, v_cache, k, v, plan.columns)  # k_cache: [B, H_kv, C, D]
        else:
            k_cache[:, :, first_column: first_column + T] = k
            v_cache[:, :, first_column: first_column + T] = v
        W = plan.width
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :, :W], v_cache[:, :, :W], attn_mask=attn_bias,
            enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I = cfg.hidden_size, cfg.intermediate_size
        self.fused = cfg.fused_gate_up
        if self.fused:
            self.gate_up_proj = nn.Linear(E, 2 * I, bias=False)
        else:
            self.gate_proj = nn.Linear(E, I, bias=cfg.mlp_bias)
            self.up_proj = nn.Linear(E, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, E, bias=cfg.mlp_bias and not self.fused)

    def fuse_(self) -> None:
        """Replace gate_proj/up_proj by one `gate_up_proj` (gate first), as GLM-4 stores it."""
        if self.fused:
            return
        gate, up = self.gate_proj, self.up_proj
        fused = nn.Linear(gate.in_features, 2 * gate.out_features, bias=gate.bias is not None,
                          device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([gate.weight, up.weight]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([gate.bias, up.bias]))
        del self.gate_proj, self.up_proj
        self.gate_up_proj = fused
        self.fused = True

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # gate first
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, plan, attn_bias, first_column):
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, plan, attn_bias, first_column)
        if self.sandwich:
            h = self.post_self_attn_layernorm(h)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if self.sandwich:
            h = self.post_mlp_layernorm(h)
        return x + h


class Transformer(nn.Module):
    """Decoder-only LM. Implements the model protocol of docs/api.md: `new_cache`, `forward`, `vocab_size`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def inv_freq(self, device) -> torch.Tensor:
        """RoPE inverse frequencies [R/2] in float32, as HF computes them (linear scaling divides)."""
        R = self.cfg.rotary_dim
        exponent = torch.arange(0, R, 2, dtype=torch.int64, device=device).float() / R
        return 1.0 / (self.cfg.rope_theta ** exponent) / self.cfg.rope_linear_factor

    def rope(self, positions):
        """cos, sin: [B, 1, T, R] in the model dtype, for positions [B, T]."""
        freqs = positions[..., None].float() * self.inv_freq(positions.device)  # [B, T, R/2] float32
        emb = freqs.repeat_interleave(2, dim=-1) if self.cfg.rope_interleaved else torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]

    def new_cache(self, batch_size: int, capacity: int, layout: str = "ragged") -> KVCache:
        cfg = self.cfg
        return KVCache.allocate(cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim,
                                self.dtype, self.device, layout)

    @torch.no_grad()
    def forward(self, input_ids, cache: KVCache, num_new=None, logits: str = "all"):
        """input_ids [B, T] -> logits [B, T, V] ("all") or [B, 1, V] ("last": each row's last real token).

        `num_new` [B]: real tokens per row (default T); the rest is padding, on the left in the
        left-padded layout and on the right in the ragged one. Writes K/V and advances `cache.length`.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        B, T = input_ids.shape
        plan = cache.plan(T, num_new)
        cos, sin = self.rope(plan.positions)
        zero = torch.zeros((), dtype=self.dtype, device=input_ids.device)
        attn_bias = torch.where(plan.mask, zero, float("-inf"))[:, None]  # [B, 1, T, W], once for all layers
        first = plan.columns[:, 0]  # [B]
        first_column = int(first[0]) if bool((first == first[0]).all()) else None
        h = self.embed_tokens(input_ids)  # [B, T, E]
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            h = layer(h, cos, sin, k_cache, v_cache, plan, attn_bias, first_column)
        if logits == "last":
            last = torch.full_like(plan.num_new, T - 1) if cache.left_padded else plan.num_new - 1  # [B]
            h = h[torch.arange(B, device=h.device), last][:, None]  # [B, 1, E]
        cache.advance(plan)
        return self.lm_head(self.norm(h))

    @torch.no_grad()
    def layer0_kv(self, token_ids, positions):
        """K/V of layer 0 for tokens [B, T] at positions [B, T]: a cheap invariant check (I2, I4)."""
        cos, sin = self.rope(positions)
        layer = self.layers[0]
        _, k, v = layer.self_attn.qkv(layer.input_layernorm(self.embed_tokens(token_ids)), cos, sin)
        return k, v

    def fuse_(self) -> "Transformer":
        """Fuse q/k/v and gate/up projections (fewer, larger matmuls); done by `load_model`."""
        for layer in self.layers:
            layer.self_attn.fuse_()
            layer.mlp.fuse_()
        return self
