"""kernels/qmm_cpu.py (the C++ CPU matmul for quantized weights, kernels/cpu/): equal to its torch reference for
every block type, the same bits on every instruction set the host runs, for every row alone or in any batch, at
any thread count; the layers built on it (models/quant.py's BlockLinear and QuantEmbedding); and the fallback
where the kernel is not built."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.kernels import qmm_cpu
from specdec.models import quant
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


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_every_instruction_set_gives_the_scalar_bits(qtype):
    """The AVX2 and AVX-512 variants perform the scalar variant's float operations, in its order."""
    p = packed_weight(qtype)
    x = activations(11, 512)  # 11 rows: every row block size of each variant (8 + 2 + 1, 4 + 4 + 2 + 1)
    scalar = qmm_cpu.qmm(x, p, isa="scalar")
    for isa in HOST_ISAS[1:]:
        assert torch.equal(qmm_cpu.qmm(x, p, isa=isa).view(torch.int32), scalar.view(torch.int32)), isa


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
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


def test_without_the_built_kernel_the_layer_multiplies_a_float_copy(monkeypatch, capsys):
    parts = [(0, packed_weight("Q8_0", n=20, k=64))]
    x = activations(2, 64)
    monkeypatch.setattr(qmm_cpu, "_library", lambda: (None, "the CPU quantized kernel is not built (test)"))
    assert not qmm_cpu.available()
    layer = BlockLinear(parts)  # its multiply is chosen for the host when it is built
    y = layer(x)
    assert torch.allclose(y, x @ layer.dequantize().t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(qmm_cpu.qmm(x, parts[0][1]), qmm_cpu.qmm_reference(x, parts[0][1]))
    with pytest.raises(RuntimeError, match="not built"):
        qmm_cpu.qmm(x, parts[0][1], isa="scalar")


def test_a_load_without_the_kernel_says_so_in_one_line_and_still_generates(tmp_path, monkeypatch, capsys):
    gguf = pytest.importorskip("gguf")
    from checkpoints import build_hf_model
    from real_model import write_gguf
    from specdec.models import load_model

    hf = build_hf_model("llama", seed=1, hidden_size=64, intermediate_size=96)
    path = tmp_path / "tiny-Q8_0.gguf"
    write_gguf(path, hf.config, hf.state_dict(), qtype=gguf.GGMLQuantizationType.Q8_0)
    built = load_model(path)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(qmm_cpu, "_library", lambda: (None, "the CPU quantized kernel is not built (test)"))
    fallback = load_model(path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not built (test)" in err[0] and "float32 copies" in err[0]
    ids = torch.tensor([[5, 17, 3, 99]])
    with torch.no_grad():
        a = built(ids, built.new_cache(1, 8))
        b = fallback(ids, fallback.new_cache(1, 8))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75  # float activations there: near, not equal
