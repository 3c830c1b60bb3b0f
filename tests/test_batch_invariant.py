"""Batch-invariant numerics (models/numerics.py, kernels/bi_matmul.py, kernels/bi_attention.py): with
`batch_invariant` on, a token's logits are the same bits whatever else shares its forward -- batch size,
new tokens per row, layout, padding, row -- and greedy speculative decoding equals AR bit for bit in
bfloat16 and float32. Each claim is also shown false with the mode off, so these tests can fail.

The Triton kernels run under the interpreter here (TRITON_INTERPRET=1, set by conftest.py) and are compared
with their torch references; `test_kernels_compile_for_sm90` compiles them for an H100/H200 without a GPU.
"""
import contextlib
import functools
import inspect
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from checkpoints import FAMILIES, make_checkpoint, make_pair
from specdec.models.cache import LEFT_PADDED, RAGGED
from specdec import LLM, SamplingParams
from specdec.kernels import bi_attention as ba
from specdec.kernels import bi_matmul as bm
from specdec.kernels import dispatch
from specdec.kernels.positions import step_plan_reference
from specdec.models import load_model, load_tokenizer
from specdec.models import numerics
from specdec.models.transformer import InvariantAttention
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET, read_prompts

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
DTYPE_IDS = ("float32", "bfloat16", "float64")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GPU = torch.cuda.is_available() and not INTERPRET  # TRITON_INTERPRET=0 on a CUDA machine: the compiled kernels
KERNEL_DEVICE = "cuda" if GPU else "cpu"
needs_triton = pytest.mark.skipif(not (dispatch.triton_available() and (INTERPRET or GPU)),
                                  reason="needs triton with TRITON_INTERPRET=1, or a CUDA device")


def rows_alone_vs_batched(fn, X, sizes=(1, 2, 3, 4, 5, 8, 17, 48), shifts=(0, 1, 3), alone=24, tile=8):
    """(M, shift) cases where a row of fn(X[s:s+M]) differs from fn of that row alone. Every row of every call
    is compared, with the row as computed in calls of `tile` rows, whose first `alone` rows are compared with
    each row alone (a kernel that rounds differently may change only a few elements of a large call)."""
    ref = torch.cat([fn(X[i:i + 1].clone()) for i in range(alone)])
    tiled = torch.cat([fn(X[i:i + tile].clone()) for i in range(0, len(X), tile)])
    bad = [(1, "tiles")] if not torch.equal(tiled[:alone], ref) else []
    for M in sizes:
        for s in shifts:
            rows = fn(X[s:s + M].clone())
            if not torch.equal(rows, tiled[s:s + len(rows)]):
                bad.append((M, s))
    return bad


# ------------------------------------------------------------------------------------------------ linear
@pytest.fixture
def fresh_plans(monkeypatch):
    """The row probes and plans of bi_matmul and bi_attention with caches of the test's own (a stand-in
    kernel's verdict must not stay in the process's caches)."""
    for module, names in ((bm, ("rows_keep_bits", "cpu_plan")), (ba, ("bmm_keeps_rows", "bmm_plan"))):
        for name in names:
            monkeypatch.setattr(module, name, functools.cache(getattr(module, name).__wrapped__))

    def clear():
        for fn in (bm.rows_keep_bits, bm.cpu_plan, ba.bmm_keeps_rows, ba.bmm_plan):
            if hasattr(fn, "cache_clear"):  # (not a test's own stand-in)
                fn.cache_clear()

    return clear


def other_kernel(x, weight, bias=None):
    """Another bfloat16 kernel's result: float32 sums rounded toward zero, not to nearest (other last bits in
    about half the outputs)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (y.view(torch.int32) & -65536).view(torch.float32).to(x.dtype)  # low 16 bits cleared: exact in bf16


def kernel_by_rows(takes_other):
    """A stand-in for `bi_matmul._cpu_linear` on a CPU whose library picks its kernel by the call's shape (as
    oneDNN picks AMX or AVX-512 kernels): calls of M rows with takes_other(M) run `other_kernel`."""
    real = bm._cpu_linear

    def kernel(x, weight, bias=None, packed=None):
        return other_kernel(x, weight, bias) if takes_other(x.shape[0]) else real(x, weight, bias, packed)

    return kernel


def kernel_by_position():
    """A stand-in whose rows after a call's first take `other_kernel` (a row's bits depend on where it sits)."""
    real = bm._cpu_linear

    def kernel(x, weight, bias=None, packed=None):
        y = real(x, weight, bias, packed)
        y[1:] = other_kernel(x[1:], weight, bias)
        return y

    return kernel


def test_a_cpu_whose_threads_change_rows_multiplies_on_one_thread(monkeypatch, fresh_plans):
    """The guard the H200 machine's host CPU needed (float32 via oneDNN changed rows at two threads): where
    `rows_keep_bits` finds rows differ at the caller's thread count, the path runs on one thread and the
    caller's count is restored; where they agree, or on one thread, it runs as called."""
    seen = []
    real = bm._cpu_linear
    monkeypatch.setattr(bm, "_cpu_linear", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(bm, "rows_keep_bits", lambda dtype, plan, shape: plan.threads == 1)
        bm.bi_matmul_reference(x, w)
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(bm, "rows_keep_bits", lambda dtype, plan, shape: True)
        fresh_plans()
        bm.bi_matmul_reference(x, w)
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(threads)


def test_a_cpu_whose_kernel_switches_with_the_call_size_multiplies_in_fixed_blocks(monkeypatch, fresh_plans):
    """Issue 42: on an Intel host exspec left AR's path on one prompt of 96, in bfloat16, at one thread too;
    exspec prefills its whole pool in one call (1035-1248 rows there; no call of the other methods exceeded
    184 rows). On a CPU whose bfloat16 kernel changes above some call size the probe sees it, and the layer then
    multiplies BLOCK_ROWS rows per call: every row, alone or in a prefill of 1248 rows, keeps its bits."""
    monkeypatch.setattr(bm, "_cpu_linear", kernel_by_rows(lambda M: M > 256))
    g = torch.Generator().manual_seed(4)
    W, b = torch.randn(640, 384, generator=g).bfloat16(), torch.randn(640, generator=g).bfloat16()
    X = torch.randn(1300, 384, generator=g).bfloat16()
    sizes = (1, 3, 48, 300, 1248)
    assert rows_alone_vs_batched(lambda x: bm._cpu_linear(x, W, b), X, sizes=sizes) == [
        (M, s) for M in (300, 1248) for s in (0, 1, 3)]  # the stand-in: the library as called
    threads = torch.get_num_threads()
    assert not bm.rows_keep_bits(torch.bfloat16, bm.RowPlan(threads, None), (640, 384))  # the probe sees it
    assert bm.cpu_plan(torch.bfloat16, threads, (640, 384)) == bm.RowPlan(threads, bm.BLOCK_ROWS)
    assert rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="torch"), X, sizes=sizes) == []
    calls = []
    kernel = bm._cpu_linear
    monkeypatch.setattr(bm, "_cpu_linear", lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    y = bm.bi_linear(X[:37].view(1, 37, 384), W, b, backend="torch")
    assert calls == [bm.BLOCK_ROWS] * 3 and y.shape == (1, 37, 640)  # 37 rows: three calls of 16, zeros pad
    assert torch.allclose(y[0].double(), F.linear(X[:37].double(), W.double(), b.double()), atol=0.1, rtol=1e-2)


def test_no_call_of_the_mode_is_larger_than_the_probed_ones(monkeypatch):
    """The probes measure calls of up to MAX_CALL_ROWS rows (BMM_MAX_MATRICES x BMM_MAX_ROWS for the attention's
    batched matmuls); the mode splits larger ones, so no call it makes is larger than one measured."""
    sizes, shapes = [], []
    real_linear, real_bmm = bm._cpu_linear, ba._library_bmm
    monkeypatch.setattr(bm, "_cpu_linear", lambda x, *a: sizes.append(x.shape[0]) or real_linear(x, *a))
    monkeypatch.setattr(ba, "_library_bmm", lambda a, b, out: shapes.append(a.shape[:2]) or real_bmm(a, b, out))
    x, w = torch.randn(2100, 16), torch.randn(8, 16)
    y = bm.bounded_linear(x, w)
    assert sizes == [bm.MAX_CALL_ROWS, bm.MAX_CALL_ROWS, 52] and torch.allclose(y, F.linear(x, w), atol=1e-5)
    a, b = torch.randn(300, 420, 8), torch.randn(300, 6, 8)
    out = ba.bounded_bmm(a, b.transpose(1, 2), torch.empty(300, 420, 6))
    assert max(n for n, _ in shapes) == ba.BMM_MAX_MATRICES and max(r for _, r in shapes) == ba.BMM_MAX_ROWS
    assert len(shapes) == 3 * 3 and torch.allclose(out, torch.bmm(a, b.transpose(1, 2)), atol=1e-5)


def test_row_probe_finds_the_first_plan_that_keeps_rows(monkeypatch, fresh_plans):
    """`rows_keep_bits` holds for this CPU's paths as called (every dtype), and fails for kernels that change a
    row with the call: another kernel for one row alone (a GEMV path), for prefill-sized calls, for rows after
    a call's first. `cpu_plan` then takes fixed blocks, or one row per call where blocks change rows too; the
    layer's rows then keep their bits."""
    for dtype in DTYPES:
        assert bm.rows_keep_bits(dtype, bm.RowPlan(1, None), (131, 64))
    g = torch.Generator().manual_seed(5)
    X, W = torch.randn(300, 64, generator=g).bfloat16(), torch.randn(131, 64, generator=g).bfloat16()
    for name, kernel, plan in (("gemv", kernel_by_rows(lambda M: M == 1), bm.RowPlan(1, bm.BLOCK_ROWS)),
                               ("prefill", kernel_by_rows(lambda M: M > 256), bm.RowPlan(1, bm.BLOCK_ROWS)),
                               ("position", kernel_by_position(), bm.RowPlan(1, 1))):
        monkeypatch.setattr(bm, "_cpu_linear", kernel)
        fresh_plans()
        assert not bm.rows_keep_bits(torch.bfloat16, bm.RowPlan(1, None), (131, 64)), name
        with dispatch.one_thread():
            assert bm.cpu_plan(torch.bfloat16, 1, (131, 64)) == plan, name
            bad = rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, backend="torch"), X, sizes=(2, 17, 270))
            assert bad == [], name


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_rows_do_not_depend_on_the_call(dtype):
    g = torch.Generator().manual_seed(0)
    for N, K in ((131, 64), (640, 384)):
        W = torch.randn(N, K, generator=g).to(dtype)
        b = torch.randn(N, generator=g).to(dtype)
        X = torch.randn(1040, K, generator=g).to(dtype)
        # up to a prefill of many prompts at once (exspec's pool: 1035-1248 rows in issue 42)
        assert rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="torch"), X,
                                     sizes=(1, 2, 3, 4, 5, 8, 17, 48, 130, 1030), shifts=(0, 3)) == []
        threads = torch.get_num_threads()
        try:  # the libraries split work by thread count: check two threads too (the CLI's default here)
            torch.set_num_threads(2)
            assert rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="torch"), X[:60],
                                         sizes=(1, 3, 48)) == []
        finally:
            torch.set_num_threads(threads)
        packed = bm.pack_weight(W)  # what the model keeps; the same bits as packing on the fly
        assert torch.equal(bm.bi_linear(X, W, b, packed=packed, backend="torch"),
                           bm.bi_linear(X, W, b, backend="torch"))
        # a misaligned view of the input (float64 MKL results depend on alignment) and a 3-d input
        flat = torch.randn(8 * K + 16, generator=g).to(dtype)
        view = flat[3: 3 + 8 * K].view(2, 4, K)
        assert torch.equal(bm.bi_linear(view, W, b, backend="torch"), bm.bi_linear(view.clone(), W, b, backend="torch"))
        if dtype != torch.bfloat16:  # the ordinary path does depend on M: the mode is needed
            assert rows_alone_vs_batched(lambda x: F.linear(x, W, b), X[:60]), f"{dtype}: F.linear already invariant"
        y = bm.bi_linear(X[:60], W, b, backend="torch").double()
        assert torch.allclose(y, F.linear(X[:60].double(), W.double(), b.double()), rtol=2e-2,
                              atol=2e-2 * y.abs().max())


def test_cpu_paths_are_the_measured_ones():
    assert bm.cpu_path(torch.bfloat16) == "native" and bm.cpu_path(torch.float64) == "padded"
    assert bm.cpu_path(torch.float32) == ("onednn" if bm.onednn_available() else "padded")
    assert [bm.padded_rows(m) for m in (1, 3, 4, 5, 48)] == [4, 4, 4, 8, 48]


def test_bi_linear_validation():
    W = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="features"):
        bm.bi_linear(torch.zeros(2, 5), W)
    with pytest.raises(ValueError, match="dtype"):
        bm.bi_linear(torch.zeros(2, 3, dtype=torch.float64), W)
    with pytest.raises(ValueError, match="bias"):
        bm.bi_linear(torch.zeros(2, 3), W, torch.zeros(5))


# --------------------------------------------------------------------------------------------- elementwise
def test_silu_every_bfloat16_input_and_float32_tails():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    pair = torch.stack([every, every], 1)  # a strided column runs torch's scalar loop
    assert torch.equal(F.silu(pair[:, 0].contiguous()), F.silu(pair[:, 0]))  # bf16 F.silu: kept as is
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 4
    pair = torch.stack([x, x], 1)
    assert not torch.equal(F.silu(pair[:, 0].contiguous()), F.silu(pair[:, 0]))  # float32: tails round differently
    silu = numerics.silu_kernel(True, x.device, x.dtype)  # the mode's SiLU on the CPU in float32
    assert silu is numerics.invariant_silu and numerics.silu_kernel(True, x.device, torch.bfloat16) is F.silu
    assert torch.equal(silu(pair[:, 0].contiguous()), silu(pair[:, 0]))
    assert torch.allclose(silu(x), F.silu(x), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------- attention
def _attention_case(dtype, B, T, rows, lengths, starts, left_padded, capacity=140, H=6, Hkv=2, D=24, seed=0,
                    backend="torch", chunk=None):
    """Attention output of row `rows[0]`'s queries for a batch whose row i has `lengths[i]` cached tokens at
    column `starts[i]`; every row's logical token t has the same K/V/q whatever the layout."""
    g = torch.Generator().manual_seed(seed)
    k_tok, v_tok = (torch.randn(8, Hkv, 100, D, generator=g).to(dtype) for _ in range(2))  # token t of sequence r
    q_tok = torch.randn(8, H, 100, D, generator=g).to(dtype)
    k_cache = torch.randn(B, Hkv, capacity, D, generator=g).to(dtype)  # junk everywhere else
    v_cache = torch.randn(B, Hkv, capacity, D, generator=g).to(dtype)
    q = torch.empty(B, H, T, D, dtype=dtype)
    for i, (n, s) in enumerate(zip(lengths, starts)):
        k_cache[i, :, s: s + n + T] = k_tok[rows[i], :, : n + T]
        v_cache[i, :, s: s + n + T] = v_tok[rows[i], :, : n + T]
        q[i] = q_tok[rows[i], :, n: n + T]
    start, length = torch.tensor(starts), torch.tensor(lengths)
    width = max(s + n + T for s, n in zip(starts, lengths))
    _, _, mask = step_plan_reference(start, length, torch.full((B,), T), T, left_padded, width)
    if backend == "triton":
        q, k_cache, v_cache, mask = (t.to(KERNEL_DEVICE) for t in (q, k_cache, v_cache, mask))
    if chunk is None:
        out = ba.bi_attention(q, k_cache, v_cache, mask, backend=backend)
    elif backend == "triton":
        out = ba.bi_attention_triton(q, k_cache, v_cache, mask, ba.first_keys(mask), chunk=chunk)
    else:
        out = ba.bi_attention_reference(q, k_cache, v_cache, mask, ba.first_keys(mask), chunk=chunk)
    bias = torch.where(mask, torch.zeros((), dtype=dtype), float("-inf"))[:, None]
    sdpa = F.scaled_dot_product_attention(q, k_cache[:, :, :width], v_cache[:, :, :width], attn_mask=bias,
                                          enable_gqa=True)
    return out.cpu(), sdpa.cpu()


# (B, T, the row's length before the step, starts, left padded): query n + j of row 0 is the same token in all
SCENARIOS = (
    (1, 1, [40], [0], False),
    (1, 1, [40], [9], True),
    (3, 1, [40, 3, 70], [0, 0, 0], False),
    (8, 1, [40, 5, 60, 1, 33, 70, 12, 8], [30, 0, 0, 0, 0, 0, 0, 0], True),
)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_query_does_not_depend_on_the_call(dtype):
    """Query 40 of a row (the 41st token) alone at T = 1, after 9 or 30 padding columns, in batches of
    3 and 8, as the first, third or sixth query of a T = 6 step: the same bits with bi_attention."""
    outs, sdpas = [], []
    for B, T, lengths, starts, left in SCENARIOS:
        out, sdpa = _attention_case(dtype, B, T, list(range(B)), lengths, starts, left)
        outs.append(out[0, :, 0])
        sdpas.append(sdpa[0, :, 0])
    for first in (40 - 2, 40 - 5):  # T = 6 steps where query 40 sits at index 2 and 5
        out, sdpa = _attention_case(dtype, 3, 6, [0, 1, 2], [first, 7, 50], [5, 0, 0], True)
        outs.append(out[0, :, 40 - first])
        sdpas.append(sdpa[0, :, 40 - first])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert not all(torch.equal(s, sdpas[0]) for s in sdpas[1:]), f"{dtype}: SDPA already invariant here"
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for o, s in zip(outs, sdpas):
        assert torch.allclose(o.double(), s.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_one_kv_head_and_reused_buffers(dtype):
    """One KV head at batch 1 with one chunk multiplies a batch of one matrix (padded to two: MKL takes another
    path for one); a model's reusable buffers give the same bits as fresh ones, whatever ran before."""
    kw = dict(H=2, Hkv=1, D=16, capacity=80)
    alone, _ = _attention_case(dtype, 1, 1, [0], [20], [0], False, **kw)
    batched, _ = _attention_case(dtype, 3, 6, [0, 1, 2], [15, 40, 2], [3, 0, 0], True, **kw)
    assert torch.equal(alone[0, :, 0], batched[0, :, 5])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 24, generator=g).to(dtype) for h, n in ((6, 3), (2, 90), (2, 90)))
    _, _, mask = step_plan_reference(torch.tensor([0, 4]), torch.tensor([70, 30]), torch.tensor([3, 3]), 3, True, 73)
    workspace = ba.Workspace()
    for shape in ((1, 6, 1, 24), (2, 6, 3, 24)):  # a smaller call first: the buffers are reused and grown
        small = torch.randn(shape, generator=g).to(dtype)
        ba.bi_attention(small, k[: shape[0]], v[: shape[0]], mask[: shape[0], : shape[2]],
                        plan=ba.chunk_plan(mask[: shape[0], : shape[2]], ba.first_keys(mask[: shape[0], : shape[2]]),
                                           3, 2, 90, workspace=workspace), backend="torch")
    plan = ba.chunk_plan(mask, ba.first_keys(mask), 3, 2, 90, workspace=workspace)
    assert torch.equal(ba.bi_attention(q, k, v, mask, plan=plan, backend="torch"),
                       ba.bi_attention(q, k, v, mask, backend="torch"))
    # one KV head: 1 matrix (padded to 2), then 2 real ones in the same buffer shapes, then 1 again
    q1, k1, v1 = (torch.randn(2, h, n, 24, generator=g).to(dtype) for h, n in ((2, 1), (1, 40), (1, 40)))
    _, _, mask1 = step_plan_reference(torch.tensor([0, 0]), torch.tensor([30, 20]), torch.tensor([1, 1]), 1, False, 31)
    for b in (1, 2, 1):
        args = (q1[:b], k1[:b], v1[:b], mask1[:b])
        plan = ba.chunk_plan(mask1[:b], ba.first_keys(mask1[:b]), 2, 1, 40, workspace=workspace)
        assert torch.equal(ba.bi_attention(*args, plan=plan, backend="torch"), ba.bi_attention(*args, backend="torch"))


POOL_PREFILL = (48, 30, [11] + [3 + (5 * i) % 40 for i in range(47)], [0] * 48, False)  # (B, T, lengths, starts, left)


def _pool_prefill_vs_alone(dtype, **kw):
    """Query 40 of sequence 0 alone (T = 1) and as query 29 of a 48-row ragged prefill-sized call (T = 30)."""
    alone, _ = _attention_case(dtype, 1, 1, [0], [40], [0], False, **kw)
    B, T, lengths, starts, left = POOL_PREFILL
    pool, _ = _attention_case(dtype, B, T, [i % 8 for i in range(B)], lengths, starts, left, **kw)
    return alone[0, :, 0], pool[0, :, 40 - lengths[0]]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_query_keeps_its_bits_in_a_pool_prefill(dtype):
    """exspec prefills its whole pool at once (48 prompts: 96 matrices per batched matmul, where the other methods'
    calls have at most 16): a query there has the bits it has alone."""
    alone, pooled = _pool_prefill_vs_alone(dtype)
    assert torch.equal(alone, pooled)


def test_a_cpu_whose_bmm_changes_rows_with_the_batch_runs_fixed_calls(monkeypatch, fresh_plans):
    """Where the library's batched matmul gives a (matrix, row) other bits in calls of more matrices (a stand-in:
    the low bits of every output cleared in calls of over 64 matrices), the probe sees it and the attention's
    products run as calls of one shape (2 matrices of BLOCK_ROWS rows): the query keeps its bits in a pool prefill."""
    real = ba._library_bmm

    def by_batch(a, b, out):
        real(a, b, out)
        if a.shape[0] > 64:
            bits = out.view(torch.int64 if out.dtype == torch.float64 else torch.int32)
            bits &= -16
        return out

    monkeypatch.setattr(ba, "_library_bmm", by_batch)
    threads = torch.get_num_threads()
    assert not ba.bmm_keeps_rows(torch.float32, bm.RowPlan(threads, None), 24, ba.CHUNK, True)  # the probe sees it
    plan = ba.bmm_plan(torch.float32, threads, 24, ba.CHUNK)
    assert plan == bm.RowPlan(threads, bm.BLOCK_ROWS)
    monkeypatch.setattr(ba, "bmm_plan", lambda *args: bm.RowPlan(threads, None))  # as called: the query differs
    alone, pooled = _pool_prefill_vs_alone(torch.float32)
    assert not torch.equal(alone, pooled)
    monkeypatch.setattr(ba, "bmm_plan", lambda *args: plan)
    alone, pooled = _pool_prefill_vs_alone(torch.float32)
    assert torch.equal(alone, pooled)
    _, sdpa = _attention_case(torch.float32, 1, 1, [0], [40], [0], False)
    assert torch.allclose(alone.double(), sdpa[0, :, 0].double(), atol=1e-5, rtol=1e-5)


def test_attention_padding_queries_and_validation():
    """A left-padding query of a prefill sees no key of its row: zeros, never NaN."""
    q = torch.randn(2, 2, 4, 8)
    cache = torch.randn(2, 1, 10, 8)
    start, length = torch.tensor([2, 0]), torch.tensor([0, 0])
    _, _, mask = step_plan_reference(start, length, torch.tensor([2, 4]), 4, True, 4)
    out = ba.bi_attention(q, cache, cache.clone(), mask, backend="torch")
    assert torch.isfinite(out).all() and (out[0, :, :2] == 0).all()
    with pytest.raises(ValueError, match="multiple"):
        ba.bi_attention(torch.zeros(2, 3, 4, 8), cache.expand(2, 2, 10, 8), cache.expand(2, 2, 10, 8), mask)
    with pytest.raises(ValueError, match="mask"):
        ba.bi_attention(q, cache, cache, mask.float())


# ------------------------------------------------------------------------------------------- the model
def _schedule_logits(model, seqs, prompt_lens, T, layout, backend=None):
    """Prefill each row's prompt (padded on the layout's side), then feed the rest T tokens per step;
    returns [B, 1 + rest, V]: the prefill's last logits and every fed token's."""
    B, width, rest = len(seqs), max(prompt_lens), len(seqs[0]) - prompt_lens[0]
    cache = model.new_cache(B, width + rest + 1, layout)
    cache.backend = backend  # the kernels' backend, as an engine sets it (LLM(kernel_backend=...))
    ids = torch.zeros(B, width, dtype=torch.int64)
    for i, (s, n) in enumerate(zip(seqs, prompt_lens)):
        if layout == LEFT_PADDED:
            ids[i, width - n:] = torch.tensor(s[:n])
        else:
            ids[i, :n] = torch.tensor(s[:n])
    cache.set_prefill(prompt_lens, width)
    out = [model.forward(ids.to(model.device), cache, num_new=prompt_lens, logits="last")]
    for j in range(0, rest, T):
        step = torch.tensor([s[n + j: n + j + T] for s, n in zip(seqs, prompt_lens)])
        out.append(model.forward(step.to(model.device), cache))
    return torch.cat(out, dim=1).cpu()


# (rows B, our row, new tokens per step T, layout); partners have other prompt lengths, so padding differs
MODEL_SCHEDULES = ((1, 0, 1, RAGGED), (1, 0, 6, RAGGED), (3, 1, 6, LEFT_PADDED), (3, 2, 1, RAGGED),
                   (8, 5, 6, RAGGED), (8, 0, 1, LEFT_PADDED), (8, 7, 6, LEFT_PADDED))


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bi")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


# on a CUDA machine with TRITON_INTERPRET=0 the model test also runs on the GPU (Triton kernels, torch's CUDA
# RMSNorm): the check this CPU-only project could not make
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and not INTERPRET else [])
# The controls (with the mode off, some schedule differs) are facts about this project's CPU (AMD EPYC, AVX2,
# measured): they show the tests can fail. On the GPU machine (seen 2026-12-04, H200 with its host CPU) cuBLAS
# and the host's libraries gave these tiny models the same bits with the mode off too, so the control cannot be
# shown there; the assertions on the mode hold everywhere.
CONTROLS_HOLD = not torch.cuda.is_available()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_model_logits_are_bitwise_batch_invariant(family_checkpoints, family, dtype, device):
    """The same 26 tokens: alone with T = 1 (AR), alone with T = 6, in batches of 3 and 8 at rows 0/1/2/5/7,
    left-padded (different padding) and ragged, T = 1 and 6. Logits of all 7 positions equal bit for bit with
    the mode on; with it off at least one schedule differs."""
    rng = random.Random(0)
    ours = [rng.randrange(3, 131) for _ in range(26)]
    partners = [[rng.randrange(3, 131) for _ in range(6 + n)] for n in (5, 40, 12, 33, 8, 27, 17)]
    model = load_model(family_checkpoints[family], dtype=dtype, device=device)
    logits = {}
    for mode in (True, False):
        model.batch_invariant = mode
        runs = []
        for B, row, T, layout in MODEL_SCHEDULES:
            seqs = partners[:row] + [ours] + partners[row:B - 1]
            lens = [len(s) - 6 for s in seqs]
            runs.append(_schedule_logits(model, seqs, lens, T, layout)[row])
        logits[mode] = runs
    on, off = logits[True], logits[False]
    for (B, row, T, layout), got in zip(MODEL_SCHEDULES[1:], on[1:]):
        assert torch.equal(got, on[0]), f"{family} {dtype}: B={B} row={row} T={T} {layout} differs from AR"
    if CONTROLS_HOLD:
        assert any(not torch.equal(got, off[0]) for got in off[1:]), f"{family} {dtype}: ordinary mode invariant"
    assert torch.allclose(on[0].float(), off[0].float(), atol=0.1 if dtype == "bfloat16" else 1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unfused_model_is_batch_invariant_too(family_checkpoints, dtype):
    """`load_model(fuse=False)` keeps separate q/k/v projections; they go through `numerics.linear` as the
    fused one does, so the model is batch-invariant (and packed) in attention too, not only in its MLP."""
    rng = random.Random(1)
    ours = [rng.randrange(3, 131) for _ in range(26)]
    partners = [[rng.randrange(3, 131) for _ in range(6 + n)] for n in (5, 40, 12, 33, 8, 27, 17)]
    model = load_model(family_checkpoints["llama"], dtype=dtype, fuse=False)
    assert hasattr(model.layers[0].self_attn, "q_proj") and not hasattr(model.layers[0].self_attn, "qkv_proj")
    model.batch_invariant = True
    runs = []
    for B, row, T, layout in MODEL_SCHEDULES:
        seqs = partners[:row] + [ours] + partners[row:B - 1]
        runs.append(_schedule_logits(model, seqs, [len(s) - 6 for s in seqs], T, layout)[row])
    for (B, row, T, layout), got in zip(MODEL_SCHEDULES[1:], runs[1:]):
        assert torch.equal(got, runs[0]), f"fuse=False {dtype}: B={B} row={row} T={T} {layout} differs from AR"


def test_cli_flag_reaches_the_engine(monkeypatch):
    import specdec
    from specdec import run as cli

    class Built(Exception):
        pass

    seen = {}

    def fake_llm(*args, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(specdec, "LLM", fake_llm)
    for argv, expected in ((["--batch-invariant"], True), ([], "auto"), (["--batch-invariant", "off"], False),
                           (["--batch-invariant=auto"], "auto")):
        with pytest.raises(Built):
            cli.run(cli.build_parser().parse_args(argv + ["--no-progress"]))
        assert seen["batch_invariant"] == expected and type(seen["batch_invariant"]) is type(expected)


def kernel_functions(kernel) -> set:
    """The functions a chosen kernel runs (a partial of a function, its arguments partials or lists of them)."""
    if isinstance(kernel, functools.partial):
        return {kernel.func}.union(*(kernel_functions(a) for a in kernel.args))
    if isinstance(kernel, list):
        return set().union(*(kernel_functions(k) for k in kernel))
    return {kernel} if inspect.isfunction(kernel) or inspect.isbuiltin(kernel) else set()


def test_mode_is_a_model_attribute_and_skips_the_compiled_forward(family_checkpoints):
    model = load_model(family_checkpoints["llama"])
    assert model.batch_invariant is False
    model.batch_invariant = True
    ordinary = {numerics.plain_linear, numerics.packed_linear, numerics.addmm_linear_add, F.silu}
    for layer in model.layers:  # setting the mode chose every layer's kernels again
        runs = set().union(*(kernel_functions(k) for k in (layer.self_attn.project_kernel,
                                                           layer.self_attn.output_kernel, layer.mlp.kernel)))
        assert {numerics.invariant_linear, numerics.invariant_silu} <= runs and not runs & ordinary
    assert isinstance(model.attention_kind, InvariantAttention)
    model.compiled_forward = lambda *a: pytest.fail("the batch-invariant forward must not run the compiled one")
    cache = model.new_cache(1, 8)
    cache.set_prefill([3], 3)
    model.forward(torch.tensor([[5, 6, 7]]), cache, num_new=[3])
    model.forward(torch.tensor([[8]]), cache)
    with pytest.raises(ValueError, match="batch_invariant"):
        numerics.set_batch_invariant(object(), True)
    fresh = load_model(family_checkpoints["llama"])
    LLM(fresh, method="ar", batch_invariant=True)  # model objects are switched in place
    assert fresh.batch_invariant
    LLM(fresh, method="ar")  # the default leaves them as they are (an AR comparison engine sharing the target)
    assert fresh.batch_invariant


# ------------------------------------------------------------------------------------------ end to end
def test_greedy_speculative_equals_ar_in_bfloat16(tmp_path):
    """bfloat16, tiny Llama pair, 16 prompts, 32 tokens, k = 5, batch 8: with the mode off some requests of
    some method leave AR's path (near ties flip); with it on eqspec, ragged and exspec equal AR at batch 1."""
    target, draft = make_pair("llama", tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(1, 60))] for _ in range(16)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    mismatches = {}
    for mode in (False, True):
        common = dict(dtype="bfloat16", batch_invariant=mode, check_invariants=False)
        ar = LLM(target, method="ar", batch_size=1, **common).generate(prompt_token_ids=prompts, sampling_params=params)
        for method in (("ragged",) if not mode else ("eqspec", "ragged", "exspec")):
            outs = LLM(target, draft, method=method, num_speculative_tokens=5, batch_size=8, **common).generate(
                prompt_token_ids=prompts, sampling_params=params)
            mismatches[mode, method] = [o.index for o, r in zip(outs, ar) if o.token_ids != r.token_ids]
    assert mismatches[False, "ragged"], "bfloat16 without the mode already equals AR here: the test shows nothing"
    for method in ("eqspec", "ragged", "exspec"):
        assert mismatches[True, method] == [], f"{method}: requests {mismatches[True, method]} differ from AR"


def test_exspec_equals_ar_where_the_bfloat16_kernel_switches_at_prefill_sizes(llama_pair, monkeypatch, fresh_plans):
    """Issue 42 end to end on a simulated CPU whose bfloat16 calls of more than 600 rows take another kernel. Only
    exspec's pool prefill is that large (12 prompts, the longest 60 tokens: 720 rows; AR's calls have at most 60,
    eqspec's 8 x 60 = 480): run as called, exspec leaves AR's path on some prompts while eqspec does not (so the
    test can fail); with the plan the probe picks, exspec equals AR."""
    target, draft = llama_pair
    monkeypatch.setattr(bm, "_cpu_linear", kernel_by_rows(lambda M: M > 600))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 131) for _ in range(60 if i == 0 else rng.randint(1, 60))] for i in range(12)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    common = dict(dtype="bfloat16", batch_invariant=True, check_invariants=False)
    mismatches = {}
    probed = bm.cpu_plan  # the fixture's: measured with the stand-in
    for plans in ("as called", "probed"):
        monkeypatch.setattr(bm, "cpu_plan", probed if plans == "probed" else (
            lambda dtype, threads, shape: bm.RowPlan(threads, None)))
        ar = LLM(target, method="ar", batch_size=1, **common).generate(prompt_token_ids=prompts, sampling_params=params)
        for method in ("eqspec", "exspec") if plans == "as called" else ("exspec",):
            outs = LLM(target, draft, method=method, num_speculative_tokens=5, batch_size=8, **common).generate(
                prompt_token_ids=prompts, sampling_params=params)
            mismatches[plans, method] = [o.index for o, r in zip(outs, ar) if o.token_ids != r.token_ids]
    assert mismatches["as called", "exspec"] and not mismatches["as called", "eqspec"], mismatches
    assert mismatches["probed", "exspec"] == []


SPEC_BENCH_SLICE = os.path.join(os.path.dirname(__file__), "data", "spec_bench_64.jsonl")


@pytest.mark.slow
def test_specbench_slice_equals_ar_in_bfloat16():
    """The CI slice of the SpecBench check: the default pair in bfloat16 with the mode on, SpecBench's first
    64 prompts (cut to 64 tokens), 16 new tokens, k = 5: eqspec, ragged and exspec at batch 8 emit exactly
    AR's tokens at batch 1 (all 480 prompts x 32 tokens: `bench/batch_invariant.py equivalence`). With the
    mode off the same slice differs from AR on requests 6 and 20 (measured: docs/benchmarks/batch-invariant.md)."""
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [tokenizer.encode(p)[:64] for p in read_prompts(SPEC_BENCH_SLICE)]
    assert len(prompts) == 64
    params = SamplingParams(max_tokens=16, temperature=0.0)
    common = dict(dtype="bfloat16", batch_invariant=True, check_invariants=False)
    ar = LLM(DEFAULT_TARGET, method="ar", batch_size=1, **common).generate(prompt_token_ids=prompts,
                                                                         sampling_params=params)
    for method in ("eqspec", "ragged", "exspec"):
        outs = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method=method, num_speculative_tokens=5, batch_size=8,
                   **common).generate(prompt_token_ids=prompts, sampling_params=params)
        mismatched = [o.index for o, r in zip(outs, ar) if o.token_ids != r.token_ids]
        assert mismatched == [], f"{method}: SpecBench prompts {mismatched} differ from AR at batch 1"


def test_seeded_sampling_does_not_depend_on_the_batch(checkpoint_pairs):
    """With the mode on, target and draft are both invariant, so a seeded sampled request (coupled sampler,
    noise keyed by (seed, position)) gives the same tokens at batch 1 and batch 8, in bfloat16 (not so
    without: near-tied logits flip with the batch; 32 requests x 32 tokens make a flip near-certain)."""
    target, draft = checkpoint_pairs("qwen3")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(1, 40))] for _ in range(32)]
    params = [SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True) for i in range(32)]
    same = {}
    for mode in (False, True):
        llm = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=8, dtype="bfloat16",
                  batch_invariant=mode, check_invariants=False)
        together = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        alone = llm.generate(prompt_token_ids=prompts, sampling_params=params, batch_size=1)
        same[mode] = [a.token_ids == b.token_ids for a, b in zip(together, alone)]
    assert all(same[True])
    if CONTROLS_HOLD:
        assert not all(same[False]), "bfloat16 sampling without the mode is already batch-invariant here"


# ----------------------------------------------------------------------------------- Triton (interpreter)
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bi_matmul_triton_matches_reference_and_rows_keep_their_bits(dtype):
    g = torch.Generator().manual_seed(1)
    W, b, X = (t.to(KERNEL_DEVICE, dtype) for t in (torch.randn(70, 40, generator=g), torch.randn(70, generator=g),
                                                    torch.randn(140, 40, generator=g)))
    y = bm.bi_linear(X, W, b, backend="triton")
    ref = F.linear(X.double(), W.double(), b.double())
    rtol, atol = (1e-2, 0.1) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    assert torch.allclose(y.double(), ref, rtol=rtol, atol=atol)
    assert torch.allclose(bm.bi_linear(X, W, backend="triton").double(), ref - b.double(), rtol=1e-2, atol=0.1)
    # rows keep their bits when M, the other rows and the tile index change (tests/test_bi_kernels.py checks
    # rows at every place in their tile, alone and in batches of 3, 8 and 48)
    BLOCK_M = bm.matmul_config(70, 40, dtype, KERNEL_DEVICE).block_m
    for M, shift in ((1, 0), (3, BLOCK_M), (40, 0), (5, 2 * BLOCK_M)):
        other = X.clone()
        other[shift + M:] = torch.randn(len(X) - shift - M, 40, generator=g).to(KERNEL_DEVICE, dtype)
        got = bm.bi_linear(other[: shift + M], W, b, backend="triton")[shift:]
        assert torch.equal(got, y[shift: shift + M])
    if GPU:  # on the GPU every row keeps its bits at any place in its tile too
        assert rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="triton"), X) == []


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bi_attention_triton_is_invariant_and_matches_reference(dtype):
    """Per-query programs: bit-exact invariance under the interpreter too (chunk 16 to cross chunks)."""
    small = dict(capacity=60, H=2, Hkv=1, D=8, chunk=16)
    outs = []
    for B, T, lengths, starts, left in ((1, 1, [20], [0], False), (2, 1, [20, 3], [7, 0], True),
                                        (2, 3, [18, 30], [0, 0], False)):
        out, sdpa = _attention_case(dtype, B, T, list(range(B)), lengths, starts, left, backend="triton", **small)
        ref, _ = _attention_case(dtype, B, T, list(range(B)), lengths, starts, left, backend="torch", **small)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        assert torch.allclose(out.double(), ref.double(), atol=tol, rtol=tol)
        assert torch.allclose(out.double(), sdpa.double(), atol=tol, rtol=tol)
        outs.append(out[0, :, 20 - lengths[0]])  # query 20 of row 0
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_kernels_compile_for_sm90():
    """The interpreter forgives what the compiler rejects: compile both kernels for sm_90 (no GPU needed)."""
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("triton's nvidia backend is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def _compile_all_for_sm90():
    from unittest import mock

    from test_kernels import _compile_recorded

    x, w, b = torch.zeros(5, 40), torch.zeros(24, 40), torch.zeros(24)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        with contextlib.ExitStack() as patches:
            xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
            ptx = _compile_recorded(patches, bm, "_bi_matmul_kernel", lambda: (
                bm.bi_matmul_triton(xd, wd, bd), bm.bi_matmul_triton(xd, wd)))
            assert "mma" in ptx[0] or dtype == torch.float32  # tensor cores for bf16/fp64; fp32 stays IEEE (FMA)
        q, kc = torch.zeros(2, 6, 3, 24, dtype=dtype), torch.zeros(2, 2, 40, 24, dtype=dtype)
        mask, first = torch.zeros(2, 3, 33, dtype=torch.bool), torch.zeros(2, dtype=torch.int64)
        for name, other in (("_bi_attention_split_kernel", "_bi_attention_combine_kernel"),
                            ("_bi_attention_combine_kernel", "_bi_attention_split_kernel")):
            with contextlib.ExitStack() as patches:  # the other kernel of the launcher is not run (no GPU)
                patches.enter_context(mock.patch.object(ba, other, type("Null", (), {
                    "__getitem__": lambda self, grid: lambda *a, **kw: None})()))
                _compile_recorded(patches, ba, name, lambda: ba.bi_attention_triton(q, kc, kc.clone(), mask, first,
                                                                                     chunk=16, split=16))
    print("compiled bi_matmul and bi_attention for sm_90")


if __name__ == "__main__":
    _compile_all_for_sm90()
