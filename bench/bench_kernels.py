"""Kernel microbenchmarks (pytest-benchmark; not part of the test run): realign, rejection sampling, race noise,
the batch-invariant linear and attention, weight-only quantized matmul. On CPU the torch reference path is timed,
on CUDA the Triton kernels; `extra_info` holds each case's shape, path and bytes per second (docs/kernels.md).

    SPECDEC_BENCH_QUICK=1 python -m pytest bench/bench_kernels.py --benchmark-only   # a couple of minutes on CPU
"""
from __future__ import annotations

import os
import statistics

import pytest
import torch

from bench.common import interleave, stopwatch
from specdec.kernels import noise as nse
from specdec.kernels import realign as rea
from specdec.kernels import rejection as rej

QUICK = os.environ.get("SPECDEC_BENCH_QUICK", "0") not in ("", "0")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PATH = "triton" if CUDA else "torch"
CPU_MEMORY_LIMIT = 2 * 2**30  # skip CPU combos that would need more (caches + reference temporaries + copy)
K = 4  # speculative tokens: |delta| <= K

BATCHES = (1, 8) if QUICK else (1, 8, 32)
CONTEXTS = (256, 1024) if QUICK else (256, 1024, 4096)
LAYERS = (4,) if QUICK else (4, 32)
REALIGN_IMPLS = ("kernel", "wrapper", "pingpong", "reference") if CUDA else ("reference",)

REJ_BATCHES = (1, 32) if QUICK else (1, 8, 32)
REJ_K = (4,) if QUICK else (1, 4, 8)
REJ_VOCAB = (32000, 151936)
REJ_MODES = ("random", "greedy")
ROUNDS = 3 if QUICK else 5
if not CUDA:  # a shared CPU box: oversubscribed intra-op threads are 10x slower, not faster
    torch.set_num_threads(int(os.environ.get("SPECDEC_BENCH_THREADS", "1")))


def _synced(fn):
    """fn, then a wait for the GPU (CUDA)."""
    def call():
        fn()
        if CUDA:
            torch.cuda.synchronize()
    return call


def _time(fn, reps=3) -> float:
    """Median seconds of fn() (synchronised), after one untimed call."""
    return statistics.median(interleave({"fn": stopwatch(_synced(fn))}, reps)["fn"])


def _run(benchmark, fn):
    call = _synced(fn)
    if CUDA:
        from triton.testing import do_bench

        q50, q20, q80 = do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        benchmark.extra_info.update(do_bench_ms_p50=q50, do_bench_ms_p20=q20, do_bench_ms_p80=q80)
        benchmark.pedantic(call, rounds=20, iterations=1, warmup_rounds=2)
        return q50 / 1e3
    benchmark.pedantic(call, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    return benchmark.stats.stats.median


def _realign_case(B, C, L):
    """Caches and one EQSPEC-like shift: rows right-aligned at column C + K move by delta in [-K, K]."""
    g = torch.Generator().manual_seed(B * 7 + C + L)
    cap = C + 2 * K
    count = C - torch.randint(0, max(1, C // 4), (B,), generator=g)  # [B] valid columns per row
    start = torch.full((B,), K) + (C - count)  # right-aligned at column C + K
    delta = torch.randint(-K, K + 1, (B,), generator=g)
    if B > 1:
        delta[0] = 0  # one row stays (in EQSPEC the longest never moves)
    elif int(delta[0]) == 0:
        delta[0] = K // 2  # a lone row never needs realigning; move it anyway to have something to time
    shapes = [(L, 8, 128), (max(1, L // 2), 8, 64)]
    caches = [tuple(torch.empty(l, B, h, cap, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
              for l, h, d in shapes]
    per_column = sum(2 * l * h * d * 2 for l, h, d in shapes)  # bytes of one column of one row, K + V, both caches
    moved = int(count[delta != 0].sum())
    everything = int(count.sum()) * per_column
    return caches, start.to(DEVICE), count.to(DEVICE), delta.to(DEVICE), moved * per_column, everything


def _realign_bytes(B, C, L):
    return B * (C + 2 * K) * (2 * L * 8 * 128 * 2 + 2 * max(1, L // 2) * 8 * 64 * 2)


@pytest.mark.parametrize("impl", REALIGN_IMPLS)
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("batch", BATCHES)
def test_realign(benchmark, batch, context, layers, impl):
    cache_bytes = _realign_bytes(batch, context, layers)
    if not CUDA and cache_bytes * 1.5 + 2 * cache_bytes > CPU_MEMORY_LIMIT:
        pytest.skip(f"needs ~{(cache_bytes * 3.5) / 2**30:.1f} GiB on CPU (> 2 GiB)")
    if CUDA:
        torch.cuda.empty_cache()  # earlier cases' blocks sit in torch's cache, not in mem_get_info's "free"
        free, _ = torch.cuda.mem_get_info()
        factor = {"reference": 6.0, "pingpong": 4.5}.get(impl, 3.5)  # int64 gather indices; second buffers
        if cache_bytes * factor > 0.8 * free:
            pytest.skip(f"needs ~{cache_bytes * factor / 2**30:.0f} GiB of GPU memory")
    caches, start, count, delta, moved_bytes, all_bytes = _realign_case(batch, context, layers)
    if impl == "kernel":
        fn = lambda: rea.realign_triton(caches, start, count, delta)  # noqa: E731
    elif impl == "wrapper":  # what the runtime pays: validation (host syncs) + kernel
        fn = lambda: rea.realign(caches, start, count, delta, backend="triton")  # noqa: E731
    elif impl == "pingpong":  # out of place into second buffers: every row is copied, delta = 0 included
        out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in caches]
        fn = lambda: rea.realign_triton(caches, start, count, delta, out=out)  # noqa: E731
        moved_bytes = all_bytes
    else:
        fn = lambda: rea.realign(caches, start, count, delta, backend="torch")  # noqa: E731
    seconds = _run(benchmark, fn)
    src = torch.empty(moved_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src))
    del src, dst
    benchmark.extra_info.update(
        path="torch" if impl == "reference" else PATH, impl=impl, device=DEVICE, threads=torch.get_num_threads(),
        batch=batch, context=context, layers=layers, cache_bytes=cache_bytes, payload_bytes=moved_bytes,
        gbps=2 * moved_bytes / seconds / 1e9, copy_gbps=2 * moved_bytes / copy_s / 1e9,
        copy_ms=copy_s * 1e3, fraction_of_copy=copy_s / seconds,
    )


def _rejection_case(B, k, V, mode):
    g = torch.Generator().manual_seed(B + k + V)
    target_probs = torch.softmax(torch.randn(B, k + 1, V, generator=g) * 3, -1).to(DEVICE)
    draft_probs = torch.softmax(torch.randn(B, k, V, generator=g) * 3, -1).to(DEVICE)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, V).cpu(), 1, generator=g).reshape(B, k).to(DEVICE)
    if mode == "greedy":
        argmax = target_probs.argmax(-1)
        return dict(draft_ids=torch.where(torch.rand(B, k, device=DEVICE) < 0.7, argmax[:, :k], draft_ids),
                    target_argmax=argmax)
    return dict(draft_ids=draft_ids, target_probs=target_probs, draft_probs=draft_probs,
                is_greedy=torch.zeros(B, dtype=torch.bool, device=DEVICE),
                uniforms=torch.rand(B, k, dtype=torch.float64, generator=g).to(DEVICE),
                noise=torch.empty(B, V).exponential_(generator=g).to(DEVICE))


@pytest.mark.parametrize("mode", REJ_MODES)
@pytest.mark.parametrize("vocab", REJ_VOCAB)
@pytest.mark.parametrize("k", REJ_K)
@pytest.mark.parametrize("batch", REJ_BATCHES)
def test_rejection(benchmark, batch, k, vocab, mode):
    kw = _rejection_case(batch, k, vocab, mode)
    backend = "triton" if CUDA else "torch"
    fn = lambda: rej.rejection_sample(**kw, backend=backend)  # noqa: E731
    seconds = _run(benchmark, fn)
    read = batch * 3 * vocab * 4 if mode == "random" else 0  # p and q at the emitted slot, and the noise row
    extra = dict(path=PATH, device=DEVICE, threads=torch.get_num_threads(), batch=batch, k=k, vocab=vocab, mode=mode,
                 bytes_read=read, gbps=read / seconds / 1e9)
    if CUDA:  # the torch reference on the same GPU, for comparison
        ref_s = _time(lambda: rej.rejection_sample(**kw, backend="torch"))
        extra.update(reference_ms=ref_s * 1e3, speedup_vs_reference=ref_s / seconds)
    benchmark.extra_info.update(extra)


# ------------------------------------------------------------------------------------------- noise
# A step's race noise [B, k+1, V] (kernels/noise.py) next to `torch.empty(...).exponential_()` of the same shape
NOISE_BATCHES = (1, 8) if QUICK else (1, 8, 32)
NOISE_K = (5,)
NOISE_VOCAB = (4000, 32000) if QUICK else (4000, 32000, 151936)


@pytest.mark.parametrize("impl", ("philox", "torch_exponential"))
@pytest.mark.parametrize("vocab", NOISE_VOCAB)
@pytest.mark.parametrize("k", NOISE_K)
@pytest.mark.parametrize("batch", NOISE_BATCHES)
def test_noise(benchmark, batch, k, vocab, impl):
    seeds = torch.arange(batch, dtype=torch.int64, device=DEVICE) * 7919 - 3
    positions = torch.arange(batch, dtype=torch.int64, device=DEVICE) * 13 + 100
    if impl == "philox":
        fn = lambda: nse.exponential_noise(seeds, positions, k + 1, vocab, nse.RACE, torch.float32,  # noqa: E731
                                           backend=PATH)
    else:
        fn = lambda: torch.empty(batch, k + 1, vocab, device=DEVICE).exponential_()  # noqa: E731
    seconds = _run(benchmark, fn)
    written = batch * (k + 1) * vocab * 4  # the float32 noise
    benchmark.extra_info.update(path=PATH if impl == "philox" else "torch", device=DEVICE, impl=impl,
                                threads=torch.get_num_threads(), batch=batch, k=k, vocab=vocab,
                                bytes_written=written, gbps=written / seconds / 1e9)


# ------------------------------------------------------------------------ batch-invariant linear / attention
# impl "invariant" (bi_linear / bi_attention / rms_norm: the Triton kernels on CUDA, the torch paths on the CPU)
# or "ordinary" (F.linear = cuBLAS / SDPA / the model's torch RMSNorm). On CUDA: Llama-2-7B (Vicuna-7B) and
# Llama-3-8B projection shapes, 1-64 rows, bfloat16 (the bar: invariant >= 0.85x ordinary, issue #42).
from specdec.kernels import bi_attention as bia  # noqa: E402
from specdec.kernels import bi_matmul as bim  # noqa: E402
from specdec.kernels import dispatch as dsp  # noqa: E402
from specdec.kernels import rmsnorm as rms  # noqa: E402

# (model, projection) -> (N, K); the models' fused q/k/v and gate/up, as specdec runs them
LLAMA_SHAPES = {
    ("7b", "qkv"): (12288, 4096), ("7b", "o"): (4096, 4096), ("7b", "gate_up"): (22016, 4096),
    ("7b", "down"): (4096, 11008), ("7b", "lm_head"): (32000, 4096),
    ("8b", "qkv"): (6144, 4096), ("8b", "gate_up"): (28672, 4096), ("8b", "down"): (4096, 14336),
    ("8b", "lm_head"): (128256, 4096),  # 8b's o_proj is 7b's
}
BI_DTYPES = ("bfloat16", "float32") if not CUDA else ("bfloat16",)
BI_ROWS = (1, 8, 48) if not CUDA else (1, 2, 4, 8, 16, 32, 64)
BI_LINEAR_SHAPES = (((640, 384), (2048, 768)) if QUICK else ((640, 384), (4000, 384), (2048, 768), (768, 2048))) \
    if not CUDA else tuple(LLAMA_SHAPES.values())
BI_ATTN = {"small": dict(H=6, Hkv=2, D=64)} if not CUDA else {"7b": dict(H=32, Hkv=32, D=128),
                                                              "8b": dict(H=32, Hkv=8, D=128)}
BI_BATCHES = (1, 8) if not CUDA else (1, 8, 32)
BI_CONTEXTS = (256,) if (QUICK or not CUDA) else (512, 2048)


def _shape_id(shape):
    names = [f"{m}-{p}" for (m, p), s in LLAMA_SHAPES.items() if s == shape]
    return (names[0] + "-" if names else "") + f"{shape[0]}x{shape[1]}"


@pytest.mark.parametrize("impl", ("invariant", "ordinary"))
@pytest.mark.parametrize("rows", BI_ROWS)
@pytest.mark.parametrize("shape", BI_LINEAR_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", BI_DTYPES)
def test_bi_linear(benchmark, dtype, shape, rows, impl):
    N, K = shape
    dt = getattr(torch, dtype)
    weight = torch.randn(N, K, device=DEVICE).to(dt) * 0.02
    x = torch.randn(rows, K, device=DEVICE).to(dt)
    packed = bim.pack_weight(weight)  # the model packs once (CPU float32)
    if impl == "invariant":
        fn = lambda: bim.bi_linear(x, weight, packed=packed, backend=PATH)  # noqa: E731
    else:
        fn = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
    seconds = _run(benchmark, fn)
    config = bim.matmul_config(N, K, dt, DEVICE)._asdict() if CUDA and impl == "invariant" else None
    benchmark.extra_info.update(path=PATH if impl == "invariant" else "torch", impl=impl, device=DEVICE,
                                threads=torch.get_num_threads(), dtype=dtype, rows=rows, N=N, K=K,
                                shape=_shape_id(shape), config=config,
                                cpu_path=bim.cpu_path(dt) if not CUDA else None,
                                weight_gbps=N * K * dt.itemsize / seconds / 1e9)


# the config sweep (CUDA): which tiles a shape should get (bi_matmul.CONFIGS / default_config); every candidate
# is M-independent, so any of them keeps the invariance; rows 1 (decode) and 32 (a verify of a batch)
SWEEP_SHAPES = ((4096, 4096), (4096, 14336)) if CUDA else ()
SWEEP_CONFIGS = tuple(bim.MatmulConfig(bm_, bn, bk, 4, 3 if bn * bk >= 128 * 128 else 4)
                      for bm_ in (16, 64) for bn in (32, 64, 128) for bk in (64, 128))


@pytest.mark.skipif(not CUDA, reason="the tile sweep times the Triton kernel: CUDA only")
@pytest.mark.parametrize("rows", (1, 32))
@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}s{c.num_stages}")
@pytest.mark.parametrize("shape", SWEEP_SHAPES, ids=_shape_id)
def test_bi_linear_configs(benchmark, shape, config, rows):
    N, K = shape
    weight = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(rows, K, device=DEVICE, dtype=torch.bfloat16)
    seconds = _run(benchmark, lambda: bim.bi_matmul_triton(x, weight, config=config))
    benchmark.extra_info.update(impl="config", device=DEVICE, dtype="bfloat16", rows=rows, N=N, K=K,
                                shape=_shape_id(shape), config=config._asdict(),
                                default=config == bim.default_config(N, K, torch.bfloat16, dsp.device_programs(DEVICE)),
                                weight_gbps=N * K * 2 / seconds / 1e9)


@pytest.mark.parametrize("impl", ("invariant", "ordinary"))
@pytest.mark.parametrize("context", BI_CONTEXTS)
@pytest.mark.parametrize("T", (1, 6))
@pytest.mark.parametrize("batch", BI_BATCHES)
@pytest.mark.parametrize("model", tuple(BI_ATTN))
@pytest.mark.parametrize("dtype", BI_DTYPES)
def test_bi_attention(benchmark, dtype, model, batch, T, context, impl):
    H, Hkv, D = BI_ATTN[model]["H"], BI_ATTN[model]["Hkv"], BI_ATTN[model]["D"]
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(batch + T + context)
    q = torch.randn(batch, H, T, D, generator=g).to(DEVICE, dt)
    k = torch.randn(batch, Hkv, context + T, D, generator=g).to(DEVICE, dt)
    v = torch.randn(batch, Hkv, context + T, D, generator=g).to(DEVICE, dt)
    lengths = torch.randint(context // 2, context + 1, (batch,), generator=g)  # rows of different lengths
    start = (context - lengths).to(DEVICE)  # left-padded: every row ends at column context + T
    from specdec.kernels.positions import step_plan_reference

    _, _, mask = step_plan_reference(start, lengths.to(DEVICE), torch.full((batch,), T, device=DEVICE), T, True,
                                     context + T)
    if impl == "invariant":
        first = bia.first_keys(mask)
        plan = None if CUDA else bia.chunk_plan(mask, first, H // Hkv, Hkv, context + T,  # once per forward
                                                workspace=bia.Workspace())  # the model's reusable buffers
        fn = lambda: bia.bi_attention(q, k, v, mask, first, plan=plan, backend=PATH)  # noqa: E731
    else:
        bias = torch.where(mask, torch.zeros((), dtype=dt, device=DEVICE), float("-inf"))[:, None]
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)  # noqa: E731
    seconds = _run(benchmark, fn)
    kv_bytes = 2 * int(lengths.sum() + batch * T) * Hkv * D * dt.itemsize  # the keys and values a step must read
    benchmark.extra_info.update(path=PATH if impl == "invariant" else "torch", impl=impl, device=DEVICE,
                                threads=torch.get_num_threads(), dtype=dtype, model=model, batch=batch, T=T,
                                context=context, kv_gbps=kv_bytes / seconds / 1e9)


@pytest.mark.parametrize("impl", ("invariant", "ordinary"))
@pytest.mark.parametrize("residual", (False, True))
@pytest.mark.parametrize("rows", (1, 8, 64, 512) if CUDA else (1, 8, 48))
@pytest.mark.parametrize("dtype", BI_DTYPES)
def test_bi_rms_norm(benchmark, dtype, rows, residual, impl):
    """rms_norm (Triton on CUDA) against the model's torch RMSNorm (+ the residual add), hidden 4096."""
    N = 4096 if CUDA else 576
    dt = getattr(torch, dtype)
    x = torch.randn(rows, N, device=DEVICE).to(dt)
    r = torch.randn(rows, N, device=DEVICE).to(dt) if residual else None
    w = torch.rand(N, device=DEVICE).to(dt)
    backend = PATH if impl == "invariant" else "torch"
    seconds = _run(benchmark, lambda: rms.rms_norm(x, w, 1e-5, residual=r, backend=backend))
    moved = rows * N * dt.itemsize * (4 if residual else 2)  # read x (and r), write y (and h)
    benchmark.extra_info.update(path=backend, impl=impl, device=DEVICE, threads=torch.get_num_threads(), dtype=dtype,
                                rows=rows, N=N, residual=residual, gbps=moved / seconds / 1e9)


# ------------------------------------------------------------------------------ weight-only quantized matmul
# impl "kernel" (Triton, CUDA), "reference" (dequantize, then matmul), "bf16" (F.linear on a bfloat16 copy: the
# float baseline); M = B * (k + 1) rows. The CPU's quantized kernel (GGUF blocks): bench/qmm_cpu.py
from specdec.kernels import quant_matmul as qmm  # noqa: E402
from specdec.models.quant import QuantLinear, QuantRows  # noqa: E402

QUANT_ROWS = (1, 8, 48) if not CUDA else (1, 2, 4, 8, 16, 64)
QUANT_SHAPES = ((1536, 576), (576, 1536)) if not CUDA else (  # (N, K): Llama-3-8B's qkv, down, gate_up; 7B's o
    (6144, 4096), (4096, 14336), (28672, 4096), (4096, 4096))
# the bar (issue #42): kernel >= 2x bf16 (int4) / >= 1.5x (int8) at 1-8 rows; "kernel_nmajor": the same kernel on
# row-major codes (QuantLinear keeps them K-major), to see what the layout is worth
QUANT_IMPLS = ("kernel", "kernel_nmajor", "bf16") if CUDA else ("reference", "bf16")  # the CPU's: bench/qmm_cpu.py


@pytest.mark.parametrize("impl", QUANT_IMPLS)
@pytest.mark.parametrize("rows", QUANT_ROWS)
@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", ("int4", "int8"))
def test_quant_matmul(benchmark, fmt, shape, rows, impl):
    N, K = shape
    weight = torch.randn(N, K) * 0.02
    part = QuantRows(fmt, (N, K), "bench", device="cuda")  # the GPU layout's codes (held on the CPU here)
    part.add_float(0, weight)
    zeros = None if part.zeros is None else part.zeros.to(DEVICE)
    layer = QuantLinear(fmt, part.codes.to(DEVICE), part.scales.to(DEVICE), zeros)
    x = torch.randn(rows, K, device=DEVICE).bfloat16()
    if impl == "bf16":
        w16 = weight.to(DEVICE, torch.bfloat16)
        fn = lambda: torch.nn.functional.linear(x, w16)  # noqa: E731
    else:
        operands = (layer.nibbles, layer.scales, layer.zeros) if fmt == "int4" else (layer.codes, layer.scales)
        if impl == "kernel_nmajor":
            operands = tuple(t.contiguous() for t in operands)
        backend = "triton" if impl.startswith("kernel") else "torch"
        fn = lambda: qmm.quant_matmul(x, fmt, *operands, backend=backend)  # noqa: E731
    seconds = _run(benchmark, fn)
    config = qmm.quant_config(fmt, N, K, x.dtype, DEVICE)._asdict() if impl.startswith("kernel") else None
    benchmark.extra_info.update(path="triton" if impl.startswith("kernel") else "torch", impl=impl, device=DEVICE,
                                threads=torch.get_num_threads(), fmt=fmt, rows=rows, N=N, K=K, config=config,
                                weight_gbps=layer.weight_bytes / seconds / 1e9)
