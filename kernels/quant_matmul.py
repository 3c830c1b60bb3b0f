"""Weight-only quantized matmul: `y = x @ W.T` with W held as int4 or int8 codes and dequantized inside the
kernel, never as a float copy in memory (the GPU path of models/quant.py's `QuantLinear`).

Formats (models/quant.py's; both dequantize as w = (code - offset) * scale + zero):
- **int4**: `nibbles` uint8 [N, K/2] (weight 2j in the low nibble of byte j, 2j + 1 in the high),
  `scales` and `zeros` [N, K/GROUP] (bfloat16), GROUP = 32 inputs per group, offset 8;
- **int8**: `codes` int8 [N, K] (-127..127), `scales` [N] (bfloat16), zero 0.

- Triton (CUDA; the CPU under `TRITON_INTERPRET=1`): written for the few rows of decode and verify steps
  (M = B * (k + 1), 1..64): one program per `[BLOCK_M, BLOCK_N]` output tile (grid (cdiv(N, BLOCK_N),
  cdiv(M, BLOCK_M))), a K loop in order in `BLOCK_K` steps. Each step loads the tile's codes (and their
  group's scale and zero), dequantizes them in registers to float32, and adds `x[:, None, :] * w[None, :, :]`
  to a `[BLOCK_M, BLOCK_N, BLOCK_K]` float32 accumulator (each K lane sums its own inputs in K order); one
  `tl.sum` over the lanes after the loop. No `tl.dot`, no split-K, no autotuning: the tiles are constants
  (`TILES`). Every (row, column) of the output is then the same
  sequence of operations in every call, whatever M or the other rows: the kernel is batch-invariant by
  construction (a blocked layout reduces every row's products along K in the same pattern), and under the
  interpreter too (numpy's sum of each element's K slice). The products and sums are float32 (x is
  converted from its dtype, the dequantized weight is exact in float32 up to its one FMA); the output is
  stored in x's dtype.
- torch reference (elsewhere): the weight dequantized to float32, `x.float() @ W.T`, cast to x's dtype.
  The same numbers up to float32 summation order; not batch-invariant on a GPU (cuBLAS picks its kernel
  by M), so it is the spec and the fallback, not the GPU path.

Not timed on a GPU yet (this project's sessions had none): `bench/bench_kernels.py -k quant_` measures it
against the reference and cuBLAS on a bfloat16 copy of the weight there.
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, check, choose_backend, lazy_jit

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

FORMATS = ("int8", "int4")
GROUP = 32  # int4: inputs per (scale, zero) group
INT4_OFFSET = 8
# fixed tiles (never tuned per shape: another tile would be another summation order): (BLOCK_M, BLOCK_N,
# BLOCK_K); int4's BLOCK_K is a multiple of GROUP. A [BLOCK_M, BLOCK_N, BLOCK_K (int4: / 2)] float32
# accumulator of 8 x 32 x 32 = 64 registers per thread.
TILES = {"int4": (8, 32, 64), "int8": (8, 32, 32)}
NUM_WARPS = 4  # fixed as well: the warps set the reduction's layout


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
@lazy_jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K] float
    c_ptr,  # int4: [N, K/2] uint8 nibbles; int8: [N, K] int8
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] tile of y: K walked in order, the weight tile dequantized in
    registers, products added to a [BLOCK_M, BLOCK_N, lanes of K] float32 accumulator, reduced over K by
    one tl.sum after the loop (a fixed order per element)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W / columns of y
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x / y
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    if INT4:
        rj = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K/2] byte j of the step holds inputs 2j (low nibble) and 2j + 1 (high)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 2], dtype=tl.float32)  # per-lane partial sums
        for k0 in range(0, K, BLOCK_K):
            even = k0 + 2 * rj  # [BLOCK_K/2] input index of each low nibble
            k_ok = even < K
            wb = tl.load(c_ptr + rn64[:, None] * stride_cn + (k0 // 2 + rj)[None, :] * stride_ck,
                         mask=n_ok[:, None] & k_ok[None, :], other=0)  # [BLOCK_N, BLOCK_K/2] uint8
            g = even // GROUP_SIZE  # [BLOCK_K/2] group of inputs 2j and 2j + 1 (GROUP_SIZE is even)
            s = tl.load(s_ptr + rn64[:, None] * stride_sn + g[None, :] * stride_sg,
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K/2]
            z = tl.load(z_ptr + rn64[:, None] * stride_zn + g[None, :] * stride_zg,
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K/2]
            w_lo = ((wb & 15).to(tl.float32) - OFFSET) * s + z  # [BLOCK_N, BLOCK_K/2] weights 2j
            w_hi = ((wb >> 4).to(tl.float32) - OFFSET) * s + z  # [BLOCK_N, BLOCK_K/2] weights 2j + 1
            x_lo = tl.load(x_ptr + rm64[:, None] * stride_xm + even[None, :] * stride_xk,
                           mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K/2]
            x_hi = tl.load(x_ptr + rm64[:, None] * stride_xm + (even + 1)[None, :] * stride_xk,
                           mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K/2]
            acc3 += x_lo[:, None, :] * w_lo[None, :, :] + x_hi[:, None, :] * w_hi[None, :, :]  # [BM, BN, BK/2]
        acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]: one reduction across lanes, after the K loop
    else:
        rk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)  # per-lane partial sums
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk  # [BLOCK_K]
            k_ok = kk < K
            w = tl.load(c_ptr + rn64[:, None] * stride_cn + kk[None, :] * stride_ck,
                        mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float32)  # [BLOCK_N, BLOCK_K] codes
            xk = tl.load(x_ptr + rm64[:, None] * stride_xm + kk[None, :] * stride_xk,
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            acc3 += xk[:, None, :] * w[None, :, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
        acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
        scale = tl.load(s_ptr + rn64 * stride_sn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc = acc * scale[None, :]  # the row's scale once, after its sum of x * code
    tl.store(y_ptr + rm64[:, None] * stride_ym + rn64[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def quant_matmul_triton(x, fmt: str, codes, scales, zeros=None):
    """Launch `_quant_matmul_kernel`: grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)); x [M, K] -> [M, N]."""
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    BLOCK_M, BLOCK_N, BLOCK_K = TILES[fmt]
    int4 = fmt == "int4"
    z = zeros if int4 else scales  # int8 reads no zeros: any pointer
    grid = (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))
    _quant_matmul_kernel[grid](
        x, codes, scales, z, y,
        M, N, K,
        x.stride(0), x.stride(1), codes.stride(0), codes.stride(1),
        scales.stride(0), scales.stride(1) if int4 else 0, z.stride(0), z.stride(1) if int4 else 0,
        y.stride(0), y.stride(1),
        INT4=int4, GROUP_SIZE=GROUP, OFFSET=INT4_OFFSET, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
    )
    return y
