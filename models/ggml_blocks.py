"""llama.cpp's quantized GGUF blocks, decomposed exactly into one uniform form, and that form packed into the
tile layout the C++ kernel reads. This docstring is the contract with that kernel.

Types (name: id, BITS, G, SB, SUB, HAS_B, OFF), with what each block field becomes:
  Q4_0:    0, 4, 32,  32, no SUB, no B,  -8     u = q;          da = d
  Q4_1:    1, 4, 32,  32, no SUB, B,      0     u = q;          da = d; db = m
  Q5_0:    2, 5, 32,  32, no SUB, no B, -16     u = q (0..31);  da = d
  Q5_1:    3, 5, 32,  32, no SUB, B,      0     u = q;          da = d; db = m
  Q8_0:    4, 8, 32,  32, no SUB, no B, -128    u = q + 128 (uint8); da = d
  Q4_K:    5, 4, 32, 256, SUB,    B,      0     u = q; da = d; sa = sc (6-bit scale of the sub-block of 32);
                                                db = -dmin (float16, sign flipped: exact); sb = m (6-bit min)
  Q5_K:    6, 5, 32, 256, SUB,    B,      0     as Q4_K, u of 5 bits
  Q6_K:    7, 6, 16, 256, SUB,    no B, -32     u = q (0..63); da = d; sa = the int8 scale of the sub-block of 16
  Q2_K:    8, 2, 16, 256, SUB,    B,      0     u = q (0..3); da = d; sa = the low nibble of the sub-block of
                                                16's scale byte; db = -dmin; sb = its high nibble (the min)
  Q3_K:    9, 3, 16, 256, SUB,    no B,  -4     u = q + 4 (0..7: 2 bits from qs, the third hmask's bit, which
                                                llama.cpp reads as "subtract 4 where clear"); da = d; sa = the
                                                sub-block of 16's 6-bit scale - 32 (-32..31)
  IQ4_NL: 10, 4, 32,  32, no SUB, no B, -128    TABLE: u = the 4-bit index q; U(u) = kvalues[q] + 128; da = d
  IQ4_XS: 11, 4, 32, 256, SUB,    no B, -128    TABLE as IQ4_NL; da = d; sa = the sub-block of 32's 6-bit
                                                scale - 32 (-32..31)
IQ4_NL and IQ4_XS keep their 4-bit codes: U(u) = TABLE[u] maps them through llama.cpp's non-linear table
kvalues (-127, -104, ..., 113) plus 128 (`IQ4_VALUES`, 1..241) where the weights are formed (`compose`, and
the kernel's unpack: a byte shuffle). For every other type U(u) = u.

The form (`Decomposed`): u uint8 [N, K]; da float16 [N, K/SB]; db float16 [N, K/SB] (HAS_B only); sa int8
[N, K/G] (SUB only); sb int8 [N, K/G] (SUB and HAS_B only). For output row n and input column k, with group
g = k // G and super-block s = k // SB, all in float32:
  a = float32(da[n, s]) * float32(sa[n, g])          (sa = 1 without SUB)
  b = float32(db[n, s]) * float32(sb[n, g])          with HAS_B (sb = 1 without SUB)
  b = OFF * a                                        without HAS_B
  w[n, k] = a * U(u[n, k]) + b
Every product is exact in float32 (at most 24 significant bits: Q6_K's a * u, 11 + 7 + 6; IQ4_XS's, 11 + 5 + 8,
|sa| <= 32), so an FMA or a separate multiply and add give the same bits, and w equals
`gguf.quants.dequantize` bit for bit, except that a zero may come out +0 where the oracle gives -0 (the oracle
computes d * (q - OFF'), we add OFF * a). Where the oracle rounds (Q2_K, the K types with a min: its
d * sc * q - dmin * m), it rounds the same exact product and sum once, as w does.

The packed layout (`Packed`): rows in tiles of 16 (T = ceil(N / 16); rows past N are all zero), columns in
groups of 32. codes uint8 [T, K/32, CB], CB = 64 * BITS bytes. For tile t (rows n = 16 t + i, i = 0..15) and
column group kb (columns k0 = 32 kb ...), the 8 chunk vectors of 64 bytes
  U_c[4 i + j] = u[16 t + i, k0 + 4 c + j]          (c = 0..7, j = 0..3)
are stored as a low plane of LB bits (LB = 4, or 2 where BITS < 4) and a high plane of HB = BITS - LB bits, a
plane of W bits being W vectors, vector v holding the W-bit fields of chunks v, v + W, v + 2W, ... at bits 0, W,
2W, ...:
  low plane,  LB vectors: L_v = OR over c with c % LB == v of ((U_c & (2^LB - 1)) << ((c // LB) * LB))
  high plane, HB vectors: H_v = OR over c with c % HB == v of ((U_c >> LB) << ((c // HB) * HB))
  codes[t, kb] = L_0 ... L_{LB-1} H_0 ... H_{HB-1}  (64 bytes each, in that order)
(4 bits: L_v = U_v | U_{v+4} << 4, no high plane; 5 bits: H_0 bit c is u's bit 4 of chunk c; 6 bits: H_v holds
chunks v, v+2, v+4, v+6 two bits each; 8 bits: H_v holds the high nibbles of U_v and U_{v+4}, as the low plane;
2 bits: L_v holds chunks v, v+2, v+4, v+6 two bits each, no high plane; 3 bits: that, and H_0 bit c is u's
bit 2 of chunk c.) So a weight costs BITS bits of codes whatever its type. The scales are transposed to tiles:
da[t, s, i] = da[16 t + i, s], db likewise [T, K/SB, 16]; sa[t, g, i] = sa[16 t + i, g], sb likewise
[T, K/G, 16]. Every buffer is contiguous.
"""
from __future__ import annotations

import sys
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
    table: tuple[int, ...] | None = None  # TABLE types: U(u) = table[u] (the module docstring); else U(u) = u

    @property
    def planes(self) -> tuple[int, int]:
        """(LB, HB): the bits of the codes' low plane and high plane (the module docstring's layout)."""
        lb = 4 if self.bits >= 4 else 2
        return lb, self.bits - lb


# llama.cpp's IQ4_NL / IQ4_XS non-linear values (kvalues_iq4nl, -127 .. 113) plus 128: what a 4-bit index means
IQ4_VALUES = tuple(v + 128 for v in (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113))

TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q4_0", 0, 4, 32, 32, False, False, -8, 18),
    BlockType("Q4_1", 1, 4, 32, 32, False, True, 0, 20),
    BlockType("Q5_0", 2, 5, 32, 32, False, False, -16, 22),
    BlockType("Q5_1", 3, 5, 32, 32, False, True, 0, 24),
    BlockType("Q8_0", 4, 8, 32, 32, False, False, -128, 34),
    BlockType("Q4_K", 5, 4, 32, 256, True, True, 0, 144),
    BlockType("Q5_K", 6, 5, 32, 256, True, True, 0, 176),
    BlockType("Q6_K", 7, 6, 16, 256, True, False, -32, 210),
    BlockType("Q2_K", 8, 2, 16, 256, True, True, 0, 84),
    BlockType("Q3_K", 9, 3, 16, 256, True, False, -4, 110),
    BlockType("IQ4_NL", 10, 4, 32, 32, False, False, -128, 18, IQ4_VALUES),
    BlockType("IQ4_XS", 11, 4, 32, 256, True, False, -128, 136, IQ4_VALUES),
)}


# byte offsets of each block's float16 fields (d first, then dmin or m): what a random valid block overwrites
# (tests/test_ggml_blocks.py, bench/qmm_cpu.py), since random bytes there could be NaN or infinite
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,),
              "IQ4_XS": (0,)}


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


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # a GGUF's float tensor types (not block types)


def unsupported_types_line(path, type_names) -> str | None:
    """The one line a load as stored prints where the file has quantized tensors of block types the CPU kernel
    does not know (`type_names`: every tensor's GGUF type name), else None."""
    missing = sorted(set(type_names) - set(TYPES) - set(FLOAT_TYPES))
    if not missing:
        return None
    return (f"specdec: {path}: block type{'s' if len(missing) > 1 else ''} {', '.join(missing)} not supported by "
            f"the CPU quantized kernel (it takes {', '.join(TYPES)} as stored); those weights load as float32 "
            f"copies")


def say_unsupported_types(path, type_names) -> None:
    """Print `unsupported_types_line` to stderr where there is one (models/gguf.py's load as stored)."""
    line = unsupported_types_line(path, type_names)
    if line is not None:
        print(line, file=sys.stderr)


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


_SHIFTS2 = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)  # the four 2-bit fields of a byte


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
    if name in ("Q2_K", "Q3_K"):
        # Q2_K: 16 scale bytes (sub-block j of 16: scale low nibble, min high nibble), 64 bytes qs, d, dmin.
        # Q3_K: 32 bytes hmask, 64 bytes qs, 12 bytes of 6-bit scales, d. Both: weight 128 h + 32 s + l (l < 32)
        # has its 2 low bits at bit 2s of qs[32 h + l]; Q3_K's weight 32 j + l its third bit at bit j of hmask[l].
        at = 16 if name == "Q2_K" else 32
        qs = b[..., at:at + 64].reshape(r, nb, 2, 1, 32)  # [r, nb, 2 (h), 1, 32]
        u = ((qs >> _SHIFTS2) & 3).reshape(r, nb, 256)  # [r, nb, 256]: (h, s, l)
        if name == "Q2_K":
            sc = b[..., 0:16]  # [r, nb, 16]
            return (u.reshape(r, -1), _f16(b, 80), np.negative(_f16(b, 82)),
                    (sc & 15).reshape(r, -1).view(np.int8), (sc >> 4).reshape(r, -1).view(np.int8))
        hm = b[..., None, 0:32]  # [r, nb, 1, 32]
        u |= (((hm >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 2).reshape(r, nb, 256)  # (j, l)
        # scale j: low 4 bits in byte j (j < 8) or the high nibble of byte j - 8; top 2 bits at bit 2 (j // 4)
        # of byte 8 + j % 4
        sc = b[..., 96:108]  # [r, nb, 12]
        low = np.concatenate((sc[..., 0:8] & 15, sc[..., 0:8] >> 4), axis=-1)  # [r, nb, 16]
        high = ((sc[..., None, 8:12] >> _SHIFTS2) & 3).reshape(r, nb, 16)  # [r, nb, 4 (j // 4), 4 (j % 4)]
        sa = (low | (high << 4)).astype(np.int8) - np.int8(32)  # [r, nb, 16]: -32..31
        return u.reshape(r, -1), _f16(b, 108), None, sa.reshape(r, -1), None
    if name == "IQ4_NL":  # d, 16 bytes: weight j's 4-bit index the low nibble of byte j, j + 16's the high one
        return _nibbles(b[..., None, 2:18]).reshape(r, -1), _f16(b, 0), None, None, None
    if name == "IQ4_XS":
        # d, scales_h (uint16: bits 2j, 2j+1 the top 2 bits of sub-block j's 6-bit scale), scales_l (4 bytes: the
        # low 4 bits of scale j in nibble j % 2 of byte j // 2), 128 bytes: sub-block j's 16 bytes 16 j ..,
        # low nibbles its weights 0..15, high ones 16..31
        sh = b[..., 2].astype(np.uint16) | (b[..., 3].astype(np.uint16) << 8)  # [r, nb] (little-endian)
        high = ((sh[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)  # [r, nb, 8]
        sl = b[..., 4:8, None] >> np.array([0, 4], np.uint8)  # [r, nb, 4, 2]
        low = (sl & 15).reshape(r, nb, 8)  # [r, nb, 8]
        sa = (low | (high << 4)).astype(np.int8) - np.int8(32)  # [r, nb, 8]: -32..31
        u = _nibbles(b[..., 8:136].reshape(r, nb, 8, 1, 16))  # [r, nb, 8, 2, 16]
        return u.reshape(r, -1), _f16(b, 0), None, sa.reshape(r, -1), None
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
    """The weights the form means: float32 [N, K], w = a U(u) + b (the module docstring's formula)."""
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
    u = dec.u if bt.table is None else torch.tensor(bt.table, dtype=torch.uint8)[dec.u.long()]  # [n, k]: U(u)
    return (a * u.view(n, s, per, bt.group).float() + b).reshape(n, k)


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


def _per_byte(bits: int) -> np.uint32:
    """The mask of a byte's low `bits` bits in each of a uint32 lane's 4 bytes."""
    return np.uint32(((1 << bits) - 1) * 0x01010101)


def _put_plane(plane: np.ndarray, fields: np.ndarray, w: int) -> None:
    """fields uint32 [tt, kb, 8, 16] (chunk c's W-bit fields, per byte) -> plane [tt, kb, W, 16]: vector v
    holds chunks v, v + W, ... at bits 0, W, ... (shifts never cross a byte: each field is below 2^W)."""
    f = fields.reshape(*fields.shape[:2], 8 // w, w, TILE_ROWS)  # [tt, kb, m, v, i]: chunk c = m W + v
    plane[...] = f[:, :, 0]
    for m in range(1, 8 // w):
        plane |= f[:, :, m] << np.uint32(m * w)


def _get_plane(plane: np.ndarray, w: int) -> np.ndarray:
    """The inverse of `_put_plane`: plane uint32 [tt, kb, W, 16] -> the fields [tt, kb, 8, 16]."""
    return np.concatenate([(plane >> np.uint32(m * w)) & _per_byte(w) for m in range(8 // w)], axis=2)


def _pack_codes(u: np.ndarray, out: np.ndarray, lb: int, hb: int) -> None:
    """u uint8 [tt * 16, K] (whole tiles) -> out uint8 [tt, K/32, 64 (lb + hb)]. The 4 bytes j = 0..3 move
    together, so the work is on uint32 lanes: a transpose into the chunk vectors, then per-byte bit
    operations (u < 2^BITS is checked by `_check`)."""
    tt, kb = u.shape[0] // TILE_ROWS, u.shape[1] // TILE_COLS
    lanes = np.ascontiguousarray(u).view(np.uint32).reshape(tt, TILE_ROWS, kb, 8)  # [tt, i, kb, c]
    chunks = np.ascontiguousarray(lanes.transpose(0, 2, 3, 1))  # [tt, kb, c, i]: U_c, 16 lanes of 4 bytes
    planes = out.view(np.uint32).reshape(tt, kb, lb + hb, TILE_ROWS)  # [tt, kb, vector, i]
    _put_plane(planes[:, :, :lb], chunks & _per_byte(lb), lb)
    if hb:
        _put_plane(planes[:, :, lb:], (chunks >> np.uint32(lb)) & _per_byte(hb), hb)


def _unpack_codes(codes: np.ndarray, lb: int, hb: int) -> np.ndarray:
    """codes uint8 [tt, K/32, 64 (lb + hb)] -> u uint8 [tt * 16, K] (the inverse of `_pack_codes`)."""
    tt, kb = codes.shape[:2]
    planes = np.ascontiguousarray(codes).view(np.uint32).reshape(tt, kb, lb + hb, TILE_ROWS)  # [tt, kb, vector, i]
    chunks = _get_plane(planes[:, :, :lb], lb)  # [tt, kb, c, i]: U_c's low bits
    if hb:
        chunks |= _get_plane(planes[:, :, lb:], hb) << np.uint32(lb)
    lanes = np.ascontiguousarray(chunks.transpose(0, 3, 1, 2))  # [tt, i, kb, c]
    return lanes.view(np.uint8).reshape(tt * TILE_ROWS, kb * TILE_COLS)


def pack(dec: Decomposed, qtype) -> Packed:
    """The uniform form -> the tile layout of the module docstring (a bounded chunk of tiles at a time)."""
    bt = block_type(qtype)
    n, k = _check(dec, bt)
    t, (lb, hb) = -(-n // TILE_ROWS), bt.planes
    codes = torch.empty(t, k // TILE_COLS, 64 * bt.bits, dtype=torch.uint8)
    u_all, codes_np = dec.u.numpy(), codes.numpy()
    step = max(1, CHUNK_ELEMENTS // max(1, TILE_ROWS * k))  # tiles at a time
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        first, last = t0 * TILE_ROWS, t1 * TILE_ROWS
        u = u_all[first:last]
        if last > n:  # the last tile's rows past N are zero
            u = np.concatenate((u, np.zeros((last - n, k), np.uint8)))
        _pack_codes(u, codes_np[t0:t1], lb, hb)
    tiles = lambda x: None if x is None else _tiles_of_rows(x, t)  # noqa: E731
    return Packed(bt.name, n, k, codes, tiles(dec.da), tiles(dec.db), tiles(dec.sa), tiles(dec.sb))


def _untile(x: torch.Tensor | None) -> torch.Tensor | None:
    """[tt, c, 16] -> [tt * 16, c]."""
    return None if x is None else x.transpose(1, 2).reshape(-1, x.shape[1])


def _unpack_tiles(p: Packed, tiles) -> Decomposed:
    """The form of tiles `tiles` (a slice or a LongTensor of tile indices): 16 rows per tile, padding included."""
    pick = lambda x: None if x is None else x[tiles]  # noqa: E731
    u = torch.from_numpy(_unpack_codes(pick(p.codes).numpy(), *block_type(p.qtype).planes))  # [16 tiles, K]
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


def select_rows(p: Packed, ids) -> Packed:
    """Rows `ids` of a packed weight, in that order, packed as a weight of their own: the same blocks (exact), e.g.
    a head restricted to a subset of the vocabulary (models/transformer.py `restrict_head`). Only the tiles those
    rows live in are unpacked, a bounded number at a time."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if not ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= p.n:
        raise IndexError(f"row ids must be a non-empty selection of [0, {p.n})")
    chunks = []
    step = _tiles_per_chunk(p)
    for first in range(0, ids.numel(), step):
        chunk = ids[first:first + step]
        dec = _unpack_tiles(p, chunk // TILE_ROWS)  # 16 rows per id
        rows = torch.arange(chunk.numel()) * TILE_ROWS + chunk % TILE_ROWS  # each id's row among them
        chunks.append(Decomposed(*(None if x is None else x[rows] for x in dec)))
    return pack(Decomposed(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*chunks))), p.qtype)
