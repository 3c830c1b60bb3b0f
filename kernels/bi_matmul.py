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
  - bfloat16: `F.linear` (torch's own fp32-accumulating kernel on this CPU) agrees for every M.
  - float64 (and float16): `F.linear` on rows padded to a multiple of 4 in a fresh 64-byte-aligned buffer:
    MKL dgemm rows agree only when M is a multiple of 4 (remainder rows take another kernel) and the input
    is aligned (a misaligned view changes the result).
  These are measured facts about these libraries on this CPU, re-checked by
  `tests/test_batch_invariant.py`, not guarantees: other CPUs (AVX-512, AMX) or library versions need
  the probe and the tests run again. One guard is built in: with more than one thread, the first call per
  (dtype, thread count) checks rows alone against rows in calls of other sizes (`threads_keep_rows`), and
  where they differ the path runs on one thread. The H200 machine's host CPU needed it: float32 through
  oneDNN at two threads changed rows at M = 3 and 48 (one thread agreed).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .dispatch import cdiv, check, choose_backend, device_programs, interpreting, lazy_jit, one_thread

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

ALIGNMENT = 64  # bytes: torch's CPU allocator aligns every new buffer to this
ROW_MULTIPLE = 4  # MKL's full row tile: padded calls multiply a multiple of this many rows
NATIVE_DTYPES = (torch.bfloat16,)  # F.linear as is
ONEDNN_DTYPES = (torch.float32,)  # oneDNN on a packed weight (when torch has oneDNN)


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


@functools.cache
def threads_keep_rows(dtype: torch.dtype, threads: int) -> bool:
    """Whether `dtype`'s CPU path gives each row the same bits alone and in calls of other sizes at `threads`
    intra-op threads: measured once per process on a fixed random [640, 384] weight (the caller's threads)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(640, 384, generator=g).to(dtype)  # [N, K]
    x = torch.randn(48, 384, generator=g).to(dtype)  # [M, K]
    packed = pack_weight(weight)
    alone = torch.cat([_cpu_linear(x[i:i + 1].clone(), weight, None, packed) for i in range(8)])  # [8, N]
    for M in (2, 3, 4, 5, 8, 17, 48):
        for shift in (0, 1, 3):
            n = min(M, 8 - shift)
            if not torch.equal(_cpu_linear(x[shift:shift + M].clone(), weight, None, packed)[:n],
                               alone[shift:shift + n]):
                return False
    return True


def bi_matmul_reference(x, weight, bias=None, packed=None):
    """x [M, K], weight [N, K], bias [N] or None -> [M, N], by the dtype's CPU path. `packed`: the weight
    from `pack_weight` (packed on the fly when missing: same bits, slower). On a CPU whose libraries split
    rows differently by M at the current thread count (`threads_keep_rows`), on one thread."""
    # is_compiling first: torch.compile cannot trace get_num_threads (a compiled graph keeps the caller's threads)
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return _cpu_linear(x, weight, bias, packed)
    threads = torch.get_num_threads()
    if threads == 1 or threads_keep_rows(x.dtype, threads):
        return _cpu_linear(x, weight, bias, packed)
    with one_thread():
        return _cpu_linear(x, weight, bias, packed)


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
