"""Batch-invariant numerics: the ops of the forward whose result for one token could depend on the rest of
the batch, and their replacements when a model's `batch_invariant` attribute is True.

A token's logits must be the same bits whether it is fed alone (AR, T = 1, B = 1), among k + 1 tokens of
a verify pass, in a batch of 8, at any row, after any left padding. Per op, on this project's CPU
(measured by `python -m bench.batch_invariant probe`, asserted by `tests/test_batch_invariant.py`):

| op | ordinary path | batch-invariant mode |
|---|---|---|
| linear (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, `lm_head`) | MKL picks a kernel by M = B*T: float32/float64 rows change with M | `kernels.bi_matmul.bi_linear`: CPU float32 oneDNN on a packed weight (kept per layer, `packed_weight`), bfloat16 `F.linear`, float64 MKL on rows padded to a multiple of 4 -- each run as `bi_matmul.cpu_plan` measures it keeps rows on this CPU (up to prefill-sized calls; else on one thread or in fixed 16-row calls); Triton: fixed tiles, no split-K |
| attention | SDPA's blocks start at column 0 and depend on T: not invariant | `kernels.bi_attention.bi_attention`: chunks from each row's first key (its batched matmuls measured like the linear layers: `bmm_plan`) |
| SiLU | float32/float64: the vectorised and the scalar tail loop differ in the last bit, and where the tail falls depends on the tensor's size and thread split | `x / (1 + exp(-x))` (exp, +, / give the same bits wherever the element sits); bfloat16's `F.silu` is invariant (all 65536 inputs checked) and kept |
| RMSNorm, q/k norm | one row at a time, fixed order: invariant | unchanged |
| RoPE (`cos`/`sin` of float32 angles, mul/add) | invariant (vectorised `cos`/`sin` are used for every element) | unchanged |
| embedding, residual adds, K/V writes, realign | exact | unchanged |
| softmax / log-softmax over the vocabulary (sampling) | one row at a time: invariant | unchanged |

On CUDA, torch's own reductions (RMSNorm's mean) and elementwise kernels are not covered by these CPU
measurements; see docs/design.md ("Batch-invariant numerics") for what is and is not claimed there.

Which implementation an op runs is chosen once per model, not per call: `linear_kernel`, `linear_add_kernel`,
`gated_mlp_kernel`, `rms_norm_kernel` and `silu_kernel` return it for a layer's weight format, device and dtype and
the model's modes (`Transformer.choose_kernels` calls them when the model is loaded, moved or cast, and when
`batch_invariant` or `packed_linear` is set).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels.bi_attention import Workspace, bi_attention, chunk_plan, first_keys
from specdec.kernels.bi_matmul import bi_linear, onednn_available, pack_weight
from specdec.kernels.dispatch import choose_backend, one_thread
from specdec.kernels.rmsnorm import rms_norm as bi_rms_norm

from .quant import QUANTIZED_LINEAR

# CPU float32 linear layers with M = B*T >= 2 rows: MKL's small-M GEMM costs ~M times its one-row GEMV
# (M = 2..8 measured 1.8-2.9x the time of M = 1 at K = 384, N = 1536), oneDNN's blocked kernel on a
# weight packed once stays nearly flat; the packed copy is extra memory, so it is on by default only up to:
PACKED_LINEAR_LIMIT_BYTES = 1 << 30
# the packed path runs steps of 2..PACKED_MAX_ROWS token rows (verify passes, batched decode steps), where it
# beats MKL; larger ones (prefills) keep MKL's GEMM, which is efficient there. oneDNN caches a primitive per
# input shape: unbounded row counts (every prefill width) grew a long-lived engine's RSS by ~150 MiB over
# 1,000 requests; with the bound the shapes, and so the cache, stay few
PACKED_MAX_ROWS = 64
# and within the bound, row counts above PACKED_EXACT_ROWS are padded up to a multiple of PACKED_ROW_STEP
# (zero rows, dropped after): 21 shapes per weight in all, so the primitive cache fills in the first few
# requests (or at once with `warm_packed`) and a long-lived engine's memory stays flat
PACKED_EXACT_ROWS = 16
PACKED_ROW_STEP = 8
# CPU attention calls of at most this many (query row, key) pairs over all heads (B * H * T * W: decode steps,
# short verify passes) run on one thread: the work is tens of microseconds, and waking a second thread for
# SDPA's parallel region cost 2.7 ms a call (OMP_WAIT_POLICY=PASSIVE) to 15 ms (OpenMP's default spin-wait)
# on this shared 2-core machine: a 2-thread SmolLM2-135M decode step went from 284 to 73 ms
# (docs/benchmarks/prefill-and-step.md). The output is then the one-thread output at any thread count (SDPA's
# CPU kernel splits a short query's keys across threads: its bits depend on the thread count).
SERIAL_ATTENTION_WORK = 1 << 16
SILU_INVARIANT_DTYPES = (torch.bfloat16,)  # torch's CPU F.silu gives the same bits for every element position


class RowKeys(NamedTuple):
    """What batch-invariant attention needs from a step's plan, computed once per forward (`row_keys`)."""

    mask: torch.Tensor  # [B, T, W] bool, True = may attend
    first: torch.Tensor  # [B] int64, each row's first key column
    plans: dict  # (group, H_kv, C) -> the torch path's ChunkPlan, built by the first layer that needs it
    workspace: Workspace | None  # the model's reusable buffers for the torch path


def row_keys(mask, workspace: Workspace | None = None) -> RowKeys:
    return RowKeys(mask, first_keys(mask), {}, workspace)


def packed_weight(layer: nn.Linear, part: int | None = None, parts: int = 2):
    """The layer's weight packed for the CPU float32 path (`bi_matmul.pack_weight`), packed at first use and
    again when the weight changes (dtype, device, storage or in-place version); None for other paths.
    `part`: only rows part * N / parts .. (part + 1) * N / parts (the gate or the up half of a fused gate_up)."""
    weight = layer.weight
    try:
        version = weight._version
    except RuntimeError:  # inference tensors keep no version counter
        version = None
    key = (weight.dtype, weight.device, weight.data_ptr(), tuple(weight.shape), version)
    name = "bi_packed" if part is None else f"bi_packed_{part}_of_{parts}"
    cached = layer.__dict__.get(name)
    if cached is None or cached[0] != key:
        if part is not None:
            n = weight.shape[0] // parts
            weight = weight[part * n:(part + 1) * n]  # [N / parts, K]
        cached = (key, pack_weight(weight))
        layer.__dict__[name] = cached
    return cached[1]


def transposed_weight(layer: nn.Linear):
    """layer.weight.t() [K, N], kept on the layer (a view: `torch.addmm` takes it without a per-call op)."""
    weight = layer.weight
    if torch.compiler.is_compiling() or (weight.requires_grad and torch.is_grad_enabled()):
        return weight.t()  # a compiled graph (no data_ptr there), or training: a view made now, in the graph
    key = (weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape))  # `.to()` swaps a parameter's data
    cached = layer.__dict__.get("weight_t")
    if cached is None or cached[0] != key:
        cached = (key, weight.t())
        layer.__dict__["weight_t"] = cached
    return cached[1]


def drop_packed_weights(model: nn.Module) -> None:
    """Free the packed copies (kept when the batch-invariant mode is switched off, so that switching back
    costs nothing; `Transformer.packed_linear = False` frees them unless that mode uses them)."""
    for module in model.modules():
        for name in [n for n in module.__dict__ if n.startswith("bi_packed")]:
            del module.__dict__[name]


# ------------------------------------------------------------------------------------------ linear kernels
# Every linear site of the forward (the q/k/v projection, the output projection and its residual add, the MLP,
# the head, a feature draft's fc) runs one kernel, chosen once by `linear_kernel`, `linear_add_kernel` or
# `gated_mlp_kernel` from the layer's weight format, device and dtype and the model's modes
# (`Transformer.choose_kernels`: at load, when a mode is set, when the model moves or changes dtype). A kernel is
# one of the functions below bound to its layer(s) (`functools.partial`); the forward calls it with the
# activations x [M, K] (the step's rows; training passes [B, T, K]) and the step's kernel backend, and nothing is
# decided per call but what the data decides: whether the packed path's row bound holds.


def plain_linear(layer: nn.Linear, x, backend: str | None = None):
    """`layer(x)` as `F.linear` (MKL picks its kernel by the row count: not batch-invariant)."""
    return F.linear(x, layer.weight, layer.bias)


def quantized_linear(layer: nn.Module, x, backend: str | None = None):
    """A quantized layer's own kernel (models/quant.py): each row on its own, batch-invariant as it is."""
    return layer(x, backend)


def invariant_linear(layer: nn.Linear, x, backend: str | None = None):
    """`bi_matmul.bi_linear`: a fixed summation order per row (on the CPU in float32, on the packed weight)."""
    return bi_linear(x, layer.weight, layer.bias, packed=packed_weight(layer), backend=backend)


def packed_linear(layer: nn.Linear, x, backend: str | None = None):
    """oneDNN on the packed weight for steps of up to PACKED_MAX_ROWS rows, else `plain_linear`."""
    if fits_packed(x):
        return _onednn(x, packed_weight(layer), layer.bias)
    return F.linear(x, layer.weight, layer.bias)


def addmm_linear_add(layer: nn.Linear, x, residual, backend: str | None = None):
    """residual + layer(x) in one op: `torch.addmm` on the transposed weight (float32, no bias; x [M, K])."""
    if x.dim() != 2:  # training's [B, T, K]
        return residual + F.linear(x, layer.weight)
    return torch.addmm(residual, x, transposed_weight(layer))  # [M, N]


def linear_then_add(linear, x, residual, backend: str | None = None):
    """residual + linear(x): the product, then the sum (float64 keeps HF's last bits so: see `linear_add_kernel`)."""
    return residual + linear(x, backend)


def linear_norm_add(linear, norm: nn.Module, x, residual, backend: str | None = None):
    """residual + norm(linear(x)): GLM-4's sublayer output, normed before the residual add."""
    return residual + norm(linear(x, backend))


def packed_linear_add(layer: nn.Linear, fallback, x, residual, backend: str | None = None):
    """residual + layer(x) as oneDNN's linear with a sum post-op on the packed weight, for steps of up to
    PACKED_MAX_ROWS rows; else `fallback` (the layer's unpacked kernel)."""
    if fits_packed(x):
        return _onednn(x, packed_weight(layer), layer.bias, residual, "add")
    return fallback(x, residual, backend)


def gate_and_up(linear, x, backend: str | None = None):
    """The fused gate/up projection's output [M, 2I] split into gate and up [M, I] (gate first)."""
    return linear(x, backend).chunk(2, dim=-1)


def separate_gate_and_up(gate, up, x, backend: str | None = None):
    """gate(x), up(x) from two projections (a model loaded unfused)."""
    return gate(x, backend), up(x, backend)


def gated_mlp(gate_up, down_add, silu, x, residual, backend: str | None = None):
    """residual + down(silu(gate(x)) * up(x)) from chosen kernels: gate_up(x) -> (gate, up), down_add(h, residual)."""
    gate, up = gate_up(x, backend)  # [M, I] each
    return down_add(silu(gate) * up, residual, backend)


def packed_gated_mlp(gate_up: nn.Linear, down: nn.Linear, fallback, x, residual, backend: str | None = None):
    """`gated_mlp` as three oneDNN ops on packed weights for steps of up to PACKED_MAX_ROWS rows: gate with a
    swish post-op, up with a product post-op, down with a sum post-op; else `fallback`."""
    if not fits_packed(x):
        return fallback(x, residual, backend)
    act = _onednn(x, packed_weight(gate_up, 0), None, attr="swish")  # [M, I] silu(gate)
    act = _onednn(x, packed_weight(gate_up, 1), None, act, "mul")  # [M, I] silu(gate) * up
    return _onednn(act, packed_weight(down), down.bias, residual, "add")  # [M, E]


def packs(layer: nn.Module) -> bool:
    """Whether the packed path can multiply this layer: a float32 weight on a CPU whose torch has oneDNN."""
    return (not isinstance(layer, QUANTIZED_LINEAR) and layer.weight.dtype == torch.float32
            and layer.weight.device.type == "cpu" and onednn_available())


def linear_kernel(layer: nn.Module, invariant: bool, packed: bool):
    """The kernel of y = layer(x): a callable (x [..., K], backend) -> [..., N]. A quantized layer runs its own
    kernel; else batch-invariant mode `invariant_linear`, `packed` (where the layer `packs`) `packed_linear`,
    otherwise `plain_linear`. Packs the weight now where the kernel reads it packed."""
    if isinstance(layer, QUANTIZED_LINEAR):
        return partial(quantized_linear, layer)
    if invariant:
        packed_weight(layer)
        return partial(invariant_linear, layer)
    if packed and packs(layer):
        packed_weight(layer)
        return partial(packed_linear, layer)
    return partial(plain_linear, layer)


def linear_add_kernel(layer: nn.Module, invariant: bool, packed: bool):
    """The kernel of residual + layer(x): a callable (x [M, K], residual [M, N], backend) -> [M, N]. One op where
    the path has one: `packed_linear_add` (packed; where the layer `packs`), `addmm_linear_add` (float32 without
    a bias); else the layer's `linear_kernel`, then the sum (float64 keeps the product, then the sum, so that its
    last bits are HF's: the float32 RMSNorm HF runs inside a float64 model would otherwise round some of them the
    other way)."""
    if invariant or isinstance(layer, QUANTIZED_LINEAR) or layer.bias is not None \
            or layer.weight.dtype != torch.float32:
        unpacked = partial(linear_then_add, linear_kernel(layer, invariant, False))
    else:
        unpacked = partial(addmm_linear_add, layer)
    if packed and not invariant and packs(layer):
        packed_weight(layer)
        return partial(packed_linear_add, layer, unpacked)
    return unpacked


def gated_mlp_kernel(gate_up: nn.Module, down: nn.Module, invariant: bool, packed: bool, silu):
    """The kernel of residual + down(silu(gate(x)) * up(x)) for the fused gate/up projection (gate first): a
    callable (x [M, E], residual [M, E], backend) -> [M, E]. Packed (both layers `pack`, no gate/up bias):
    `packed_gated_mlp`; else `gated_mlp` on the layers' own kernels. `silu`: `silu_kernel`'s."""
    unpacked = partial(gated_mlp, partial(gate_and_up, linear_kernel(gate_up, invariant, False)),
                       linear_add_kernel(down, invariant, False), silu)
    if packed and not invariant and packs(gate_up) and packs(down) and gate_up.bias is None:
        for part in (0, 1):
            packed_weight(gate_up, part)
        packed_weight(down)
        return partial(packed_gated_mlp, gate_up, down, unpacked)
    return unpacked


def fits_packed(x) -> bool:
    """Whether x [M, K] takes the packed path: an eager forward's step of 1..PACKED_MAX_ROWS rows."""
    return not torch.compiler.is_compiling() and x.numel() // x.shape[-1] <= PACKED_MAX_ROWS


def _onednn(x, weight, bias, other=None, attr: str = "none"):
    """oneDNN's linear on a packed weight, x [..., K] -> [..., N], with a unary post-op (`attr` "none",
    "swish") or, given `other` [..., N], a binary one ("add", "mul": the linear's output op `other`). Rows
    above PACKED_EXACT_ROWS are padded to a bucket (PACKED_ROW_STEP)."""
    flat = x.dim() == 2  # the forward's [M, K]: no reshapes
    rows = x.shape[0] if flat else x.numel() // x.shape[-1]
    x2 = x if flat else x.reshape(rows, x.shape[-1])  # [M, K]
    o2 = other if other is None or other.dim() == 2 else other.reshape(rows, other.shape[-1])  # [M, N]
    padded = packed_rows(rows)
    if padded != rows:
        x2 = F.pad(x2, (0, 0, 0, padded - rows))  # [M', K]: zero rows up to the bucket
        o2 = None if o2 is None else F.pad(o2, (0, 0, 0, padded - rows))  # [M', N]
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if o2 is None:
        out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, attr, [], "")  # [M', N]
    else:
        out = torch.ops.mkldnn._linear_pointwise.binary(x2, o2 if o2.is_contiguous() else o2.contiguous(), weight,
                                                        bias, attr)  # [M', N]
    if padded != rows:
        out = out[:rows]
    return out if flat else out.view(*x.shape[:-1], out.shape[-1])


def packed_rows(rows: int) -> int:
    """The row count the packed path runs `rows` (1..PACKED_MAX_ROWS) token rows as (see PACKED_ROW_STEP)."""
    return rows if rows <= PACKED_EXACT_ROWS else -(-rows // PACKED_ROW_STEP) * PACKED_ROW_STEP


def warm_packed(model) -> int:
    """Run every packed linear layer of `model` once at every row count the packed path uses, so that oneDNN's
    primitives exist before a long-lived engine serves (its memory then stays flat); returns the calls made.
    A no-op (0) for models without packed weights."""
    if not getattr(model, "packed_linear", False):
        return 0
    calls = 0
    buckets = sorted({packed_rows(m) for m in range(1, PACKED_MAX_ROWS + 1)})
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and packs(module):
                for rows in buckets:
                    packed_linear(module, module.weight.new_zeros(rows, module.in_features))
                    calls += 1
    return calls


def packing_pays(model, limit_bytes: int = PACKED_LINEAR_LIMIT_BYTES) -> bool:
    """Whether `packed_linear` is on by default for `model`: float32 on a CPU with oneDNN, and the packed
    copies of its linear weights (the memory it costs) at most `limit_bytes`."""
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.float32 or first.device.type != "cpu" or pack_weight(
            torch.zeros(8, 8)) is None:
        return False
    linear_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    return linear_bytes <= limit_bytes


def serial(q, width: int) -> bool:
    """Whether attention of q [B, H, T, D] over `width` key columns runs on one thread (SERIAL_ATTENTION_WORK)."""
    B, H, T, _ = q.shape
    # is_compiling first: torch.compile cannot trace get_num_threads (a compiled graph keeps the caller's threads)
    return (not torch.compiler.is_compiling() and B * H * T * width <= SERIAL_ATTENTION_WORK
            and q.device.type == "cpu" and torch.get_num_threads() > 1)


def sdpa(q, k, v, attn_bias, gqa: bool, causal: bool = False):
    """Ordinary attention of q [B, H, T, D] over k/v [B, H_kv, W, D] (the caches' first W columns): SDPA with
    the additive mask attn_bias [B, 1, T, W], or (attn_bias None) causal (`causal`: W = T, a prefill from
    column 0) or unmasked (every query sees all W columns: a one-token step of rows that all end at W). On a
    CPU with several threads, a call of at most SERIAL_ATTENTION_WORK (B H T W) runs on one (see there)."""
    mask = {"attn_mask": attn_bias} if attn_bias is not None else {"is_causal": causal}
    if serial(q, k.shape[2]):
        with one_thread():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **mask)  # [B, H, T, D]
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **mask)  # [B, H, T, D]


def float32_rms_norm(x, weight, eps: float, backend: str | None = None):
    """HF's RMSNorm in float32 as one op (`F.rms_norm` gives the chain's bits: tests/test_lean_forward.py)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(x, weight, eps: float, backend: str | None = None):
    """HF's RMSNorm in its order: normalise in float32, cast back to x's dtype, then scale by `weight` (bfloat16
    would differ from `float32_rms_norm`'s one op: the weight multiplies after the cast)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def invariant_rms_norm(ordinary, x, weight, eps: float, backend: str | None = None):
    """Batch-invariant RMSNorm: on the Triton backend `kernels.rmsnorm` (one program per row; torch's CUDA
    reductions choose their strategy by shape), elsewhere `ordinary` (the CPU's reductions are row by row:
    invariant as they are). `backend`: the step's (the cache's kernel backend)."""
    if choose_backend(x, backend) == "triton":
        return bi_rms_norm(x, weight, eps, backend="triton")
    return ordinary(x, weight, eps)


def rms_norm_kernel(invariant: bool, dtype: torch.dtype):
    """The RMSNorm of a model whose activations are `dtype`: a callable (x, weight, eps, backend) -> [..., E]."""
    ordinary = float32_rms_norm if dtype == torch.float32 else rms_norm
    return partial(invariant_rms_norm, ordinary) if invariant else ordinary


def rotate(x, cos, sin, perm):
    """RoPE of x [B, T, heads, D] as one formula for every layout: x * cos + x[..., perm] * sin, where the tables
    (`Transformer.rope_heads`) fold rotate-half's (or rotate-pairs') sign into `sin` and pass the dimensions and
    heads that are not rotated (partial rotary, V) through with cos 1 and sin 0. The same bits as HF's
    `x * cos + rotate_half(x) * sin` (a sign flip is exact; each product rounds once, then the sum)."""
    return x * cos + x.index_select(-1, perm) * sin  # [B, T, heads, D]


def invariant_silu(x):
    """SiLU as x / (1 + exp(-x)): every step rounds the same wherever the element sits (batch-invariant)."""
    return x / (1 + torch.exp(-x))


def silu_kernel(invariant: bool, device: torch.device, dtype: torch.dtype):
    """The SiLU of a model on `device` whose activations are `dtype`: `F.silu`, or in batch-invariant mode on a
    CPU `invariant_silu` (bfloat16's `F.silu` is invariant: SILU_INVARIANT_DTYPES)."""
    if not invariant or device.type == "cuda" or dtype in SILU_INVARIANT_DTYPES:
        return F.silu
    return invariant_silu


def attention(q, k_cache, v_cache, keys: RowKeys, backend: str | None = None):
    """Batch-invariant attention of q [B, H, T, D] over the cache (see `kernels.bi_attention`)."""
    _, kv_heads, capacity, _ = k_cache.shape
    shape = (q.shape[1] // kv_heads, kv_heads, capacity)  # (group, H_kv, C): the same for every layer
    plan = None
    if choose_backend(q, backend) == "torch":
        plan = keys.plans.get(shape)
        if plan is None:
            plan = keys.plans[shape] = chunk_plan(keys.mask, keys.first, *shape, workspace=keys.workspace)
    return bi_attention(q, k_cache, v_cache, keys.mask, keys.first, plan=plan, backend=backend)


def set_batch_invariant(model, on: bool) -> None:
    """Switch a model object into (or out of) batch-invariant mode; refuses objects without the mode."""
    if not hasattr(model, "batch_invariant"):
        raise ValueError(f"batch_invariant=True needs models with a `batch_invariant` attribute; "
                         f"{type(model).__name__} has none")
    model.batch_invariant = bool(on)
