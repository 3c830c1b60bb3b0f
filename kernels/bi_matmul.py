"""Batch-invariant linear layer: `y = x @ weight.T + bias` where row i of `y` depends on row i of `x` only,
bit for bit, whatever the number of rows M (= B * T) of the call and wherever the row sits in it.

Why it is needed: a GEMM library picks its kernel, blocking and (on GPUs) split-K from the shape, so the
same row multiplied in a call of M = 1 (AR step) and in one of M = 48 (verify of k + 1 = 6 tokens, batch 8)
can be summed in a different order and round differently.

- Triton (GPU): a persistent kernel (one program per multiprocessor, looping over `[BLOCK_M, BLOCK_N]`
  output tiles) whose tiles are a function of (N, K, dtype, device) only, never of M (`matmul_config`: no
  autotuning by M, no split-K), a K loop in order in `BLOCK_K` steps accumulating `tl.dot` (tensor cores for
  16-bit and float64) into one fp32 (fp64 for fp64) accumulator. Row i's value is then the same sequence of
  MMA steps in every call: invariant by construction.
- torch reference (CPU; what runs on the CPU), by dtype, each measured on this project's CPU (AMD EPYC,
  AVX2, torch 2.13 with MKL 2024.2 and oneDNN 3.12; `python -m bench.batch_invariant probe`) for every M in
  1..69 and up to 4100, rows at every offset, 1 and 2 threads:
  - float32: oneDNN's matmul on a weight packed once (`pack_weight`; what inductor uses on CPUs): rows agree
    for every M. (Plain `F.linear` is MKL sgemm: M = 1..3 take other kernels than M >= 4.)
  - bfloat16: `F.linear` agrees for every M (on that AVX2 CPU torch's own fp32-accumulating kernel; on an
    AVX-512 CPU with avx512_bf16 oneDNN's, see below).
  - float64 (and float16): `F.linear` on rows padded to a multiple of 4 in a fresh 64-byte-aligned buffer:
    MKL dgemm rows agree only when M is a multiple of 4 (remainder rows take another kernel) and the input
    is aligned (a misaligned view changes the result).
  These are measured facts about these libraries on that CPU, re-checked by
  `tests/test_batch_invariant.py`, not guarantees: the libraries pick kernels by CPU and by shape. On an
  AVX-512 CPU with avx512_bf16, torch hands bfloat16 to oneDNN (`brg_matmul:avx512_core_bf16` on the
  project's AVX-512 EPYC; invariant there for every M in 1..70 and up to 2000 rows, the default pair's 10
  weight shapes, 1 and 2 threads); on an AMX CPU oneDNN chooses between AMX and AVX-512 kernels, whose bf16
  dot products round differently, from the shape (issue 42: an Intel host left AR's path only in exspec,
  the one method that multiplies a thousand rows at once). So the path is not trusted, it is measured where it runs:
  the first call per (dtype, thread count, weight shape) multiplies random rows of that shape alone and in
  calls of other sizes, from 2 rows to a prefill of 1024 (`rows_keep_bits`; larger calls are split into
  calls of at most 1024 rows, `bounded_linear`), and picks the first
  formulation under which every row keeps its bits (`cpu_plan`): the path as called; on one thread (the
  H200 machine's host CPU needed it: float32 through oneDNN at two threads changed rows at M = 3 and 48);
  in calls of exactly BLOCK_ROWS rows (`blocked_linear`: zero rows pad the last block; every call then has
  one shape, so a kernel chosen by shape is the same kernel for every row), at the caller's threads or one;
  and, where even that fails, one row per call.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .dispatch import cdiv, check, choose_backend, device_programs, interpreting, lazy_jit, num_threads, one_thread

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

ALIGNMENT = 64  # bytes: torch's CPU allocator aligns every new buffer to this
ROW_MULTIPLE = 4  # MKL's full row tile: padded calls multiply a multiple of this many rows
NATIVE_DTYPES = (torch.bfloat16,)  # F.linear as is
ONEDNN_DTYPES = (torch.float32,)  # oneDNN on a packed weight (when torch has oneDNN)
# What `rows_keep_bits` multiplies: calls of M rows starting at row `shift` of its inputs, (M, shift). The sizes
# run from a decode step to a prefill of many prompts at once (exspec prefills its whole pool in one call: 1035
# and 1248 rows on 96 short prompts at batch 5 and 8, where no call of the other methods exceeded 184 rows).
# Larger calls are split into calls of MAX_CALL_ROWS rows (and one of the rest), so that no call of the mode
# is larger than the largest one probed.
MAX_CALL_ROWS = 1024
PROBE_CALLS = tuple((M, shift) for M in (2, 3, 4, 5, 8, 17, 48) for shift in (0, 1, 3)) + ((130, 1), (MAX_CALL_ROWS, 3))
PROBE_TILE = 48  # every probed row is compared with the same row in a call of this many rows (22 of them)
BLOCK_ROWS = 16  # the fixed call size of `blocked_linear` (a multiple of every GEMM row tile seen: 4, 8, 16)


def padded_rows(M: int, multiple: int = ROW_MULTIPLE) -> int:
    """The row count a padded call multiplies for M rows: a positive multiple of `multiple`."""
    return max(multiple, cdiv(M, multiple) * multiple)


@functools.cache
def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@functools.cache
def cpu_path(dtype: torch.dtype) -> str:
    """How the torch reference multiplies `dtype` on the CPU: "native", "onednn" or "padded" (see above)."""
    if dtype in NATIVE_DTYPES:
        return "native"
    if dtype in ONEDNN_DTYPES and onednn_available():
        return "onednn"
    return "padded"


def pack_weight(weight):
    """The weight in oneDNN's blocked layout when the CPU path of its dtype is "onednn" (pack once per
    model: `Transformer.batch_invariant = True` does), else None. An extra copy of the weight."""
    if weight.device.type != "cpu" or cpu_path(weight.dtype) != "onednn":
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def padded_linear(x, weight, bias=None):
    """`F.linear` on x's M rows padded to a multiple of ROW_MULTIPLE in an aligned, contiguous buffer (the
    input itself when it already is one). x [M, K] -> [M, N]."""
    M, K = x.shape
    Mp = padded_rows(M)
    if Mp == M and x.is_contiguous() and x.data_ptr() % ALIGNMENT == 0:
        return F.linear(x, weight, bias)
    rows = torch.empty((Mp, K), dtype=x.dtype, device=x.device)  # [Mp, K], freshly allocated: aligned
    rows[:M] = x
    rows[M:] = 0
    return F.linear(rows, weight, bias)[:M]  # [M, N]


def _cpu_linear(x, weight, bias=None, packed=None):
    """The dtype's CPU path (module docstring) at the caller's thread count."""
    path = cpu_path(x.dtype) if x.device.type == "cpu" else "padded"
    if path == "native":
        return F.linear(x, weight, bias)
    if path == "onednn":
        if packed is None:
            packed = pack_weight(weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return padded_linear(x, weight, bias)


def blocked_linear(x, weight, bias=None, packed=None, block: int = BLOCK_ROWS):
    """The dtype's CPU path on x's rows `block` at a time: every call multiplies exactly `block` rows (zero rows
    pad the last) from one staging buffer, so every call has the same shape and alignment. x [M, K] -> [M, N]."""
    M, K = x.shape
    stage = torch.zeros((block, K), dtype=x.dtype, device=x.device)  # [block, K], fresh: aligned
    out = torch.empty((M, weight.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]
    for i in range(0, M, block):
        n = min(block, M - i)
        stage[:n] = x[i:i + n]
        if n < block:
            stage[n:] = 0
        out[i:i + n] = _cpu_linear(stage, weight, bias, packed)[:n]
    return out


class RowPlan(NamedTuple):
    """How the CPU path runs so that rows keep their bits (`cpu_plan`)."""

    threads: int  # intra-op threads during the call
    block: int | None  # None: the whole call at once; else calls of exactly `block` rows (`blocked_linear`)


def bounded_linear(x, weight, bias=None, packed=None):
    """The dtype's CPU path in calls of at most MAX_CALL_ROWS rows. x [M, K] -> [M, N]."""
    M = x.shape[0]
    if M <= MAX_CALL_ROWS:
        return _cpu_linear(x, weight, bias, packed)
    return torch.cat([_cpu_linear(x[i:i + MAX_CALL_ROWS], weight, bias, packed) for i in range(0, M, MAX_CALL_ROWS)])


def _run(plan: RowPlan, x, weight, bias=None, packed=None):
    with num_threads(plan.threads):
        if plan.block is None:
            return bounded_linear(x, weight, bias, packed)
        return blocked_linear(x, weight, bias, packed, plan.block)


@functools.cache
def rows_keep_bits(dtype: torch.dtype, plan: RowPlan, shape: tuple[int, int] = (640, 384)) -> bool:
    """Whether `dtype`'s CPU path run as `plan` gives each row the same bits alone and in the PROBE_CALLS:
    measured once per process on a fixed random weight of `shape` [N, K] (the caller's layer's shape). Every
    row of every call is compared (a kernel that rounds differently changes only some elements: a float32 and
    a bfloat16-native GEMM of 1030 x 384 x 640 gave other bfloat16 bits in 72 of 659,200 on the project's
    AVX-512 EPYC), against the same
    rows in calls of PROBE_TILE rows, whose first PROBE_TILE rows are compared with each row alone."""
    N, K = shape
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=g).to(dtype)  # [N, K]
    rows = -(-max(M + shift for M, shift in PROBE_CALLS) // PROBE_TILE) * PROBE_TILE
    x = torch.randn(rows, K, generator=g).to(dtype)  # [rows, K]
    packed = pack_weight(weight)
    tiled = torch.cat([_run(plan, x[i:i + PROBE_TILE].clone(), weight, None, packed)
                       for i in range(0, rows, PROBE_TILE)])  # [rows, N]
    alone = torch.cat([_run(plan, x[i:i + 1].clone(), weight, None, packed) for i in range(PROBE_TILE)])
    if not torch.equal(alone, tiled[:PROBE_TILE]):
        return False
    return all(torch.equal(_run(plan, x[shift:shift + M].clone(), weight, None, packed), tiled[shift:shift + M])
               for M, shift in PROBE_CALLS)


@functools.cache
def cpu_plan(dtype: torch.dtype, threads: int, shape: tuple[int, int] = (640, 384)) -> RowPlan:
    """The first formulation under which `rows_keep_bits` holds for weights of `shape` [N, K] at the caller's
    `threads`: the path as called, on one thread, in blocks of BLOCK_ROWS rows (at `threads`, then one);
    else one row per call, whose calls all have one shape."""
    candidates = [RowPlan(threads, None), RowPlan(1, None), RowPlan(threads, BLOCK_ROWS), RowPlan(1, BLOCK_ROWS)]
    for plan in dict.fromkeys(candidates):  # in order, without repeats (threads == 1)
        if rows_keep_bits(dtype, plan, shape):
            return plan
    return RowPlan(1, 1)


def bi_matmul_reference(x, weight, bias=None, packed=None):
    """x [M, K], weight [N, K], bias [N] or None -> [M, N], by the dtype's CPU path. `packed`: the weight
    from `pack_weight` (packed on the fly when missing: same bits, slower). Run as `cpu_plan` says for this
    dtype, thread count and weight shape (on one thread, or in fixed blocks of rows, where the libraries give
    a row other bits in calls of other sizes)."""
    # is_compiling first: torch.compile cannot trace get_num_threads (a compiled graph keeps the caller's threads)
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return _cpu_linear(x, weight, bias, packed)
    threads = torch.get_num_threads()
    plan = cpu_plan(x.dtype, threads, tuple(weight.shape))
    if plan.threads == threads and plan.block is None:
        return bounded_linear(x, weight, bias, packed)
    return _run(plan, x, weight, bias, packed)


def bi_linear(x, weight, bias=None, packed=None, backend: str | None = None):
    """Validate and dispatch. x [..., K]; weight [N, K]; bias [N] or None -> [..., N] in x's dtype.
    `packed`: `pack_weight(weight)`, kept by the caller (only the CPU float32 path reads it)."""
    N, K = weight.shape if weight.dim() == 2 else (-1, -1)
    if not (x.dim() >= 1 and x.shape[-1] == K and x.dtype == weight.dtype and x.device == weight.device
            and x.dtype.is_floating_point and (bias is None or (bias.shape == (N,) and bias.dtype == x.dtype))):
        _explain(x, weight, bias)  # raises, naming what is wrong (messages built only on failure: hot path)
    x2 = x if x.dim() == 2 else x.reshape(-1, K)  # [M, K]
    if choose_backend(x, backend) == "triton":
        y = bi_matmul_triton(x2, weight, bias)
    else:
        y = bi_matmul_reference(x2, weight, bias, packed)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], N)


def _explain(x, weight, bias) -> None:
    check(weight.dim() == 2, f"bi_linear: weight must be [N, K], got {tuple(weight.shape)}")
    N, K = weight.shape
    check(x.dim() >= 1 and x.shape[-1] == K, f"bi_linear: x must be [..., {K}] (the weight's in features), got "
          f"{tuple(x.shape)}")
    check(x.dtype == weight.dtype, f"bi_linear: x dtype {x.dtype} != weight dtype {weight.dtype}")
    check(x.device == weight.device, f"bi_linear: x on {x.device}, weight on {weight.device}")
    check(x.dtype.is_floating_point, f"bi_linear: x must be floating point, got {x.dtype}")
    check(False, f"bi_linear: bias must be [{N}] of dtype {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")


# ------------------------------------------------------------------------------------------ Triton
class MatmulConfig(NamedTuple):
    """Tiles and launch settings of the Triton matmul for one (N, K, dtype, device): never a function of M."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (N, K, dtype, programs) -> MatmulConfig: explicit, filled by `matmul_config` at a shape's first call. A
# tuning run may put entries here first (bench/bench_kernels.py::test_bi_linear_configs measures candidates);
# every process whose outputs must agree (an AR run and a speculative one) has to see the same entries.
# Deliberately not tuned by timing inside the process: a choice that follows timing noise would give two
# processes different tiles, i.e. different bits.
CONFIGS: dict = {}
BLOCK_N_CHOICES = (128, 64, 32)  # widest first: the widest with at least one tile per multiprocessor wins


def default_config(N: int, K: int, dtype: torch.dtype, programs: int) -> MatmulConfig:
    """The rule behind `matmul_config` (module docstring): a function of N, the dtype and the device's
    multiprocessor count (`programs`), not of M.

    - 16-bit: BLOCK_M 64 (one Hopper warpgroup MMA, m64; a decode step of 1-64 rows is one M tile that
      reads the weight once), BLOCK_K 128, and the widest BLOCK_N in 128/64/32 that still gives every
      multiprocessor a tile at one row (N = 4096 on 132 SMs: 32, 128 tiles; the old fixed 64 gave 64): the
      one-row decode step is weight-bandwidth bound, so what matters is that every SM streams weights, with
      4 stages of loads in flight (3 at BLOCK_N 128: 144 KiB of shared memory);
    - float32 (`input_precision="ieee"`: CUDA cores, no TF32): 32 x (64 or 32) x 32;
    - float64 (DMMA): 32 x 32 x 16."""
    if dtype == torch.float64:
        return MatmulConfig(32, 32, 16, 4, 2)
    if dtype == torch.float32:
        block_m, block_k, widths, stages = 32, 32, BLOCK_N_CHOICES[1:], 3
    else:
        block_m, block_k, widths, stages = 64, 128, BLOCK_N_CHOICES, 4
    block_n = next((w for w in widths if cdiv(N, w) >= programs), widths[-1])
    if block_n == 128:
        stages = 3  # 3 x (64 x 128 + 128 x 128) x 2 bytes = 144 KiB of shared memory
    return MatmulConfig(block_m, block_n, block_k, 4, stages)


def matmul_config(N: int, K: int, dtype: torch.dtype, device) -> MatmulConfig:
    """The config of (N, K, dtype) on `device`, from CONFIGS (filled with `default_config` at first use)."""
    programs = device_programs(device)
    key = (N, K, dtype, programs)
    config = CONFIGS.get(key)
    if config is None:
        config = CONFIGS[key] = default_config(N, K, dtype, programs)
    return config


@lazy_jit
def _bi_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (not read without HAS_BIAS)
    y_ptr,  # [M, N], out
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    ACC_F64: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Persistent: program p computes output tiles p, p + P, p + 2P, ... (P programs), M tiles of one N tile
    adjacent (they share the weight tile in L2). Each tile: K walked in order in BLOCK_K steps, one
    accumulator, no split-K. DOT_SUM (the interpreter) sums the products with tl.sum instead of tl.dot."""
    num_m = tl.cdiv(M, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        rm = (tile % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x / y
        rn = (tile // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of w / columns of y
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        if ACC_F64:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk  # [BLOCK_K]
            a = tl.load(x_ptr + rm64[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
            b = tl.load(w_ptr + rn64[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
            if DOT_SUM:  # per element: BLOCK_K products summed in one fixed order, whatever the row's place
                acc += tl.sum(a.to(acc.dtype)[:, :, None] * b.to(acc.dtype)[None, :, :], axis=1)  # [BM, BN]
            else:
                if DOT_FP32:  # the interpreter multiplies 16-bit floats' raw bits (triton 3.9): give it fp32
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision="ieee")  # fp32 stays fp32 (no tf32), fp64 stays fp64
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)  # [BLOCK_N]
            acc += bias[None, :].to(acc.dtype)
        tl.store(y_ptr + rm64[:, None] * stride_ym + rn64[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def bi_matmul_triton(x, weight, bias=None, config: MatmulConfig | None = None, dot: str | None = None,
                     out_dtype: torch.dtype | None = None):
    """Launch `_bi_matmul_kernel` on min(tiles, multiprocessors) programs; x [M, K] -> [M, N].
    `config`: default `matmul_config(N, K, dtype, device)`. `dot`: "mma" (`tl.dot`; default on a GPU) or
    "sum" (`tl.sum` of the products; default under the interpreter, whose `tl.dot` is numpy's matmul).
    `out_dtype`: default x's; float32 returns the accumulator itself (tests: bits a 16-bit output rounds away)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.copy_(bias.expand(M, N)) if bias is not None else y.zero_()
    cfg = config or matmul_config(N, K, x.dtype, x.device)
    dot = dot or ("sum" if interpreting() else "mma")
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    grid = (min(tiles, device_programs(x.device)),)
    _bi_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y,
        M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, ACC_F64=x.dtype == torch.float64,
        DOT_FP32=interpreting() and x.element_size() == 2, DOT_SUM=dot == "sum",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
