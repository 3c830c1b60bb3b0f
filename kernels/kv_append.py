"""KV append: write the K and V of T new tokens per row into one layer's cache at per-row columns, one op.

A layer's cache is `kv` [2, B, H_kv, C, D] (K at 0, V at 1: a view of the model's `[L, 2, B, H_kv, C, D]`
cache); the new tokens' K and V come as one tensor `new` [B, T, 2 H_kv, D] (K heads, then V heads: how the
rotated q/k/v projection of the forward lays them out, a strided view of it). In the ragged layout every row
writes at its own columns (`start[i] + length[i] + j`); in the left-padded layout the columns coincide for
all rows; the same scatter serves both.

- torch reference (CPU): one `index_put_` with the indices of `write_index` (the forward computes them once
  for every layer).
- Triton (GPU): one program per (row, token, tile of heads), copying [BLOCK_H, D] of K or V; columns outside
  the cache are dropped, never written (the reference raises on them).
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)


def write_index(columns, kv_heads: int, constants: tuple | None = None) -> tuple:
    """The `index_put_` indices of a K/V write at columns [B, T]: (slot [1, 1, 2 H_kv], row [B, 1, 1],
    head [1, 1, 2 H_kv], column [B, T, 1]), broadcasting to [B, T, 2 H_kv] (the `new` tensor's first dims).
    `constants`: `write_constants(B, kv_heads, device)`, when the caller keeps them (one op per call then)."""
    B, T = columns.shape
    slot, row, head = constants if constants is not None else write_constants(B, kv_heads, columns.device)
    return slot, row, head, columns.view(B, T, 1)


def write_constants(rows: int, kv_heads: int, device) -> tuple:
    """The parts of `write_index` that depend on the shape alone: slot, row and head indices."""
    j = torch.arange(2 * kv_heads, device=device).view(1, 1, 2 * kv_heads)  # [1, 1, 2 H_kv]
    return j // kv_heads, torch.arange(rows, device=device).view(rows, 1, 1), j % kv_heads


def kv_append_reference(kv, new, columns, index=None) -> None:
    """kv: [2, B, H_kv, C, D]; new: [B, T, 2 H_kv, D]; columns: [B, T] int64. `index`: `write_index`'s."""
    kv.index_put_(write_index(columns, kv.shape[2]) if index is None else index, new)


def kv_append(kv, new, columns, backend: str | None = None, index=None) -> None:
    """Validate and dispatch; writes in place. `index`: `write_index(columns, H_kv)`, when the caller has it
    (the torch path then computes nothing). Inside torch.compile the checks are skipped (formatting a
    symbolic size into a message would pin it to one value and recompile for every batch size)."""
    if not torch.compiler.is_compiling():
        _validate(kv, new, columns)
    if choose_backend(kv, backend) == "triton":
        kv_append_triton(kv, new, columns)
    else:
        kv_append_reference(kv, new, columns, index)


def _validate(kv, new, columns) -> None:
    check(kv.dim() == 5 and kv.shape[0] == 2, "kv_append: kv must be [2, B, H_kv, C, D]")
    _, B, H, C, D = kv.shape
    check(columns.dim() == 2 and columns.shape[0] == B and columns.dtype == torch.int64,
          f"kv_append: columns must be [{B}, T] int64, got {tuple(columns.shape)} {columns.dtype}")
    T = columns.shape[1]
    check(new.shape == (B, T, 2 * H, D), f"kv_append: new must be [{B}, {T}, {2 * H}, {D}], got {tuple(new.shape)}")
    check(new.dtype == kv.dtype, f"kv_append: new dtype {new.dtype} != cache dtype {kv.dtype}")


@lazy_jit
def _kv_append_kernel(
    kv_ptr,  # [2, B, H_kv, C, D]
    new_ptr,  # [B, T, 2 H_kv, D]
    col_ptr,  # [B, T] int64
    s_slot, s_b, s_h, s_c, s_d,
    sn_b, sn_t, sn_h, sn_d,
    scol_b, scol_t,
    T, H, C, D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (row, token, K or V, tile of BLOCK_H heads): copies [BLOCK_H, D]."""
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    slot = tl.program_id(2).to(tl.int64)  # 0: K, 1: V
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col = tl.load(col_ptr + b * scol_b + t * scol_t)  # int64 scalar
    # block-shaped on purpose: triton 3.9's interpreter mis-types `block_bool & scalar_bool` (int32 mask)
    cols = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + col
    # out-of-range columns are dropped, never written (the reference would raise)
    m = (h[:, None] < H) & (d[None, :] < D) & (cols >= 0) & (cols < C)  # [BLOCK_H, BLOCK_D]
    hh = h[:, None].to(tl.int64)
    dd = d[None, :]
    x = tl.load(new_ptr + b * sn_b + t * sn_t + (slot * H + hh) * sn_h + dd * sn_d, mask=m)
    tl.store(kv_ptr + slot * s_slot + b * s_b + hh * s_h + col * s_c + dd * s_d, x, mask=m)


def kv_append_triton(kv, new, columns) -> None:
    """Launch `_kv_append_kernel`: grid (B * T, cdiv(H_kv, BLOCK_H), 2). Writes in place."""
    _, B, H, C, D = kv.shape
    T = columns.shape[1]
    if B == 0 or T == 0 or H == 0 or D == 0:
        return
    BLOCK_D = next_power_of_2(D)
    BLOCK_H = min(next_power_of_2(H), max(1, 4096 // BLOCK_D))
    grid = (B * T, cdiv(H, BLOCK_H), 2)
    _kv_append_kernel[grid](
        kv, new, columns,
        *kv.stride(), *new.stride(), *columns.stride(),
        T, H, C, D,
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
    )
