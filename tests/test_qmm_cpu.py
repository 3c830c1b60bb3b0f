"""kernels/qmm_cpu.py (the C++ CPU matmul for quantized weights, kernels/cpu/): equal to its torch reference for
every block type, the same bits on every instruction set the host runs, for every row alone or in any batch, at
any thread count; the layers built on it (models/quant.py's BlockLinear and QuantEmbedding); and the fallback
where the kernel is not built."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.kernels import qmm_cpu
from specdec.models.ggml_blocks import TYPES, decompose, dequantize, pack
from specdec.models.quant import BlockLinear, QuantEmbedding
from test_ggml_blocks import random_raw

pytestmark = pytest.mark.skipif(not qmm_cpu.available(), reason="the CPU quantized kernel is not built")

HOST_ISAS = qmm_cpu.ISAS[: qmm_cpu.ISAS.index(qmm_cpu.host_isa()) + 1] if qmm_cpu.available() else ()


def packed_weight(qtype, n=37, k=512, seed=0):
    """A random GGUF tensor of `qtype` (n rows: not a whole number of 16-row tiles), packed."""
    return pack(decompose(random_raw(np.random.default_rng(seed), qtype, n, k), qtype), qtype)


def activations(m, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # a block of zeros: scale 0
    x[-1, 40] = 1e4  # an outlier: the rest of its block rounds to small codes
    return x


def assert_near_reference(y, x, p):
    """|kernel - reference| within float32 rounding of the kernel's sums: a few ulps of sum |x_k w_k|."""
    ref = qmm_cpu.qmm_reference(x, p).double()
    xs = qmm_cpu.activations_as_multiplied(x)  # [M, K]
    scale = xs.abs() @ dequantize(p).double().abs().t()  # [M, N]
    assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_kernel_equals_its_reference(qtype):
    k = 256 if TYPES[qtype].superblock == 256 else 96
    p = packed_weight(qtype, k=k)
    x = activations(5, k)
    y = qmm_cpu.qmm(x, p)
    assert y.shape == (5, 37) and y.dtype == torch.float32
    assert_near_reference(y, x, p)
    for isa in HOST_ISAS:  # each variant on its own (the scalar one is the others' spec)
        assert_near_reference(qmm_cpu.qmm(x, p, isa=isa), x, p)


# every row-block size of every variant: AVX-512 passes of 16 rows then one of the remaining 1..15 (M = 1..17,
# 31..33: every remainder, one and two full passes, a full pass then 1 and 15); AVX2 passes of 4 then one of 1..3
ROW_COUNTS = (*range(1, 18), 31, 32, 33)


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_every_instruction_set_gives_the_scalar_bits_at_every_row_block_size(qtype):
    """The AVX2 and AVX-512 variants perform the scalar variant's float operations, in its order, in every row
    block they have: for each M of ROW_COUNTS the rows of an M-row call (the first M rows, and the last M) are,
    on every instruction set the host runs, the bits of the same rows computed alone by the scalar variant."""
    p = packed_weight(qtype)
    x = activations(33, 512)  # [33, 512]
    alone = torch.cat([qmm_cpu.qmm(x[i: i + 1], p, isa="scalar") for i in range(33)]).view(torch.int32)
    assert torch.equal(qmm_cpu.qmm(x, p, isa="scalar").view(torch.int32), alone)
    for isa in HOST_ISAS:
        for m in ROW_COUNTS:
            for first in {0, 33 - m}:
                got = qmm_cpu.qmm(x[first: first + m], p, isa=isa).view(torch.int32)  # [m, 37]
                assert torch.equal(got, alone[first: first + m]), f"{isa}, M = {m} from row {first}"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(qtype):
    p = packed_weight(qtype, n=64)
    x = activations(48, 512)
    full = qmm_cpu.qmm(x, p)
    for isa in HOST_ISAS:
        assert torch.equal(torch.cat([qmm_cpu.qmm(x[i: i + 1], p, isa=isa) for i in range(48)]), full)
        for size in (3, 8):
            assert torch.equal(torch.cat([qmm_cpu.qmm(x[i: i + size], p, isa=isa) for i in range(0, 48, size)]), full)
    assert torch.equal(qmm_cpu.qmm(x.view(6, 8, 512), p).reshape(48, 64), full)  # any leading shape


def test_the_thread_count_does_not_change_the_bits():
    p = packed_weight("Q4_K", n=200, k=1024)
    x = activations(9, 1024)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qmm_cpu.qmm(x, p)
        torch.set_num_threads(2)
        two = qmm_cpu.qmm(x, p)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bfloat16_activations_are_taken_exactly():
    p = packed_weight("Q4_1", k=128)
    x = activations(3, 128).bfloat16()
    assert torch.equal(qmm_cpu.qmm(x, p), qmm_cpu.qmm(x.float(), p))


def test_out_writes_a_column_slice_of_a_wider_output():
    p = packed_weight("Q6_K", n=40, k=256)
    x = activations(4, 256)
    out = torch.full((4, 100), 7.0)
    qmm_cpu.qmm(x, p, out=out[:, 30:70])
    assert torch.equal(out[:, 30:70], qmm_cpu.qmm(x, p))
    assert (out[:, :30] == 7).all() and (out[:, 70:] == 7).all()  # nothing outside the slice written


def test_bad_arguments_are_one_line():
    p = packed_weight("Q4_0", k=64)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        qmm_cpu.qmm(torch.randn(2, 32), p)
    with pytest.raises(ValueError, match="out must be float32"):
        qmm_cpu.qmm(torch.randn(2, 64), p, out=torch.empty(2, 36))


def test_block_linear_of_parts_of_two_types_is_its_dequantized_weight_times_x():
    """A fused q/k/v whose parts are of different types (Q4_K q and k, Q6_K v, as a Q4_K_M file has them)."""
    parts = [(0, packed_weight("Q4_K", n=48, k=256)), (48, packed_weight("Q6_K", n=20, k=256, seed=2))]
    bias = torch.randn(68)
    layer = BlockLinear(parts, bias)
    x = activations(3, 256)
    y = layer(x)
    assert y.shape == (3, 68)
    assert torch.equal(y[:, :48], qmm_cpu.qmm(x, parts[0][1]) + bias[:48])
    assert torch.equal(y[:, 48:], qmm_cpu.qmm(x, parts[1][1]) + bias[48:])
    w = layer.dequantize()
    assert torch.equal(w, torch.cat([dequantize(p) for _, p in parts]))
    assert layer.weight_bytes == sum(p.nbytes for _, p in parts)
    emb = QuantEmbedding(layer, torch.float32)
    ids = torch.tensor([[0, 47, 48, 67, 5]])
    assert torch.equal(emb(ids)[0], w[ids[0]])
