"""llama.cpp's quantized GGUF blocks, decomposed exactly into one uniform form, and that form packed into the
tile layout the C++ kernel reads. This docstring is the contract with that kernel.

Types (name: id, BITS, G, SB, SUB, HAS_B, OFF), with what each block field becomes:
  Q4_0: 0, 4, 32,  32, no SUB, no B,  -8     u = q;          da = d
  Q4_1: 1, 4, 32,  32, no SUB, B,      0     u = q;          da = d; db = m
  Q5_0: 2, 5, 32,  32, no SUB, no B, -16     u = q (0..31);  da = d
  Q5_1: 3, 5, 32,  32, no SUB, B,      0     u = q;          da = d; db = m
  Q8_0: 4, 8, 32,  32, no SUB, no B, -128    u = q + 128 (uint8); da = d
  Q4_K: 5, 4, 32, 256, SUB,    B,      0     u = q; da = d; sa = sc (6-bit scale of the sub-block of 32);
                                             db = -dmin (float16, sign flipped: exact); sb = m (6-bit min)
  Q5_K: 6, 5, 32, 256, SUB,    B,      0     as Q4_K, u of 5 bits
  Q6_K: 7, 6, 16, 256, SUB,    no B, -32     u = q (0..63); da = d; sa = the int8 scale of the sub-block of 16

The form (`Decomposed`): u uint8 [N, K]; da float16 [N, K/SB]; db float16 [N, K/SB] (HAS_B only); sa int8
[N, K/G] (SUB only); sb int8 [N, K/G] (SUB and HAS_B only). For output row n and input column k, with group
g = k // G and super-block s = k // SB, all in float32:
  a = float32(da[n, s]) * float32(sa[n, g])          (sa = 1 without SUB)
  b = float32(db[n, s]) * float32(sb[n, g])          with HAS_B (sb = 1 without SUB)
  b = OFF * a                                        without HAS_B
  w[n, k] = a * u[n, k] + b
Every product is exact in float32 (at most 11 + 7 + 6 = 24 significant bits, Q6_K's a * u), so an FMA or a
separate multiply and add give the same bits, and w equals `gguf.quants.dequantize` bit for bit, except that
a zero may come out +0 where the oracle gives -0 (the oracle computes d * (q - OFF'), we add OFF * a).

The packed layout (`Packed`): rows in tiles of 16 (T = ceil(N / 16); rows past N are all zero), columns in
groups of 32. codes uint8 [T, K/32, CB], CB = 256 + 64 * HB bytes, HB = BITS - 4. For tile t (rows
n = 16 t + i, i = 0..15) and column group kb (columns k0 = 32 kb ...), the 8 chunk vectors of 64 bytes
  U_c[4 i + j] = u[16 t + i, k0 + 4 c + j]          (c = 0..7, j = 0..3)
are stored as
  low plane,  4 vectors:  L_v = (U_v & 15) | ((U_{v+4} & 15) << 4)                          (v = 0..3)
  high plane, HB vectors: H_v = OR over c with c % HB == v of ((U_c >> 4) << ((c // HB) * HB))   (v < HB)
  codes[t, kb] = L_0 L_1 L_2 L_3 H_0 ... H_{HB-1}  (64 bytes each, in that order)
(4 bits: no high plane; 5 bits: H_0 bit c is u's bit 4 of chunk c; 6 bits: H_v holds chunks v, v+2, v+4,
v+6 two bits each; 8 bits: H_v holds the high nibbles of U_v and U_{v+4}, as the low plane.) The scales are
transposed to tiles: da[t, s, i] = da[16 t + i, s], db likewise [T, K/SB, 16]; sa[t, g, i] = sa[16 t + i, g],
sb likewise [T, K/G, 16]. Every buffer is contiguous.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

TILE_ROWS = 16  # rows per tile
TILE_COLS = 32  # columns per code block of a tile
CHUNK_ELEMENTS = 1 << 22  # weights handled at a time by decompose, pack, unpack and dequantize


class BlockType(NamedTuple):
    name: str
    id: int
    bits: int  # bits of u
    group: int  # G: columns per sa / sb
    superblock: int  # SB: columns per da / db (also the weights of one GGUF block)
    sub: bool  # has sa (and sb where has_b)
    has_b: bool  # has db; otherwise b = off * a
    off: int
    block_bytes: int  # bytes of one GGUF block of `superblock` weights


TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q4_0", 0, 4, 32, 32, False, False, -8, 18),
    BlockType("Q4_1", 1, 4, 32, 32, False, True, 0, 20),
    BlockType("Q5_0", 2, 5, 32, 32, False, False, -16, 22),
    BlockType("Q5_1", 3, 5, 32, 32, False, True, 0, 24),
    BlockType("Q8_0", 4, 8, 32, 32, False, False, -128, 34),
    BlockType("Q4_K", 5, 4, 32, 256, True, True, 0, 144),
    BlockType("Q5_K", 6, 5, 32, 256, True, True, 0, 176),
    BlockType("Q6_K", 7, 6, 16, 256, True, False, -32, 210),
)}


# byte offsets of each block's float16 fields (d first, then dmin or m): what a random valid block overwrites
# (tests/test_ggml_blocks.py, bench/qmm_cpu.py), since random bytes there could be NaN or infinite
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


class Decomposed(NamedTuple):
    u: torch.Tensor  # uint8 [N, K]
    da: torch.Tensor  # float16 [N, K/SB]
    db: torch.Tensor | None  # float16 [N, K/SB] (has_b only)
    sa: torch.Tensor | None  # int8 [N, K/G] (sub only)
    sb: torch.Tensor | None  # int8 [N, K/G] (sub and has_b only)


class Packed(NamedTuple):
    qtype: str
    n: int  # true rows N
    k: int  # columns K
    codes: torch.Tensor  # uint8 [T, K/32, CB]
    da: torch.Tensor  # float16 [T, K/SB, 16]
    db: torch.Tensor | None  # float16 [T, K/SB, 16]
    sa: torch.Tensor | None  # int8 [T, K/G, 16]
    sb: torch.Tensor | None  # int8 [T, K/G, 16]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.codes, self.da, self.db, self.sa, self.sb)
                   if x is not None)


def block_type(qtype) -> BlockType:
    """The BlockType of `qtype` (a name, or anything with a `.name` such as gguf.GGMLQuantizationType)."""
    name = qtype if isinstance(qtype, str) else getattr(qtype, "name", str(qtype))
    bt = TYPES.get(name)
    if bt is None:
        raise ValueError(f"block type {name!r} is not supported; supported: {', '.join(TYPES)}")
    return bt


# ---------------------------------------------------------------------------------------------- decompose

def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of each block: [r, nb, bytes] -> [r, nb]."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., m, 1, w] bytes -> [..., m, 2, w]: the low nibbles, then the high ones."""
    return np.concatenate((qs & 15, qs >> 4), axis=-2)


def _k_scales_mins(packed: np.ndarray):
    """Q4_K / Q5_K's 8 six-bit scales and mins from their 12 bytes: uint8 [..., 12] -> two uint8 [..., 8]
    (as models/gguf.py's q4k_scales_mins: bytes 0-3 scale j low 6 bits, top 2 bits of scale j + 4; bytes
    4-7 the same for the mins; bytes 8-11 the low 4 bits of scale j + 4 (low nibble) and min j + 4)."""
    lo_sc, lo_m, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # [..., 4] each
    scales = np.concatenate((lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)), axis=-1)  # [..., 8]
    mins = np.concatenate((lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)), axis=-1)  # [..., 8]
    return scales, mins


def _decompose_blocks(b: np.ndarray, name: str):
    """Blocks uint8 [r, nb, block bytes] -> numpy (u [r, K], da, db, sa, sb) (None where absent)."""
    r, nb = b.shape[:2]
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        # d, [m], [qh: uint32, bit j = bit 4 of weight j], 16 bytes: weight j low nibble of byte j, j + 16 high
        has_m, five = name.endswith("_1"), name.startswith("Q5")
        at = 4 if has_m else 2
        qh = b[..., at:at + 4] if five else None  # [r, nb, 4]
        at += 4 if five else 0
        u = _nibbles(b[..., None, at:at + 16]).reshape(r, nb, 32)  # [r, nb, 32]
        if five:
            u |= np.unpackbits(qh, axis=-1, bitorder="little") << 4  # [r, nb, 32]: little-endian uint32 bits
        return u.reshape(r, -1), _f16(b, 0), _f16(b, 2) if has_m else None, None, None
    if name == "Q8_0":  # d, 32 int8
        return (b[..., 2:34] ^ 0x80).reshape(r, -1), _f16(b, 0), None, None, None  # q + 128 == q ^ 0x80
    if name in ("Q4_K", "Q5_K"):
        # d, dmin, 12 bytes of scales and mins, [qh 32 bytes: bit i of byte l is bit 4 of sub-block i's
        # weight l], 128 bytes: bytes 32c..32c+31 hold sub-block 2c (low nibbles) and 2c + 1 (high)
        sc, m = _k_scales_mins(b[..., 4:16])  # [r, nb, 8] each
        at = 16 if name == "Q4_K" else 48
        u = _nibbles(b[..., at:at + 128].reshape(r, nb, 4, 1, 32)).reshape(r, nb, 8, 32)  # [r, nb, sub, 32]
        if name == "Q5_K":
            bits = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # [r, nb, 32 (l), 8 (i)]
            u |= bits.swapaxes(-1, -2) << 4  # [r, nb, 8, 32]
        return (u.reshape(r, -1), _f16(b, 0), np.negative(_f16(b, 2)),
                sc.reshape(r, -1).view(np.int8), m.reshape(r, -1).view(np.int8))
    if name == "Q6_K":
        # 128 bytes ql, 64 bytes qh, 16 int8 scales, d. Weight 128 h + 64 s + x (x < 64): low 4 bits in nibble s
        # of ql[64 h + x]; weight 128 h + 32 t + l (l < 32): top 2 bits at bit 2t of qh[32 h + l].
        low = _nibbles(b[..., 0:128].reshape(r, nb, 2, 1, 64))  # [r, nb, 2 (h), 2 (s), 64]
        qh = b[..., 128:192].reshape(r, nb, 2, 1, 32)  # [r, nb, 2 (h), 1, 32]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [r, nb, 2 (h), 4 (t), 32]
        u = low.reshape(r, nb, 2, 4, 32) | (high << 4)
        sa = np.ascontiguousarray(b[..., 192:208]).view(np.int8)  # [r, nb, 16]
        return u.reshape(r, -1), _f16(b, 208), None, sa.reshape(r, -1), None
    raise ValueError(f"block type {name!r} is not supported")  # pragma: no cover (block_type checked it)


def decompose(raw, qtype) -> Decomposed:
    """Rows of a GGUF tensor as stored (uint8 [r, bytes per row], numpy or torch; `GGUFFile.raw_rows`) -> the
    uniform form, exactly. A bounded chunk of rows at a time (no loop over blocks)."""
    bt = block_type(qtype)
    raw = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"raw rows must be uint8 [rows, bytes per row], got {raw.dtype} {tuple(raw.shape)}")
    r, row_bytes = raw.shape
    if row_bytes % bt.block_bytes:
        raise ValueError(f"{bt.name}: a row of {row_bytes} bytes is not a whole number of "
                         f"{bt.block_bytes}-byte blocks")
    nb = row_bytes // bt.block_bytes
    k = nb * bt.superblock
    u = np.empty((r, k), np.uint8)
    da = np.empty((r, nb), np.float16)
    db = np.empty((r, nb), np.float16) if bt.has_b else None
    sa = np.empty((r, k // bt.group), np.int8) if bt.sub else None
    sb = np.empty((r, k // bt.group), np.int8) if bt.sub and bt.has_b else None
    step = max(1, CHUNK_ELEMENTS // max(1, k))
    for first in range(0, r, step):
        last = min(r, first + step)
        parts = _decompose_blocks(raw[first:last].reshape(last - first, nb, bt.block_bytes), bt.name)
        for out, part in zip((u, da, db, sa, sb), parts):
            if out is not None:
                out[first:last] = part
    wrap = lambda x: None if x is None else torch.from_numpy(x)  # noqa: E731
    return Decomposed(wrap(u), wrap(da), wrap(db), wrap(sa), wrap(sb))


def compose(dec: Decomposed, qtype) -> torch.Tensor:
    """The weights the form means: float32 [N, K], w = a u + b (the module docstring's formula)."""
    bt = block_type(qtype)
    n, k = dec.u.shape
    s, per = k // bt.superblock, bt.superblock // bt.group
    a = dec.da.float().view(n, s, 1, 1)
    if bt.sub:
        a = a * dec.sa.float().view(n, s, per, 1)  # [n, s, per, 1]
    if bt.has_b:
        b = dec.db.float().view(n, s, 1, 1)
        if bt.sub:
            b = b * dec.sb.float().view(n, s, per, 1)
    else:
        b = bt.off * a
    return (a * dec.u.view(n, s, per, bt.group).float() + b).reshape(n, k)


# --------------------------------------------------------------------------------------- quantize_rows

def quantize_rows(w: torch.Tensor, qtype: str) -> Decomposed:
    """Float weights [r, K] (K % 32 == 0) quantized the llama.cpp way into Q4_1's or Q8_0's form, with u
    computed against the float16-rounded d (and m). Q4_1, per 32: d = fp16((max - min) / 15), m = fp16(min),
    u = clamp(round((w - m) / d), 0, 15). Q8_0: d = fp16(amax / 127), u = clamp(round(w / d), -127, 127) + 128
    (round half away from zero). A group with d = 0 gets u = 0 (Q4_1) or 128 (Q8_0)."""
    bt = block_type(qtype)
    if bt.name not in ("Q4_1", "Q8_0"):
        raise ValueError(f"quantize_rows makes Q4_1 or Q8_0, not {bt.name}")
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"quantize_rows needs [rows, K] with K a multiple of 32, got {tuple(w.shape)}")
    r, k = w.shape
    x = w.detach().to("cpu", torch.float32).reshape(r, k // 32, 32)  # [r, groups, 32]
    if not torch.isfinite(x).all():
        raise ValueError("quantize_rows: the weights are not all finite")
    if bt.name == "Q4_1":
        lo, hi = x.amin(-1), x.amax(-1)  # [r, groups]
        d, m = ((hi - lo) / 15).half(), lo.half()
        q = torch.floor((x - m.float()[..., None]) / d.float()[..., None] + 0.5).clamp_(0, 15)
        q = torch.where(d[..., None] == 0, 0, q)
        db = m
    else:
        d = (x.abs().amax(-1) / 127).half()  # [r, groups]
        y = x / d.float()[..., None]
        q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp_(-127, 127) + 128
        q = torch.where(d[..., None] == 0, 128, q)
        db = None
    if not torch.isfinite(d).all():
        raise ValueError(f"quantize_rows: a {bt.name} scale overflows float16")
    return Decomposed(q.to(torch.uint8).reshape(r, k), d, db, None, None)


# ------------------------------------------------------------------------------------------ pack / unpack

def _check(dec: Decomposed, bt: BlockType) -> tuple[int, int]:
    if dec.u.dim() != 2 or dec.u.dtype != torch.uint8:
        raise ValueError(f"u must be uint8 [N, K], got {dec.u.dtype} {tuple(dec.u.shape)}")
    n, k = dec.u.shape
    if k % bt.superblock:
        raise ValueError(f"{bt.name}: K = {k} is not a multiple of {bt.superblock}")
    want = {"da": ((n, k // bt.superblock), torch.float16, True),
            "db": ((n, k // bt.superblock), torch.float16, bt.has_b),
            "sa": ((n, k // bt.group), torch.int8, bt.sub),
            "sb": ((n, k // bt.group), torch.int8, bt.sub and bt.has_b)}
    for field, (shape, dtype, present) in want.items():
        x = getattr(dec, field)
        if not present:
            if x is not None:
                raise ValueError(f"{bt.name} has no {field}")
        elif x is None or tuple(x.shape) != shape or x.dtype != dtype:
            got = None if x is None else (x.dtype, tuple(x.shape))
            raise ValueError(f"{bt.name}: {field} must be {dtype} {shape}, got {got}")
    if n and k and int(dec.u.max()) >> bt.bits:
        raise ValueError(f"{bt.name}: u has values of more than {bt.bits} bits")
    return n, k


def _tiles_of_rows(x: torch.Tensor, t: int) -> torch.Tensor:
    """[n, c] per-row values -> [t, c, 16] (rows past n zero), contiguous."""
    n, c = x.shape
    padded = torch.zeros(t * TILE_ROWS, c, dtype=x.dtype)
    padded[:n] = x
    return padded.view(t, TILE_ROWS, c).transpose(1, 2).contiguous()


_LOW4 = np.uint32(0x0F0F0F0F)  # per-byte masks for 4 bytes at a time (a uint32 lane holds j = 0..3)
_HIGH4 = np.uint32(0xF0F0F0F0)


def _pack_codes(u: np.ndarray, out: np.ndarray, hb: int) -> None:
    """u uint8 [tt * 16, K] (whole tiles) -> out uint8 [tt, K/32, 256 + 64 hb]. The 4 bytes j = 0..3 move
    together, so the work is on uint32 lanes: a transpose into the chunk vectors, then per-byte bit
    operations whose shifts never cross a byte (u < 2^BITS is checked by `_check`)."""
    tt, kb = u.shape[0] // TILE_ROWS, u.shape[1] // TILE_COLS
    lanes = np.ascontiguousarray(u).view(np.uint32).reshape(tt, TILE_ROWS, kb, 8)  # [tt, i, kb, c]
    chunks = np.ascontiguousarray(lanes.transpose(0, 2, 3, 1))  # [tt, kb, c, i]: U_c, 16 lanes of 4 bytes
    planes = out.view(np.uint32).reshape(tt, kb, 4 + hb, TILE_ROWS)  # [tt, kb, plane, i]
    low = planes[:, :, :4]  # L_v = (U_v & 15) | (U_{v+4} << 4)
    np.bitwise_and(chunks[:, :, :4], _LOW4, out=low)
    low |= (chunks[:, :, 4:] << np.uint32(4)) & _HIGH4
    if hb:
        high = ((chunks >> np.uint32(4)) & _LOW4).reshape(tt, kb, 8 // hb, hb, TILE_ROWS)  # [.., m, v, i]: c = m hb + v
        h = planes[:, :, 4:]  # H_v
        h[...] = high[:, :, 0]
        for m in range(1, 8 // hb):
            h |= high[:, :, m] << np.uint32(m * hb)


def _unpack_codes(codes: np.ndarray, hb: int) -> np.ndarray:
    """codes uint8 [tt, K/32, 256 + 64 hb] -> u uint8 [tt * 16, K] (the inverse of `_pack_codes`)."""
    tt, kb = codes.shape[:2]
    planes = np.ascontiguousarray(codes).view(np.uint32).reshape(tt, kb, 4 + hb, TILE_ROWS)  # [tt, kb, plane, i]
    chunks = np.empty((tt, kb, 8, TILE_ROWS), np.uint32)  # [tt, kb, c, i]: U_c
    np.bitwise_and(planes[:, :, :4], _LOW4, out=chunks[:, :, :4])
    np.bitwise_and(planes[:, :, :4] >> np.uint32(4), _LOW4, out=chunks[:, :, 4:])
    if hb:
        high = planes[:, :, 4:]  # [tt, kb, v, i]
        per_byte = np.uint32(((1 << hb) - 1) * 0x01010101)
        for m in range(8 // hb):
            chunks[:, :, m * hb:(m + 1) * hb] |= ((high >> np.uint32(m * hb)) & per_byte) << np.uint32(4)
    lanes = np.ascontiguousarray(chunks.transpose(0, 3, 1, 2))  # [tt, i, kb, c]
    return lanes.view(np.uint8).reshape(tt * TILE_ROWS, kb * TILE_COLS)


def pack(dec: Decomposed, qtype) -> Packed:
    """The uniform form -> the tile layout of the module docstring (a bounded chunk of tiles at a time)."""
    bt = block_type(qtype)
    n, k = _check(dec, bt)
    t, hb = -(-n // TILE_ROWS), bt.bits - 4
    codes = torch.empty(t, k // TILE_COLS, 256 + 64 * hb, dtype=torch.uint8)
    u_all, codes_np = dec.u.numpy(), codes.numpy()
    step = max(1, CHUNK_ELEMENTS // max(1, TILE_ROWS * k))  # tiles at a time
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        first, last = t0 * TILE_ROWS, t1 * TILE_ROWS
        u = u_all[first:last]
        if last > n:  # the last tile's rows past N are zero
            u = np.concatenate((u, np.zeros((last - n, k), np.uint8)))
        _pack_codes(u, codes_np[t0:t1], hb)
    tiles = lambda x: None if x is None else _tiles_of_rows(x, t)  # noqa: E731
    return Packed(bt.name, n, k, codes, tiles(dec.da), tiles(dec.db), tiles(dec.sa), tiles(dec.sb))


def _untile(x: torch.Tensor | None) -> torch.Tensor | None:
    """[tt, c, 16] -> [tt * 16, c]."""
    return None if x is None else x.transpose(1, 2).reshape(-1, x.shape[1])


def _unpack_tiles(p: Packed, tiles) -> Decomposed:
    """The form of tiles `tiles` (a slice or a LongTensor of tile indices): 16 rows per tile, padding included."""
    pick = lambda x: None if x is None else x[tiles]  # noqa: E731
    hb = block_type(p.qtype).bits - 4
    u = torch.from_numpy(_unpack_codes(pick(p.codes).numpy(), hb))  # [16 tiles, K]
    return Decomposed(u, _untile(pick(p.da)), _untile(pick(p.db)), _untile(pick(p.sa)), _untile(pick(p.sb)))


def unpack(p: Packed) -> Decomposed:
    """The inverse of `pack`: the form of rows [:N]."""
    dec = _unpack_tiles(p, slice(None))
    return Decomposed(*(None if x is None else x[:p.n].contiguous() for x in dec))


def _tiles_per_chunk(p: Packed) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, TILE_ROWS * p.k))


def dequantize(p: Packed) -> torch.Tensor:
    """The torch reference: float32 [N, K] straight from the packed buffers, a bounded chunk of tiles at a time."""
    out = torch.empty(p.n, p.k, dtype=torch.float32)
    t = p.codes.shape[0]
    step = _tiles_per_chunk(p)
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        first, last = t0 * TILE_ROWS, min(p.n, t1 * TILE_ROWS)
        out[first:last] = compose(_unpack_tiles(p, slice(t0, t1)), p.qtype)[:last - first]
    return out


def dequantize_rows(p: Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the packed table (an embedding lookup): float32 [len(ids), K]; only the tiles those rows
    live in are unpacked, a bounded number at a time."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= p.n):
        raise IndexError(f"row ids must be in [0, {p.n})")
    out = torch.empty(ids.numel(), p.k, dtype=torch.float32)
    step = _tiles_per_chunk(p)
    for first in range(0, ids.numel(), step):
        chunk = ids[first:first + step]
        dec = _unpack_tiles(p, chunk // TILE_ROWS)  # 16 rows per id
        rows = torch.arange(chunk.numel()) * TILE_ROWS + chunk % TILE_ROWS  # each id's row among them
        out[first:first + chunk.numel()] = compose(Decomposed(*(None if x is None else x[rows] for x in dec)),
                                                   p.qtype)
    return out
