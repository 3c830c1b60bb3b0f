"""KV append: scatter the K/V of T new tokens per row into one layer's cache at per-row columns.

In the ragged layout every row writes at its own columns (`start[i] + length[i] + j`); in the left-padded
layout the columns coincide for all rows, but the same scatter serves both.
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)


def kv_append_reference(k_cache, v_cache, k_new, v_new, columns) -> None:
    """k_cache/v_cache: [B, H_kv, C, D]; k_new/v_new: [B, H_kv, T, D]; columns: [B, T] int64."""
    index = columns[:, None, :, None].expand_as(k_new)  # [B, H_kv, T, D] the column of every element
    k_cache.scatter_(2, index, k_new)
    v_cache.scatter_(2, index, v_new)


def kv_append(k_cache, v_cache, k_new, v_new, columns, backend: str | None = None) -> None:
    """Validate and dispatch; writes in place. Inside torch.compile the checks are skipped (formatting a
    symbolic size into a message would pin it to one value and recompile for every batch size)."""
    if not torch.compiler.is_compiling():
        _validate(k_cache, v_cache, k_new, v_new, columns)
    if choose_backend(k_cache, backend) == "triton":
        kv_append_triton(k_cache, v_cache, k_new, v_new, columns)
    else:
        kv_append_reference(k_cache, v_cache, k_new, v_new, columns)


def _validate(k_cache, v_cache, k_new, v_new, columns) -> None:
    check(k_cache.shape == v_cache.shape and k_cache.dim() == 4, "kv_append: k_cache/v_cache must be [B, H_kv, C, D]")
    B, H, C, D = k_cache.shape
    T = columns.shape[1]
    check(k_new.shape == v_new.shape == (B, H, T, D), f"kv_append: k_new/v_new must be [{B}, {H}, {T}, {D}], got {tuple(k_new.shape)}")
    check(columns.shape == (B, T) and columns.dtype == torch.int64, "kv_append: columns must be [B, T] int64")
    check(k_new.dtype == k_cache.dtype, f"kv_append: k_new dtype {k_new.dtype} != cache dtype {k_cache.dtype}")
    check(v_new.dtype == v_cache.dtype == k_cache.dtype,
          f"kv_append: v_new/v_cache dtypes {v_new.dtype}/{v_cache.dtype} != k_cache dtype {k_cache.dtype}")


@lazy_jit
def _kv_append_kernel(
    k_cache_ptr,  # [B, H_kv, C, D]
    v_cache_ptr,  # [B, H_kv, C, D]
    k_new_ptr,  # [B, H_kv, T, D]
    v_new_ptr,  # [B, H_kv, T, D]
    col_ptr,  # [B, T] int64
    skc_b, skc_h, skc_c, skc_d,
    svc_b, svc_h, svc_c, svc_d,
    skn_b, skn_h, skn_t, skn_d,
    svn_b, svn_h, svn_t, svn_d,
    scol_b, scol_t,
    T, H, C, D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (row, token, tile of BLOCK_H heads): copies [BLOCK_H, D] of K and of V."""
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col = tl.load(col_ptr + b * scol_b + t * scol_t)  # int64 scalar
    # block-shaped on purpose: triton 3.9's interpreter mis-types `block_bool & scalar_bool` (int32 mask)
    cols = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + col
    # out-of-range columns are dropped, never written (the reference would wrap or raise)
    m = (h[:, None] < H) & (d[None, :] < D) & (cols >= 0) & (cols < C)  # [BLOCK_H, BLOCK_D]
    hh = h[:, None].to(tl.int64)
    dd = d[None, :]
    k = tl.load(k_new_ptr + b * skn_b + hh * skn_h + t * skn_t + dd * skn_d, mask=m)
    tl.store(k_cache_ptr + b * skc_b + hh * skc_h + col * skc_c + dd * skc_d, k, mask=m)
    v = tl.load(v_new_ptr + b * svn_b + hh * svn_h + t * svn_t + dd * svn_d, mask=m)
    tl.store(v_cache_ptr + b * svc_b + hh * svc_h + col * svc_c + dd * svc_d, v, mask=m)


def kv_append_triton(k_cache, v_cache, k_new, v_new, columns) -> None:
    """Launch `_kv_append_kernel`: grid (B * T, cdiv(H_kv, BLOCK_H)). Writes in place."""
    B, H, C, D = k_cache.shape
    T = columns.shape[1]
    if B == 0 or T == 0 or H == 0 or D == 0:
        return
    BLOCK_D = next_power_of_2(D)
    BLOCK_H = min(next_power_of_2(H), max(1, 4096 // BLOCK_D))
    grid = (B * T, cdiv(H, BLOCK_H))
    _kv_append_kernel[grid](
        k_cache, v_cache, k_new, v_new, columns,
        *k_cache.stride(), *v_cache.stride(), *k_new.stride(), *v_new.stride(), *columns.stride(),
        T, H, C, D,
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
    )
