"""Our minimal decoder-only transformer for Llama/Vicuna, Qwen3 and GLM-4 checkpoints.

`forward(input_ids [B, T], cache)` derives positions, write columns and the attention mask from the
cache's per-row `start`/`length`, so one code path serves prefill of prompts of different lengths and
steps of T >= 1 new tokens per row, in both cache layouts. Module names mirror HF's state-dict keys
(with the `model.` prefix dropped) so weights load by name.

The layer is written as few ops as the ordinary mode allows (docs/design.md, "The forward"): the hidden
states stay [M, E] (M = B T); RMSNorm is one op in float32; q, k and v come from one projection and are
rotated together by one formula (`numerics.rotate`, per-head tables built once per forward: V passes through);
K and V are written into the cache by one op (`kv_append`); attention is one SDPA call, with no mask where
every query sees all its row's columns; the output projection and the MLP's down projection add the residual
in the same op; on the CPU in float32 the MLP is three oneDNN ops on packed weights. Everything a forward
derives from the step (RoPE tables, the write index, the mask) is computed once, before the layers; what it
would derive from the modes (each op's kernel, the attention kind, the step's path) is chosen once per mode,
where the mode is set (`Transformer`).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from specdec.kernels.forward_cpu import NativeBindError
from specdec.kernels.kv_append import kv_append, write_constants, write_index

from . import native, numerics, quant
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
        self.kernel = numerics.rms_norm  # (x, weight, eps, backend) -> [..., dim], chosen by `choose_kernel`

    def choose_kernel(self, invariant: bool) -> None:
        """The RMSNorm for the weight's dtype (the activations') and the batch-invariant setting."""
        self.kernel = numerics.rms_norm_kernel(invariant, self.weight.dtype)

    def forward(self, x, backend: str | None = None):
        # HF order: normalise in float32, cast back, then scale (it matters for parity); backend: the step's
        return self.kernel(x, self.weight, self.eps, backend)


class OrdinaryAttention:
    """SDPA (`numerics.sdpa`), with an additive mask only where some query must not see some of its row's
    columns: a prefill from column 0 runs SDPA's causal path, a one-token step of rows that all end at one
    column none (the same bits: hidden keys add exact zeros either way; tests/test_prefill_step.py)."""

    def step_mask(self, cache: KVCache, host_new: list[int], T: int) -> tuple[bool, bool]:
        """(whether the step needs its mask, whether it is causal without one) for T new tokens per row."""
        # every row's first T tokens at columns 0..T-1, none of them padding: attention is causal, no mask
        causal = all(s == 0 and n == 0 for s, n in zip(cache.host_start, cache.host_length)) \
            and all(n == T for n in host_new)
        # one token per row, every row seeing every column 0..W-1 (B = 1, or rows of one length): no mask
        unmasked = T == 1 and len({e + 1 for e in cache.host_end}) == 1 and all(s == 0 for s in cache.host_start)
        return not (causal or unmasked), causal

    def keys(self, mask, dtype: torch.dtype):
        """The layers' attention input for mask [B, T, W] bool (or None): the additive mask [B, 1, T, W], once for
        all layers, or None."""
        if mask is None:
            return None
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, float("-inf"))[:, None]  # [B, 1, T, W]

    def attend(self, q, k, v, step: "StepInputs"):
        """q [B, H, T, D] over k, v [B, H_kv, W, D] -> [B, H, T, D]."""
        return numerics.sdpa(q, k, v, step.attn, q.shape[1] != k.shape[1], step.causal)


ORDINARY_ATTENTION = OrdinaryAttention()  # it keeps nothing: one for every model


class InvariantAttention:
    """Batch-invariant attention (`numerics.attention`: chunks from each row's first key), always masked."""

    def __init__(self, workspace: numerics.Workspace):
        self.workspace = workspace  # the model's reusable buffers for the torch path

    def step_mask(self, cache: KVCache, host_new: list[int], T: int) -> tuple[bool, bool]:
        return True, False

    def keys(self, mask, dtype: torch.dtype) -> numerics.RowKeys:
        return numerics.row_keys(mask, self.workspace)  # the mask, each row's first key

    def attend(self, q, k, v, step: "StepInputs"):
        return numerics.attention(q, k, v, step.attn, step.backend)  # [B, H, T, D]


class StepInputs(NamedTuple):
    """What every layer of one forward shares, computed once before the layers (`Transformer.forward_tensors`)."""

    rows: int  # B
    tokens: int  # T new tokens per row
    cos: torch.Tensor  # [B, T, H + 2 H_kv, D] RoPE tables per head (`Transformer.rope_heads`)
    sin: torch.Tensor  # [B, T, H + 2 H_kv, D]
    columns: torch.Tensor  # [B, T] cache columns written
    write: tuple | None  # `kv_append.write_index(columns)`: the torch path's K/V write indices
    attn: object  # the attention kind's `keys`: an additive mask [B, 1, T, W], None (no mask: `causal` or every
    # query sees all W columns), or a numerics.RowKeys (batch-invariant mode)
    causal: bool  # with attn None: causal over W = T columns (a prefill from column 0)
    backend: str | None  # kernel backend
    attention: object  # the model's attention kind (OrdinaryAttention or InvariantAttention)


def concatenated(kernels, x, backend=None):
    """The outputs of several linear kernels of x, side by side (a model loaded unfused: q, k, v)."""
    return torch.cat([kernel(x, backend) for kernel in kernels], dim=-1)


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
        self.sandwich = None  # GLM-4: the layer's post_self_attn_layernorm (set by DecoderLayer)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.project_kernel = None  # (x, backend) -> q, k, v side by side [..., (H + 2 H_kv) D]: `choose_kernels`
        self.output_kernel = None  # (out, residual, backend) -> residual + o_proj(out) [M, E]: `choose_kernels`

    def choose_kernels(self, invariant: bool, packed: bool) -> None:
        """The projections' kernels for their weights and the modes (models/numerics.py, "linear kernels")."""
        if hasattr(self, "qkv_proj"):
            self.project_kernel = numerics.linear_kernel(self.qkv_proj, invariant, packed)
        else:  # built unfused
            self.project_kernel = partial(concatenated, [numerics.linear_kernel(proj, invariant, packed)
                                                         for proj in (self.q_proj, self.k_proj, self.v_proj)])
        if self.sandwich is None:
            self.output_kernel = numerics.linear_add_kernel(self.o_proj, invariant, packed)
        else:  # GLM-4: the output is normed before the residual add
            o_proj = numerics.linear_kernel(self.o_proj, invariant, packed)
            self.output_kernel = partial(numerics.linear_norm_add, o_proj, self.sandwich)

    def project(self, x, cos, sin, perm, backend=None):
        """x [B T, E] or [B, T, E] (normed) -> q, k, v rotated, in one tensor [B, T, H + 2 H_kv, D] (heads q, then
        k, then v; q and k normed first where the family says so); B, T: the tables' [B, T, ...]."""
        cfg = self.cfg
        B, T = cos.shape[:2]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.project_kernel(x, backend).view(B, T, H + 2 * Hkv, D)  # [B, T, H + 2 H_kv, D]
        if cfg.qk_norm:  # per-head RMSNorm of q and k (their own weights), before RoPE
            q = self.q_norm(qkv[:, :, :H], backend)  # [B, T, H, D]
            k = self.k_norm(qkv[:, :, H:H + Hkv], backend)  # [B, T, H_kv, D]
            qkv = torch.cat((q, k, qkv[:, :, H + Hkv:]), dim=2)  # [B, T, H + 2 H_kv, D]
        return numerics.rotate(qkv, cos, sin, perm)

    def qkv(self, x, cos, sin, perm, backend=None):
        """q [B, H, T, D], k [B, H_kv, T, D] (both normed as the family says, rotated) and v [B, H_kv, T, D]:
        what the forward computes, for training and the invariant checks (`cos`/`sin`: `rope_heads`)."""
        H, Hkv = self.cfg.num_heads, self.cfg.num_kv_heads
        rot = self.project(x, cos, sin, perm, backend)  # [B, T, H + 2 H_kv, D]
        return rot[:, :, :H].transpose(1, 2), rot[:, :, H:H + Hkv].transpose(1, 2), rot[:, :, H + Hkv:].transpose(1, 2)

    def forward(self, x, residual, step: StepInputs, perm, kv, k, v):
        """residual + attention(x): x, residual [M, E] (M = B T; x normed); kv [2, B, H_kv, W, D] this layer's
        cache (K/V written in place); k, v [B, H_kv, W, D] its views."""
        cfg = self.cfg
        B, T = step.rows, step.tokens
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rot = self.project(x, step.cos, step.sin, perm, step.backend)  # [B, T, H + 2 H_kv, D]
        NH = H + 2 * Hkv
        kv_append(kv, rot.as_strided((B, T, 2 * Hkv, D), (T * NH * D, NH * D, D, 1), H * D), step.columns,
                  step.backend, step.write)  # K, V heads of every token
        q = rot.as_strided((B, H, T, D), (T * NH * D, D, NH * D, 1))  # [B, H, T, D] view
        out = step.attention.attend(q, k, v, step)  # [B, H, T, D]
        out = (out.reshape(B, H * D) if T == 1 else out.transpose(1, 2).reshape(B * T, H * D))  # [M, H D]
        return self.output_kernel(out, residual, step.backend)


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
        self.sandwich = None  # GLM-4: the layer's post_mlp_layernorm (set by DecoderLayer)
        self.kernel = None  # (x, residual, backend) -> residual + MLP(x) [M, E]: `choose_kernels`

    def choose_kernels(self, invariant: bool, packed: bool, device: torch.device, dtype: torch.dtype) -> None:
        """The MLP's kernel for its weights, the activations' device and dtype and the modes (models/numerics.py)."""
        silu = numerics.silu_kernel(invariant, device, dtype)
        if self.fused and self.sandwich is None:
            self.kernel = numerics.gated_mlp_kernel(self.gate_up_proj, self.down_proj, invariant, packed, silu)
            return
        if self.fused:
            gate_up = partial(numerics.gate_and_up, numerics.linear_kernel(self.gate_up_proj, invariant, packed))
        else:
            gate_up = partial(numerics.separate_gate_and_up, numerics.linear_kernel(self.gate_proj, invariant, packed),
                              numerics.linear_kernel(self.up_proj, invariant, packed))
        if self.sandwich is None:
            down_add = numerics.linear_add_kernel(self.down_proj, invariant, packed)
        else:  # GLM-4: the output is normed before the residual add
            down_add = partial(numerics.linear_norm_add, numerics.linear_kernel(self.down_proj, invariant, packed),
                               self.sandwich)
        self.kernel = partial(numerics.gated_mlp, gate_up, down_add, silu)

    def forward(self, x, residual, backend=None):
        """residual + MLP(x): x (normed), residual [M, E]."""
        return self.kernel(x, residual, backend)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, fused)
        self.mlp = MLP(cfg, fused)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            # the sublayers apply them (one submodule each, registered here: the checkpoint's names)
            object.__setattr__(self.self_attn, "sandwich", self.post_self_attn_layernorm)
            object.__setattr__(self.mlp, "sandwich", self.post_mlp_layernorm)

    def choose_kernels(self, invariant: bool, packed: bool) -> None:
        """The sublayers' kernels (the activations' device and dtype: the norms' weight's; the norms choose theirs
        in `Transformer.choose_kernels`)."""
        norm = self.input_layernorm.weight
        self.self_attn.choose_kernels(invariant, packed)
        self.mlp.choose_kernels(invariant, packed, norm.device, norm.dtype)

    def forward(self, h, step: StepInputs, perm, kv, k, v):
        """h [M, E] -> [M, E]; kv, k, v: this layer's cache and its K/V views (see `Attention.forward`)."""
        h = self.self_attn(self.input_layernorm(h, step.backend), h, step, perm, kv, k, v)
        return self.mlp(self.post_attention_layernorm(h, step.backend), h, step.backend)


class Transformer(nn.Module):
    """Decoder-only LM. Implements the model protocol of docs/api.md: `new_cache`, `forward`, `vocab_size`.

    `fused=True` builds the fused q/k/v and gate/up projections directly (see `fusion_layout`).

    Each mode is chosen once, where it is set, and the forward then runs what was chosen: `choose_kernels` gives
    every linear site, norm and SiLU its kernel (from the weights' format, device and dtype and the
    `batch_invariant` / `packed_linear` modes) and the model its attention kind; `_choose_step` picks the step's
    path (eager, `compile_forward`'s compiled forward, or `use_graphs`' CUDA graphs). Setting a mode, moving or
    casting the model (`.to()`) and `load_state_dict` (the loaders' last step) choose again."""

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
        self._compiled_forward = None  # `compile_forward`'s
        self._graph_runner = None  # models/graphs.py GraphRunner (`use_graphs`)
        self._compile_mode = None
        self._batch_invariant = False
        self._packed_linear = False
        self._bi_workspace = None  # reusable buffers of batch-invariant attention (models/numerics.py)
        self._rope_table = None  # (cos, sin) [N, R] for positions 0..N-1 (`rope_table`)
        self._rope_heads = None  # (cos, sin) [N + 1, D] and perm [D], from `_rope_table` (`rope_heads`)
        self._write_constants = {}  # (B, H_kv, device) -> `kv_append.write_constants`
        self.attention_kind = ORDINARY_ATTENTION  # `choose_kernels`'
        self.head_kernel = None  # (h, backend) -> logits: `choose_kernels`'
        self._run_step = self._eager_step  # `_choose_step`'
        # the head's rows where it is restricted to a subset of the vocabulary (`restrict_head`), else None
        self.register_buffer("head_ids", None, persistent=False)
        self._native_forward = True  # `native_forward`
        self.native = None  # the C++ model of models/native.py, where the model qualifies (`choose_kernels`)
        self.native_reason = None  # why not, in one line
        Transformer.choose_kernels(self)  # the parts built here (a subclass chooses again once it has built its own)

    def choose_kernels(self) -> None:
        """Give every linear site, norm and SiLU of the model its kernel, and the model its attention kind, for the
        weights' format, device and dtype and the modes; packs the weights the chosen kernels read packed."""
        invariant, packed = self._batch_invariant, self._packed_linear
        for layer in self.layers:
            layer.choose_kernels(invariant, packed)
        for module in self.modules():  # the model's own norms (a feature draft's borrowed final norm is the target's)
            if isinstance(module, RMSNorm):
                module.choose_kernel(invariant)
        self.head_kernel = numerics.linear_kernel(self.lm_head, invariant, packed)
        if invariant:
            if self._bi_workspace is None:
                self._bi_workspace = numerics.Workspace()
            self.attention_kind = InvariantAttention(self._bi_workspace)
        else:
            self.attention_kind = ORDINARY_ATTENTION
        self._bind_native()

    def _bind_native(self) -> None:
        """Bind the native CPU forward (models/native.py) over the weights as they are now, where the model
        qualifies and `native_forward` is on; else say why not (`native_reason`)."""
        self.native = None
        if not self._native_forward:
            self.native_reason = "turned off (native_forward = False)"
        elif type(self).embed is not Transformer.embed:
            self.native_reason = f"{type(self).__name__} mixes other inputs into its embedding"
        else:
            self.native_reason = native.why_not(self)
        if self.native_reason is None:
            try:
                self.native = native.bind(self)
            except NativeBindError as err:  # a tensor it cannot read as it now is (a bias cast by .half())
                self.native_reason = str(err)
        self._choose_step()

    def _choose_step(self) -> None:
        """The step's path: CUDA graphs (`use_graphs`; not with a compiled forward), the compiled forward (not in
        batch-invariant mode: inductor picks its own kernels), or eager."""
        if self.native is not None:
            self._run_step = self._native_step
        elif self._graph_runner is not None and self._compiled_forward is None:
            self._run_step = self._graphed_step
        elif self._compiled_forward is not None and not self._batch_invariant:
            self._run_step = self._compiled_step
        else:
            self._run_step = self._eager_step

    def _apply(self, fn, recurse=True):
        """`.to()`, `.float()`, `.cuda()`...: the kernels are chosen again for the new dtype and device."""
        super()._apply(fn, recurse)
        self.choose_kernels()
        return self

    def __getstate__(self):  # copy.deepcopy and pickle: the C++ model points into this model's tensors
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["native"], state["_run_step"] = None, None
        return state

    def __setstate__(self, state):  # ... and is bound again over the copy's
        super().__setstate__(state)
        self.choose_kernels()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's; the kernels are chosen again (`assign` may bring another dtype or device)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.choose_kernels()
        return result

    @property
    def compiled_forward(self):
        """`forward_tensors` compiled by `compile_forward` (None: not compiled)."""
        return self._compiled_forward

    @compiled_forward.setter
    def compiled_forward(self, compiled) -> None:
        self._compiled_forward = compiled
        self._choose_step()

    @property
    def graph_runner(self):
        """models/graphs.py GraphRunner: plain steps as CUDA graph replays (`use_graphs`), or None."""
        return self._graph_runner

    @graph_runner.setter
    def graph_runner(self, runner) -> None:
        self._graph_runner = runner
        self._choose_step()

    @property
    def batch_invariant(self) -> bool:
        """Batch-invariant numerics (models/numerics.py): a token's logits are the same bits whatever else
        shares its forward (B, T, row, padding). Set it on the model (`model.batch_invariant = True`): the kernels
        are chosen again, and the forward then runs eager (a compiled forward is not used: inductor picks its own
        kernels)."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = bool(on)
        self.choose_kernels()
        self._choose_step()

    @property
    def packed_linear(self) -> bool:
        """CPU float32 linear layers through oneDNN on weights packed once, for steps of up to
        `numerics.PACKED_MAX_ROWS` token rows (models/numerics.py says why; `LLM` turns it on by default where
        `numerics.packing_pays`). Costs one packed copy of the linear weights (packed when it is set); other dtypes
        and devices ignore it."""
        return self._packed_linear

    @packed_linear.setter
    def packed_linear(self, on: bool) -> None:
        self._packed_linear = bool(on)
        self.choose_kernels()
        if not on and not self.batch_invariant:
            numerics.drop_packed_weights(self)

    @property
    def native_forward(self) -> bool:
        """Run each step as one native C++ call (models/native.py) where the model qualifies: quantized blocks on
        the CPU (`native` is then the C++ model; `native_reason` says why not, where it is None). On by default;
        False runs the torch modules' forward."""
        return self._native_forward

    @native_forward.setter
    def native_forward(self, on: bool) -> None:
        self._native_forward = bool(on)
        self._bind_native()

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

    def rope_heads(self, positions, count: int | None = None, tables=None):
        """The tables of `numerics.rotate` for positions [B, T]: cos, sin [B, T, H + 2 H_kv, D] and perm [D].

        Built from `rope_table` (the same cos/sin bits) as one [N + 1, D] table pair per model: row p holds
        position p's cos and its sin with rotate-half's (or rotate-pairs') sign folded in, over D columns
        (cos 1, sin 0 past the rotary dims); row N is the identity (cos 1, sin 0), which V's heads look up.
        `count`: a host bound on the positions (every one below it; the forward passes the cache's width); None
        reads it from `positions` (one device read, for checks and training); `tables`: `rope_head_table(count)`'s,
        when the caller has them."""
        if tables is None:
            tables = self.rope_head_table(int(positions.max()) + 1 if count is None else count)
        cos_h, sin_h, perm, index_v = tables
        cfg = self.cfg
        H, Hkv = cfg.num_heads, cfg.num_kv_heads
        index = positions[:, :, None].expand(*positions.shape, H + 2 * Hkv)  # [B, T, H + 2 H_kv] table rows
        index = torch.where(index_v, cos_h.shape[0] - 1, index)  # V's heads read the identity row
        return cos_h[index], sin_h[index], perm  # [B, T, H + 2 H_kv, D] x 2, [D]

    def rope_head_table(self, count: int):
        """(cos, sin [N + 1, D], perm [D], V-head flags [H + 2 H_kv]) for `rope_heads`, N >= count: built from
        `rope_table` once per model (again only when that table is rebuilt)."""
        cos_t, sin_t = self.rope_table(count)
        cached = self._rope_heads
        if cached is None or cached[0] is not cos_t:
            cached = self._rope_heads = (cos_t, *self._head_tables(cos_t, sin_t))
        return cached[1:]

    def _head_tables(self, cos_t, sin_t):
        cfg = self.cfg
        N, R = cos_t.shape
        D = cfg.head_dim
        device = cos_t.device
        cos_h = torch.ones(N + 1, D, dtype=cos_t.dtype, device=device)  # [N + 1, D]
        sin_h = torch.zeros(N + 1, D, dtype=sin_t.dtype, device=device)  # [N + 1, D]
        cos_h[:N, :R] = cos_t
        sign = torch.ones(R, dtype=sin_t.dtype, device=device)  # [R] the sign rotate-half/-pairs puts on x[perm]
        perm = torch.arange(D, device=device)  # [D]
        if cfg.rope_interleaved:  # (x0, x1) -> (-x1, x0): x[perm] swaps each pair, the even slots negate
            perm[:R] = torch.arange(R, device=device).view(-1, 2).flip(-1).reshape(-1)
            sign[0::2] = -1
        else:  # (x1, x2) -> (-x2, x1): x[perm] swaps the halves, the first half negates
            perm[:R] = torch.arange(R, device=device).roll(R // 2)
            sign[: R // 2] = -1
        sin_h[:N, :R] = sin_t * sign
        H, Hkv = cfg.num_heads, cfg.num_kv_heads
        index_v = torch.arange(H + 2 * Hkv, device=device) >= H + Hkv  # [H + 2 H_kv] the V heads
        return cos_h, sin_h, perm, index_v

    def new_cache(self, batch_size: int, capacity: int, layout: str = RAGGED) -> KVCache:
        cfg = self.cfg
        cache = KVCache.allocate(cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim,
                                 self.dtype, self.device, layout)
        if self.graph_runner is not None:  # storage rows for its graphs' bucket (models/graphs.py)
            self.graph_runner.reserve(cache)
        return cache

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
        return self._run_step(input_ids, cache, num_new, logits, features, hidden)

    def _eager_step(self, input_ids, cache: KVCache, num_new, logits: str, features, hidden):
        """`forward` over the columns in use, with the mask the attention kind needs for this step (none where a
        prefill from column 0 is causal or every query sees all columns, unless the kind always masks)."""
        B, T = input_ids.shape
        host_new = [T] * B if num_new is None else list(num_new)
        masked, causal = self.attention_kind.step_mask(cache, host_new, T)
        plan = cache.plan(T, num_new, mask=masked)
        tables = self.rope_head_table(cache.capacity)  # positions < capacity
        last_index = None  # [B] each row's last real token, when it is not token T - 1
        if logits == "last" and not cache.left_padded and any(n != T for n in plan.host_num_new):
            last_index = plan.num_new - 1
        kv = cache.kv[:, :, :, :, :plan.width]  # [L, 2, B, H_kv, W, D]
        out = self.forward_tensors(input_ids, kv, plan.positions, plan.columns, plan.mask, last_index,
                                   logits == "last", cache.backend, features, hidden, causal, tables)
        cache.advance(plan)
        return out

    def _native_step(self, input_ids, cache: KVCache, num_new, logits: str, features, hidden):
        """`forward` as one native call (models/native.py): the embedding, every layer, the final norm and the head;
        positions, write columns and each row's keys derived in C++ from the cache's rows (kernels/positions.py's
        rules)."""
        if features is not None:
            self.embed(input_ids, features)  # a plain transformer takes none: its error
        T = input_ids.shape[1]
        host_new, _ = cache.step_rows(T, num_new)
        out, hid = self.native.forward(input_ids, cache.host_start, cache.host_length, host_new, cache.left_padded,
                                       cache.kv, self.rope_table(cache.capacity), logits, hidden)
        cache.advance_host(host_new)
        out = self.full_vocab(out)
        return (out, hid) if hidden else out

    def _compiled_step(self, input_ids, cache: KVCache, num_new, logits: str, features, hidden):
        """`forward` through the compiled forward (`compile_forward`): one graph for every step (scatter writes
        over the cache's full width, all T logits, inductor's own kernels); a prefill (`num_new`: rows of varied
        lengths) runs eager."""
        if num_new is not None:
            return self._eager_step(input_ids, cache, num_new, logits, features, hidden)
        T = input_ids.shape[1]
        plan = cache.plan(T, None, full_width=True)
        tables = self.rope_head_table(cache.capacity)  # positions < capacity; built (or grown) outside the graph
        kv = cache.kv  # [L, 2, B, H_kv, C, D]
        marks = [(input_ids, (0, 1)), (kv, (2, 4)), (plan.positions, (0, 1)), (plan.columns, (0, 1)),
                 (plan.mask, (0, 1, 2)), (tables[0], (0,)), (tables[1], (0,))]  # the tables grow too
        if features is not None:
            marks.append((features, (0, 1)))
        for t, dims in marks:
            for dim in dims:  # rows, new tokens and cache capacity vary: one graph for all of them
                torch._dynamo.maybe_mark_dynamic(t, dim)
        out = self._compiled_forward(input_ids, kv, plan.positions, plan.columns, plan.mask, None, False, "torch",
                                     features, hidden, False, tables)
        if logits == "last":  # every row's last token is token T - 1 here (num_new is None)
            out = (out[0][:, -1:], out[1][:, -1:] if hidden == "last" else out[1]) if hidden else out[:, -1:]
        cache.advance(plan)
        return out

    def _graphed_step(self, input_ids, cache: KVCache, num_new, logits: str, features, hidden):
        """`forward` as a replay of the step's CUDA graph (models/graphs.py) where one serves the step (every row
        T real tokens, within the runner's bounds); else eager."""
        runner = self._graph_runner
        if runner.takes(input_ids, cache, num_new):
            return runner.run(input_ids, cache, logits, hidden, features)
        return self._eager_step(input_ids, cache, num_new, logits, features, hidden)

    def embed(self, input_ids, features=None, backend=None):
        """The first layer's input [B, T, E] (a feature draft mixes in the target's hidden states)."""
        if features is not None:
            raise ValueError(f"{type(self).__name__} takes no features (it is not a feature draft)")
        return self.embed_tokens(input_ids)

    def head(self, h, backend=None):
        """Logits [B, T, V] of the last layer's output h [B, T, E]."""
        return self.full_vocab(self.head_kernel(self.norm(h, backend), backend))

    def full_vocab(self, logits):
        """The head's logits [..., N] over the whole vocabulary [..., V]: themselves, or where the head is restricted
        to a subset (`restrict_head`) -inf for every token outside it (a softmax gives those tokens 0)."""
        if self.head_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))  # [..., V]
        return full.index_copy_(-1, self.head_ids, logits)

    def restrict_head(self, token_ids) -> None:
        """Compute the head for `token_ids` only (FR-Spec's frequency-ranked subset, for a draft model): their rows of
        the head, as stored (the same numbers), and -inf for every other token. The forward's logits stay [.., V]:
        a greedy draft takes the subset's argmax, a sampled one draws from the renormalised subset distribution,
        which is the distribution rejection sampling then holds it to (exact). The full head is released (a tied
        embedding keeps its table); one-way."""
        ids = torch.unique(torch.as_tensor(token_ids, dtype=torch.long))  # [N] ascending
        V = self.cfg.vocab_size
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ValueError(f"restrict_head: token ids must be a non-empty subset of [0, {V})")
        if self.head_ids is not None:
            raise ValueError("restrict_head: the head is already restricted")
        head = self.lm_head
        if isinstance(head, quant.BlockLinear):
            subset = head.select_rows(ids)
        else:
            subset = nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None, device=head.weight.device,
                               dtype=head.weight.dtype)
            with torch.no_grad():
                subset.weight.copy_(head.weight[ids])
                if head.bias is not None:
                    subset.bias.copy_(head.bias[ids])
        self.lm_head = subset
        self.head_ids = ids.to(self.device)
        self.choose_kernels()

    def forward_tensors(self, input_ids, kv, positions, columns, mask, last_index, last_only: bool,
                        backend: str | None = None, features=None, hidden: str | None = None, causal: bool = False,
                        rope_tables=None):
        """The forward on tensors alone (what `compile_forward` captures): input_ids [B, T]; kv [L, 2, B, H_kv, W, D]
        the caches' first W columns, written in place; positions/columns [B, T]; mask [B, T, W] bool, or None
        (every query sees every column 0..W-1 of its row; with `causal`, W = T and query t sees columns 0..t:
        a prefill from column 0, which takes SDPA's causal path: the same bits, hidden keys add exact zeros
        either way; tests/test_prefill_step.py); last_index [B] or None; features [B, T, E] or None (`embed`);
        hidden: also return the last layer's output, at every position ("all") or where the logits are ("last");
        rope_tables: `rope_head_table`'s (a compiled forward takes them as inputs: they grow with the cache)."""
        B, T = input_ids.shape
        cos, sin, perm = self.rope_heads(positions, kv.shape[4], rope_tables)  # [B, T, H + 2 H_kv, D] x 2
        write = None
        if numerics.choose_backend(kv, backend) != "triton":  # the torch path's index_put_ indices
            key = (B, kv.shape[3], kv.device)
            constants = None if torch.compiler.is_compiling() else self._write_constants.get(key)
            if constants is None:  # (a compiled graph computes them: a few ops, B symbolic)
                constants = write_constants(*key)
                if not torch.compiler.is_compiling():
                    self._write_constants[key] = constants
            write = write_index(columns, kv.shape[3], constants)
        kind = self.attention_kind
        step = StepInputs(B, T, cos, sin, columns, write, kind.keys(mask, self.dtype), causal, backend, kind)
        layer_kv, ks, vs = kv.unbind(0), kv[:, 0].unbind(0), kv[:, 1].unbind(0)  # L x [2, B, H_kv, W, D], L x [B, H_kv, W, D]
        h = self.embed(input_ids, features, backend)  # [B, T, E]
        h = h.view(B * T, -1)  # [M, E]
        for layer, layer_cache, k, v in zip(self.layers, layer_kv, ks, vs):
            h = layer(h, step, perm, layer_cache, k, v)
        h = h.view(B, T, -1)  # [B, T, E]
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

    def use_graphs(self, on: bool = True, capture: bool | None = None) -> "Transformer":
        """Run plain steps (every row T real tokens) through CUDA graphs captured per rows bucket, T and width
        (models/graphs.py); `capture`: the graph API (default torch.cuda on CUDA; a CPU stand-in in tests), False
        runs the graphs' static-buffer path eagerly."""
        from .graphs import GraphRunner

        self.graph_runner = GraphRunner(self, capture=capture) if on else None
        return self

    def compile_forward(self, mode: str | None = None) -> "Transformer":
        """Compile `forward_tensors` with torch.compile (inductor's kernels; a mode that captures CUDA graphs, such
        as "reduce-overhead", is refused: `use_graphs` is the one capture mechanism). The batch, step-length
        and capacity dimensions are marked dynamic, so one compilation serves every batch size and step length
        (a size of 1 gets its own graph, as torch.compile always specialises it: at most four graphs per model);
        attention runs over the cache's full width so that
        no shape depends on the rows' lengths. Results equal the eager forward's up to rounding (inductor's
        float32 rsqrt differs from eager's in the last bit; the RoPE table is built eagerly, outside the graph;
        token-exact in float64 in our tests)."""
        # emulate_precision_casts: round where eager rounds (RMSNorm's float32 pass), so the compiled
        # forward computes what the eager one does instead of skipping the casts; inductor's own float32
        # rsqrt still differs from eager's in the last bit
        if self.compiled_forward is not None and self._compile_mode == mode:
            return self  # already compiled so: several LLMs sharing this model share its graphs
        from torch._inductor import list_mode_options

        if mode and list_mode_options(mode).get("triton.cudagraphs"):
            raise ValueError(f"compile_forward: mode {mode!r} captures CUDA graphs; the step's graphs are "
                             f"use_graphs()'s (models/graphs.py), the one capture mechanism")
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
        """K/V of layer 0 for tokens [B, T] at positions [B, T]: a cheap invariant check (I2, I4). A model that runs
        natively recomputes them natively (its first layer alone, into a scratch cache: the same bits as its
        steps'), where the positions are each row's 0..T-1; else with the torch modules."""
        B, T = token_ids.shape
        if self.native is not None and torch.equal(positions, torch.arange(T, device=positions.device).expand(B, T)):
            cache = self.new_cache(B, T)
            self.native.forward(token_ids, [0] * B, [0] * B, [T] * B, False, cache.kv, self.rope_table(T), None,
                                layers=1)
            return cache.k[0], cache.v[0]  # [B, H_kv, T, D] each
        layer = self.layers[0]
        _, k, v = layer.self_attn.qkv(layer.input_layernorm(self.embed_tokens(token_ids)), *self.rope_heads(positions))
        return k, v


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
