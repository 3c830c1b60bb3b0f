"""Realignment for the left-padded (rectangular) layout: shift each row's cached columns by δ_i.

After a verification step rows have accepted different numbers of drafts, so their right edges differ.
EQSPEC restores invariant I6 (`start[i] + length[i]` equal for every row) by moving row i's valid columns
`[start[i], start[i] + count[i])` to `[start[i] + δ_i, ...)` in every layer of K and V, of the target and
the draft cache alike, and adding δ_i to `start[i]`. δ_i may be negative (shift left) so that the common
edge is the longest row, never more: the cache width stays bounded by the longest sequence.
"""
from __future__ import annotations

import torch

from .dispatch import check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

SLOTS = 4  # tensors moved per launch: K and V of two caches (target and draft)
TILE_ELEMS = 4096  # elements per [BLOCK_C, BLOCK_D] tile


def realign_reference(caches, start, count, delta) -> None:
    """caches: list of (k, v), each [L, B, H_kv, C, D]; start/count/delta: [B] int64. In place."""
    B = start.shape[0]
    new_start = start + delta  # [B]
    width = int(torch.maximum(start, new_start).add(count).max()) if B else 0
    if width == 0:
        return
    dest = torch.arange(width, device=start.device)[None, :].expand(B, width)  # [B, W] destination columns
    moved = (dest >= new_start[:, None]) & (dest < (new_start + count)[:, None])  # [B, W]
    source = torch.where(moved, dest - delta[:, None], dest)  # [B, W] identity where nothing moves
    for k, v in caches:
        L, _, H, _, D = k.shape
        index = source[None, :, None, :, None].expand(L, B, H, width, D)  # [L, B, H, W, D]
        k[:, :, :, :width] = k[:, :, :, :width].gather(3, index)
        v[:, :, :, :width] = v[:, :, :, :width].gather(3, index)


def realign_rows(caches, host_start: list[int], host_count: list[int], host_delta: list[int]) -> None:
    """The CPU path: one slice copy per moved row and tensor, of the live columns only (host lists of
    the row values; a row with delta 0 costs nothing). Same result as `realign_reference`."""
    for i, (s, n, d) in enumerate(zip(host_start, host_count, host_delta)):
        if d == 0 or n == 0:
            continue
        for k, v in caches:
            for t in (k, v):
                row = t[:, i]  # [L, H_kv, C, D] view
                src = row[:, :, s:s + n]
                # overlapping source and destination: copy through a temporary when they overlap
                row[:, :, s + d:s + d + n].copy_(src.clone() if abs(d) < n else src)


def realign(caches, start, count, delta, backend: str | None = None, host=None) -> None:
    """Validate and dispatch. Moves data only; the caller updates each cache's start/length.

    `host`: (start, count, delta) as host lists, when the caller knows them (the runtime does): the
    arguments are then validated without reading the device, and the torch backend copies row slices
    (`realign_rows`) instead of gathering every column (`realign_reference`, the test oracle)."""
    check(len(caches) >= 1, "realign: need at least one (k, v) pair")
    B = start.shape[0]
    check(start.shape == count.shape == delta.shape == (B,), "realign: start, count, delta must be [B]")
    check(all(t.dtype == torch.int64 for t in (start, count, delta)), "realign: start, count, delta must be int64")
    host_start, host_count, host_delta = host if host is not None else (start.tolist(), count.tolist(), delta.tolist())
    check(len(host_start) == len(host_count) == len(host_delta) == B, "realign: host lists must have B entries")
    for k, v in caches:
        check(k.shape == v.shape and k.dim() == 5 and k.shape[1] == B, "realign: each cache must be [L, B, H_kv, C, D] for K and V")
        C = k.shape[3]
        inside = all(min(s, s + d) >= 0 and max(s, s + d) + n <= C for s, n, d in zip(host_start, host_count, host_delta))
        check(inside, f"realign: a shifted row leaves the cache's {C} columns (or starts outside them)")
    if choose_backend(start, backend) == "triton":
        realign_triton(caches, start, count, delta)
    elif host is not None:
        realign_rows(caches, host_start, host_count, host_delta)
    else:
        realign_reference(caches, start, count, delta)


@lazy_jit
def _shift_stripe(
    src_ptr,  # [L, B, H_kv, C, D] (one tensor; only the stripe at `base` is touched)
    dst_ptr,  # [L, B, H_kv, C, D] same strides as src; == src_ptr when INPLACE
    base,  # int64 element offset of the (layer, row, head) stripe
    stride_c, stride_d,
    start, count, delta,  # int64 scalars of this row
    D,
    INPLACE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Move columns [start, start+count) of one stripe to [start+delta, ...), tile by tile.

    In place, tiles are visited from the destination's far end (right shifts from the right, left shifts
    from the left), so no tile reads a column an earlier tile wrote; inside a tile every lane loads before
    any lane stores (the barrier), so overlap within a tile (|delta| < BLOCK_C) is safe as well.
    """
    c = tl.arange(0, BLOCK_C)  # [BLOCK_C]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    new_start = start + delta
    new_end = new_start + count
    n_tiles = tl.cdiv(count, BLOCK_C)
    if INPLACE:
        n_tiles = tl.where(delta != 0, n_tiles, 0)  # nothing to do in place when delta == 0
    right = delta > 0
    for i in range(0, n_tiles):
        first = tl.where(right, new_end - (i + 1) * BLOCK_C, new_start + i * BLOCK_C)
        cols = first + c  # [BLOCK_C] destination columns
        m = ((cols >= new_start) & (cols < new_end))[:, None] & (d[None, :] < D)  # [BLOCK_C, BLOCK_D]
        x = tl.load(src_ptr + base + (cols - delta)[:, None] * stride_c + d[None, :] * stride_d, mask=m)
        if INPLACE:
            tl.debug_barrier()
        tl.store(dst_ptr + base + cols[:, None] * stride_c + d[None, :] * stride_d, x, mask=m)


@lazy_jit
def _slot(
    src_ptr,  # [L, B, H_kv, C, D]
    dst_ptr,  # [L, B, H_kv, C, D]
    stripe, b, start, count, delta,
    s_l, s_b, s_h, s_c, s_d, H, D,
    INPLACE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    layer = (stripe // H).to(tl.int64)
    head = (stripe % H).to(tl.int64)
    base = layer * s_l + b * s_b + head * s_h
    _shift_stripe(src_ptr, dst_ptr, base, s_c, s_d, start, count, delta, D, INPLACE, BLOCK_C, BLOCK_D)


@lazy_jit
def _realign_kernel(
    src0_ptr, dst0_ptr,  # [L0, B, H0, C0, D0] e.g. target K
    src1_ptr, dst1_ptr,  # [L1, B, H1, C1, D1] e.g. target V
    src2_ptr, dst2_ptr,  # [L2, B, H2, C2, D2] e.g. draft K
    src3_ptr, dst3_ptr,  # [L3, B, H3, C3, D3] e.g. draft V
    start_ptr,  # [B] int64
    count_ptr,  # [B] int64
    delta_ptr,  # [B] int64
    s0_l, s0_b, s0_h, s0_c, s0_d,
    s1_l, s1_b, s1_h, s1_c, s1_d,
    s2_l, s2_b, s2_h, s2_c, s2_d,
    s3_l, s3_b, s3_h, s3_c, s3_d,
    H0, D0, H1, D1, H2, D2, H3, D3,
    E0, E1, E2,  # cumulative stripe counts: slot s owns program ids [E_{s-1}, E_s), E_s += L_s * H_s
    NUM_SLOTS: tl.constexpr,
    INPLACE: tl.constexpr,
    BLOCK_C0: tl.constexpr, BLOCK_D0: tl.constexpr,
    BLOCK_C1: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_C2: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_C3: tl.constexpr, BLOCK_D3: tl.constexpr,
):
    """Grid (sum over slots of L*H_kv, B): one program per (tensor, layer, head) stripe of row b."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    start = tl.load(start_ptr + b)
    count = tl.load(count_ptr + b)
    delta = tl.load(delta_ptr + b)
    if pid < E0:
        _slot(src0_ptr, dst0_ptr, pid, b, start, count, delta, s0_l, s0_b, s0_h, s0_c, s0_d, H0, D0,
              INPLACE, BLOCK_C0, BLOCK_D0)
    else:
        if NUM_SLOTS > 1:
            if pid < E1:
                _slot(src1_ptr, dst1_ptr, pid - E0, b, start, count, delta, s1_l, s1_b, s1_h, s1_c, s1_d,
                      H1, D1, INPLACE, BLOCK_C1, BLOCK_D1)
            else:
                if NUM_SLOTS > 2:
                    if pid < E2:
                        _slot(src2_ptr, dst2_ptr, pid - E1, b, start, count, delta,
                              s2_l, s2_b, s2_h, s2_c, s2_d, H2, D2, INPLACE, BLOCK_C2, BLOCK_D2)
                    else:
                        if NUM_SLOTS > 3:
                            _slot(src3_ptr, dst3_ptr, pid - E2, b, start, count, delta,
                                  s3_l, s3_b, s3_h, s3_c, s3_d, H3, D3, INPLACE, BLOCK_C3, BLOCK_D3)


def _blocks(t: torch.Tensor, block_c: int | None):
    D, C = t.shape[4], t.shape[3]
    BLOCK_D = next_power_of_2(D)
    if block_c is None:
        block_c = min(next_power_of_2(C), max(1, TILE_ELEMS // BLOCK_D))
    return block_c, BLOCK_D


def _launch(srcs, dsts, start, count, delta, inplace: bool, block_c: int | None) -> None:
    """One launch over up to SLOTS tensors (srcs[i] -> dsts[i], same shape and strides)."""
    n = len(srcs)
    B = srcs[0].shape[1]
    pad = SLOTS - n
    srcs, dsts = list(srcs) + [srcs[0]] * pad, list(dsts) + [dsts[0]] * pad
    strides, dims, ends, meta = [], [], [], {}
    total = 0
    for i, t in enumerate(srcs):
        strides += list(t.stride())
        dims += [t.shape[2], t.shape[4]]
        if i < n:
            total += t.shape[0] * t.shape[2]
        ends.append(total)
        meta[f"BLOCK_C{i}"], meta[f"BLOCK_D{i}"] = _blocks(t, block_c)
    if total == 0:
        return
    pointers = [p for pair in zip(srcs, dsts) for p in pair]
    _realign_kernel[(total, B)](
        *pointers, start, count, delta, *strides, *dims, *ends[:3],
        NUM_SLOTS=n, INPLACE=inplace, **meta,
    )


def realign_triton(caches, start, count, delta, out=None, block_c: int | None = None) -> None:
    """Launch `_realign_kernel`: K and V of two caches per launch (one launch for target + draft).

    In place by default. `out` (a list of (k, v) shaped and strided like `caches`) selects the ping-pong
    variant kept for benchmarking: every row's columns [start, start+count) are written, shifted, into `out`
    (rows with delta 0 are copied too) and `caches` are only read. `block_c` overrides the column tile
    (tests use it to force many tiles on small caches).
    """
    B = start.shape[0]
    if B == 0:
        return
    srcs = [t for kv in caches for t in kv]
    dsts = srcs if out is None else [t for kv in out for t in kv]
    if len({t.data_ptr() for t in srcs}) != len(srcs):
        raise ValueError("realign: the same tensor appears twice in caches (it would be moved twice at once)")
    for s_, d_ in zip(srcs, dsts):
        if s_.shape != d_.shape or s_.stride() != d_.stride() or s_.dtype != d_.dtype:
            raise ValueError("realign: out tensors must match caches in shape, stride and dtype")
    start, count, delta = (x.contiguous() for x in (start, count, delta))
    for i in range(0, len(srcs), SLOTS):
        _launch(srcs[i:i + SLOTS], dsts[i:i + SLOTS], start, count, delta, out is None, block_c)
