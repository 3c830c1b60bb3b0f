"""Our minimal decoder-only transformer for Llama/Vicuna, Qwen3 and GLM-4 checkpoints.

`forward(input_ids [B, T], cache)` derives positions, write columns and the attention mask from the
cache's per-row `start`/`length`, so one code path serves prefill of prompts of different lengths and
steps of T >= 1 new tokens per row, in both cache layouts. Module names mirror HF's state-dict keys
(with the `model.` prefix dropped) so weights load by name.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.kernels.kv_append import kv_append

from . import numerics
from .cache import RAGGED, KVCache
from .config import ModelConfig

# torch.compile's cache entries of `forward_tensors`, for every compiled model of the process together (dynamo's
# default of 8 is per code object, which all models share): 4 graphs per model (one row or several, one new
# token or several), so a target and a draft per LLM for 8 LLMs
COMPILED_GRAPHS = 64


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


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output rows are `parts`' rows stacked in order. Each part is copied straight into its
    rows of the one new buffer (no concatenated temporary), so fusing needs one extra copy of these parts."""
    first = parts[0].weight
    with torch.device("meta"):
        fused = nn.Linear(first.shape[1], sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                          dtype=first.dtype)
    fused = fused.to_empty(device=first.device)
    row = 0
    with torch.no_grad():
        for p in parts:
            fused.weight[row: row + p.out_features].copy_(p.weight)  # [out_p, in]
            if fused.bias is not None:
                fused.bias[row: row + p.out_features].copy_(p.bias)
            row += p.out_features
    return fused


class Attention(nn.Module):
    """`fused=True` builds the one `qkv_proj` directly (what `load_model` fills); else q/k/v_proj as in HF."""

    FUSED = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def __init__(self, cfg: ModelConfig, fused: bool = False):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        if fused:
            self.qkv_proj = nn.Linear(E, (H + 2 * Hkv) * D, bias=cfg.attention_bias)
        else:
            self.q_proj = nn.Linear(E, H * D, bias=cfg.attention_bias)
            self.k_proj = nn.Linear(E, Hkv * D, bias=cfg.attention_bias)
            self.v_proj = nn.Linear(E, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, E, bias=cfg.attention_out_bias)
        self.batch_invariant = False  # set by Transformer.batch_invariant (models/numerics.py)
        self.packed_linear = False  # set by Transformer.packed_linear
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def fuse_(self) -> None:
        """Replace q/k/v_proj by one `qkv_proj` (one matmul instead of three); a no-op when already fused."""
        if hasattr(self, "qkv_proj"):
            return
        self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x, cos, sin, backend=None):
        """q [B, H, T, D], k [B, H_kv, T, D] (both normed as the family says, rotated) and v [B, H_kv, T, D]."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if hasattr(self, "qkv_proj"):
            qkv = numerics.linear(self.qkv_proj, x, self.batch_invariant, backend,
                                  self.packed_linear)  # [B, T, (H + 2 H_kv) D]
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = (numerics.linear(proj, x, self.batch_invariant, backend, self.packed_linear)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))  # [B, T, H D], [B, T, H_kv D] x 2
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin, cfg.rope_interleaved)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin, cfg.rope_interleaved)  # [B, H_kv, T, D]
        return q, k, v.transpose(1, 2)

    def forward(self, x, cos, sin, k_cache, v_cache, columns, attn_bias, first_column, backend=None):
        """x [B, T, E]; k_cache/v_cache [B, H_kv, C, D]; columns [B, T] write columns; attn_bias [B, 1, T, W]
        additive mask over cache columns 0..W-1 (None: each row's first T tokens, unpadded: causal); first_column: the shared write column when every row
        writes the same contiguous columns (a host int: a slice write), else None (scatter per row, with the
        kv_append kernel of `backend`)."""
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin, backend)
        if first_column is None:
            kv_append(k_cache, v_cache, k, v, columns, backend=backend)  # k_cache: [B, H_kv, C, D]
        else:
            k_cache[:, :, first_column: first_column + T] = k
            v_cache[:, :, first_column: first_column + T] = v
        if self.batch_invariant:  # attn_bias is then a numerics.RowKeys (mask and each row's first key)
            out = numerics.attention(q, k_cache, v_cache, attn_bias, backend)  # [B, H, T, D]
        else:  # attn_bias None: a causal prefill from column 0 (`forward_tensors`)
            out = numerics.sdpa(q, k_cache, v_cache, attn_bias, cfg.num_heads != cfg.num_kv_heads)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim)  # [B, T, H * D]
        return numerics.linear(self.o_proj, out, self.batch_invariant, backend, self.packed_linear)


class MLP(nn.Module):
    """`fused=True` builds the one `gate_up_proj` (gate first) directly; GLM-4 checkpoints store it that way."""

    FUSED = ("gate_up_proj", ("gate_proj", "up_proj"))

    def __init__(self, cfg: ModelConfig, fused: bool = False):
        super().__init__()
        E, I = cfg.hidden_size, cfg.intermediate_size
        self.fused = fused or cfg.fused_gate_up
        if self.fused:
            self.gate_up_proj = nn.Linear(E, 2 * I, bias=cfg.mlp_bias and not cfg.fused_gate_up)
        else:
            self.gate_proj = nn.Linear(E, I, bias=cfg.mlp_bias)
            self.up_proj = nn.Linear(E, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, E, bias=cfg.mlp_bias and not cfg.fused_gate_up)
        self.batch_invariant = False  # set by Transformer.batch_invariant (models/numerics.py)
        self.packed_linear = False  # set by Transformer.packed_linear

    def fuse_(self) -> None:
        """Replace gate_proj/up_proj by one `gate_up_proj` (gate first), as GLM-4 stores it."""
        if self.fused:
            return
        self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj
        self.fused = True

    def forward(self, x, backend=None):
        invariant, packed = self.batch_invariant, self.packed_linear
        if self.fused:
            gate, up = numerics.linear(self.gate_up_proj, x, invariant, backend, packed).chunk(2, dim=-1)  # gate first
        else:
            gate = numerics.linear(self.gate_proj, x, invariant, backend, packed)
            up = numerics.linear(self.up_proj, x, invariant, backend, packed)
        return numerics.linear(self.down_proj, numerics.silu(gate, invariant) * up, invariant, backend, packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, fused)
        self.mlp = MLP(cfg, fused)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, columns, attn_bias, first_column, backend=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, columns, attn_bias, first_column,
                           backend)
        if self.sandwich:
            h = self.post_self_attn_layernorm(h)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x), backend)
        if self.sandwich:
            h = self.post_mlp_layernorm(h)
        return x + h


class Transformer(nn.Module):
    """Decoder-only LM. Implements the model protocol of docs/api.md: `new_cache`, `forward`, `vocab_size`.

    `fused=True` builds the fused q/k/v and gate/up projections directly (see `fusion_layout`)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False):
        super().__init__()
        self.cfg = cfg
        embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(cfg, fused) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # the local: a subclass may redefine `embed_tokens` (models/feature_draft.py)
            self.lm_head.weight = embed_tokens.weight
        self.compiled_forward = None  # set by `compile_forward`
        self._compile_mode = None
        self._batch_invariant = False
        self._packed_linear = False
        self._bi_workspace = None  # reusable buffers of batch-invariant attention (models/numerics.py)
        self._rope_table = None  # (cos, sin) [N, R] for positions 0..N-1 (`rope_table`)

    @property
    def batch_invariant(self) -> bool:
        """Batch-invariant numerics (models/numerics.py): a token's logits are the same bits whatever else
        shares its forward (B, T, row, padding). Set it on the model (`model.batch_invariant = True`); the
        forward then runs eager (a compiled forward is not used: inductor picks its own kernels)."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = bool(on)
        for layer in self.layers:
            layer.self_attn.batch_invariant = layer.mlp.batch_invariant = bool(on)

    @property
    def packed_linear(self) -> bool:
        """CPU float32 linear layers through oneDNN on weights packed once, for steps of two or more token
        rows (models/numerics.py says why; `LLM` turns it on by default where `numerics.packing_pays`).
        Costs one packed copy of every linear weight; other dtypes and devices ignore it."""
        return self._packed_linear

    @packed_linear.setter
    def packed_linear(self, on: bool) -> None:
        self._packed_linear = bool(on)
        for layer in self.layers:
            layer.self_attn.packed_linear = layer.mlp.packed_linear = bool(on)
        if on:  # pack now, not inside the first timed step
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    numerics.packed_weight(module)
        elif not self.batch_invariant:
            numerics.drop_packed_weights(self)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's weight: never quantized, models/quant.py)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def inv_freq(self, device) -> torch.Tensor:
        """RoPE inverse frequencies [R/2] in float32, as HF computes them (linear scaling divides)."""
        R = self.cfg.rotary_dim
        exponent = torch.arange(0, R, 2, dtype=torch.int64, device=device).float() / R
        return 1.0 / (self.cfg.rope_theta ** exponent) / self.cfg.rope_linear_factor

    def rope_table(self, count: int):
        """cos, sin: [N, R] in the model dtype for positions 0..N-1, N >= count. Computed once per model, as a
        forward of every position would (float32 angles, cast to the model dtype), and again only for more
        positions (N doubles at least), another dtype or another device."""
        table = self._rope_table
        if table is not None and table[0].shape[0] >= count and table[0].dtype == self.dtype \
                and table[0].device == self.device:
            return table
        N = max(count, 2 * table[0].shape[0] if table is not None else 0)
        positions = torch.arange(N, dtype=torch.int64, device=self.device)  # [N]
        freqs = positions[:, None].float() * self.inv_freq(self.device)  # [N, R/2] float32
        emb = freqs.repeat_interleave(2, dim=-1) if self.cfg.rope_interleaved else torch.cat((freqs, freqs), dim=-1)
        self._rope_table = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))  # [N, R] each
        return self._rope_table

    def rope(self, positions, count: int | None = None):
        """cos, sin: [B, 1, T, R] in the model dtype, for positions [B, T], looked up in `rope_table`. `count`:
        a host bound on the positions (every one below it; the forward passes the cache's capacity); None
        reads it from `positions` (one device read, for checks and training)."""
        cos, sin = self.rope_table(int(positions.max()) + 1 if count is None else count)
        return cos[positions][:, None], sin[positions][:, None]

    def new_cache(self, batch_size: int, capacity: int, layout: str = RAGGED) -> KVCache:
        cfg = self.cfg
        return KVCache.allocate(cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim,
                                self.dtype, self.device, layout)

    @torch.no_grad()
    def forward(self, input_ids, cache: KVCache, num_new=None, logits: str = "all", features=None,
                hidden: str | None = None):
        """input_ids [B, T] -> logits [B, T, V] ("all") or [B, 1, V] ("last": each row's last real token).

        `num_new`: real tokens per row, a host list (default T for every row); the rest is padding, on the
        left in the left-padded layout and on the right in the ragged one. Writes K/V and advances the
        cache. Reads nothing back from the device: the cache's host mirror sizes the step.
        `hidden` "all" / "last" returns (logits, hidden): the last layer's output before the final norm
        ([B, T, E] at every fed position, or [B, 1, E] where the "last" logits are; what a feature draft
        reads, docs/api.md). `features` [B, T, E]: the input of a feature draft (models/feature_draft.py); a
        plain transformer takes none.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if hidden not in (None, "all", "last"):
            raise ValueError(f"hidden must be None, 'all' or 'last', got {hidden!r}")
        B, T = input_ids.shape
        compiled = self.compiled_forward is not None and num_new is None  # steps; prefills (varied shapes) run eager
        compiled = compiled and not self.batch_invariant
        plan = cache.plan(T, num_new, full_width=compiled)
        self.rope_table(cache.capacity)  # positions < capacity; built (or grown) here, outside a compiled graph
        last_index = None  # [B] each row's last real token, when it is not token T - 1
        if logits == "last" and not cache.left_padded and any(n != T for n in plan.host_num_new):
            last_index = plan.num_new - 1
        if compiled:  # one graph for every step: scatter writes, all T logits, inductor's own kernels
            marks = [(input_ids, (0, 1)), (cache.k, (1, 3)), (cache.v, (1, 3)), (plan.positions, (0, 1)),
                     (plan.columns, (0, 1)), (plan.mask, (0, 1, 2))]
            if features is not None:
                marks.append((features, (0, 1)))
            for t, dims in marks:
                for dim in dims:  # rows, new tokens and cache capacity vary: one graph for all of them
                    torch._dynamo.maybe_mark_dynamic(t, dim)
            out = self.compiled_forward(input_ids, cache.k, cache.v, plan.positions, plan.columns, plan.mask, None,
                                        None, False, "torch", features, hidden)
            if logits == "last":  # every row's last token is token T - 1 here (num_new is None)
                out = (out[0][:, -1:], out[1][:, -1:] if hidden == "last" else out[1]) if hidden else out[:, -1:]
        else:  # every row's first T tokens, none of them padding: attention needs no mask (causal)
            causal = plan.first_column == 0 and all(n == T for n in plan.host_num_new) and plan.mask.shape[-1] == T
            out = self.forward_tensors(input_ids, cache.k, cache.v, plan.positions, plan.columns, plan.mask, last_index,
                                       plan.first_column, logits == "last", cache.backend, features, hidden, causal)
        cache.advance(plan)
        return out

    def embed(self, input_ids, features=None, backend=None):
        """The first layer's input [B, T, E] (a feature draft mixes in the target's hidden states)."""
        if features is not None:
            raise ValueError(f"{type(self).__name__} takes no features (it is not a feature draft)")
        return self.embed_tokens(input_ids)

    def head(self, h, backend=None):
        """Logits [B, T, V] of the last layer's output h [B, T, E]."""
        return numerics.linear(self.lm_head, self.norm(h), self.batch_invariant, backend, self.packed_linear)

    def forward_tensors(self, input_ids, k, v, positions, columns, mask, last_index, first_column, last_only: bool,
                        backend: str | None = None, features=None, hidden: str | None = None, causal: bool = False):
        """The forward on tensors alone (what `compile_forward` captures): input_ids [B, T]; k/v caches
        [L, B, H_kv, C, D], written in place; positions/columns [B, T]; mask [B, T, W]; last_index [B] or
        None; first_column: a host int (contiguous slice write) or None (scatter at `columns` with the
        kv_append kernel of `backend`); features [B, T, E] or None (`embed`); hidden: also return the last
        layer's output, at every position ("all") or where the logits are ("last"); causal: `mask` is the causal
        mask of T tokens at columns 0..T-1 in every row (W = T), so ordinary attention builds no additive mask and
        takes SDPA's causal path, which skips the hidden blocks (the same bits: hidden keys add exact zeros
        either way; tests/test_models.py)."""
        B, T = input_ids.shape
        cos, sin = self.rope(positions, k.shape[3])  # [B, 1, T, R]; positions < capacity C
        if self.batch_invariant:
            if self._bi_workspace is None:
                self._bi_workspace = numerics.Workspace()
            attn_bias = numerics.row_keys(mask, self._bi_workspace)  # the mask, each row's first key
        elif causal:
            attn_bias = None  # numerics.sdpa: is_causal
        else:
            zero = torch.zeros((), dtype=self.dtype, device=input_ids.device)
            attn_bias = torch.where(mask, zero, float("-inf"))[:, None]  # [B, 1, T, W], once for all layers
        h = self.embed(input_ids, features, backend)  # [B, T, E]
        for layer, k_cache, v_cache in zip(self.layers, k, v):
            h = layer(h, cos, sin, k_cache, v_cache, columns, attn_bias, first_column, backend)
        out = h
        if last_only:
            if last_index is None:
                out = h[:, -1:]  # [B, 1, E]
            else:
                out = h[torch.arange(B, device=h.device), last_index][:, None]  # [B, 1, E]
        logits = self.head(out, backend)
        if hidden is None:
            return logits
        return logits, (h if hidden == "all" else out)

    def compile_forward(self, mode: str | None = None) -> "Transformer":
        """Compile `forward_tensors` with torch.compile (inductor; `mode="reduce-overhead"` adds CUDA graphs
        on GPUs). The batch, step-length and capacity dimensions are marked dynamic, so one compilation
        serves every batch size and step length (a size of 1 gets its own graph, as torch.compile always
        specialises it: at most four graphs per model); attention runs over the cache's full width so that
        no shape depends on the rows' lengths. Results equal the eager forward's up to rounding (inductor's
        float32 rsqrt differs from eager's in the last bit; the RoPE table is built eagerly, outside the graph;
        token-exact in float64 in our tests)."""
        # emulate_precision_casts: round where eager rounds (RMSNorm's float32 pass), so the compiled
        # forward computes what the eager one does instead of skipping the casts; inductor's own float32
        # rsqrt still differs from eager's in the last bit
        if self.compiled_forward is not None and self._compile_mode == mode:
            return self  # already compiled so: several LLMs sharing this model share its graphs
        from torch._inductor import list_mode_options

        # torch.compile takes a mode or options, not both: the mode enters as its options
        options = {**(list_mode_options(mode) if mode else {}), "emulate_precision_casts": True}
        # dynamo counts recompilations per code object, and every compiled model shares forward_tensors' code
        # (each architecture, and each of its 4 graphs, a cache entry): room for COMPILED_GRAPHS of them, set
        # once here (a context around every compiled call cost 15 us a forward); a larger setting is kept
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_GRAPHS)
        self.compiled_forward = torch.compile(self.forward_tensors, fullgraph=True, options=options)
        self._compile_mode = mode
        return self

    @torch.no_grad()
    def layer0_kv(self, token_ids, positions):
        """K/V of layer 0 for tokens [B, T] at positions [B, T]: a cheap invariant check (I2, I4)."""
        cos, sin = self.rope(positions)
        layer = self.layers[0]
        _, k, v = layer.self_attn.qkv(layer.input_layernorm(self.embed_tokens(token_ids)), cos, sin)
        return k, v

    def fuse_(self) -> "Transformer":
        """Fuse q/k/v and gate/up projections (fewer, larger matmuls) of a model built unfused; `load_model`
        instead builds the model fused and reads each projection straight into its rows."""
        for layer in self.layers:
            layer.self_attn.fuse_()
            layer.mlp.fuse_()
        return self


def fusion_layout(cfg: ModelConfig) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Where each HF projection lives in a model built with `fused=True`: checkpoint weight name (without
    `model.`) -> (fused parameter name, first row, the weight's own shape), e.g. `layers.0.self_attn.k_proj.weight`
    -> (`layers.0.self_attn.qkv_proj.weight`, H * D, (H_kv * D, E)). Empty for projections stored fused."""
    with torch.device("meta"):
        plain = (("self_attn", Attention(cfg)), ("mlp", MLP(cfg)))
    layout = {}
    for prefix, module in plain:
        fused_name, parts = type(module).FUSED
        if not hasattr(module, parts[0]):
            continue  # the checkpoint stores it fused (GLM-4 gate_up_proj)
        for kind in ("weight", "bias"):
            row = 0
            for part in parts:
                tensor = getattr(getattr(module, part), kind)
                if tensor is None:
                    break
                for i in range(cfg.num_layers):
                    layout[f"layers.{i}.{prefix}.{part}.{kind}"] = (f"layers.{i}.{prefix}.{fused_name}.{kind}", row,
                                                                    tuple(tensor.shape))
                row += tensor.shape[0]
    return layout
