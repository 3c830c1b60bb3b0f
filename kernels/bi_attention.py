"""Batch-invariant attention over a KV cache: a query's output depends only on the query and on its row's
visible keys, bit for bit, not on how many queries share the call (T), how many rows (B), the attention
width W, or how many padding columns lie before the row's first key (left-padded layout, realigned rows).

Every row's keys are reduced in fixed-size chunks of `CHUNK` columns that start at the row's *first key*
(`first[b]`, the first column its queries may see): chunk c always holds the row's logical tokens
`c * CHUNK .. (c + 1) * CHUNK - 1`, whatever the layout. Keys a query may not see (the causal future, other
padding, columns past W) enter as exact zeros (`exp(-inf) = 0`), and a chunk with no visible key leaves
every sum unchanged, so the extra chunks that a wider batch brings are no-ops. A query that sees no key
at all (left padding in a prefill: it only sees its own column, left of the row's first key) gets zeros.

- Triton (GPU): one program per (row, query head, query): the query's dot products with a `[CHUNK, D]`
  key tile, online softmax across chunks in order, `tl.sum` trees of fixed shape. No tile depends on T or
  B, no split over keys. Invariant by construction (and bit-exact under the interpreter too).
- torch reference (CPU; what runs on the CPU): the same chunks, two passes. Scores and chunk outputs are
  batched matmuls of fixed inner sizes (D and CHUNK) with the query rows padded to a multiple of 4
  (`bi_matmul.padded_rows`) and K^T as a transposed view (a batch of one matrix padded to two): measured
  invariant on this CPU, like bi_matmul's paths; the row maximum is exact in any order; `exp` is torch's
  vectorised one (the same per element wherever it sits); each chunk's sum has the fixed length CHUNK;
  chunks are added in order by `cumsum` (a sequential scan). Computed in float32 (float64 for float64),
  with a model's reusable buffers (`Workspace`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .bi_matmul import padded_rows
from .dispatch import cdiv, check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

CHUNK = 64  # keys reduced together; chunks start at each row's first key


def first_keys(mask):
    """mask [B, T, W] bool -> [B] int64: the first column row b's queries may see (the row's first key),
    read from its last query (always a real token in the left-padded layout; in the ragged one a padding
    query on the right sees from the same first key)."""
    return mask[:, -1].to(torch.uint8).argmax(dim=-1)  # [B]; argmax returns the first maximal index


def _accumulation_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class Workspace:
    """Reusable buffers for the torch reference's temporaries (the gathered K/V, the scores, the padded query
    rows). On the CPU, allocating and freeing megabyte temporaries in every layer costs more in page faults
    than the arithmetic (the allocator hands them back to the OS), so a model keeps one Workspace across its
    forwards. Buffers grow to the largest request and are never shrunk; each name has its own allocation (so
    each view starts at an aligned address). Not for concurrent use."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.views: dict[str, tuple] = {}  # name -> (request, view) of the last request

    def get(self, name: str, shape, dtype, device, layout=None) -> tuple[torch.Tensor, bool]:
        """A `shape` view of buffer `name`, and whether the request (shape, dtype, device, `layout`: what the
        caller keeps in it between calls, e.g. which rows stay zero) differs from the previous one."""
        request = (tuple(shape), dtype, device, layout)
        last = self.views.get(name)
        if last is not None and last[0] == request:
            return last[1], False
        n = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self.buffers[name] = torch.empty(n, dtype=dtype, device=device)
        view = buf[:n].view(shape)
        self.views[name] = (request, view)
        return view, True


class ChunkPlan(NamedTuple):
    """Which cache columns the torch reference reads, and what each padded query row may see; the same for
    every layer of a forward (`chunk_plan`)."""

    rows_index: torch.Tensor  # [B * H_kv * NC * chunk] row of the cache viewed as [B * H_kv * C, D] to read
    hidden: torch.Tensor  # [B, 1, NC, Rp, chunk] bool, query row g * T + t may NOT see the key (padding rows: all)
    chunks: int  # NC
    rows: int  # R = G * T real query rows per (row, KV head)
    workspace: Workspace | None = None  # None: fresh temporaries


def chunk_plan(mask, first, group: int, kv_heads: int, capacity: int, chunk: int = CHUNK,
               workspace: Workspace | None = None) -> ChunkPlan:
    """The reference's gather index and visibility for mask [B, T, W], first [B], `group` query heads per
    KV head and caches [B, kv_heads, capacity, D]."""
    B, T, W = mask.shape
    NC = max(1, cdiv(W, chunk))  # enough for any row (first >= 0); surplus chunks are no-ops
    R = group * T
    Rp = padded_rows(R)
    span = torch.arange(NC * chunk, device=mask.device)  # [NCW]
    index = first[:, None] + span[None, :]  # [B, NCW] cache column of the row's key c * chunk + j
    inside = index < W  # [B, NCW]
    index = index.clamp(max=max(W - 1, 0))
    visible = mask.gather(2, index[:, None, :].expand(B, T, NC * chunk)) & inside[:, None, :]  # [B, T, NCW]
    seen = torch.zeros(B, 1, NC, Rp, chunk, dtype=torch.bool, device=mask.device)
    seen[:, :, :, :R] = visible.view(B, 1, 1, T, NC, chunk).permute(0, 1, 4, 2, 3, 5).expand(
        B, 1, NC, group, T, chunk).reshape(B, 1, NC, R, chunk)  # row g * T + t sees what query t sees
    heads = torch.arange(B * kv_heads, device=mask.device).view(B, kv_heads, 1)  # [B, H_kv, 1] = b * H_kv + h
    rows_index = (heads * capacity + index[:, None, :]).reshape(-1)  # [B * H_kv * NCW]
    return ChunkPlan(rows_index, ~seen, NC, R, workspace)


def bi_attention_reference(q, k_cache, v_cache, mask, first, plan: ChunkPlan | None = None, chunk: int = CHUNK):
    """Torch reference; shapes as in `bi_attention`. Returns [B, H, T, D] in q's dtype."""
    B, H, T, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    G = H // Hkv  # query heads per KV head (head h reads KV head h // G)
    if plan is None:
        plan = chunk_plan(mask, first, G, Hkv, C, chunk)
    NC, R = plan.chunks, plan.rows
    Rp = plan.hidden.shape[3]
    Bt = B * Hkv * NC  # one [chunk]-key matmul per (row, KV head, chunk)
    acc = _accumulation_dtype(q.dtype)
    ws = plan.workspace

    def buffer(name, shape, dtype, layout=None):  # (view, new layout: padding not zeroed yet)
        if ws is None:
            return torch.zeros(shape, dtype=dtype, device=q.device), True
        return ws.get(name, shape, dtype, q.device, layout)

    Bm = max(Bt, 2)  # a batch of one matrix with a transposed operand takes another MKL path (measured): pad
    picked_k, new = buffer("picked_k", (Bm * chunk, D), k_cache.dtype, layout=Bt)  # rows' keys from their first
    if new and Bm > Bt:
        picked_k[Bt * chunk:] = 0
    torch.index_select(k_cache.reshape(B * Hkv * C, D), 0, plan.rows_index,
                       out=picked_k if Bm == Bt else picked_k[: Bt * chunk])
    picked_v, _ = buffer("picked_v", (Bt * chunk, D), v_cache.dtype)
    torch.index_select(v_cache.reshape(B * Hkv * C, D), 0, plan.rows_index, out=picked_v)
    keys, values = picked_k.view(Bm, chunk, D), picked_v.view(Bt, chunk, D)
    if keys.dtype != acc:
        keys = buffer("keys", (Bm, chunk, D), acc)[0].copy_(keys)  # [Bm, chunk, D]
        values = buffer("values", (Bt, chunk, D), acc)[0].copy_(values)  # [Bt, chunk, D]
    rows, new = buffer("rows", (Bm, Rp, D), acc, layout=(Bt, R))  # query rows, padded, once per chunk
    if new:  # rows R.. and matrices Bt.. stay zero for as long as this layout is reused
        rows.zero_()
    scaled = (q.to(acc) * (1.0 / math.sqrt(D))).reshape(B, Hkv, 1, R, D)  # row g*T+t: query head kv*G+g, query t
    rows[:Bt].view(B, Hkv, NC, Rp, D)[:, :, :, :R] = scaled
    scores, _ = buffer("scores", (Bm, Rp, chunk), acc)
    torch.bmm(rows, keys.transpose(1, 2), out=scores)  # [Bm, Rp, chunk]: K^T as a view, never copied
    scores = scores[:Bt].view(B, Hkv, NC, Rp, chunk).masked_fill_(plan.hidden, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # [B, H_kv, 1, Rp, 1] exact in any order
    top.clamp_(min=torch.finfo(acc).min)  # finite for rows with no visible key (their scores stay -inf)
    probs = scores.sub_(top).exp_()  # [B, H_kv, NC, Rp, chunk], in place of the scores; 0 where hidden
    sums = probs.sum(dim=-1)  # [B, H_kv, NC, Rp], one fixed-length sum per chunk
    parts, _ = buffer("parts", (Bt, Rp, D), acc)
    torch.bmm(probs.view(Bt, Rp, chunk), values, out=parts)  # [Bt, Rp, D]
    # chunks added in order (cumsum is a sequential scan: one fixed order for every row)
    total = sums.cumsum(dim=2)[:, :, -1]  # [B, H_kv, Rp]
    out = _last_prefix_sum(parts.view(B, Hkv, NC, Rp, D))  # [B, H_kv, Rp, D], fresh: not a buffer
    out = out / total[..., None].clamp_min(torch.finfo(acc).tiny)  # rows with no visible key: 0 / tiny = 0
    return out[:, :, :R].reshape(B, H, T, D).to(q.dtype)


def _last_prefix_sum(x):
    """`x.cumsum(dim=2)[:, :, -1]`, the same bits: on the CPU cumsum adds sequentially in double (its
    accumulation type for float32 and float64), which this left fold does without writing every prefix (4x
    faster for the attention's [B, H_kv, NC, Rp, D] parts at 2,000 keys). Elsewhere: cumsum itself."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.shape[2] < 2:
        return x.cumsum(dim=2)[:, :, -1]
    acc = x[:, :, 0].to(torch.float64)  # a copy
    for c in range(1, x.shape[2]):
        acc.add_(x[:, :, c])
    return acc.to(x.dtype)


def bi_attention(q, k_cache, v_cache, mask, first=None, plan: ChunkPlan | None = None, backend: str | None = None):
    """Validate and dispatch. q [B, H, T, D] (rotated); k_cache/v_cache [B, H_kv, C, D] (the step's K/V
    already written); mask [B, T, W] bool, True = may attend (W <= C); first [B] int64, each row's first
    key column (default: `first_keys(mask)`); plan: the torch path's `chunk_plan(mask, first, H // H_kv, H_kv, C)`,
    shared by a forward's layers (computed here when None). Returns [B, H, T, D] in q's dtype; scale
    1/sqrt(D)."""
    ok = (q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape and mask.dim() == 3
          and k_cache.shape[0] == q.shape[0] and k_cache.shape[3] == q.shape[3] and k_cache.shape[1] > 0
          and q.shape[1] % k_cache.shape[1] == 0 and q.dtype == k_cache.dtype == v_cache.dtype
          and q.dtype.is_floating_point and mask.dtype == torch.bool and mask.shape[:2] == q.shape[:1] + q.shape[2:3]
          and mask.shape[2] <= k_cache.shape[2] and (first is None or (first.shape == q.shape[:1]
                                                                      and first.dtype == torch.int64)))
    if not ok:
        _explain(q, k_cache, v_cache, mask, first)  # raises, naming what is wrong (hot path: no messages built)
    B, H, T, D = q.shape
    if first is None:
        first = first_keys(mask)
    if B == 0 or T == 0 or mask.shape[2] == 0:
        return q.new_zeros(q.shape)
    if choose_backend(q, backend) == "triton":
        return bi_attention_triton(q, k_cache, v_cache, mask, first)
    return bi_attention_reference(q, k_cache, v_cache, mask, first, plan)


def _explain(q, k_cache, v_cache, mask, first) -> None:
    check(q.dim() == 4 and k_cache.dim() == 4, "bi_attention: q must be [B, H, T, D] and k_cache [B, H_kv, C, D]")
    B, H, T, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    check(k_cache.shape == v_cache.shape and k_cache.shape[0] == B and k_cache.shape[3] == D,
          f"bi_attention: k_cache/v_cache must be [{B}, H_kv, C, {D}], got {tuple(k_cache.shape)} and "
          f"{tuple(v_cache.shape)}")
    check(Hkv > 0 and H % Hkv == 0, f"bi_attention: {H} query heads are not a multiple of {Hkv} KV heads")
    check(q.dtype == k_cache.dtype == v_cache.dtype and q.dtype.is_floating_point,
          f"bi_attention: q/k_cache/v_cache dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype} must be one float dtype")
    check(mask.dtype == torch.bool and mask.dim() == 3 and mask.shape[:2] == (B, T) and mask.shape[2] <= C,
          f"bi_attention: mask must be bool [{B}, {T}, W <= {C}], got {mask.dtype} {tuple(mask.shape)}")
    check(False, f"bi_attention: first must be [{B}] int64, got {tuple(first.shape)} {first.dtype}")


@lazy_jit
def _bi_attention_kernel(
    q_ptr,  # [B, H, T, D]
    k_ptr,  # [B, H_kv, C, D]
    v_ptr,  # [B, H_kv, C, D]
    mask_ptr,  # [B, T, W] uint8 (a view of the bool mask)
    first_ptr,  # [B] int64
    o_ptr,  # [B, H, T, D], out
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_c, sk_d,
    sv_b, sv_h, sv_c, sv_d,
    sm_b, sm_t, sm_w,
    so_b, so_h, so_t, so_d,
    H, GROUP, W, D, scale,
    ACC_F64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (row b, query head h, query t): online softmax over the row's keys in BLOCK_N-column
    chunks starting at first[b], in order; every reduction is a `tl.sum` over a fixed block shape."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    kv = h // GROUP
    if ACC_F64:
        acc_ty = tl.float64
        # a float argument arrives as float32: float64 computes 1/sqrt(D) itself (IEEE-rounded, as Python does)
        scale = 1.0 / tl.sqrt(tl.full([], D, tl.float64))  # float64 sqrt and division round to nearest
    else:
        acc_ty = tl.float32
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dm = d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + t * sq_t + d * sq_d, mask=dm, other=0.0).to(acc_ty) * scale  # [BLOCK_D]
    first = tl.load(first_ptr + b)  # int64 scalar
    m_i = tl.full([], float("-inf"), acc_ty)  # running maximum
    l_i = tl.zeros([], acc_ty)  # running sum of exp
    acc = tl.zeros([BLOCK_D], acc_ty)  # running weighted sum of values
    j = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    for c0 in range(first, W, BLOCK_N):
        cols = c0 + j  # [BLOCK_N] cache columns of this chunk
        cm = cols < W
        kv_mask = cm[:, None] & dm[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_ptr + b * sk_b + kv * sk_h + cols[:, None] * sk_c + d[None, :] * sk_d, mask=kv_mask,
                    other=0.0).to(acc_ty)  # [BLOCK_N, BLOCK_D]
        s = tl.sum(k * q[None, :], axis=1)  # [BLOCK_N]
        seen = tl.load(mask_ptr + b * sm_b + t * sm_t + cols * sm_w, mask=cm, other=0)  # [BLOCK_N] uint8
        s = tl.where(seen != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new).to(acc_ty)
        alpha = tl.exp(m_i - m_safe)  # 1 exactly when this chunk raised nothing (or was all masked)
        p = tl.exp(s - m_safe)  # [BLOCK_N], 0 where masked
        v = tl.load(v_ptr + b * sv_b + kv * sv_h + cols[:, None] * sv_c + d[None, :] * sv_d, mask=kv_mask,
                    other=0.0).to(acc_ty)  # [BLOCK_N, BLOCK_D]
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0).to(acc_ty)
    out = tl.where(l_i > 0, acc / safe_l, 0.0)  # [BLOCK_D]; a query that sees nothing gets zeros
    tl.store(o_ptr + b * so_b + h * so_h + t * so_t + d * so_d, out.to(o_ptr.dtype.element_ty), mask=dm)


def bi_attention_triton(q, k_cache, v_cache, mask, first, chunk: int = CHUNK):
    """Launch `_bi_attention_kernel`: grid (B * H, T). Same math as the reference (online instead of two
    passes, so not the same bits)."""
    B, H, T, D = q.shape
    Hkv = k_cache.shape[1]
    W = mask.shape[-1]
    out = torch.empty_like(q)
    mask_u8 = mask.view(torch.uint8)
    _bi_attention_kernel[(B * H, T)](
        q, k_cache, v_cache, mask_u8, first, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *mask_u8.stride(), *out.stride(),
        H, H // Hkv, W, D, 1.0 / math.sqrt(D),
        ACC_F64=q.dtype == torch.float64, BLOCK_N=chunk, BLOCK_D=next_power_of_2(max(D, 1)),
    )
    return out
