"""Positions, cache write columns and attention mask for one forward step, from (start, length).

Row i holds its logical token t at cache column `start[i] + t`; `length[i]` tokens are already cached.
A step feeds T new tokens per row, of which `num_new[i]` are real:

- ragged layout (right-padded input): token j of row i is logical index `length[i] + j`;
- left-padded layout (input left-padded, used for prefill): the real tokens are the last `num_new[i]`,
  so token j is logical index `length[i] + j - (T - num_new[i])`.

Token j is written at column `start[i] + index` and rotated at position `index` (clamped at 0 for
padding). Query (i, j) sees columns `start[i] .. col[i, j]` (invariant I3); a padding query whose
column lies left of `start[i]` sees only itself, so no softmax row is empty.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .dispatch import cdiv, check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)


@dataclass
class StepPlan:
    positions: torch.Tensor  # [B, T] int64, RoPE positions
    columns: torch.Tensor  # [B, T] int64, cache columns written
    mask: torch.Tensor | None  # [B, T, W] bool, True = may attend (None: not asked for)
    width: int  # W: columns 0..W-1 of the cache take part in attention
    num_new: torch.Tensor  # [B] int64, real tokens per row
    host_num_new: list[int] | None = None  # the same on the host (set by KVCache.plan)


def step_plan_reference(start, length, num_new, T: int, left_padded: bool, width: int, mask: bool = True):
    """Torch reference: returns (positions [B, T], columns [B, T], mask [B, T, W] or None without `mask`)."""
    j = torch.arange(T, device=start.device)  # [T]
    index = length[:, None] + j  # [B, T] logical index
    if left_padded:
        index = index - (T - num_new)[:, None]
    columns = start[:, None] + index  # [B, T]
    positions = index.clamp(min=0)  # [B, T]
    if not mask:
        return positions, columns, None
    c = torch.arange(width, device=start.device)  # [W]
    visible = (c[None, None, :] >= start[:, None, None]) & (c[None, None, :] <= columns[:, :, None])  # [B, T, W]
    mask = visible | (c[None, None, :] == columns[:, :, None])  # [B, T, W]
    return positions, columns, mask


def step_plan(start, length, T: int, num_new=None, left_padded: bool = False, backend: str | None = None,
              width: int | None = None, mask: bool = True) -> StepPlan:
    """Validate and dispatch. `start`, `length`, `num_new`: [B] int64 on the cache's device.

    `width`: the mask's W, known on the host by the caller (`KVCache.plan` keeps host copies of start and
    length); when None it is read from the device (one synchronisation: tools and tests only). `mask`
    False: positions and columns only (the plan's mask is None)."""
    B = start.shape[0]
    if num_new is None:
        num_new = torch.full((B,), T, dtype=torch.int64, device=start.device)
    check(start.dtype == torch.int64 and length.dtype == torch.int64, "step_plan: start/length must be int64")
    check(start.shape == length.shape == num_new.shape == (B,), "step_plan: start, length, num_new must be [B]")
    check(not num_new.is_floating_point() and num_new.dtype != torch.bool,
          "step_plan: num_new must be an integer tensor")
    check(T >= 1, f"step_plan: T must be >= 1, got {T}")
    if width is None:
        last = start + length + (num_new if left_padded else torch.full_like(num_new, T))  # [B] one past last column
        width = int(last.max()) if B else 0
    if choose_backend(start, backend) == "triton":
        positions, columns, visible = step_plan_triton(start, length, num_new, T, left_padded, width if mask else 0)
        visible = visible if mask else None
    else:
        positions, columns, visible = step_plan_reference(start, length, num_new, T, left_padded, width, mask)
    return StepPlan(positions, columns, visible, width, num_new)


@lazy_jit
def _step_plan_kernel(
    start_ptr,  # [B] int64
    length_ptr,  # [B] int64
    num_new_ptr,  # [B] int64
    pos_ptr,  # [B, T] int64, out
    col_ptr,  # [B, T] int64, out
    mask_ptr,  # [B, T, W] uint8 (a view of the bool mask), out
    stride_s, stride_l, stride_n,
    stride_pb, stride_pt,
    stride_cb, stride_ct,
    stride_mb, stride_mt, stride_mw,
    T, W,
    LEFT_PADDED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One program per (row, tile of BLOCK_T queries); loops over the W mask columns in BLOCK_W tiles."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] query index within the step
    jm = j < T
    s = tl.load(start_ptr + b * stride_s)  # int64 scalars
    n = tl.load(length_ptr + b * stride_l)
    if LEFT_PADDED:
        offset = T - tl.load(num_new_ptr + b * stride_n)
    else:
        offset = 0
    index = n + j - offset  # [BLOCK_T] logical index (negative for left padding)
    col = s + index  # [BLOCK_T] cache column written
    pos = tl.maximum(index, 0)
    tl.store(pos_ptr + b * stride_pb + j * stride_pt, pos, mask=jm)
    tl.store(col_ptr + b * stride_cb + j * stride_ct, col, mask=jm)
    row = mask_ptr + b * stride_mb + j[:, None] * stride_mt  # [BLOCK_T, 1]
    for w0 in range(0, W, BLOCK_W):
        c = w0 + tl.arange(0, BLOCK_W)  # [BLOCK_W]
        cc = c[None, :]
        visible = ((cc >= s) & (cc <= col[:, None])) | (cc == col[:, None])  # [BLOCK_T, BLOCK_W]
        tl.store(row + cc * stride_mw, visible.to(tl.uint8), mask=jm[:, None] & (cc < W))


def step_plan_triton(start, length, num_new, T: int, left_padded: bool, width: int):
    """Launch `_step_plan_kernel`; same outputs as `step_plan_reference`."""
    B = start.shape[0]
    device = start.device
    positions = torch.empty((B, T), dtype=torch.int64, device=device)
    columns = torch.empty((B, T), dtype=torch.int64, device=device)
    mask = torch.empty((B, T, width), dtype=torch.bool, device=device)
    if B == 0:
        return positions, columns, mask
    mask_u8 = mask.view(torch.uint8)
    num_new = num_new.to(device=device, dtype=torch.int64)
    BLOCK_T = min(next_power_of_2(T), 16)
    BLOCK_W = min(next_power_of_2(max(width, 1)), 256)
    grid = (B, cdiv(T, BLOCK_T))
    _step_plan_kernel[grid](
        start, length, num_new, positions, columns, mask_u8,
        start.stride(0), length.stride(0), num_new.stride(0),
        positions.stride(0), positions.stride(1),
        columns.stride(0), columns.stride(1),
        mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2),
        T, width,
        LEFT_PADDED=bool(left_padded), BLOCK_T=BLOCK_T, BLOCK_W=BLOCK_W,
    )
    return positions, columns, mask
