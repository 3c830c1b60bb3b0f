"""The batch-invariant Triton kernels (issue #42): the tensor-core matmul (kernels/bi_matmul.py), the weight-only
int4/int8 matmul (kernels/quant_matmul.py), flash-decoding attention with a fixed split size
(kernels/bi_attention.py) and RMSNorm (kernels/rmsnorm.py).

For each: a row's (query's) output is the same bits alone and in batches of 3, 8 and 48 at other places among
random neighbours, and agrees with the torch reference within the dtype's tolerance. On a CPU the kernels run
under the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py), both with `dot="sum"` (each `tl.dot`
replaced by a `tl.sum` of the products: bit-exact invariant there) and with `dot="mma"` (the `tl.dot` code the
GPU runs; under the interpreter numpy's matmul, so checked against the reference only). On a CUDA machine run
with TRITON_INTERPRET=0: the compiled `tl.dot` kernels, whose full invariance is then asserted too
(bench/gpu_check.sh does). Shapes are small: the interpreter is slow.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from specdec.kernels import bi_attention as ba
from specdec.kernels import bi_matmul as bm
from specdec.kernels import dispatch
from specdec.kernels import quant_matmul as qm
from specdec.kernels import rmsnorm as rn
from specdec.kernels.positions import step_plan_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if GPU else "cpu"
needs_triton = pytest.mark.skipif(not (dispatch.triton_available() and (INTERPRET or GPU)),
                                  reason="needs triton with TRITON_INTERPRET=1, or a CUDA device")
# "sum" would not fit a GPU's registers at the real tiles; it exists for the interpreter
DOTS = ("sum", "mma") if not GPU else ("mma",)
BATCHES = (3, 8, 48)  # the batch sizes a row is checked in (besides alone)


def exact_invariance(dot: str) -> bool:
    """Whether the rows must be bit-exact across calls: always with "sum"; with "mma" on a GPU (an MMA's row
    does not depend on its place in the tile), not under the interpreter (numpy's matmul is not promised so)."""
    return dot == "sum" or GPU


def rows_in_batches(fn, X, probe=(0, 5, 11), batches=BATCHES, seed=0):
    """For each probed row of X (rows of X are independent inputs): fn of it alone, then of batches of
    `batches` rows where it sits at other places among random neighbours. Returns [(alone, batched), ...]:
    what must be equal."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i in probe:
        alone = fn(X[i: i + 1])
        for n in batches:
            place = (i * 7 + n) % n  # a different place in each batch
            other = (torch.randn((n,) + X.shape[1:], generator=g) * 3).to(X.dtype).to(X.device)
            other[place] = X[i]
            pairs.append((alone[0], fn(other)[place]))
    return pairs


# ------------------------------------------------------------------------------------------------ matmul
MATMUL_TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 0.1), torch.float16: (2e-3, 2e-2),
              torch.float64: (1e-12, 1e-12)}


@needs_triton
@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["float32", "bfloat16", "float16", "float64"])
def test_bi_matmul_rows_alone_and_in_batches(dtype, dot):
    g = torch.Generator().manual_seed(1)
    wide = dtype in (torch.float32, torch.float64)
    K = 40 if wide else 200  # two or three BLOCK_K steps, the last partial
    W, b = torch.randn(72, K, generator=g).to(DEVICE, dtype), torch.randn(72, generator=g).to(DEVICE, dtype)
    X = torch.randn(12, K, generator=g).to(DEVICE, dtype)
    fn = lambda x: bm.bi_matmul_triton(x, W, b, dot=dot)  # noqa: E731
    y = fn(X)
    ref = X.double() @ W.double().t() + b.double()
    rtol, atol = MATMUL_TOL[dtype]
    assert torch.allclose(y.double(), ref, rtol=rtol, atol=atol)
    assert torch.allclose(bm.bi_matmul_triton(X, W, dot=dot).double(), ref - b.double(), rtol=rtol, atol=atol)
    if exact_invariance(dot):
        assert all(torch.equal(a, c) for a, c in rows_in_batches(fn, X))
        if not wide:  # the float32 accumulator itself: a 16-bit output rounds most order differences away
            acc = lambda x: bm.bi_matmul_triton(x, W, b, dot=dot, out_dtype=torch.float32)  # noqa: E731
            assert all(torch.equal(a, c) for a, c in rows_in_batches(acc, X, probe=(5,)))
    else:  # the interpreter's tl.dot path: against the tolerance
        assert all(torch.allclose(a.double(), c.double(), rtol=rtol, atol=atol)
                   for a, c in rows_in_batches(fn, X, probe=(5,)))


@needs_triton
def test_bi_matmul_crosses_tiles_and_takes_any_strides():
    """More rows than BLOCK_M and more columns than BLOCK_N x programs (the persistent loop runs several
    tiles per program); a transposed weight view and a strided input; the config never depends on M."""
    g = torch.Generator().manual_seed(2)
    dtype = torch.float32
    cfg = bm.matmul_config(200, 24, dtype, DEVICE)
    assert all(bm.matmul_config(200, 24, dtype, DEVICE) is cfg for _ in range(2)) and bm.CONFIGS
    W = torch.randn(24, 200, generator=g).to(DEVICE, dtype).t()  # [200, 24] view
    X = torch.randn(70, 48, generator=g).to(DEVICE, dtype)[:, ::2]  # [70, 24] view
    y = bm.bi_linear(X, W, backend="triton")
    assert torch.allclose(y.double(), X.double() @ W.double().t(), rtol=1e-5, atol=1e-4)
    assert torch.equal(bm.bi_linear(X[40:41], W, backend="triton")[0], y[40])
    for M in (1, 8, 64):  # the same config object for every M: nothing is chosen by the rows
        assert bm.matmul_config(200, 24, dtype, DEVICE) == cfg
        bm.bi_linear(X[:M], W, backend="triton")
    assert bm.default_config(4096, 4096, torch.bfloat16, 132).block_n == 32  # 128 tiles on an H200 at one row
    assert bm.default_config(32000, 4096, torch.bfloat16, 132).block_n == 128


# ------------------------------------------------------------------------------------ weight-only int4/int8
def _quant_weight(fmt, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    if fmt == "int4":
        codes = qm.pack_nibbles(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8))
        scales = (torch.rand(N, K // qm.GROUP, generator=g) * 0.1 + 0.01).bfloat16()
        zeros = (torch.randn(N, K // qm.GROUP, generator=g) * 0.05).bfloat16()
        return tuple(qm.k_major(t).to(DEVICE) for t in (codes, scales, zeros))  # QuantLinear's layout
    codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scales = (torch.rand(N, generator=g) * 0.01 + 1e-3).bfloat16()
    return qm.k_major(codes).to(DEVICE), scales.to(DEVICE), None


@needs_triton
@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", qm.FORMATS)
def test_quant_matmul_rows_alone_and_in_batches(fmt, dtype, dot):
    N, K = 40, 96  # int4: 3 groups, one step of BLOCK_K = 128 with its last group masked
    codes, scales, zeros = _quant_weight(fmt, N, K, seed=3)
    X = torch.randn(12, K, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    fn = lambda x: qm.quant_matmul_triton(x, fmt, codes, scales, zeros, dot=dot)  # noqa: E731
    y = fn(X)
    w = qm.dequantize_weight(fmt, codes, scales, zeros, torch.float64)  # [N, K]
    magnitude = X.double().abs() @ w.abs().t()
    eps = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert ((y.double() - X.double() @ w.t()).abs() <= (1e-5 + 2 * eps) * magnitude + 1e-6).all()
    full = exact_invariance(dot)  # the interpreter's tl.dot path: one batch, against the tolerance
    pairs = rows_in_batches(fn, X, probe=(0, 7) if full else (7,), batches=BATCHES if full else (8,))
    if full:  # the float32 accumulator itself too: a bfloat16 output rounds most order differences away
        pairs += rows_in_batches(lambda x: qm.quant_matmul_triton(x, fmt, codes, scales, zeros, dot=dot,
                                                                  out_dtype=torch.float32), X, probe=(3,))
    if exact_invariance(dot):
        assert all(torch.equal(a, c) for a, c in pairs)
    else:
        assert all(((a.double() - c.double()).abs() <= 1e-5 * magnitude[0].max() + 2 * eps * a.double().abs()).all()
                   for a, c in pairs)


@needs_triton
def test_quant_matmul_layouts_agree_and_the_model_keeps_k_major():
    """The kernel takes any strides: K-major (QuantLinear's) and row-major operands give the same bits."""
    codes, scales, zeros = _quant_weight("int4", 40, 64, seed=5)
    x = torch.randn(3, 64).to(DEVICE, torch.bfloat16)
    dense = [t.contiguous() for t in (codes, scales, zeros)]
    assert not codes.is_contiguous() and codes.stride() == (1, 40)
    assert torch.equal(qm.quant_matmul(x, "int4", codes, scales, zeros, backend="triton"),
                       qm.quant_matmul(x, "int4", *dense, backend="triton"))
    from specdec.models.quant import QuantLinear

    layer = QuantLinear("int8", torch.randint(-127, 128, (40, 64), dtype=torch.int8), torch.rand(40) * 0.01)
    assert layer.codes.stride() == (1, 40)  # the layer keeps its codes K-major


# -------------------------------------------------------------------------------------------- attention
H, HKV, D, CAP = 6, 2, 16, 96  # GQA group of 3 query heads; T = 6 gives 18 query rows: two row blocks
CHUNK, SPLIT = 16, 32  # small, so that contexts of 20-70 keys cross chunks and splits


def _attention(dtype, B, T, seqs, lengths, starts, left_padded, dot, seed=0):
    """Attention outputs [B, H, T, D] for a batch whose row i holds sequence seqs[i]'s first lengths[i] tokens
    at column starts[i] and feeds its next T; a sequence's token j has the same q/K/V in every layout."""
    g = torch.Generator().manual_seed(seed)
    k_tok, v_tok = (torch.randn(64, HKV, 90, D, generator=g).to(dtype) for _ in range(2))  # sequence, token
    q_tok = torch.randn(64, H, 90, D, generator=g).to(dtype)
    k_cache = torch.randn(B, HKV, CAP, D, generator=g).to(dtype)  # junk everywhere else
    v_cache = torch.randn(B, HKV, CAP, D, generator=g).to(dtype)
    q = torch.empty(B, H, T, D, dtype=dtype)
    for i, (r, n, s) in enumerate(zip(seqs, lengths, starts)):
        k_cache[i, :, s: s + n + T] = k_tok[r, :, : n + T]
        v_cache[i, :, s: s + n + T] = v_tok[r, :, : n + T]
        q[i] = q_tok[r, :, n: n + T]
    width = max(s + n + T for s, n in zip(starts, lengths))
    _, _, mask = step_plan_reference(torch.tensor(starts), torch.tensor(lengths), torch.full((B,), T), T,
                                     left_padded, width)
    q, k_cache, v_cache, mask = (t.to(DEVICE) for t in (q, k_cache, v_cache, mask))
    first = ba.first_keys(mask)
    out = ba.bi_attention_triton(q, k_cache, v_cache, mask, first, chunk=CHUNK, split=SPLIT, dot=dot)
    ref = ba.bi_attention_reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), mask.cpu(), first.cpu())
    return out.cpu(), ref


ATT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def _attention_schedules(dtype, dot, full=True):
    """Token 40 of sequence 0 (its 41st: 40 keys before it) computed as: AR (alone, T = 1) after 0 and after 9
    padding columns; as query 2 and 5 of a verify of T = 6 alone; in batches of 3, 8 and 48, decode and
    verify, ragged and left-padded with other rows' padding (`full`: with the batches of 8 and 48); returns its
    [H, D] outputs and the references'."""
    outs, refs = [], []

    def add(B, T, lengths, starts, left, j, seed_rows=1):
        seqs = [0] + [(seed_rows + i) % 63 + 1 for i in range(B - 1)]
        out, ref = _attention(dtype, B, T, seqs, lengths, starts, left, dot)
        outs.append(out[0, :, j])
        refs.append(ref[0, :, j])

    add(1, 1, [40], [0], False, 0)  # AR: W = 41 -> 2 splits of 32
    add(1, 1, [40], [9], True, 0)  # AR after 9 padding columns
    add(1, 6, [38], [0], False, 2)  # verify of k + 1 = 6, the token is query 2
    add(1, 6, [35], [4], True, 5)  # ... query 5, left-padded
    add(3, 1, [40, 3, 70], [0, 0, 0], False, 0)  # ragged decode batch, W = 71 -> 3 splits
    add(3, 6, [38, 7, 50], [12, 43, 0], True, 2)  # left-padded verify, other padding
    if full:
        add(8, 6, [37, 5, 20, 1, 33, 9, 12, 8], [0] * 8, False, 3, seed_rows=9)  # ragged verify
        lengths48 = [40] + [(7 * i) % 29 for i in range(1, 48)]
        starts48 = [41 - n for n in lengths48]  # left-padded: every row ends at column 41 (2 splits)
        add(48, 1, lengths48, starts48, True, 0, seed_rows=20)
    return outs, refs


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bi_attention_query_alone_verify_batched_ragged_padded(dtype):
    """The kernel's own dot ("sum" under the interpreter, "mma" on a GPU): bit-exact across the schedules."""
    outs, refs = _attention_schedules(dtype, DOTS[0])
    tol = ATT_TOL[dtype]
    for out, ref in zip(outs, refs):
        assert torch.allclose(out.double(), ref.double(), atol=tol, rtol=tol)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), [torch.equal(o, outs[0]) for o in outs]


@needs_triton
@pytest.mark.skipif(GPU, reason="the GPU runs the tl.dot path in the test above")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["float32", "bfloat16", "float64"])
def test_bi_attention_mma_path_matches_reference(dtype):
    """The tl.dot code (what the GPU runs) under the interpreter: the reference's numbers, in fewer schedules."""
    outs, refs = _attention_schedules(dtype, "mma", full=False)
    for out, ref in zip(outs, refs):
        assert torch.allclose(out.double(), ref.double(), atol=ATT_TOL[dtype], rtol=ATT_TOL[dtype])


@needs_triton
def test_bi_attention_one_split_equals_many_and_short_queries():
    """A query whose keys fit in split 0 gets the same bits from the one-split kernel (W <= split, the output
    written directly) and through the combine kernel (a wider row beside it); a prefill's left-padding query
    that sees no key gets zeros; the wrapper runs the kernel with its default chunk and split."""
    dot = DOTS[0]
    a, _ = _attention(torch.float32, 1, 1, [0], [20], [0], False, dot)  # W = 21 <= 32: one split
    b, _ = _attention(torch.float32, 2, 1, [0, 5], [20, 80], [0, 0], False, dot)  # W = 81: 3 splits
    assert torch.equal(a[0], b[0])
    q = torch.randn(2, 4, 4, D).to(DEVICE)
    cache = torch.randn(2, 2, 10, D).to(DEVICE)
    _, _, mask = step_plan_reference(torch.tensor([2, 0]), torch.tensor([0, 0]), torch.tensor([2, 4]), 4, True, 4)
    out = ba.bi_attention(q, cache, cache.clone(), mask.to(DEVICE), backend="triton")
    assert torch.isfinite(out).all() and (out[0, :, :2] == 0).all()
    ref = ba.bi_attention(q.cpu(), cache.cpu(), cache.cpu(), mask, backend="torch")
    assert torch.allclose(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of chunk"):
        ba.bi_attention_triton(q, cache, cache, mask.to(DEVICE), ba.first_keys(mask).to(DEVICE), chunk=16, split=40)


# ---------------------------------------------------------------------------------------------- RMSNorm
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["float32", "bfloat16", "float16", "float64"])
def test_rms_norm_rows_alone_and_in_batches(dtype):
    g = torch.Generator().manual_seed(6)
    N = 200  # not a power of two: the block is masked
    X = (torch.randn(12, N, generator=g) * 4).to(DEVICE, dtype)
    R = torch.randn(12, N, generator=g).to(DEVICE, dtype)
    w = (torch.rand(N, generator=g) + 0.5).to(DEVICE, dtype)
    y = rn.rms_norm(X, w, 1e-6, backend="triton")
    ref = rn.rms_norm(X, w, 1e-6, backend="torch")
    assert y.dtype == ref.dtype and y.shape == ref.shape
    # one rounding of the output (and, under the interpreter, a truncating cast to bfloat16) apart
    tol = {torch.float32: 1e-5, torch.float64: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert torch.allclose(y.double(), ref.double(), rtol=tol, atol=tol)
    y2, h2 = rn.rms_norm(X, w, 1e-6, residual=R, backend="triton")
    ref2, h_ref = rn.rms_norm(X, w, 1e-6, residual=R, backend="torch")
    assert torch.allclose(y2.double(), ref2.double(), rtol=tol, atol=tol)
    if dtype != torch.bfloat16 or GPU:  # the interpreter's float32 -> bfloat16 cast truncates
        assert torch.equal(h2, h_ref)  # the residual add is torch's, bit for bit
    pairs = rows_in_batches(lambda x: rn.rms_norm(x, w, 1e-6, backend="triton"), X)
    pairs += rows_in_batches(lambda x: rn.rms_norm(x, w, 1e-6, residual=torch.ones_like(x), backend="triton")[0], X,
                             probe=(5,))
    assert all(torch.equal(a, c) for a, c in pairs)


def test_rms_norm_reference_is_the_models_rmsnorm_and_validates():
    """The torch path is models/transformer.py's RMSNorm.forward bit for bit (so the model may call the wrapper
    unconditionally), mixed weight/activation dtypes promote like it, and the wrapper names bad arguments."""
    from specdec.models.transformer import RMSNorm

    for xdt, wdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
        norm = RMSNorm(48, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48))
        norm = norm.to(wdt)
        x = torch.randn(3, 5, 48).to(xdt)
        assert torch.equal(rn.rms_norm(x, norm.weight, norm.eps, backend="torch"), norm(x))
        r = torch.randn(3, 5, 48).to(xdt)
        y, h = rn.rms_norm(x, norm.weight, norm.eps, residual=r, backend="torch")
        assert torch.equal(h, x + r) and torch.equal(y, norm(x + r))
    with pytest.raises(ValueError, match="weight must be"):
        rn.rms_norm(torch.zeros(2, 4), torch.zeros(5), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rn.rms_norm(torch.zeros(2, 4), torch.zeros(4), 1e-6, residual=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="floating-point"):
        rn.rms_norm(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(4), 1e-6)


# ------------------------------------------------------------------------------------------- the model
@pytest.mark.slow  # ~130 kernel launches per dtype under the interpreter (~20-40 s on a 2-core CPU)
@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_on_the_triton_kernels_keeps_a_prompts_logits(llama_pair, monkeypatch, dtype):
    """The wiring: a batch-invariant model whose linear layers and attention run the Triton kernels
    (models/numerics.py -> bi_linear / bi_attention, forced with the caches' backend "triton") gives a prompt the same
    logits bit for bit alone (T = 1 steps) and in a left-padded batch of 3 (T = 2 steps). (float32 shows a
    matmul tile chosen by M: checked by hand; bfloat16 logits round such differences away more often.)"""
    from test_batch_invariant import _schedule_logits

    from specdec.models import load_model
    from specdec.models.cache import LEFT_PADDED, RAGGED

    model = load_model(llama_pair[0], dtype=dtype, device=DEVICE)
    model.batch_invariant = True
    ours = [5, 17, 3, 99, 42, 7, 1, 100, 8, 64, 9, 30]
    partners = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [40, 41, 42, 43, 44, 45]]
    with torch.no_grad():
        alone = _schedule_logits(model, [ours], [8], 1, RAGGED, "triton")[0]  # [1 + 4, V]
        seqs = [partners[0], ours, partners[1]]
        batched = _schedule_logits(model, seqs, [len(s) - 4 for s in seqs], 2, LEFT_PADDED, "triton")[1]
    assert torch.equal(alone, batched)


# ------------------------------------------------------------------------------------------------ compiler
@pytest.mark.slow  # ~1-2 min of compiling on a 2-core CPU
@pytest.mark.skipif(not dispatch.triton_compiles_for_nvidia(), reason="triton's nvidia backend is not installed")
def test_new_kernels_compile_for_sm90_with_tensor_cores():
    """Compile every new kernel as its launcher calls it, specialised as on a GPU (unit strides constant,
    16-byte alignment known): tensor-core MMAs for 16-bit inputs, pipelined (cp.async) loads, no spills, and
    shared memory within an H100/H200's 227 KiB. No GPU needed."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout + proc.stderr[-4000:]


class _Null:
    def __getitem__(self, grid):
        return lambda *a, **kw: None


def _compile_for_sm90():
    from unittest import mock

    from test_kernels import _compile_recorded

    def compile_(mod, name, launch, others=()):
        meta = []
        with contextlib.ExitStack() as patches:
            for other in others:  # the launcher's other kernels are not run (no GPU here)
                patches.enter_context(mock.patch.object(mod, other, _Null()))
            ptx = _compile_recorded(patches, mod, name, launch, specialize=True, metadata=meta)
        for p, m in zip(ptx, meta):
            assert ".local" not in p, f"{name}: registers spilled"
            assert m.shared <= 227 * 1024, f"{name}: {m.shared} bytes of shared memory"
        return ptx

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x, w, b = torch.zeros(5, 512, dtype=dtype), torch.zeros(512, 512, dtype=dtype), torch.zeros(512, dtype=dtype)
        configs = {bm.default_config(n * 200, 512, dtype, 132) for n in bm.BLOCK_N_CHOICES}
        for cfg in configs:
            ptx = compile_(bm, "_bi_matmul_kernel", lambda: (bm.bi_matmul_triton(x, w, b, config=cfg),
                                                             bm.bi_matmul_triton(x, w, config=cfg)))
            assert "cp.async" in ptx[0], f"{dtype} {cfg}: loads not pipelined"
            if dtype in (torch.bfloat16, torch.float16):
                assert "wgmma" in ptx[0], f"{dtype} {cfg}: no warpgroup MMA"
            if dtype == torch.float64:
                assert "mma" in ptx[0]
        if dtype == torch.float64:
            continue
        q, kc = torch.zeros(2, 32, 6, 128, dtype=dtype), torch.zeros(2, 8, 600, 128, dtype=dtype)
        mask, first = torch.zeros(2, 6, 520, dtype=torch.bool), torch.zeros(2, dtype=torch.int64)
        launch = lambda: (ba.bi_attention_triton(q, kc, kc.clone(), mask, first),  # noqa: E731
                          ba.bi_attention_triton(q, kc, kc.clone(), mask[:, :, :200], first))
        ptx = compile_(ba, "_bi_attention_split_kernel", launch, others=("_bi_attention_combine_kernel",))
        assert dtype == torch.float32 or "mma" in ptx[0]
        compile_(ba, "_bi_attention_combine_kernel", launch, others=("_bi_attention_split_kernel",))
        xr = torch.zeros(3, 4096, dtype=dtype)
        compile_(rn, "_rms_norm_kernel", lambda: (rn.rms_norm_triton(xr, xr[0], 1e-6),
                                                  rn.rms_norm_triton(xr, xr[0].float(), 1e-6, residual=xr)))
        if dtype != torch.float64:
            xq = torch.zeros(5, 4096, dtype=dtype)
            nib, sc = qm.k_major(torch.zeros(4096, 2048, dtype=torch.uint8)), qm.k_major(
                torch.zeros(4096, 128, dtype=torch.bfloat16))
            codes = qm.k_major(torch.zeros(4096, 4096, dtype=torch.int8))
            row_scales = torch.zeros(4096, dtype=torch.bfloat16)
            ptx = compile_(qm, "_quant_matmul_kernel", lambda: (qm.quant_matmul_triton(xq, "int4", nib, sc, sc.clone()),
                                                                qm.quant_matmul_triton(xq, "int8", codes, row_scales)))
            assert all("cp.async" in p for p in ptx) and (dtype == torch.float32 or all("mma" in p for p in ptx))
    print("compiled the batch-invariant kernels for sm_90")


if __name__ == "__main__":
    _compile_for_sm90()
