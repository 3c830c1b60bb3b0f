"""Batch-invariant RMSNorm, optionally fused with the residual add: `y = rms_norm(x)` or, with a residual,
`h = x + residual; y = rms_norm(h)` returning both (the decoder layer's "add, then normalise").

The order is Hugging Face's (models/transformer.py `RMSNorm.forward`, kept bit for bit by the reference):
h in its own dtype (the residual add rounds there), then in float32 `h * rsqrt(mean(h^2) + eps)`, cast back
to h's dtype, then multiplied by the weight (`weight * normed`, torch's type promotion: the output has the
dtype of `weight * h`).

Why a kernel: torch's CUDA reduction picks its strategy (threads per row, vectorisation, how many rows a
block takes) from the tensor's shape, so a row's mean of squares may be summed in another order when the
batch grows. Here one program normalises one row, summing its squares with one `tl.sum` over a block of
next_power_of_2(hidden) elements: a fixed tree per hidden size, whatever the number of rows or the row's
place. Invariant by construction, and under the interpreter too.

- Triton (CUDA; the CPU under `TRITON_INTERPRET=1`): grid (rows,), one program per row, `num_warps` by the
  hidden size only.
- torch reference (elsewhere): exactly `RMSNorm.forward`'s ops (one row at a time on the CPU: measured
  invariant there, docs/design.md).

Where the model calls it: `models/transformer.py`'s `RMSNorm.forward` when the model is batch-invariant and
the kernels' backend is Triton (`rms_norm(x, self.weight, self.eps, backend=backend)`); the decoder layer may
fuse its residual adds (`rms_norm(h, weight, eps, residual=x)` -> (normed, x + h)).
"""
from __future__ import annotations

import torch

from .dispatch import check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)


def rms_norm_reference(x, weight, eps: float, residual=None):
    """x [..., N], weight [N], residual None or like x -> y (and h = x + residual with a residual)."""
    h = x if residual is None else x + residual  # the residual add rounds in x's dtype
    h32 = h.float()
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h32.to(h.dtype)
    return y if residual is None else (y, h)


def rms_norm(x, weight, eps: float, residual=None, backend: str | None = None):
    """Validate and dispatch. x [..., N] floating point; weight [N]; residual None or x's shape and dtype.
    Returns y [..., N] in the dtype of `weight * x` (HF's order, see the module docstring), or (y, h) with
    h = x + residual in x's dtype when a residual is given."""
    if not (x.dim() >= 1 and x.dtype.is_floating_point and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and weight.dtype.is_floating_point and weight.device == x.device
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.device == x.device))):
        _explain(x, weight, residual)  # raises, naming what is wrong (messages built only on failure: hot path)
    if choose_backend(x, backend) == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def _explain(x, weight, residual) -> None:
    check(x.dim() >= 1 and x.dtype.is_floating_point, f"rms_norm: x must be a floating-point [..., N] tensor, got "
          f"{x.dtype} {tuple(x.shape)}")
    N = x.shape[-1]
    check(weight.dim() == 1 and weight.shape[0] == N and weight.dtype.is_floating_point,
          f"rms_norm: weight must be floating-point [{N}], got {weight.dtype} {tuple(weight.shape)}")
    check(weight.device == x.device, f"rms_norm: x on {x.device}, weight on {weight.device}")
    check(False, f"rms_norm: residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}), got "
          f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")


@lazy_jit
def _rms_norm_kernel(
    x_ptr,  # [M, N]
    r_ptr,  # [M, N] residual (not read without HAS_RESIDUAL)
    w_ptr,  # [N]
    y_ptr,  # [M, N], out: weight * normed
    h_ptr,  # [M, N], out: x + residual (not written without HAS_RESIDUAL)
    N, eps,
    stride_xm, stride_xn,
    stride_rm, stride_rn,
    stride_ym, stride_yn,
    stride_hm, stride_hn,
    HAS_RESIDUAL: tl.constexpr,
    X_F64: tl.constexpr,
    Y_F64: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per row: the row's squares summed by one tl.sum over BLOCK_N lanes (a fixed tree)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ok = cols < N
    x = tl.load(x_ptr + row * stride_xm + cols * stride_xn, mask=ok, other=0.0)  # [BLOCK_N], x's dtype
    if HAS_RESIDUAL:
        res = tl.load(r_ptr + row * stride_rm + cols * stride_rn, mask=ok, other=0.0)  # [BLOCK_N]
        if X_F64:
            x = x + res
        else:  # torch's 16-bit add: the float32 sum of two 16-bit numbers, rounded once
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_hm + cols * stride_hn, x, mask=ok)
    h = x.to(tl.float32)  # [BLOCK_N] (float64 is cut to float32 too, as `.float()` does)
    mean = tl.sum(h * h, axis=0) / N
    normed = (h * tl.math.rsqrt(mean + eps)).to(x_ptr.dtype.element_ty)  # [BLOCK_N] cast back to x's dtype
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)  # [BLOCK_N]
    if Y_F64:
        y = w.to(tl.float64) * normed.to(tl.float64)
    else:  # a 16-bit product is exact in float32: rounding it once is torch's 16-bit multiply
        y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols * stride_yn, y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x, weight, eps: float, residual=None):
    """Launch `_rms_norm_kernel` on grid (rows,); shapes as in `rms_norm`."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)  # [M, N] (a view where it can be)
    r2 = residual.reshape(-1, N) if residual is not None else x2  # [M, N]
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)  # [M, N]
    h = torch.empty((M, N), dtype=x.dtype, device=x.device) if residual is not None else y  # [M, N]
    if M and N:
        block = next_power_of_2(N)
        _rms_norm_kernel[(M,)](
            x2, r2, weight, y, h, N, float(eps),
            x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1), y.stride(0), y.stride(1), h.stride(0), h.stride(1),
            HAS_RESIDUAL=residual is not None, X_F64=x.dtype == torch.float64, Y_F64=y.dtype == torch.float64,
            BLOCK_N=block, num_warps=min(16, max(1, block // 256)),
        )
    y = y.view(*x.shape[:-1], N)
    return y if residual is None else (y, h.view(x.shape))
