"""Weight-only quantized matmul: `y = x @ W.T` with W held as int4 or int8 codes and dequantized inside the
kernel, never as a float copy in memory (the GPU path of models/quant.py's `QuantLinear`).

Formats (models/quant.py's; both dequantize as w = (code - offset) * scale + zero):
- **int4**: `nibbles` uint8 [N, K/2] (weight 2j in the low nibble of byte j, 2j + 1 in the high),
  `scales` and `zeros` [N, K/GROUP] (bfloat16), GROUP = 32 inputs per group, offset 8;
- **int8**: `codes` int8 [N, K] (-127..127), `scales` [N] (bfloat16), zero 0.

- Triton (CUDA; the CPU under `TRITON_INTERPRET=1`): written for the few rows of decode and verify steps
  (M = B * (k + 1), 1..64), to stream the codes at HBM bandwidth. A persistent kernel over `[BLOCK_M,
  BLOCK_N]` output tiles whose sizes depend on (format, N, K, dtype, device), never on M (`quant_config`),
  K walked in order. Codes are converted in registers to x's dtype *exactly* (int8 codes, int4 code - 8)
  and multiplied by `tl.dot` (tensor cores for 16-bit x) with float32 accumulation; the scales (and int4's
  zeros) are applied to the partial sums: int8 once per output after the K loop, int4 once per group of 32
  inputs (sum_k x_k w_k = s * sum_k x_k (c_k - 8) + z * sum_k x_k). Every product is exact, only float32
  sums round, in an order fixed by the tiles: batch-invariant by construction (no split-K, no M-dependent
  tile). Under the interpreter each `tl.dot` is replaced by a `tl.sum` of the products (`dot="sum"`), bit-exact
  invariant there too. The operands may have any strides; `QuantLinear` keeps them K-major (`k_major`), so a
  group's codes for BLOCK_N weight rows are contiguous bytes.
- torch reference (elsewhere): the weight dequantized to float32, `x.float() @ W.T`, cast to x's dtype.
  The same numbers up to float32 summation order; not batch-invariant on a GPU (cuBLAS picks its kernel
  by M), so it is the spec and the fallback, not the GPU path.

The previous kernel (tl.sum on CUDA cores, 8 x 32 tiles) measured 0.01-0.41x of bfloat16 cuBLAS on an H200;
this one is not timed yet: `bench/bench_kernels.py -k quant_` measures it against cuBLAS on a bfloat16 copy of
the weight there (docs/kernels.md).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import cdiv, check, choose_backend, device_programs, interpreting, lazy_jit

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

FORMATS = ("int8", "int4")
GROUP = 32  # int4: inputs per (scale, zero) group
INT4_OFFSET = 8


# ------------------------------------------------------------------------------------------ the formats
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (0..15) -> [N, K/2]: element 2j in the low nibble of byte j, 2j+1 in the high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: [N, K/2] -> codes uint8 [N, K]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype=torch.float32):
    """codes uint8 [N, K], scales/zeros [N, K/GROUP] -> w [N, K] in `dtype` (computed in `dtype`)."""
    N, K = codes.shape
    c = codes.reshape(N, K // GROUP, GROUP).to(dtype)  # [N, G, 32]
    w = (c - INT4_OFFSET) * scales.to(dtype)[..., None] + zeros.to(dtype)[..., None]
    return w.reshape(N, K)


def dequantize_weight(fmt: str, codes, scales, zeros=None, dtype=torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype` from the kernel's operands: int4 `codes` are the nibbles [N, K/2]."""
    if fmt == "int4":
        return dequantize_int4(unpack_nibbles(codes), scales, zeros, dtype)
    return codes.to(dtype) * scales.to(dtype)[:, None]


# ------------------------------------------------------------------------------------------ reference
def quant_matmul_reference(x, fmt: str, codes, scales, zeros=None):
    """x [M, K] -> [M, N] in x's dtype: float32 `x @ W.T` on the dequantized weight."""
    w = dequantize_weight(fmt, codes, scales, zeros, torch.float32)  # [N, K]
    return (x.float() @ w.t()).to(x.dtype)


# ------------------------------------------------------------------------------------------ wrapper
def quant_matmul(x, fmt: str, codes, scales, zeros=None, backend: str | None = None):
    """Validate and dispatch. x [..., K] (floating point) -> [..., N] in x's dtype. int4: `codes` the
    nibbles uint8 [N, K/2], `scales` and `zeros` [N, K/32]; int8: `codes` int8 [N, K], `scales` [N]."""
    if not _valid(x, fmt, codes, scales, zeros):
        _explain(x, fmt, codes, scales, zeros)  # raises, naming what is wrong (messages built only on failure)
    N = codes.shape[0]
    K = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, K)  # [M, K]
    if choose_backend(x, backend) == "triton":
        y = quant_matmul_triton(x2, fmt, codes, scales, zeros)
    else:
        y = quant_matmul_reference(x2, fmt, codes, scales, zeros)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], N)


def _in_features(fmt, codes) -> int:
    return codes.shape[1] * 2 if fmt == "int4" else codes.shape[1]


def _valid(x, fmt, codes, scales, zeros) -> bool:
    if fmt not in FORMATS or codes.dim() != 2 or x.dim() < 1 or not x.dtype.is_floating_point:
        return False
    N, K = codes.shape[0], _in_features(fmt, codes)
    same_device = x.device == codes.device == scales.device
    if fmt == "int4":
        return (codes.dtype == torch.uint8 and x.shape[-1] == K and K % GROUP == 0 and zeros is not None
                and scales.shape == (N, K // GROUP) and zeros.shape == scales.shape and same_device
                and zeros.device == x.device)
    return codes.dtype == torch.int8 and x.shape[-1] == K and scales.shape == (N,) and same_device


def _explain(x, fmt, codes, scales, zeros) -> None:
    check(fmt in FORMATS, f"quant_matmul: fmt must be one of {FORMATS}, got {fmt!r}")
    check(codes.dim() == 2, f"quant_matmul: codes must be 2-D, got {tuple(codes.shape)}")
    want = torch.uint8 if fmt == "int4" else torch.int8
    check(codes.dtype == want, f"quant_matmul: {fmt} codes must be {want}, got {codes.dtype}")
    N, K = codes.shape[0], _in_features(fmt, codes)
    check(x.dim() >= 1 and x.shape[-1] == K, f"quant_matmul: x must be [..., {K}] (the weight's in features), "
          f"got {tuple(x.shape)}")
    check(x.dtype.is_floating_point, f"quant_matmul: x must be floating point, got {x.dtype}")
    if fmt == "int4":
        check(K % GROUP == 0, f"quant_matmul: int4 needs in features divisible by {GROUP}, got {K}")
        check(scales.shape == (N, K // GROUP), f"quant_matmul: int4 scales must be [{N}, {K // GROUP}], got "
              f"{tuple(scales.shape)}")
        check(zeros is not None and zeros.shape == scales.shape, f"quant_matmul: int4 zeros must be "
              f"[{N}, {K // GROUP}], got {None if zeros is None else tuple(zeros.shape)}")
    else:
        check(scales.shape == (N,), f"quant_matmul: int8 scales must be [{N}], got {tuple(scales.shape)}")
    devices = {str(t.device) for t in (x, codes, scales, zeros) if t is not None}
    check(False, f"quant_matmul: x, codes, scales (and zeros) must be on one device, got {sorted(devices)}")


# ------------------------------------------------------------------------------------------ Triton
class QuantConfig(NamedTuple):
    """Tiles and launch settings of the Triton kernel for one (format, N, K, dtype, device): never of M."""

    block_m: int
    block_n: int
    block_k: int  # int4: a multiple of GROUP (the step's groups are unrolled)
    num_warps: int
    num_stages: int


# (fmt, N, K, dtype, programs) -> QuantConfig: explicit, filled by `quant_config` at a shape's first call (a
# tuning run may set entries first; processes that must agree have to see the same ones). Not tuned by
# timing inside the process (another tile is another summation order: see kernels/bi_matmul.py's CONFIGS).
CONFIGS: dict = {}
BLOCK_N_CHOICES = (128, 64, 32)


def default_config(fmt: str, N: int, K: int, dtype: torch.dtype, programs: int) -> QuantConfig:
    """BLOCK_M 16 (the MMA's smallest M: decode and verify steps have 1-64 rows), BLOCK_K 128 (int4: four
    groups of 32 per step, 64 bytes of codes per weight row), and the widest BLOCK_N in 128/64/32 that
    still gives every multiprocessor a tile at one row: the kernel is meant to stream the codes at HBM
    bandwidth, so every SM must have codes to load; 4 stages of loads in flight."""
    block_n = next((w for w in BLOCK_N_CHOICES if cdiv(N, w) >= programs), BLOCK_N_CHOICES[-1])
    return QuantConfig(16, block_n, 128, 4, 4)


def quant_config(fmt: str, N: int, K: int, dtype: torch.dtype, device) -> QuantConfig:
    """The config of (fmt, N, K, dtype) on `device`, from CONFIGS (filled with `default_config` at first use)."""
    programs = device_programs(device)
    key = (fmt, N, K, dtype, programs)
    config = CONFIGS.get(key)
    if config is None:
        config = CONFIGS[key] = default_config(fmt, N, K, dtype, programs)
    return config


@lazy_jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K] float
    c_ptr,  # int4: [N, K/2] uint8 nibbles; int8: [N, K] int8 (any strides: QuantLinear keeps them K-major)
    s_ptr,  # int4: [N, K/GROUP]; int8: [N]
    z_ptr,  # int4: [N, K/GROUP] (not read for int8)
    y_ptr,  # [M, N], out (x's dtype)
    M, N, K,
    stride_xm, stride_xk,
    stride_cn, stride_ck,
    stride_sn, stride_sg,
    stride_zn, stride_zg,
    stride_ym, stride_yn,
    INT4: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    OFFSET: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Persistent over [BLOCK_M, BLOCK_N] output tiles (M tiles of one N tile adjacent: they share codes in
    L2); each tile walks K in order. The codes are converted in registers to x's dtype, exactly (int8:
    -127..127; int4: code - 8 in -8..7), and multiplied by `tl.dot` with float32 accumulation; the scales
    (and int4's zeros) are applied to the dot's partial sums: int8 once per output after the K loop (one
    scale per row of W), int4 once per group of 32 inputs, sum_k x_k w_k = s_g * sum_k x_k (c_k - 8) +
    z_g * sum_k x_k. Every product is exact; only the float32 sums round, in an order fixed by the tiles.
    DOT_SUM (the interpreter) replaces each tl.dot by a tl.sum of the products."""
    num_m = tl.cdiv(M, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    if DOT_FP32:  # the interpreter: 16-bit dots in float32 (and its integer -> bfloat16 cast is wrong)
        w_ty = tl.float32
    else:
        w_ty = x_ptr.dtype.element_ty  # the codes' dtype in the dot: x's (exact for these small integers)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        rm = (tile % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x / y
        rn = (tile // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W / columns of y
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if INT4:
            jb = tl.arange(0, GROUP_SIZE // 2)  # [GROUP/2] byte j of a group: inputs 2j (low nibble), 2j + 1 (high)
            for k0 in range(0, K, BLOCK_K):
                for gi in tl.static_range(BLOCK_K // GROUP_SIZE):
                    kg = k0 + gi * GROUP_SIZE  # the group's first input (K is a multiple of GROUP_SIZE)
                    even = kg + 2 * jb  # [GROUP/2] inputs of the low nibbles
                    e_ok = even < K  # [GROUP/2] (the whole group is in or out: K % GROUP_SIZE == 0)
                    s_ok = n_ok & ((rn * 0 + kg) < K)  # [BLOCK_N]
                    wb = tl.load(c_ptr + rn64[None, :] * stride_cn + (kg // 2 + jb)[:, None] * stride_ck,
                                 mask=n_ok[None, :] & e_ok[:, None], other=0)  # [GROUP/2, BLOCK_N] uint8
                    lo = ((wb & 15).to(tl.int32) - OFFSET).to(w_ty)  # [GROUP/2, BLOCK_N] codes 2j, exact
                    hi = ((wb >> 4).to(tl.int32) - OFFSET).to(w_ty)  # [GROUP/2, BLOCK_N] codes 2j + 1
                    xe = tl.load(x_ptr + rm64[:, None] * stride_xm + even[None, :] * stride_xk,
                                 mask=m_ok[:, None] & e_ok[None, :], other=0.0)  # [BLOCK_M, GROUP/2]
                    xo = tl.load(x_ptr + rm64[:, None] * stride_xm + (even + 1)[None, :] * stride_xk,
                                 mask=m_ok[:, None] & e_ok[None, :], other=0.0)  # [BLOCK_M, GROUP/2]
                    if DOT_SUM:
                        part = tl.sum(xe.to(tl.float32)[:, :, None] * lo.to(tl.float32)[None, :, :], axis=1) + \
                            tl.sum(xo.to(tl.float32)[:, :, None] * hi.to(tl.float32)[None, :, :], axis=1)
                    else:
                        if DOT_FP32:  # the interpreter multiplies 16-bit floats' raw bits (triton 3.9)
                            xe, xo = xe.to(tl.float32), xo.to(tl.float32)
                        part = tl.dot(xe, lo, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
                        part = tl.dot(xo, hi, part, input_precision="ieee")
                    xs = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)  # [BLOCK_M]
                    g = kg // GROUP_SIZE
                    s = tl.load(s_ptr + rn64 * stride_sn + g * stride_sg, mask=s_ok,
                                other=0.0).to(tl.float32)  # [BLOCK_N]
                    z = tl.load(z_ptr + rn64 * stride_zn + g * stride_zg, mask=s_ok,
                                other=0.0).to(tl.float32)  # [BLOCK_N]
                    acc += part * s[None, :] + xs[:, None] * z[None, :]
        else:
            rk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk  # [BLOCK_K]
                k_ok = kk < K
                w = tl.load(c_ptr + rn64[None, :] * stride_cn + kk[:, None] * stride_ck,
                            mask=n_ok[None, :] & k_ok[:, None], other=0).to(w_ty)  # [BLOCK_K, BLOCK_N] codes, exact
                xk = tl.load(x_ptr + rm64[:, None] * stride_xm + kk[None, :] * stride_xk,
                             mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                if DOT_SUM:
                    acc += tl.sum(xk.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
                else:
                    if DOT_FP32:
                        xk = xk.to(tl.float32)
                    acc = tl.dot(xk, w, acc, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
            scale = tl.load(s_ptr + rn64 * stride_sn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
            acc = acc * scale[None, :]  # the row's scale once, after its sum of x * code
        tl.store(y_ptr + rm64[:, None] * stride_ym + rn64[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def quant_matmul_triton(x, fmt: str, codes, scales, zeros=None, config: QuantConfig | None = None,
                        dot: str | None = None, out_dtype: torch.dtype | None = None):
    """Launch `_quant_matmul_kernel` on min(tiles, multiprocessors) programs; x [M, K] -> [M, N].
    `config`: default `quant_config(...)`. `dot`: "mma" (`tl.dot`, default on a GPU) or "sum" (`tl.sum` of
    the products, default under the interpreter, whose `tl.dot` is numpy's matmul). `out_dtype`: default
    x's; float32 returns the accumulator itself (tests)."""
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    cfg = config or quant_config(fmt, N, K, x.dtype, x.device)
    dot = dot or ("sum" if interpreting() else "mma")
    int4 = fmt == "int4"
    z = zeros if int4 else scales  # int8 reads no zeros: any pointer
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    _quant_matmul_kernel[(min(tiles, device_programs(x.device)),)](
        x, codes, scales, z, y,
        M, N, K,
        x.stride(0), x.stride(1), codes.stride(0), codes.stride(1),
        scales.stride(0), scales.stride(1) if int4 else 0, z.stride(0), z.stride(1) if int4 else 0,
        y.stride(0), y.stride(1),
        INT4=int4, GROUP_SIZE=GROUP, OFFSET=INT4_OFFSET, DOT_FP32=interpreting() and x.element_size() == 2,
        DOT_SUM=dot == "sum", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def k_major(t: torch.Tensor) -> torch.Tensor:
    """t [N, K'] with the same values, stored K-major (a transposed view of a contiguous [K', N]): the
    layout QuantLinear keeps for this kernel, so that a [k, BLOCK_N] tile of codes is BLOCK_N contiguous
    bytes per k (coalesced loads of a group's 16 bytes per weight row)."""
    return t.t().contiguous().t()
