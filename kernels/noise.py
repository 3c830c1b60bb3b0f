"""Counter-based random numbers keyed by (seed, absolute position): the randomness of seeded sampling.

A request's random numbers for the token at absolute sequence position p (prompt + output index) are a
pure function of (its 64-bit seed, p, a stream number, the vocabulary index v): Philox4x32-10, Triton's
generator (`tl.randint4x`), with key = the seed and 64-bit counter offset = ((stream << 28 | p) << 32 |
v >> 1). One counter gives four 32-bit words: words 0 and 1 make the uniform of the even index, words 2
and 3 that of the odd one, as 53-bit floats u = (m + 1) * 2**-53 in (0, 1] (m: 32 high bits of the first
word, 21 of the second). Nothing depends on how the draws are grouped into steps, batches or launches,
so a sample at position p sees the same numbers whether p is a draft position of a k = 5 step, a bonus
token or a target-only step.

- `uniform_noise_reference`: pure torch, the Philox rounds in int64 arithmetic (the Random123
  known-answer vector is a test);
- `uniform_noise_triton`: one program per (row, position, vocabulary block), `tl.randint4x`;
- `uniform_noise`: validation and dispatch (`dispatch.py`); the two give the same bits (tests/test_kernels.py);
- `exponential_noise`: Exp(1) = -log(u), one torch op on either backend's uniforms, so the bits agree too.
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

RACE, ACCEPT, RESIDUAL = 0, 1, 2  # streams: race noise, acceptance uniforms, residual/bonus noise
STREAMS = (RACE, ACCEPT, RESIDUAL)
POSITION_BITS = 28  # positions < 2**28; the stream sits above them in the counter's high word
MAX_POSITION = 1 << POSITION_BITS
BLOCK_V = 1024

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Philox4x32 key increments (Random123, triton.language.random)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
_ROUNDS = 10


def philox4x32(seed: torch.Tensor, c0, c1) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of counter (c0, c1, 0, 0) under key (low, high 32 bits of seed), as `tl.randint4x`
    computes it: four int64 tensors of 32-bit words (broadcast shape of the arguments). A 32 x 32-bit
    product is formed in int64 and wraps modulo 2**64 (two's complement, as torch's integer multiply does
    on every device): its low and high words are then exact."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0 = (c0 & _MASK32).expand(torch.broadcast_shapes(c0.shape, c1.shape, seed.shape)).contiguous()
    c1 = (c1 & _MASK32).expand_as(c0).contiguous()
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    for _ in range(_ROUNDS):
        prod_b = c2 * _ROUND_B
        prod_a = c0 * _ROUND_A
        c0 = (prod_b >> 32).bitwise_and_(_MASK32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (prod_a >> 32).bitwise_and_(_MASK32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1, c3 = prod_b.bitwise_and_(_MASK32), prod_a.bitwise_and_(_MASK32)
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def _to_unit(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Two 32-bit words -> float64 in (0, 1]: (m + 1) * 2**-53, m = first << 21 | second >> 11 (exact)."""
    return ((first << 21) | (second >> 11)).add_(1).double().mul_(2.0 ** -53)


def uniform_noise_reference(seeds, positions, count: int, width: int, stream: int) -> torch.Tensor:
    """[B, count, width] float64 uniforms in (0, 1]: row b, column j, index v is keyed by (seeds[b],
    positions[b] + j, stream, v). seeds, positions: [B] int64."""
    B, device = seeds.shape[0], seeds.device
    pairs = (width + 1) // 2
    high = (positions[:, None] + torch.arange(count, device=device)) | (stream << POSITION_BITS)  # [B, count]
    low = torch.arange(pairs, dtype=torch.int64, device=device)  # [pairs]: counter c0 = v >> 1
    w0, w1, w2, w3 = philox4x32(seeds[:, None, None], low[None, None, :], high[:, :, None])  # each [B, count, pairs]
    out = torch.empty(B, count, 2 * pairs, dtype=torch.float64, device=device)
    out[..., 0::2] = _to_unit(w0, w1)  # even v: words 0, 1
    out[..., 1::2] = _to_unit(w2, w3)  # odd v: words 2, 3
    return out[..., :width]


def uniform_noise(seeds, positions, count: int, width: int, stream: int, backend: str | None = None,
                  host_max_position: int | None = None) -> torch.Tensor:
    """Validate and dispatch: [B, count, width] float64 uniforms in (0, 1] keyed by (seed, position, stream, v).

    seeds:     [B] int64, each request's 64-bit key (bit pattern)
    positions: [B] int64, absolute position of column 0 of each row (column j is positions + j)
    host_max_position: the largest positions[b] + count - 1, when the caller knows it on the host (the
        runtime does); checked against 2**28 without reading the device. None: not checked.
    """
    B = seeds.shape[0]
    check(seeds.dtype == torch.int64 and seeds.dim() == 1, "uniform_noise: seeds must be [B] int64")
    check(positions.dtype == torch.int64 and positions.shape == (B,), f"uniform_noise: positions must be [{B}] int64")
    check(isinstance(count, int) and count >= 1 and isinstance(width, int) and width >= 1,
          "uniform_noise: count and width must be integers >= 1")
    check(stream in STREAMS, f"uniform_noise: stream must be one of {STREAMS}")
    check(host_max_position is None or host_max_position < MAX_POSITION,
          f"uniform_noise: positions must be < 2**{POSITION_BITS}, got {host_max_position}")
    if choose_backend(seeds, backend) == "triton":
        return uniform_noise_triton(seeds, positions, count, width, stream)
    return uniform_noise_reference(seeds, positions, count, width, stream)


def exponential_noise(seeds, positions, count: int, width: int, stream: int, dtype: torch.dtype,
                      backend: str | None = None, host_max_position: int | None = None) -> torch.Tensor:
    """[B, count, width] Exp(1) noise -log(u) of `uniform_noise`, in `dtype`, at least its smallest normal
    (an exact 0 would make p / e = 0/0 = NaN and let a zero-probability token win a race)."""
    u = uniform_noise(seeds, positions, count, width, stream, backend, host_max_position)
    return u.log_().neg_().to(dtype).clamp_(min=torch.finfo(dtype).tiny)


@lazy_jit
def _uniform_kernel(
    out_ptr,  # [B, count, width] float64, out
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    s_b, s_j,
    width,
    STREAM: tl.constexpr,
    POS_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, column, block of the width): Philox via tl.randint4x, as the reference."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    v = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK]
    seed = tl.load(seed_ptr + b)
    high = (tl.load(pos_ptr + b) + j) | (STREAM << POS_BITS)
    offset = (high << 32) | (v >> 1)  # [BLOCK] int64: counter words (v >> 1, high)
    w0, w1, w2, w3 = tl.randint4x(seed, offset)
    odd = (v & 1) != 0
    first = tl.where(odd, w2, w0).to(tl.int64)
    second = tl.where(odd, w3, w1).to(tl.int64)
    m = (first << 21) | (second >> 11)  # [BLOCK] < 2**53
    u = (m + 1).to(tl.float64) * 1.1102230246251565e-16  # 2**-53: exact
    tl.store(out_ptr + b * s_b + j * s_j + v, u, mask=v < width)


def uniform_noise_triton(seeds, positions, count: int, width: int, stream: int) -> torch.Tensor:
    """Launch `_uniform_kernel` with grid (B, count, width blocks); same bits as `uniform_noise_reference`."""
    B = seeds.shape[0]
    out = torch.empty(B, count, width, dtype=torch.float64, device=seeds.device)
    if B == 0:
        return out
    block = min(BLOCK_V, next_power_of_2(width))
    _uniform_kernel[(B, count, cdiv(width, block))](
        out, seeds.contiguous(), positions.contiguous(), out.stride(0), out.stride(1), width,
        STREAM=stream, POS_BITS=POSITION_BITS, BLOCK=block)
    return out
