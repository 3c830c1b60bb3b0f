"""Batch-invariant numerics: the ops of the forward whose result for one token could depend on the rest of
the batch, and their replacements when a model's `batch_invariant` attribute is True.

A token's logits must be the same bits whether it is fed alone (AR, T = 1, B = 1), among k + 1 tokens of
a verify pass, in a batch of 8, at any row, after any left padding. Per op, on this project's CPU
(measured by `bench/batch_invariant.py --probe`, asserted by `tests/test_batch_invariant.py`):

| op | ordinary path | batch-invariant mode |
|---|---|---|
| linear (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, `lm_head`) | MKL picks a kernel by M = B*T: float32/float64 rows change with M | `kernels.bi_matmul.bi_linear`: rows padded to a multiple of 4, aligned (CPU); fixed tiles, no split-K (Triton) |
| attention | SDPA's blocks start at column 0 and depend on T: not invariant | `kernels.bi_attention.bi_attention`: chunks from each row's first key |
| SiLU | float32/float64: the vectorised and the scalar tail loop differ in the last bit, and where the tail falls depends on the tensor's size and thread split | `x / (1 + exp(-x))` (exp, +, / give the same bits wherever the element sits); bfloat16's `F.silu` is invariant (all 65536 inputs checked) and kept |
| RMSNorm, q/k norm | one row at a time, fixed order: invariant | unchanged |
| RoPE (`cos`/`sin` of float32 angles, mul/add) | invariant (vectorised `cos`/`sin` are used for every element) | unchanged |
| embedding, residual adds, K/V writes, realign | exact | unchanged |
| softmax / log-softmax over the vocabulary (sampling) | one row at a time: invariant | unchanged |

On CUDA, torch's own reductions (RMSNorm's mean) and elementwise kernels are not covered by these CPU
measurements; see docs/design.md ("Batch-invariant numerics") for what is and is not claimed there.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels.bi_attention import bi_attention, first_keys
from specdec.kernels.bi_matmul import bi_linear

SILU_INVARIANT_DTYPES = (torch.bfloat16,)  # torch's CPU F.silu gives the same bits for every element position


class RowKeys(NamedTuple):
    """What batch-invariant attention needs from a step's plan, computed once per forward."""

    mask: torch.Tensor  # [B, T, W] bool, True = may attend
    first: torch.Tensor  # [B] int64, each row's first key column


def row_keys(mask) -> RowKeys:
    return RowKeys(mask, first_keys(mask))


def linear(layer: nn.Linear, x, invariant: bool, backend: str | None = None):
    """`layer(x)`, or its batch-invariant equivalent (same weights, a fixed summation order per row)."""
    if not invariant:
        return layer(x)
    return bi_linear(x, layer.weight, layer.bias, backend=backend)


def silu(x, invariant: bool):
    """SiLU; in the mode with a formula whose every step rounds the same wherever the element sits."""
    if not invariant or x.is_cuda or x.dtype in SILU_INVARIANT_DTYPES:
        return F.silu(x)
    return x / (1 + torch.exp(-x))


def attention(q, k_cache, v_cache, keys: RowKeys, backend: str | None = None):
    """Batch-invariant attention of q [B, H, T, D] over the cache (see `kernels.bi_attention`)."""
    return bi_attention(q, k_cache, v_cache, keys.mask, keys.first, backend=backend)


def set_batch_invariant(model, on: bool) -> None:
    """Switch a model object into (or out of) batch-invariant mode; refuses objects without the mode."""
    if not hasattr(model, "batch_invariant"):
        raise ValueError(f"batch_invariant=True needs models with a `batch_invariant` attribute; "
                         f"{type(model).__name__} has none")
    model.batch_invariant = bool(on)
