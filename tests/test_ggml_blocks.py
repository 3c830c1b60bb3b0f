"""models/ggml_blocks.py: GGUF blocks decomposed into the uniform form (checked bit for bit against the gguf
library's own numpy dequantizers), packed into the kernel's tile layout (checked byte by byte against a
literal loop transcription of the layout, and by hand-set bytes), and quantize_rows' Q4_1 / Q8_0."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.models import ggml_blocks as G
from specdec.models.ggml_blocks import (F16_FIELDS, TYPES, Decomposed, compose, decompose, dequantize,
                                        dequantize_rows, pack, quantize_rows, unpack)

gguf = pytest.importorskip("gguf")

def random_f16(rng, shape):
    """Finite float16 values of moderate size, both signs, with some zeros and some subnormals."""
    v = rng.uniform(0.5, 1.0, shape) * 2.0 ** rng.integers(-24, 6, shape) * rng.choice([-1, 1], shape)
    v[rng.random(shape) < 0.05] = 0.0
    return v.astype(np.float16)


def random_raw(rng, qtype, n, k):
    """n rows of K weights of GGUF type `qtype`: random bytes, float16 fields overwritten: uint8 [n, bytes]."""
    bt = TYPES[qtype]
    nb = k // bt.superblock
    raw = rng.integers(0, 256, (n, nb, bt.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[..., at:at + 2] = random_f16(rng, (n, nb)).view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, -1)


def oracle(raw, qtype):
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])))


def assert_same_weights(w, ref):
    """Equal as values (== : +0 equals -0), and so bit for bit everywhere except the sign of some zeros."""
    assert w.dtype == ref.dtype == torch.float32 and w.shape == ref.shape
    assert torch.equal(w, ref)
    differ = w.view(torch.int32) != ref.view(torch.int32)
    assert (w[differ] == 0).all()


def assert_same_form(x: Decomposed, y: Decomposed):
    for name, a, b in zip(Decomposed._fields, x, y):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_types_match_the_gguf_library():
    for name, bt in TYPES.items():
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (bt.superblock, bt.block_bytes) == (block, size), name
        assert bt.superblock % bt.group == 0 and bt.sub == (bt.superblock != 32)
    assert [bt.id for bt in TYPES.values()] == list(range(12))
    assert [bt.name for bt in TYPES.values() if bt.table] == ["IQ4_NL", "IQ4_XS"]
    assert G.IQ4_VALUES == tuple(v + 128 for v in gguf.quants.IQ4_NL.kvalues)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_decompose_is_the_oracle_bit_for_bit(qtype):
    rng = np.random.default_rng(TYPES[qtype].id)
    bt = TYPES[qtype]
    n, k = 6, 512
    raw = random_raw(rng, qtype, n, k)
    dec = decompose(raw, qtype)
    s, g = k // bt.superblock, k // bt.group
    assert dec.u.dtype == torch.uint8 and dec.u.shape == (n, k) and int(dec.u.max()) < 1 << bt.bits
    assert int(dec.u.min()) == 0 and int(dec.u.max()) == (1 << bt.bits) - 1  # random bytes: every code's range
    assert dec.da.dtype == torch.float16 and dec.da.shape == (n, s)
    assert (dec.db is not None) == bt.has_b and (dec.sa is not None) == bt.sub
    assert (dec.sb is not None) == (bt.sub and bt.has_b)
    if bt.has_b:
        assert dec.db.dtype == torch.float16 and dec.db.shape == (n, s)
    if bt.sub:
        assert dec.sa.dtype == torch.int8 and dec.sa.shape == (n, g)
    if qtype in ("Q4_K", "Q5_K"):  # six-bit scales and mins; db is -dmin
        assert 0 <= int(dec.sa.min()) and int(dec.sa.max()) < 64 and 0 <= int(dec.sb.min()) and int(dec.sb.max()) < 64
        dmin = torch.from_numpy(raw.reshape(n, s, -1)[..., 2:4].copy()).view(torch.float16)[..., 0]
        assert torch.equal(dec.db.view(torch.int16), (-dmin).view(torch.int16))  # sign flipped, bits kept
    if qtype == "Q2_K":  # 4-bit scales and mins; db is -dmin (bytes 82..83)
        assert 0 <= int(dec.sa.min()) and int(dec.sa.max()) < 16 and 0 <= int(dec.sb.min()) and int(dec.sb.max()) < 16
        dmin = torch.from_numpy(raw.reshape(n, s, -1)[..., 82:84].copy()).view(torch.float16)[..., 0]
        assert torch.equal(dec.db.view(torch.int16), (-dmin).view(torch.int16))
    if qtype in ("Q3_K", "IQ4_XS"):  # 6-bit scales less 32
        assert int(dec.sa.min()) >= -32 and int(dec.sa.max()) <= 31
    ref = oracle(raw, qtype)
    assert_same_weights(compose(dec, qtype), ref)
    # the formula written out once more, literally, per element group: a = da sa, b = db sb or OFF a
    a = dec.da.float().repeat_interleave(bt.superblock, 1)
    if bt.sub:
        a = a * dec.sa.float().repeat_interleave(bt.group, 1)
    if bt.has_b:
        b = dec.db.float().repeat_interleave(bt.superblock, 1)
        if bt.sub:
            b = b * dec.sb.float().repeat_interleave(bt.group, 1)
    else:
        b = bt.off * a
    u = dec.u.float() if bt.table is None else torch.tensor(bt.table, dtype=torch.float32)[dec.u.long()]
    assert_same_weights(a * u + b, ref)
    assert_same_form(decompose(torch.from_numpy(raw), qtype), dec)  # torch input


def test_decompose_in_chunks(monkeypatch):
    rng = np.random.default_rng(11)
    raw = random_raw(rng, "Q5_K", 9, 256)
    whole = decompose(raw, "Q5_K")
    monkeypatch.setattr(G, "CHUNK_ELEMENTS", 512)  # 2 rows at a time
    assert_same_form(decompose(raw, "Q5_K"), whole)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_pack_unpack_dequantize(qtype, monkeypatch):
    rng = np.random.default_rng(100 + TYPES[qtype].id)
    bt = TYPES[qtype]
    n, k = 37, 256 if bt.sub else 512  # 37 rows: 3 tiles, the last one 5 rows
    raw = random_raw(rng, qtype, n, k)
    dec = decompose(raw, qtype)
    ref = oracle(raw, qtype)
    p = pack(dec, qtype)
    t = 3
    assert (p.qtype, p.n, p.k) == (qtype, n, k)
    assert p.codes.shape == (t, k // 32, 64 * bt.bits) and p.codes.dtype == torch.uint8
    assert p.da.shape == (t, k // bt.superblock, 16) and p.da.dtype == torch.float16
    for field in ("db", "sa", "sb"):
        assert (getattr(p, field) is None) == (getattr(dec, field) is None), field
    if bt.sub:
        assert p.sa.shape == (t, k // bt.group, 16) and p.sa.dtype == torch.int8
    buffers = [x for x in (p.codes, p.da, p.db, p.sa, p.sb) if x is not None]
    assert all(x.is_contiguous() for x in buffers)
    assert p.nbytes == sum(x.numel() * x.element_size() for x in buffers)
    # scales transposed into tiles: da[t, s, i] = da[16 t + i, s]; rows past N are zero
    assert p.da[1, 0, 3] == dec.da[19, 0] and p.da[2, -1, 4] == dec.da[36, -1]
    assert (p.da[2, :, 5:] == 0).all() and (p.da.reshape(-1) != 0).any()
    if bt.sub:
        assert p.sa[2, 3, 4] == dec.sa[36, 3] and (p.sa[2, :, 5:] == 0).all()
    if bt.has_b:
        assert p.db[0, -1, 15] == dec.db[15, -1] and (p.db[2, :, 5:] == 0).all()
    assert torch.equal(G._unpack_tiles(p, slice(2, 3)).u[5:], torch.zeros(11, k, dtype=torch.uint8))
    # the codes byte for byte against the literal transcription of the layout
    assert torch.equal(p.codes, reference_codes(dec.u, bt.bits))
    assert_same_form(unpack(p), dec)
    assert_same_weights(dequantize(p), ref)
    ids = torch.tensor([36, 0, 17, 17, 15, 16, 32])
    assert torch.equal(dequantize_rows(p, ids), dequantize(p)[ids])
    assert dequantize_rows(p, torch.tensor([], dtype=torch.long)).shape == (0, k)
    with pytest.raises(IndexError):
        dequantize_rows(p, torch.tensor([37]))
    monkeypatch.setattr(G, "CHUNK_ELEMENTS", 16 * k)  # one tile (or one id) at a time
    assert torch.equal(pack(dec, qtype).codes, p.codes)
    assert_same_weights(dequantize(p), ref)
    assert torch.equal(dequantize_rows(p, ids), dequantize(p)[ids])


def reference_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes layout written out literally with loops (the module docstring's definition)."""
    n, k = u.shape
    t = -(-n // 16)
    lb = 4 if bits >= 4 else 2
    hb = bits - lb
    uu = [[int(x) for x in row] for row in u.tolist()] + [[0] * k] * (16 * t - n)
    out = torch.zeros(t, k // 32, 64 * bits, dtype=torch.uint8)
    for tile in range(t):
        for kb in range(k // 32):
            chunk = [[uu[16 * tile + i][32 * kb + 4 * c + j] for i in range(16) for j in range(4)] for c in range(8)]
            vecs = []
            for v in range(lb):
                low = [0] * 64
                for c in range(8):
                    if c % lb == v:
                        low = [low[x] | ((chunk[c][x] & ((1 << lb) - 1)) << ((c // lb) * lb)) for x in range(64)]
                vecs.append(low)
            for v in range(hb):
                h = [0] * 64
                for c in range(8):
                    if c % hb == v:
                        h = [h[x] | ((chunk[c][x] >> lb) << ((c // hb) * hb)) for x in range(64)]
                vecs.append(h)
            out[tile, kb] = torch.tensor(sum(vecs, []), dtype=torch.uint8)
    return out


def hand_form(qtype, entries, k=32):
    """A one-tile form of `qtype` with u zero but for `entries` {(row, column): value}, unit scales."""
    bt = TYPES[qtype]
    u = torch.zeros(16, k, dtype=torch.uint8)
    for (i, col), value in entries.items():
        u[i, col] = value
    ones = lambda cols, dtype: torch.ones(16, cols, dtype=dtype)  # noqa: E731
    return Decomposed(u, ones(k // bt.superblock, torch.float16),
                      ones(k // bt.superblock, torch.float16) if bt.has_b else None,
                      ones(k // bt.group, torch.int8) if bt.sub else None,
                      ones(k // bt.group, torch.int8) if bt.sub and bt.has_b else None)


@pytest.mark.parametrize("qtype, k, entries, expected", [
    # 4 bits: L_v = U_v low nibble | U_{v+4} << 4; U_c[4 i + j] is row i, column 4 c + j
    ("Q4_0", 32, {(0, 0): 0x3, (0, 16): 0xA, (15, 31): 0x7, (2, 5): 0x9},
     {0: 0xA3, 3 * 64 + 4 * 15 + 3: 0x70, 64 + 4 * 2 + 1: 0x09}),
    # 5 bits: H_0 bit c = bit 4 of chunk c
    ("Q5_0", 32, {(2, 13): 31, (0, 28): 16},
     {3 * 64 + 9: 0x0F, 256 + 9: 0x08, 256 + 0: 0x80}),
    # 6 bits: H_v holds chunks v, v + 2, v + 4, v + 6 at bits 0, 2, 4, 6; the second column group is codes[0, 1]
    ("Q6_K", 256, {(1, 22): 53, (3, 0): 47, (0, 32): 63},
     {64 + 6: 0x50, 256 + 64 + 6: 0x30, 12: 0x0F, 256 + 12: 0x02, 384 + 0: 0x0F, 384 + 256: 0x03}),
    # 8 bits: the high plane holds the high nibbles of U_v and U_{v+4}, as the low plane does the low ones
    ("Q8_0", 32, {(0, 0): 0xAB, (0, 16): 0xCD, (4, 7): 0x12},
     {0: 0xDB, 256: 0xCA, 64 + 19: 0x02, 256 + 64 + 19: 0x01}),
    # 2 bits: L_v holds chunks v, v + 2, v + 4, v + 6 at bits 0, 2, 4, 6; a column group is 128 bytes
    ("Q2_K", 256, {(0, 0): 3, (1, 22): 2, (15, 31): 1, (0, 32): 3},
     {0: 0x03, 64 + 6: 0x20, 64 + 63: 0x40, 128: 0x03}),
    # 3 bits: the 2-bit plane, then H_0 bit c = bit 2 of chunk c
    ("Q3_K", 256, {(2, 13): 7, (0, 28): 4, (5, 0): 1},
     {64 + 9: 0x0C, 128 + 9: 0x08, 128: 0x80, 20: 0x01}),
    # IQ4: the 4-bit indices laid out as Q4's codes (the table is applied where the weights are formed)
    ("IQ4_NL", 32, {(0, 0): 0xF, (3, 17): 0x5}, {0: 0x0F, 13: 0x50}),
])
def test_layout_by_hand(qtype, k, entries, expected):
    p = pack(hand_form(qtype, entries, k), qtype)
    flat = p.codes.reshape(-1)
    assert flat.numel() == (k // 32) * 64 * TYPES[qtype].bits
    got = {int(x): int(flat[x]) for x in torch.nonzero(flat).reshape(-1)}
    assert got == expected
    assert_same_form(unpack(p), hand_form(qtype, entries, k))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q6_K", "Q8_0", "Q2_K", "Q3_K", "IQ4_XS"])
def test_layout_random_against_loops(qtype):
    bt = TYPES[qtype]
    k = 256 if bt.sub else 64
    u = torch.randint(0, 1 << bt.bits, (20, k), generator=torch.Generator().manual_seed(bt.bits), dtype=torch.uint8)
    dec = hand_form(qtype, {}, k)
    dec = Decomposed(u, *(None if x is None else torch.cat((x, x[:4])) for x in dec[1:]))  # 20 rows
    p = pack(dec, qtype)
    assert torch.equal(p.codes, reference_codes(u, bt.bits))
    assert torch.equal(unpack(p).u, u)


def test_pack_rejects_bad_forms():
    dec = hand_form("Q5_0", {(0, 0): 32})  # more than 5 bits
    with pytest.raises(ValueError, match="5 bits"):
        pack(dec, "Q5_0")
    with pytest.raises(ValueError, match="db"):
        pack(hand_form("Q4_1", {}), "Q4_0")
    with pytest.raises(ValueError, match="multiple of 256"):
        pack(hand_form("Q4_0", {}), "Q4_K")


def test_unknown_type_is_named():
    raw = np.zeros((1, 66), np.uint8)
    with pytest.raises(ValueError, match="IQ2_XXS.*supported: Q4_0, .*, IQ4_XS"):
        decompose(raw, "IQ2_XXS")
    with pytest.raises(ValueError, match="TQ1_0"):
        pack(hand_form("Q4_0", {}), "TQ1_0")
    with pytest.raises(ValueError, match="not a whole number"):
        decompose(np.zeros((1, 19), np.uint8), "Q4_0")
    assert G.block_type(gguf.GGMLQuantizationType.Q6_K) is TYPES["Q6_K"]


def quant_weights():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(37, 256, generator=gen) * torch.logspace(-3, 1, 37).reshape(-1, 1)
    w[3, 32:64] = 0.75  # a constant group: d = 0
    w[4] = 0.0  # an all-zero row
    w[5, :32] += 40.0  # an offset group
    return w


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_quantize_rows(qtype):
    w = quant_weights()
    dec = quantize_rows(w, qtype)
    bt = TYPES[qtype]
    assert dec.u.shape == w.shape and dec.u.dtype == torch.uint8 and dec.da.shape == (37, 8)
    assert dec.da.dtype == torch.float16 and (dec.db is not None) == bt.has_b and dec.sa is None and dec.sb is None
    w_hat = compose(dec, qtype)
    groups = w.reshape(37, 8, 32)
    d = dec.da.float()[..., None]  # [37, 8, 1]
    err = (w_hat.reshape(37, 8, 32) - groups).abs()
    # |w - w_hat| <= d / 2, plus what rounding d (and m) to float16 costs at the ends of the range: up to
    # 2^-11 relative on d (so 15 d or 127 d may fall short of the range by 2^-11 of it) and on m
    amax = groups.abs().amax(-1, keepdim=True)
    assert (err <= d / 2 * (1 + 2 ** -10) + 2 ** -9 * amax + 1e-30).all()
    if qtype == "Q4_1":
        lo, hi = groups.amin(-1), groups.amax(-1)
        assert torch.equal(dec.da, ((hi - lo) / 15).half()) and torch.equal(dec.db, lo.half())
        assert int(dec.u.max()) <= 15 and (dec.u[3, 32:64] == 0).all()
        assert torch.equal(w_hat[3, 32:64], torch.full((32,), 0.75))  # fp16(0.75) is exact
    else:
        assert torch.equal(dec.da, (groups.abs().amax(-1) / 127).half())
        assert int(dec.u.min()) >= 1 and int(dec.u.max()) <= 255 and (dec.u[4] == 128).all()
        assert (w_hat[4] == 0).all()
    assert (err[4] == 0).all()
    p = pack(dec, qtype)
    assert torch.equal(dequantize(p), w_hat)
    assert_same_form(unpack(p), dec)


def test_quantize_rows_rejects():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rows(torch.zeros(2, 48), "Q8_0")
    with pytest.raises(ValueError, match="Q4_0"):
        quantize_rows(torch.zeros(2, 32), "Q4_0")
    with pytest.raises(ValueError, match="finite"):
        quantize_rows(torch.full((1, 32), float("nan")), "Q4_1")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_agrees_with_the_int4_loader(qtype):
    """models/gguf.py's int4 codes (w = (code - 8) scale + zero) are the same u with da (and sa) as scale."""
    from specdec.models.gguf import int4_codes

    rng = np.random.default_rng(7)
    raw = random_raw(rng, qtype, 5, 512)
    codes, scales, zeros = int4_codes(raw, qtype)
    dec = decompose(raw, qtype)
    assert torch.equal(codes, dec.u)
    bt = TYPES[qtype]
    a = dec.da.float().repeat_interleave(bt.superblock // bt.group, 1)
    if bt.sub:
        a = a * dec.sa.float()
    assert torch.equal(scales, a)
    if qtype == "Q4_0":
        assert (zeros == 0).all()
    elif qtype == "Q4_1":
        assert torch.equal(zeros, dec.db.float() + 8 * dec.da.float())
    ref = oracle(raw, qtype)
    assert torch.allclose((codes.float() - 8).reshape(5, -1, 32) * scales[..., None] + zeros[..., None],
                          ref.reshape(5, -1, 32), rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


# ------------------------------------------------------------------- Q2_K, Q3_K, IQ4_NL, IQ4_XS: every pattern
def encode_blocks(qtype, dec: Decomposed) -> np.ndarray:
    """The GGUF bytes of a form, written literally from llama.cpp's block structs and dequantize_row_* loops
    (block_q2_K: scales[16] (scale | min << 4), qs[64], d, dmin; block_q3_K: hmask[32], qs[64], scales[12], d;
    block_iq4_nl: d, qs[16]; block_iq4_xs: d, scales_h, scales_l[4], qs[128]): uint8 [n, bytes]. An inverse of
    `decompose` written independently of it."""
    bt = TYPES[qtype]
    n, k = dec.u.shape
    nb = k // bt.superblock
    out = np.zeros((n, nb, bt.block_bytes), np.uint8)
    u = dec.u.numpy().reshape(n, nb, bt.superblock).astype(int)
    da = dec.da.numpy().reshape(n, nb)
    sa = None if dec.sa is None else dec.sa.numpy().reshape(n, nb, -1).astype(int)

    def f16(at, value):
        out[r, b, at:at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    for r in range(n):
        for b in range(nb):
            blk, q = out[r, b], u[r, b]
            if qtype == "Q2_K":
                sb = dec.sb.numpy().reshape(n, nb, -1).astype(int)
                for j in range(16):
                    blk[j] = sa[r, b, j] | (sb[r, b, j] << 4)
                for i in range(256):  # y[128 h + 32 j + l] = dl * ((q[32 h + l] >> 2 j) & 3) - ml
                    h, j, l = i // 128, (i % 128) // 32, i % 32
                    blk[16 + 32 * h + l] |= q[i] << (2 * j)
                f16(80, da[r, b])
                f16(82, -dec.db.numpy().reshape(n, nb)[r, b])
            elif qtype == "Q3_K":
                for i in range(256):  # 2 low bits as Q2_K's (after hmask), the third at bit i // 32 of hmask[i % 32]
                    h, j, l = i // 128, (i % 128) // 32, i % 32
                    blk[32 + 32 * h + l] |= (q[i] & 3) << (2 * j)
                    blk[i % 32] |= (q[i] >> 2) << (i // 32)
                for j in range(16):  # 6-bit scale + 32: low 4 bits in byte j % 8 (high nibble for j >= 8), top 2
                    v = sa[r, b, j] + 32  # bits at 2 (j // 4) of byte 8 + j % 4
                    blk[96 + j % 8] |= (v & 15) << (4 * (j // 8))
                    blk[96 + 8 + j % 4] |= (v >> 4) << (2 * (j // 4))
                f16(108, da[r, b])
            elif qtype == "IQ4_NL":
                for j in range(16):
                    blk[2 + j] = q[j] | (q[j + 16] << 4)
                f16(0, da[r, b])
            else:  # IQ4_XS
                f16(0, da[r, b])
                scales_h = 0
                for ib in range(8):
                    v = sa[r, b, ib] + 32
                    blk[4 + ib // 2] |= (v & 15) << (4 * (ib % 2))
                    scales_h |= (v >> 4) << (2 * ib)
                    for j in range(16):
                        blk[8 + 16 * ib + j] = q[32 * ib + j] | (q[32 * ib + j + 16] << 4)
                blk[2:4] = np.frombuffer(np.uint16(scales_h).tobytes(), np.uint8)
    return out.reshape(n, -1)


def every_pattern(qtype, rng) -> Decomposed:
    """A form of `qtype` in which every code value and every scale (and min) value occurs, at several positions
    in a block, with random finite float16 super-block scales."""
    bt = TYPES[qtype]
    n, k = 4, 1024  # Q2_K: 256 groups of 16, every (scale, min) pair once
    u = (torch.arange(n * k).reshape(n, k) * 7 + torch.arange(n).reshape(n, 1)) % (1 << bt.bits)
    u = u.to(torch.uint8)  # [n, k]: every code, shifted from row to row and group to group
    da = torch.from_numpy(random_f16(rng, (n, k // bt.superblock)))
    db = sa = sb = None
    if qtype == "Q2_K":
        g = torch.arange(n * k // 16).reshape(n, -1)
        sa, sb = (g % 16).to(torch.int8), ((g // 16 + g) % 16).to(torch.int8)  # every (scale, min) pair
        db = torch.from_numpy(random_f16(rng, (n, k // 256)))
    elif bt.sub:  # Q3_K, IQ4_XS: every 6-bit scale - 32
        g = torch.arange(n * k // bt.group).reshape(n, -1)
        sa = ((g * 5 + g // 64) % 64 - 32).to(torch.int8)
    return Decomposed(u, da, db, sa, sb)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_every_code_and_scale_pattern_is_the_oracle(qtype):
    """Blocks written literally from llama.cpp's layout with every code and every scale (and min) value: decompose
    gives back the form exactly, and the form's weights are the gguf library's bit for bit; packed and unpacked,
    the same."""
    dec = every_pattern(qtype, np.random.default_rng(TYPES[qtype].id))
    bt = TYPES[qtype]
    assert sorted(set(dec.u.reshape(-1).tolist())) == list(range(1 << bt.bits))
    if qtype == "Q2_K":
        assert len(set(zip(dec.sa.reshape(-1).tolist(), dec.sb.reshape(-1).tolist()))) == 256
    elif bt.sub:
        assert sorted(set(dec.sa.reshape(-1).tolist())) == list(range(-32, 32))
    raw = encode_blocks(qtype, dec)
    assert_same_form(decompose(raw, qtype), dec)
    ref = oracle(raw, qtype)
    assert_same_weights(compose(dec, qtype), ref)
    p = pack(dec, qtype)
    assert_same_form(unpack(p), dec)
    assert_same_weights(dequantize(p), ref)


def test_iq4_indices_mean_the_non_linear_values():
    """An IQ4 index u is the weight d * kvalues[u] (U(u) = kvalues[u] + 128, OFF = -128), not d * (u + OFF)."""
    u = torch.arange(16, dtype=torch.uint8).repeat(2).reshape(1, 32)  # [1, 32]: every index, twice
    dec = Decomposed(u, torch.tensor([[0.5]], dtype=torch.float16), None, None, None)
    kvalues = torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.float32).repeat(2)
    assert torch.equal(compose(dec, "IQ4_NL")[0], 0.5 * kvalues)
    xs = Decomposed(torch.cat([u] * 8, 1), dec.da, None, torch.full((1, 8), -3, dtype=torch.int8), None)
    assert torch.equal(compose(xs, "IQ4_XS")[0], -1.5 * kvalues.repeat(8))


def test_unsupported_types_line():
    line = G.unsupported_types_line("m.gguf", ["F32", "Q4_K", "IQ2_XXS", "F16", "IQ3_S", "IQ2_XXS", "Q3_K"])
    assert "\n" not in line and line.startswith("specdec: m.gguf: block types IQ2_XXS, IQ3_S not supported")
    assert "Q2_K, Q3_K, IQ4_NL, IQ4_XS as stored" in line and "float32" in line
    assert G.unsupported_types_line("m.gguf", ["F32", "BF16", "Q6_K", "IQ4_XS"]) is None
