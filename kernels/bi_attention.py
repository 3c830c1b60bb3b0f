"""Batch-invariant attention over a KV cache: a query's output depends only on the query and on its row's
visible keys, bit for bit, not on how many queries share the call (T), how many rows (B), the attention
width W, or how many padding columns lie before the row's first key (left-padded layout, realigned rows).

Every row's keys are reduced in fixed-size chunks of `CHUNK` columns that start at the row's *first key*
(`first[b]`, the first column its queries may see): chunk c always holds the row's logical tokens
`c * CHUNK .. (c + 1) * CHUNK - 1`, whatever the layout. Keys a query may not see (the causal future, other
padding, columns past W) enter as exact zeros (`exp(-inf) = 0`), and a chunk with no visible key leaves
every sum unchanged, so the extra chunks that a wider batch brings are no-ops. A query that sees no key
at all (left padding in a prefill: it only sees its own column, left of the row's first key) gets zeros.

- Triton (GPU), flash-decoding with a fixed split size: a row's keys fall into splits of `SPLIT` columns
  (a multiple of CHUNK) that also start at the row's first key. One program per (row, KV head, split,
  block of `BLOCK_R` query rows): all query heads of the GQA group and all T queries of the row share each
  `[CHUNK, D]` K and V tile, scores and p @ V are `tl.dot`s of fixed shape ([BLOCK_R, D] x [D, CHUNK] and
  [BLOCK_R, CHUNK] x [CHUNK, D]: a query row's result does not depend on its place in the block), online
  softmax over the split's chunks in order. With one split (W <= SPLIT) the program writes the output;
  otherwise a combine kernel merges each query's splits in order, skipping splits it sees nothing of and
  taking the first it sees as is (so a query whose keys fit in one split gets the one-split bits whatever
  the number of splits). Nothing depends on T, B, W or the padding: invariant by construction.
- torch path (CPU; what runs on the CPU, `bi_attention_reference`): the same chunks, two passes. Scores and
  chunk outputs are batched matmuls of fixed inner sizes (D and CHUNK) with the query rows padded to a
  multiple of 4 (`bi_matmul.padded_rows`) and K^T as a transposed view (a batch of one matrix padded to two):
  measured invariant on this CPU, like bi_matmul's paths; the row maximum is exact in any order; `exp` is
  torch's vectorised one (the same per element wherever it sits); each chunk's sum has the fixed length CHUNK;
  chunks are added in order by `cumsum` (a sequential scan; for calls of 64+ query rows, a prefill's, the
  same additions as a left fold in double, `last_prefix_sum`: cumsum's own bits without writing every
  prefix). Computed in float32 (float64 for float64). The
  two batched matmuls are MKL's, which picks kernels by CPU and shape, so as with `bi_matmul` the first call
  per (dtype, thread count, D, chunk) measures whether a (matrix, row) keeps its bits alone and in calls of
  up to 128 matrices and 200 rows (`bmm_keeps_rows`; larger ones are split, `bounded_bmm`), and where it does
  not they run on one thread, or as calls of one fixed shape (`blocked_bmm`, `bmm_plan`).
  The lean step (issue 41; the same bits as the path it replaced, tests/test_bi_attention_lean.py): what
  depends only on the mask is done once per forward (`chunk_plan`: the visibility, and one host read of
  whether every row starts at column 0, whether a query sees no key, which chunks hide a key), every view
  of the buffers once per shape (`_Buffers`, kept by the model's `Workspace` across forwards) or per forward
  (`_Layout`), so that a layer runs 13-16 ops: one copy stages K and V (from the cache when every row starts
  at column 0, as in the ragged layout; else a gather from each row's first key, reading the cache's own
  storage), one op writes the scaled query rows (and casts), two `bmm`s, the mask on the chunks that hide a
  key only, one `amax`, `sub`, `exp`, `sum`, two `cumsum`s (with more than one chunk), `div`. Calls of more
  than 128 matrices stage and multiply a block of (row, KV head) groups at a time (`_blocks`).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .bi_matmul import BLOCK_ROWS, RowPlan, padded_rows
from .dispatch import cdiv, check, choose_backend, interpreting, lazy_jit, next_power_of_2, num_threads

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

CHUNK = 64  # keys reduced together; chunks start at each row's first key
# Larger batched matmuls are split into calls of at most this many matrices and rows (the largest probed)
BMM_MAX_MATRICES, BMM_MAX_ROWS = 128, 200
# (matrices, rows) of the calls `bmm_keeps_rows` compares with each (matrix, row) alone: a decode step of one
# row (1-2 matrices of 4 rows), verify passes, and a prefill of many prompts at once (exspec's pool prefill of
# 48 prompts: 96 matrices of 80 rows), and long prompts (200 rows)
BMM_PROBE = ((1, 4), (2, 4), (2, 20), (3, 12), (16, 20), (96, 80), (BMM_MAX_MATRICES, 8), (8, BMM_MAX_ROWS))


def _library_bmm(a, b, out):
    """The library's batched matmul (MKL's on the CPU): a [Bm, R, X] @ b [Bm, X, Y] into out [Bm, R, Y]."""
    return torch.bmm(a, b, out=out)


def blocked_bmm(a, b, out, rows: int = BLOCK_ROWS):
    """out[i] = a[i] @ b[i] by `torch.bmm` calls of one shape: 2 matrices of `rows` rows (zeros pad the rest),
    from staging buffers of b's layout (a transposed view stays a transposed view). a [Bm, R, X]; b [Bm, X, Y];
    out [Bm, R, Y]."""
    Bm, R, X = a.shape
    Y = b.shape[2]
    transposed = not b.is_contiguous() and b.transpose(1, 2).is_contiguous()
    store = b.new_zeros((2, Y, X) if transposed else (2, X, Y))  # [2, Y, X] or [2, X, Y]
    sb = store.transpose(1, 2) if transposed else store  # [2, X, Y]
    sa = a.new_zeros(2, rows, X)  # [2, rows, X]
    so = out.new_empty(2, rows, Y)  # [2, rows, Y]
    for i in range(0, Bm, 2):
        n = min(2, Bm - i)
        sb[:n] = b[i:i + n]
        sb[n:] = 0
        for r in range(0, R, rows):
            m = min(rows, R - r)
            sa.zero_()
            sa[:n, :m] = a[i:i + n, r:r + m]
            _library_bmm(sa, sb, so)
            out[i:i + n, r:r + m] = so[:n, :m]
    return out


def bounded_bmm(a, b, out):
    """`_library_bmm` in calls of at most BMM_MAX_MATRICES matrices of BMM_MAX_ROWS rows."""
    Bm, R, _ = a.shape
    if Bm <= BMM_MAX_MATRICES and R <= BMM_MAX_ROWS:
        return _library_bmm(a, b, out)
    for i in range(0, Bm, BMM_MAX_MATRICES):
        for r in range(0, R, BMM_MAX_ROWS):
            part = a[i:i + BMM_MAX_MATRICES, r:r + BMM_MAX_ROWS].contiguous()
            out[i:i + BMM_MAX_MATRICES, r:r + BMM_MAX_ROWS] = _library_bmm(
                part, b[i:i + BMM_MAX_MATRICES], part.new_empty(part.shape[0], part.shape[1], out.shape[2]))
    return out


def _bmm(plan: RowPlan, a, b, out):
    with num_threads(plan.threads):
        if plan.block is None:
            return bounded_bmm(a, b, out)
        return blocked_bmm(a, b, out, plan.block)


@functools.cache
def bmm_keeps_rows(dtype: torch.dtype, plan: RowPlan, inner: int, cols: int, transposed: bool) -> bool:
    """Whether `torch.bmm` run as `plan` gives a (matrix, row) of a [Bm, R, inner] @ [Bm, inner, cols] product
    (b a transposed view of [Bm, cols, inner] when `transposed`, as the scores' K^T is) the same bits in every
    BMM_PROBE call as in calls of 2 matrices of 20 rows (and those, for two matrices' first 20 rows, as in calls
    of 2 matrices of 4 rows: a decode step's); every row of every call compared. Measured once per process."""
    g = torch.Generator().manual_seed(0)
    most, longest = max(n for n, _ in BMM_PROBE), max(r for _, r in BMM_PROBE)
    A = torch.randn(most, longest, inner, generator=g).to(dtype)  # [most, longest, inner]
    Bs = torch.randn(most, *((cols, inner) if transposed else (inner, cols)), generator=g).to(dtype)

    def call(i, n, r0, R):  # matrices i..i+n-1, rows r0..r0+R-1, in one call -> [n, R, cols]
        bs = Bs[i:i + n].clone()
        return _bmm(plan, A[i:i + n, r0:r0 + R].clone(), bs.transpose(1, 2) if transposed else bs,
                    torch.empty(n, R, cols, dtype=dtype))

    @functools.cache
    def tile(i, j):  # matrices i, i+1 and rows j..j+19 in one call: the reference
        return call(i, 2, j, 20)

    def reference(n, R):  # [n, R, cols] from tiles
        return torch.cat([torch.cat([tile(i, j) for j in range(0, R, 20)], dim=1)
                          for i in range(0, n, 2)])[:n, :R]

    decode = torch.cat([call(0, 2, j, 4) for j in range(0, 20, 4)], dim=1)  # [2, 20, cols], calls of 4 rows
    if not torch.equal(decode, reference(2, 20)):
        return False
    for n, R in BMM_PROBE:
        if transposed and n == 1:  # never called so: the scores' batch is padded to two matrices
            continue
        if not torch.equal(call(0, n, 0, R), reference(n, R)):
            return False
    return True


@functools.cache
def bmm_plan(dtype: torch.dtype, threads: int, head_dim: int, chunk: int) -> RowPlan:
    """How the reference's two products run (the first plan under which both keep rows, as `bi_matmul.cpu_plan`):
    scores [Bm, Rp, D] @ K^T [Bm, D, chunk] and chunk outputs [Bt, Rp, chunk] @ V [Bt, chunk, D]."""
    candidates = [RowPlan(threads, None), RowPlan(1, None), RowPlan(threads, BLOCK_ROWS), RowPlan(1, BLOCK_ROWS)]
    for plan in dict.fromkeys(candidates):
        if bmm_keeps_rows(dtype, plan, head_dim, chunk, True) and bmm_keeps_rows(dtype, plan, chunk, head_dim, False):
            return plan
    return RowPlan(1, 1)


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
        self.owner = None  # the torch path's `_Layout` whose zeros the buffers hold now
        self.kept: dict = {}  # the torch path's `_Buffers` by shape, views of these buffers (at most KEPT_SHAPES)

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
    """What the torch path needs from the mask, the same for every layer of a forward (`chunk_plan`)."""

    hidden: torch.Tensor  # [B, 1, NC, Rp or 1, chunk] bool: query row g * T + t may NOT see the row's key
    #                       c * chunk + j (padding rows see every key; with T = 1 one row stands for all)
    chunks: int  # NC
    rows: int  # R = G * T real query rows per (row, KV head)
    workspace: Workspace | None = None  # the buffers (one of the plan's own when the caller has none)
    first: torch.Tensor | None = None  # [B] each row's first key column
    width: int = 0  # W, the mask's columns
    from_zero: bool = False  # every row's first key is column 0: chunk c is columns c * chunk.. of the cache
    blind: bool = True  # some real query sees no key (its maximum and its total need the clamps)
    masked_from: int = 0  # the first chunk where some query row may not see some key (NC: none, no masking)
    layouts: dict | None = None  # (D, accumulation dtype, device, chunk) -> the forward's `_Layout`


def chunk_plan(mask, first, group: int, kv_heads: int, capacity: int, chunk: int = CHUNK,
               workspace: Workspace | None = None) -> ChunkPlan:
    """The torch path's per-forward work for mask [B, T, W], first [B], `group` query heads per KV head and
    caches [B, kv_heads, capacity, D]: the visibility of every padded query row in its row's chunks and, on
    the CPU (one host read), whether every first key is column 0, whether a real query sees no key, and the
    first chunk that hides a key from a query row."""
    B, T, W = mask.shape
    NC = max(1, cdiv(W, chunk))  # enough for any row (first >= 0); surplus chunks are no-ops
    NCW = NC * chunk
    R = group * T
    span = torch.arange(NCW, device=mask.device)  # [NCW]
    columns = first[:, None] + span  # [B, NCW] column of the row's key c * chunk + j (past W: hidden)
    blocked = ~F.pad(mask, (0, NCW)).gather(2, columns[:, None, :].expand(B, T, NCW))  # [B, T, NCW]
    if T == 1:  # every query row of a (row, KV head) sees what the row's one query sees
        hidden = blocked.view(B, 1, NC, 1, chunk)
    else:
        Rp = padded_rows(R)
        hidden = torch.zeros(B, 1, NC, Rp, chunk, dtype=torch.bool, device=mask.device)  # padding rows: none
        hidden[:, :, :, :R].view(B, 1, NC, group, T, chunk).copy_(
            blocked.view(B, 1, T, NC, chunk).transpose(2, 3)[:, :, :, None])  # row g * T + t: query t's
    from_zero, blind, masked_from = False, True, 0
    if mask.device.type == "cpu" and not torch.compiler.is_compiling():  # one host read: free on the CPU
        facts = torch.cat([blocked.view(B * T, NC, chunk).any(dim=2).any(dim=0), blocked.all(dim=2).any().view(1),
                           first.any().view(1)]).tolist()
        masked_from = next((c for c in range(NC) if facts[c]), NC)  # chunks before it hide nothing
        blind, from_zero = facts[NC], not facts[NC + 1]
    return ChunkPlan(hidden, NC, R, workspace if workspace is not None else Workspace(), first, W, from_zero,
                     blind, masked_from, {})


def _kv_pair(k_cache, v_cache, W: int):
    """k_cache/v_cache [B, H_kv, C, D] as one view [2, B, H_kv, W, D] of their first W columns, when they are
    two views of one tensor of the same strides with V after K (the model's layer cache [2, B, H_kv, C, D]:
    one copy then stages both); else None."""
    base = k_cache._base  # views of one tensor share its storage
    if base is None or base is not v_cache._base or k_cache.stride() != v_cache.stride():
        return None
    apart = v_cache.storage_offset() - k_cache.storage_offset()
    if apart <= 0:
        return None
    B, Hkv, _, D = k_cache.shape
    return k_cache.as_strided((2, B, Hkv, W, D), (apart, *k_cache.stride()))


ALIGN_BYTES = 64  # the staged V starts at a multiple of this (as a buffer of its own would: the allocator's)
KEPT_SHAPES = 4  # `_Buffers` a workspace keeps (decode and verify steps of a few batch sizes and context chunks)
STAGE_MATRICES = BMM_MAX_MATRICES  # calls of more [chunk, D] matrices stage them a block of groups at a time


def _blocks(groups: int, NC: int) -> list[tuple[int, int]]:
    """The (row, KV head) groups [g0, g1) whose keys are staged and multiplied together: all of them when their
    groups * NC matrices fit one call of BMM_MAX_MATRICES, else blocks of as many whole groups as fit (a
    block's staged keys then stay in the CPU's caches between the copy and the product: staging a whole batch
    of long rows at once went to memory three times). Never a block of one matrix: a batch of one transposed
    matrix takes another MKL path (measured)."""
    if groups * NC <= STAGE_MATRICES:
        return [(0, groups)]
    per = max(1, STAGE_MATRICES // NC)
    blocks = [(g, min(g + per, groups)) for g in range(0, groups, per)]
    if (blocks[-1][1] - blocks[-1][0]) * NC == 1:  # (NC == 1) the last block takes a group of the one before
        (a, b), (_, d) = blocks[-2], blocks[-1]
        blocks[-2:] = [(a, b - 1), (b - 1, d)]
    return blocks


FOLD_MIN_ROWS = 64  # padded query rows from which the chunks' outputs are folded, not scanned (prefills)


def folds(device, acc, Rp: int) -> bool:
    """Whether `last_prefix_sum` replaces the cumsum of the chunks' outputs: on the CPU, where cumsum of
    float32/float64 accumulates in double, and for calls with many query rows (a prefill's: at a decode
    step's few rows one cumsum costs less than a loop of NC adds)."""
    return torch.device(device).type == "cpu" and acc in (torch.float32, torch.float64) and Rp >= FOLD_MIN_ROWS


def last_prefix_sum(parts, acc64, out) -> None:
    """out = parts.cumsum(dim=2)[:, :, -1] in the same bits, without writing every prefix: parts [B, H_kv, NC,
    Rp, D] (float32/float64, CPU), acc64 [B, H_kv, Rp, D] float64, out [B, H_kv, Rp, D]. The CPU cumsum of
    these dtypes adds sequentially in double and rounds each prefix; this left fold does the same additions in
    the same order and rounds the last (a 200-token prefill over 2,000 cached tokens: cumsum was a third of
    the int4 forward)."""
    acc64.copy_(parts[:, :, 0])
    for c in range(1, parts.shape[2]):
        acc64.add_(parts[:, :, c])
    out.copy_(acc64)


class _Buffers:
    """The torch path's buffers for one (B, H_kv, T, NC, D, dtype, chunk) and every view of them a layer uses
    (made once: a layer then runs no view ops of its own), kept by the workspace across forwards.

    Staged keys and values of one block of groups (`_blocks`; usually all of them): one buffer, K's matrices
    [chunk, D] (at least two) then, at a 64-byte aligned row, V's; group slot s holds matrices s * NC ..
    (s + 1) * NC - 1, matrix c the group's keys c * chunk .. (c + 1) * chunk - 1. The padding matrix, the gap
    before V and the padding query rows are zeroed when the buffers are taken (`_layout`): they only reach
    results that are dropped (a product's rows and matrices are computed apart), so zeros are not for the bits
    but to keep NaN and subnormal junk out of the arithmetic. The zeros the bits need are the columns past W
    (`_Layout.tail`): their probabilities are exact zeros, and 0 * NaN would not be."""

    NAMES = ("bi_kv", "bi_rows", "bi_scores", "bi_top", "bi_sums", "bi_parts", "bi_added", "bi_totals", "bi_fold",
             "bi_folded")

    def __init__(self, ws: Workspace, B, Hkv, T, NC, R, D, acc, device, chunk):
        Rp = padded_rows(R)
        G = R // T
        Bt = B * Hkv * NC  # one [chunk]-key matmul per (row, KV head, chunk)
        self.blocks = _blocks(B * Hkv, NC)
        slots = max(g1 - g0 for g0, g1 in self.blocks)  # groups staged at once
        Bs = slots * NC
        Bm = max(Bs, 2)  # a batch of one matrix with a transposed operand takes another MKL path (measured): pad
        per_row = ALIGN_BYTES // math.gcd(ALIGN_BYTES, D * torch.finfo(acc).bits // 8)  # rows per aligned step
        v_row = cdiv(Bm * chunk, per_row) * per_row  # V's first row: 64-byte aligned
        self.shape = (B, Hkv, NC, chunk, D, Bt, slots, v_row)
        self.staged = staged = ws.get("bi_kv", (v_row + Bs * chunk, D), acc, device)[0]  # [rows, D]
        keys_t = staged[: Bm * chunk].view(Bm, chunk, D).transpose(1, 2)  # [Bm, D, chunk] K^T, a view
        values = staged[v_row:].view(Bs, chunk, D)  # [Bs, chunk, D]
        self.gap = staged[Bs * chunk: v_row]  # K's padding matrix and the gap before V
        Mt = max(Bt, 2)
        self.rows = ws.get("bi_rows", (Mt, Rp, D), acc, device)[0]  # query rows, padded, once per chunk
        self.rows_dest = self.rows[:Bt].view(B, Hkv, NC, Rp, D)[:, :, :, :R].view(B, Hkv, NC, G, T, D)
        self.scale = torch.full((1, 1, NC, 1, 1, 1), 1.0 / math.sqrt(D), dtype=acc, device=device)
        self.scores = ws.get("bi_scores", (Mt, Rp, chunk), acc, device)[0]  # [Mt, Rp, chunk]
        self.scores5 = self.scores[:Bt].view(B, Hkv, NC, Rp, chunk)
        self.top = ws.get("bi_top", (B, Hkv, 1, Rp, 1), acc, device)[0]  # [B, H_kv, 1, Rp, 1] row maxima
        self.sums = ws.get("bi_sums", (B, Hkv, NC, Rp), acc, device)[0]  # one fixed-length sum per chunk
        self.parts = ws.get("bi_parts", (Bt, Rp, D), acc, device)[0]  # [Bt, Rp, D]
        self.parts5 = self.parts.view(B, Hkv, NC, Rp, D)
        self.fold = None
        if NC > 1:  # chunks added in order (cumsum is a sequential scan)
            self.totals = ws.get("bi_totals", (B, Hkv, NC, Rp), acc, device)[0]
            self.den = self.totals[:, :, -1, :R, None]  # [B, H_kv, R, 1]
            if folds(device, acc, Rp):  # many query rows: the last prefix alone, in cumsum's own bits
                self.fold = ws.get("bi_fold", (B, Hkv, Rp, D), torch.float64, device)[0]  # [B, H_kv, Rp, D]
                self.folded = ws.get("bi_folded", (B, Hkv, Rp, D), acc, device)[0]
                self.num = self.folded[:, :, :R]  # [B, H_kv, R, D]
            else:
                self.added = ws.get("bi_added", (B, Hkv, NC, Rp, D), acc, device)[0]
                self.num = self.added[:, :, -1, :R]  # [B, H_kv, R, D]
        else:  # one chunk: its sums are the totals
            self.num, self.den = self.parts5[:, :, 0, :R], self.sums[:, :, 0, :R, None]
        # per block: the scores' product (query rows, K^T, scores: two matrices at least) and p @ V's
        self.products = []
        for g0, g1 in self.blocks:
            m0, n = g0 * NC, (g1 - g0) * NC
            nk = max(n, 2)
            self.products.append(((self.rows[m0:m0 + nk], keys_t[:nk], self.scores[m0:m0 + nk]),
                                  (self.scores[m0:m0 + n], values[:n], self.parts[m0:m0 + n])))
        self.held = {name: ws.buffers[name] for name in self.NAMES if name in ws.buffers}

    def current(self, ws: Workspace) -> bool:
        """Whether every buffer is still the workspace's (none was grown into a new one since)."""
        return all(ws.buffers.get(name) is buf for name, buf in self.held.items())


def _flat_rows(k_cache, v_cache, pair):
    """(rows per unit of k's (B, H_kv) strides, V's first row after K's) when the caches' rows of D can be read as
    rows of one [N, D] view from K's start: unit column and D-element row strides, and V a view of the same
    tensor (`pair`) at a whole number of rows; else None."""
    D = k_cache.shape[3]
    sb, sh, sc, sd = k_cache.stride()
    if pair is None or sd != 1 or sc != D or sb % D or sh % D:
        return None
    apart = pair.stride(0)
    return None if apart % D else (sb // D, sh // D, apart // D)


class _Layout:
    """A forward's way of staging K and V into `_Buffers` (it depends on W, the rows' first keys and the
    caches' strides), and its masked chunks:

    - every row from column 0 (`from_zero`): one strided copy per block (K and V at once with one block) puts
      the cache's first W columns into their chunks; the columns past W (`tail`) stay zero;
    - else a gather from each row's first key (`index_select`; the columns past W read column W - 1, hidden),
      from the caches themselves read as rows [N, D] (then cast) when their strides allow, or from a copy of
      their first W columns (`stage`, with a zero row for the padding)."""

    def __init__(self, plan: ChunkPlan, buffers: _Buffers, acc, device, k_cache, v_cache, pair):
        B, Hkv, NC, chunk, D, Bt, slots, v_row = buffers.shape
        W, NCW, ws, groups = plan.width, NC * chunk, plan.workspace, B * Hkv
        self.buffers, self.plan = buffers, plan
        self.strides = (k_cache.stride(), v_cache.stride(), None if pair is None else pair.stride(0))
        self.masked = buffers.scores5[:, :, plan.masked_from:] if plan.masked_from < NC else None
        self.hidden = plan.hidden[:, :, plan.masked_from:]
        staged = buffers.staged
        off = staged.storage_offset()
        single = len(buffers.blocks) == 1
        flat = _flat_rows(k_cache, v_cache, pair)
        self.from_zero = plan.from_zero and (single or k_cache.stride(0) == Hkv * k_cache.stride(1))
        self.tail = self.stage = self.index = self.raw = None
        if self.from_zero:  # (group slot, column) -> staged row slot * NCW + column
            strides = (v_row * D, NCW * D, D, 1)
            if NCW > W:  # columns W .. NCW - 1 of every (K/V, group slot)
                self.tail = staged.as_strided((2, slots, NCW - W, D), strides, off + W * D)
            if single:
                self.dest = staged.as_strided((2, B, Hkv, W, D), (v_row * D, Hkv * NCW * D, NCW * D, D, 1))
            else:  # block of s groups: K's and V's destinations
                self.dests = {s: (staged.as_strided((s, W, D), strides[1:], off),
                                  staged.as_strided((s, W, D), strides[1:], off + v_row * D))
                              for s in {g1 - g0 for g0, g1 in buffers.blocks}}
            return
        columns = (plan.first[:, None] + torch.arange(NCW, device=device)).clamp_(max=W - 1)  # [B, NCW]
        if flat is not None:  # rows of the caches' own storage, from K's first element
            per_b, per_h, v_shift = flat
            heads = (torch.arange(B, device=device) * per_b)[:, None] + torch.arange(Hkv, device=device) * per_h
            keys = (heads[:, :, None] + columns[:, None, :]).view(groups, NCW)  # [groups, NCW]
            self.rows_needed = v_shift + int((B - 1) * per_b + (Hkv - 1) * per_h + W)
            if k_cache.dtype != acc:  # gathered in the cache's dtype, then cast into the staged buffer
                self.raw = ws.get("bi_kv_raw", tuple(staged.shape), k_cache.dtype, device)[0]
        else:  # a copy of the first W columns, [2, B, H_kv, W, D] rows, and a zero row after them
            v_shift = groups * W
            self.stage = ws.get("bi_stage", (2 * groups * W + 1, D), acc, device)[0]
            self.stage_dest = self.stage[:-1].view(2, B, Hkv, W, D)
            keys = (torch.arange(groups, device=device)[:, None] * W + columns.repeat_interleave(Hkv, 0))
        pad = 0 if flat is not None else 2 * groups * W  # a row for the padding matrix and the gap
        if single:
            self.index = torch.cat([keys.view(-1), torch.full((v_row - Bt * chunk,), pad, device=device),
                                    keys.view(-1) + v_shift])  # [v_row + Bt chunk]: K, padding and gap, V
            self.out = staged[: v_row + Bt * chunk] if self.raw is None else self.raw[: v_row + Bt * chunk]
        else:
            self.index = [(keys[g0:g1].reshape(-1), keys[g0:g1].reshape(-1) + v_shift) for g0, g1 in buffers.blocks]
            target = staged if self.raw is None else self.raw
            self.outs = {s: (target[: s * NCW], target[v_row: v_row + s * NCW])
                         for s in {g1 - g0 for g0, g1 in buffers.blocks}}
            self.casts = {s: (staged[: s * NCW], staged[v_row: v_row + s * NCW])
                          for s in {g1 - g0 for g0, g1 in buffers.blocks}}

    def matches(self, k_cache, v_cache, pair) -> bool:
        return self.strides == (k_cache.stride(), v_cache.stride(), None if pair is None else pair.stride(0))

    def source(self, k_cache, v_cache, pair):
        """What the gather reads this call: the caches as rows [N, D], or the copy of their first W columns."""
        if self.stage is None:
            return k_cache.as_strided((self.rows_needed, k_cache.shape[3]), (k_cache.shape[3], 1))
        if pair is not None:
            self.stage_dest.copy_(pair)
        else:
            W = self.plan.width
            self.stage_dest[0].copy_(k_cache[:, :, :W])
            self.stage_dest[1].copy_(v_cache[:, :, :W])
        return self.stage

    def stage_all(self, k_cache, v_cache, pair):
        """One block: K and V of every group into the staged buffer."""
        if self.from_zero:
            if pair is not None:
                self.dest.copy_(pair)  # K and V of every row, cast to the accumulation dtype
            else:
                W = self.plan.width
                self.dest[0].copy_(k_cache[:, :, :W])
                self.dest[1].copy_(v_cache[:, :, :W])
            return
        torch.index_select(self.source(k_cache, v_cache, pair), 0, self.index, out=self.out)
        if self.raw is not None:
            self.buffers.staged[: self.out.shape[0]].copy_(self.out)

    def stage_block(self, source, cache, i: int, which: int):
        """Block i's K (which 0) or V (1) into the staged buffer: from `cache` (from_zero) or `source` (gather)."""
        g0, g1 = self.buffers.blocks[i]
        if self.from_zero:
            sb, sh, sc, sd = cache.stride()
            part = cache.as_strided((g1 - g0, self.plan.width, cache.shape[3]), (sh, sc, sd),
                                    cache.storage_offset() + g0 * sh)  # [s, W, D] of groups g0 .. g1 - 1
            self.dests[g1 - g0][which].copy_(part)
            return
        out = self.outs[g1 - g0][which]
        torch.index_select(source, 0, self.index[i][which], out=out)
        if self.raw is not None:
            self.casts[g1 - g0][which].copy_(out)


def _layout(plan: ChunkPlan, B, Hkv, T, D, acc, device, chunk, k_cache, v_cache, pair) -> _Layout:
    """The plan's layout, with the workspace taken for it: the `_Buffers` of this shape (kept by the workspace,
    made again when another shape grew one of its buffers), zeroed where they must be zero unless the
    workspace's last user had the same ones (nothing writes there), and the layout's own zeros (the columns
    past W, or the staging copy's zero row) each time the workspace changes hands."""
    ws = plan.workspace
    key = (B, Hkv, T, plan.chunks, D, acc, device, chunk)
    kept = ws.kept
    buffers = kept.get(key)
    if buffers is None or not buffers.current(ws):
        for old in [k for k, b in kept.items() if not b.current(ws)]:  # views of buffers grown since: let go
            del kept[old]
        while len(kept) >= KEPT_SHAPES:
            kept.pop(next(iter(kept)))
        buffers = kept[key] = _Buffers(ws, B, Hkv, T, plan.chunks, plan.rows, D, acc, device, chunk)
    lay = plan.layouts.get((D, acc, device, chunk))
    if lay is None or lay.buffers is not buffers or not lay.matches(k_cache, v_cache, pair):
        lay = plan.layouts[(D, acc, device, chunk)] = _Layout(plan, buffers, acc, device, k_cache, v_cache, pair)
    if getattr(ws.owner, "buffers", None) is not buffers:  # another shape (or nothing) used the buffers last
        buffers.rows.zero_()
        buffers.gap.zero_()
    if lay.tail is not None:
        lay.tail.zero_()
    if lay.stage is not None:
        lay.stage[-1].zero_()
    ws.owner = lay
    return lay


def bi_attention_reference(q, k_cache, v_cache, mask, first, plan: ChunkPlan | None = None, chunk: int = CHUNK):
    """Torch path (what runs on the CPU); shapes as in `bi_attention`. Returns [B, H, T, D] in q's dtype.

    Per layer, with the views made once (`_Buffers`, `_Layout`): stage the keys and values (a strided copy from
    the cache when every row starts at column 0, else a gather from each row's first key), the scaled query
    rows into the padded buffer (one op, which also casts), scores by one `bmm`, mask the chunks that hide keys,
    the row maximum, `exp`, fixed-length chunk sums, p @ V by a second `bmm`, chunks added in order (`cumsum`,
    with more than one chunk), divide. Calls of more than BMM_MAX_MATRICES matrices stage and multiply their
    keys, then their values, a block of (row, KV head) groups at a time."""
    B, H, T, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    G = H // Hkv  # query heads per KV head (head h reads KV head h // G)
    if plan is None:
        plan = chunk_plan(mask, first, G, Hkv, C, chunk)
    acc = _accumulation_dtype(q.dtype)
    pair = _kv_pair(k_cache, v_cache, plan.width)
    lay = plan.layouts.get((D, acc, q.device, chunk))
    if lay is None or plan.workspace.owner is not lay or not lay.matches(k_cache, v_cache, pair):
        lay = _layout(plan, B, Hkv, T, D, acc, q.device, chunk, k_cache, v_cache, pair)  # a forward's first layer
    buf = lay.buffers
    bmm = bounded_bmm
    # is_compiling first: torch.compile cannot trace get_num_threads (a compiled graph keeps the caller's threads)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        threads = torch.get_num_threads()
        how = bmm_plan(acc, threads, D, chunk)
        if how.threads != threads or how.block is not None:  # this CPU's bmm changes rows with the call
            bmm = functools.partial(_bmm, how)
    # row g * T + t of (b, kv, c): query t of head kv * G + g, scaled (in the accumulation dtype: the scale
    # tensor's dtype wins the promotion), the same for every chunk
    torch.mul(q.view(B, Hkv, 1, G, T, D), buf.scale, out=buf.rows_dest)
    single = len(buf.products) == 1
    if single:
        lay.stage_all(k_cache, v_cache, pair)
        bmm(*buf.products[0][0])  # scores [Bm, Rp, chunk]: K^T a view, never copied
    else:
        source = None if lay.from_zero else lay.source(k_cache, v_cache, pair)
        for i, (scores_product, _) in enumerate(buf.products):
            lay.stage_block(source, k_cache, i, 0)
            bmm(*scores_product)
    scores = buf.scores5  # [B, H_kv, NC, Rp, chunk]
    if lay.masked is not None:  # the chunks where some query row may not see some key
        lay.masked.masked_fill_(lay.hidden, float("-inf"))
    torch.amax(scores, dim=(2, 4), keepdim=True, out=buf.top)  # [B, H_kv, 1, Rp, 1], exact in any order
    if plan.blind:
        buf.top.clamp_(min=torch.finfo(acc).min)  # finite for rows with no visible key (their scores stay -inf)
    scores.sub_(buf.top).exp_()  # probabilities in place of the scores; 0 where hidden
    torch.sum(scores, dim=-1, out=buf.sums)  # [B, H_kv, NC, Rp], one fixed-length sum per chunk
    if single:
        bmm(*buf.products[0][1])  # parts [Bt, Rp, D]
    else:
        for i, (_, values_product) in enumerate(buf.products):
            lay.stage_block(source, v_cache, i, 1)
            bmm(*values_product)
    if plan.chunks > 1:  # chunks added in order (cumsum is a sequential scan: one order for every row)
        if buf.fold is not None:
            last_prefix_sum(buf.parts5, buf.fold, buf.folded)
        else:
            torch.cumsum(buf.parts5, dim=2, out=buf.added)
        torch.cumsum(buf.sums, dim=2, out=buf.totals)
    if plan.blind:
        buf.den.clamp_min_(torch.finfo(acc).tiny)  # rows with no visible key: 0 / tiny = 0
    out = torch.div(buf.num, buf.den)  # [B, H_kv, R, D], fresh
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    return out.view(B, H, T, D)


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


SPLIT = 256  # Triton: keys per split (a multiple of CHUNK); split s of a row starts at first + s * SPLIT
BLOCK_R = 16  # Triton: query rows (GQA heads x queries of one KV head) per program, the MMA's smallest M
COMBINE_ROWS = 16  # Triton: queries merged per program of the combine kernel


@lazy_jit
def _bi_attention_split_kernel(
    q_ptr,  # [B, H, T, D]
    k_ptr,  # [B, H_kv, C, D]
    v_ptr,  # [B, H_kv, C, D]
    mask_ptr,  # [B, T, W] uint8 (a view of the bool mask)
    first_ptr,  # [B] int64
    o_ptr,  # [B, H, T, D], out (FINAL)
    pacc_ptr,  # [B * H * T * NS, D] fp32 (fp64 for fp64) partial sums of p v, out (not FINAL)
    pm_ptr,  # [B * H * T * NS] running maxima, out (not FINAL)
    pl_ptr,  # [B * H * T * NS] sums of exp, out (not FINAL)
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_c, sk_d,
    sv_b, sv_h, sv_c, sv_d,
    sm_b, sm_t, sm_w,
    so_b, so_h, so_t, so_d,
    H_KV, H, GROUP, T, W, D, NS, scale,
    ACC_F64: tl.constexpr,
    FINAL: tl.constexpr,
    DOT_SUM: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (row b and KV head, split s, block of ROWS query rows): the block's query rows r = t * GROUP + g
    (query t of head kv * GROUP + g) against the split's keys, columns first[b] + s * SPLIT_SIZE + [0, SPLIT_SIZE),
    in CHUNK-column steps in order: scores by one MMA per chunk (a K tile shared by every head of the group
    and every query), online softmax, p @ V by a second MMA. FINAL (one split): writes the output; else the
    split's (max, sum, p @ V) for `_bi_attention_combine_kernel`."""
    pid = tl.program_id(0)
    b = (pid // H_KV).to(tl.int64)
    kv = (pid % H_KV).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # [ROWS] query rows of this block
    r_ok = r < GROUP * T
    t = (r // GROUP).to(tl.int64)  # [ROWS] query
    h = kv * GROUP + (r % GROUP)  # [ROWS] query head
    if ACC_F64:
        acc_ty = tl.float64
        scale = 1.0 / tl.sqrt(tl.full([], D, tl.float64))  # a float argument arrives as float32
    else:
        acc_ty = tl.float32
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dm = d < D
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
                mask=r_ok[:, None] & dm[None, :], other=0.0)  # [ROWS, BLOCK_D]
    if DOT_FP32:  # the interpreter multiplies 16-bit floats' raw bits (triton 3.9)
        q = q.to(tl.float32)
    start = tl.load(first_ptr + b) + s * SPLIT_SIZE  # the split's first column
    end = tl.minimum(start + SPLIT_SIZE, W)
    m_i = tl.full([ROWS], float("-inf"), acc_ty)  # running maximum per query row
    l_i = tl.zeros([ROWS], acc_ty)  # running sum of exp
    acc = tl.zeros([ROWS, BLOCK_D], acc_ty)  # running sum of p v
    j = tl.arange(0, CHUNK)  # [CHUNK]
    k_tile = k_ptr + b * sk_b + kv * sk_h + j[:, None] * sk_c + d[None, :] * sk_d  # [CHUNK, BLOCK_D] at column 0
    v_tile = v_ptr + b * sv_b + kv * sv_h + j[:, None] * sv_c + d[None, :] * sv_d  # [CHUNK, BLOCK_D]
    mask_rows = mask_ptr + b * sm_b + t[:, None] * sm_t + j[None, :] * sm_w  # [ROWS, CHUNK] at column 0
    for c0 in range(start, end, CHUNK):
        cm = (c0 + j) < W  # [CHUNK] columns of this chunk inside the mask
        kv_mask = cm[:, None] & dm[None, :]  # [CHUNK, BLOCK_D]
        k = tl.load(k_tile + c0 * sk_c, mask=kv_mask, other=0.0)  # [CHUNK, BLOCK_D]
        if DOT_SUM:
            sc = tl.sum(q.to(acc_ty)[:, None, :] * k.to(acc_ty)[None, :, :], axis=2)  # [ROWS, CHUNK]
        else:
            if DOT_FP32:
                k = k.to(tl.float32)
            sc = tl.dot(q, tl.trans(k), input_precision="ieee").to(acc_ty)  # [ROWS, CHUNK]
        sc = sc * scale
        seen = tl.load(mask_rows + c0 * sm_w, mask=r_ok[:, None] & cm[None, :], other=0)  # [ROWS, CHUNK] uint8
        sc = tl.where(seen != 0, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))  # [ROWS]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new).to(acc_ty)
        alpha = tl.exp(m_i - m_safe)  # [ROWS]; 1 exactly when this chunk raised nothing
        p = tl.exp(sc - m_safe[:, None])  # [ROWS, CHUNK], 0 where hidden
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_tile + c0 * sv_c, mask=kv_mask, other=0.0)  # [CHUNK, BLOCK_D]
        pv = p.to(v_ptr.dtype.element_ty)  # [ROWS, CHUNK] in the values' dtype: the MMA's operand
        if DOT_SUM:
            acc = acc * alpha[:, None] + tl.sum(pv.to(acc_ty)[:, :, None] * v.to(acc_ty)[None, :, :], axis=1)
        else:
            if DOT_FP32:
                pv = pv.to(tl.float32)
                v = v.to(tl.float32)
            acc = tl.dot(pv, v, acc * alpha[:, None], input_precision="ieee")  # [ROWS, BLOCK_D]
        m_i = m_new
    if FINAL:
        safe_l = tl.where(l_i > 0, l_i, 1.0).to(acc_ty)
        out = tl.where(l_i[:, None] > 0, acc / safe_l[:, None], 0.0)  # a query that sees nothing gets zeros
        tl.store(o_ptr + b * so_b + h[:, None] * so_h + t[:, None] * so_t + d[None, :] * so_d,
                 out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & dm[None, :])
    else:
        part = ((b * H + h) * T + t) * NS + s  # [ROWS] partial row of (b, h, t, s)
        tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc, mask=r_ok[:, None] & dm[None, :])
        tl.store(pm_ptr + part, m_i, mask=r_ok)
        tl.store(pl_ptr + part, l_i, mask=r_ok)


@lazy_jit
def _bi_attention_combine_kernel(
    pacc_ptr,  # [B * H * T * NS, D] partial sums of p v
    pm_ptr,  # [B * H * T * NS] maxima
    pl_ptr,  # [B * H * T * NS] sums of exp
    o_ptr,  # [B, H, T, D], out
    so_b, so_h, so_t, so_d,
    H, T, D, NS, QUERIES,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per ROWS queries (b, h, t), flattened as (b * H + h) * T + t: each query's NS splits are
    merged in order. A split the query sees nothing of (max -inf) is skipped; the first one it sees is taken
    as is, so a query whose keys all lie in split 0 gets exactly the one-split (FINAL) kernel's bits,
    whatever NS."""
    qid = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    q_ok = qid < QUERIES
    t = qid % T
    h = (qid // T) % H
    b = qid // (T * H)
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    ok = q_ok[:, None] & (d < D)[None, :]  # [ROWS, BLOCK_D]
    m = tl.load(pm_ptr + qid * NS, mask=q_ok, other=float("-inf"))  # [ROWS]
    l_i = tl.load(pl_ptr + qid * NS, mask=q_ok, other=0.0)  # [ROWS]
    acc = tl.load(pacc_ptr + (qid * NS)[:, None] * D + d[None, :], mask=ok, other=0.0)  # [ROWS, BLOCK_D]
    for s in range(1, NS):
        m_s = tl.load(pm_ptr + qid * NS + s, mask=q_ok, other=float("-inf"))  # [ROWS]
        l_s = tl.load(pl_ptr + qid * NS + s, mask=q_ok, other=0.0)  # [ROWS]
        a_s = tl.load(pacc_ptr + (qid * NS + s)[:, None] * D + d[None, :], mask=ok, other=0.0)  # [ROWS, BLOCK_D]
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new).to(m.dtype)
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_s - m_safe)
        take = m == float("-inf")  # nothing seen yet: this split as is
        keep = m_s == float("-inf")  # this split saw nothing: unchanged
        l_i = tl.where(keep, l_i, tl.where(take, l_s, l_i * alpha + l_s * beta))
        acc = tl.where(keep[:, None], acc, tl.where(take[:, None], a_s, acc * alpha[:, None] + a_s * beta[:, None]))
        m = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0).to(l_i.dtype)
    out = tl.where(l_i[:, None] > 0, acc / safe_l[:, None], 0.0)  # [ROWS, BLOCK_D]
    tl.store(o_ptr + b[:, None] * so_b + h[:, None] * so_h + t[:, None] * so_t + d[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty), mask=ok)


def bi_attention_triton(q, k_cache, v_cache, mask, first, chunk: int = CHUNK, split: int = SPLIT,
                        dot: str | None = None):
    """Launch `_bi_attention_split_kernel` on grid (B * H_kv, cdiv(W, split), cdiv(G * T, BLOCK_R)), then, when
    there is more than one split, `_bi_attention_combine_kernel` on (cdiv(B * H * T, COMBINE_ROWS),).
    `dot`: "mma" (`tl.dot`, default on a GPU) or "sum" (`tl.sum` of products, default under the interpreter).
    Same math as the reference, another order (so not the same bits)."""
    B, H, T, D = q.shape
    Hkv = k_cache.shape[1]
    W = mask.shape[-1]
    check(split % chunk == 0, f"bi_attention_triton: split ({split}) must be a multiple of chunk ({chunk})")
    dot = dot or ("sum" if interpreting() else "mma")
    group = H // Hkv
    NS = cdiv(W, split)  # enough for any row (first >= 0): a row's surplus splits are no-ops
    final = NS == 1
    acc_dtype = _accumulation_dtype(q.dtype)
    out = torch.empty_like(q)
    rows = B * H * T * NS
    pacc = torch.empty((1, 1) if final else (rows, D), dtype=acc_dtype, device=q.device)  # [rows, D]
    pm = torch.empty(1 if final else rows, dtype=acc_dtype, device=q.device)  # [rows]
    pl = torch.empty_like(pm)  # [rows]
    mask_u8 = mask.view(torch.uint8)
    block_d = next_power_of_2(max(D, 16))  # tl.dot needs K >= 16
    _bi_attention_split_kernel[(B * Hkv, NS, cdiv(group * T, BLOCK_R))](
        q, k_cache, v_cache, mask_u8, first, out, pacc, pm, pl,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *mask_u8.stride(), *out.stride(),
        Hkv, H, group, T, W, D, NS, 1.0 / math.sqrt(D),
        ACC_F64=q.dtype == torch.float64, FINAL=final, DOT_SUM=dot == "sum",
        DOT_FP32=interpreting() and q.element_size() == 2, SPLIT_SIZE=split, CHUNK=chunk, ROWS=BLOCK_R,
        BLOCK_D=block_d, num_warps=4,
    )
    if not final:
        queries = B * H * T
        _bi_attention_combine_kernel[(cdiv(queries, COMBINE_ROWS),)](
            pacc, pm, pl, out, *out.stride(), H, T, D, NS, queries, ROWS=COMBINE_ROWS,
            BLOCK_D=next_power_of_2(D), num_warps=4,
        )
    return out
