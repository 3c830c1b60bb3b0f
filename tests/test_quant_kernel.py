"""The weight-only quantized matmul (kernels/quant_matmul.py): the Triton kernel against its torch reference,
bit-exact batch invariance, the wrapper's dispatch and validation, and QuantLinear's GPU-path wiring.

On a CPU machine the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py); on a
CUDA machine run with TRITON_INTERPRET=0 to test the compiled kernel on the GPU. Shapes are small."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from specdec.kernels import dispatch
from specdec.kernels import quant_matmul as qm
from specdec.models.quant import QuantLinear, QuantRows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if GPU else "cpu"
needs_triton = pytest.mark.skipif(not (dispatch.triton_available() and (INTERPRET or GPU)),
                                  reason="needs triton and a CUDA GPU or TRITON_INTERPRET=1")


def int4_weight(N, K, seed=0):
    """Random int4 operands: nibbles uint8 [N, K/2], scales and zeros bfloat16 [N, K/32]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)  # [N, K]
    scales = (torch.rand(N, K // qm.GROUP, generator=g) * 0.1 + 0.01).bfloat16()
    zeros = (torch.randn(N, K // qm.GROUP, generator=g) * 0.05).bfloat16()
    return tuple(t.to(DEVICE) for t in (qm.pack_nibbles(codes), scales, zeros))


def int8_weight(N, K, seed=0):
    """Random int8 operands: codes int8 [N, K], scales bfloat16 [N]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scales = (torch.rand(N, generator=g) * 0.01 + 1e-3).bfloat16()
    return codes.to(DEVICE), scales.to(DEVICE), None


WEIGHTS = {"int4": int4_weight, "int8": int8_weight}


def tolerance(x, fmt, codes, scales, zeros, dtype):
    """float32 summation-order error (a few ulps of sum |x| |w|), plus the output's rounding to `dtype`."""
    w = qm.dequantize_weight(fmt, codes, scales, zeros)  # [N, K] float32
    magnitude = x.float().abs() @ w.abs().t()  # [M, N]
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    return 1e-5 * magnitude + eps * magnitude + 1e-6


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", qm.FORMATS)
@pytest.mark.parametrize("M, N, K", [(1, 32, 32), (5, 70, 96), (13, 40, 128)])
def test_kernel_matches_reference(fmt, dtype, M, N, K):
    codes, scales, zeros = WEIGHTS[fmt](N, K, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(N)).to(DEVICE, dtype)
    got = qm.quant_matmul(x, fmt, codes, scales, zeros, backend="triton")
    want = qm.quant_matmul(x, fmt, codes, scales, zeros, backend="torch")
    assert got.dtype == dtype and got.shape == (M, N)
    assert ((got.float() - want.float()).abs() <= tolerance(x, fmt, codes, scales, zeros, dtype)).all()
    # the reference is the dequantized weight's float64 product, to float32 rounding
    exact = x.double() @ qm.dequantize_weight(fmt, codes, scales, zeros, torch.float64).t()
    assert ((want.double() - exact).abs() <= tolerance(x, fmt, codes, scales, zeros, dtype).double()).all()


@needs_triton
@pytest.mark.parametrize("fmt", qm.FORMATS)
def test_strided_input_and_leading_dims(fmt):
    codes, scales, zeros = WEIGHTS[fmt](48, 64, seed=3)
    wide = torch.randn(2, 3, 128).to(DEVICE)
    x = wide[..., ::2]  # [2, 3, 64], a non-contiguous view
    got = qm.quant_matmul(x, fmt, codes, scales, zeros, backend="triton")
    assert got.shape == (2, 3, 48)
    want = qm.quant_matmul(x.contiguous(), fmt, codes, scales, zeros, backend="torch")
    assert ((got - want).abs() <= tolerance(x.reshape(6, 64), fmt, codes, scales, zeros, torch.float32)
            .view(2, 3, 48)).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", qm.FORMATS)
def test_kernel_is_batch_invariant_bitwise(fmt, dtype):
    """A row's result is the same bits whatever M, the row's place in its tile, and the other rows."""
    codes, scales, zeros = WEIGHTS[fmt](40, 96, seed=5)
    g = torch.Generator().manual_seed(7)
    X = torch.randn(21, 96, generator=g).to(DEVICE, dtype)  # 21 rows: 3 tiles of BLOCK_M = 8, the last partial
    full = qm.quant_matmul(X, fmt, codes, scales, zeros, backend="triton")  # [21, 40]
    alone = torch.cat([qm.quant_matmul(X[i: i + 1], fmt, codes, scales, zeros, backend="triton")
                       for i in range(len(X))])
    assert torch.equal(alone, full)
    for first, M in ((3, 1), (1, 7), (5, 11), (0, 16), (9, 12)):  # rows at other places in other tiles
        other = torch.randn(M + 4, 96, generator=g).to(DEVICE, dtype) * 100  # different neighbours
        other[2: 2 + M] = X[first: first + M]
        got = qm.quant_matmul(other, fmt, codes, scales, zeros, backend="triton")[2: 2 + M]
        assert torch.equal(got, full[first: first + M]), (first, M)


def test_dispatch_runs_the_reference_on_cpu_and_the_kernel_when_asked(monkeypatch):
    codes, scales, zeros = int4_weight(32, 64)
    x = torch.randn(3, 64).to(DEVICE)
    calls = []
    reference = qm.quant_matmul_reference  # the real one: the patched reference below would log "torch" too
    monkeypatch.setattr(qm, "quant_matmul_triton", lambda *a: calls.append("triton") or reference(*a))
    monkeypatch.setattr(qm, "quant_matmul_reference", lambda *a: calls.append("torch") or torch.zeros(3, 32))
    qm.quant_matmul(x, "int4", codes, scales, zeros)
    assert calls == ["triton" if x.is_cuda else "torch"]
    if dispatch.triton_available() and (INTERPRET or GPU):
        calls.clear()
        qm.quant_matmul(x, "int4", codes, scales, zeros, backend="triton")
        assert calls[0] == "triton"


@pytest.mark.parametrize("change, message", [
    (dict(fmt="int2"), "fmt must be one of"),
    (dict(x=torch.randn(2, 60)), r"x must be \[\.\.\., 64\]"),
    (dict(x=torch.ones(2, 64, dtype=torch.int32)), "x must be floating point"),
    (dict(codes=torch.zeros(32, 32, dtype=torch.int8)), "int4 codes must be torch.uint8"),
    (dict(scales=torch.zeros(32, 3)), r"int4 scales must be \[32, 2\]"),
    (dict(zeros=None), r"int4 zeros must be \[32, 2\], got None"),
])
def test_wrapper_rejects_bad_arguments_naming_them(change, message):
    codes, scales, zeros = (t.cpu() for t in int4_weight(32, 64))
    args = dict(x=torch.randn(2, 64), fmt="int4", codes=codes, scales=scales, zeros=zeros)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        qm.quant_matmul(**args)
    with pytest.raises(ValueError, match=r"int8 scales must be \[32\]"):
        qm.quant_matmul(torch.randn(2, 64), "int8", torch.zeros(32, 64, dtype=torch.int8), torch.zeros(31))


@needs_triton
@pytest.mark.parametrize("fmt", qm.FORMATS)
def test_quant_linear_gpu_layout_runs_the_kernel(monkeypatch, fmt):
    """QuantLinear's layout (nibbles, scales, zeros) through the kernel: its dequantized weight (the rows' numbers
    with bfloat16 scales and zeros) and the kernel's numbers."""
    w = torch.randn(40, 96)
    rows = QuantRows(fmt, (40, 96), "w", device="cuda")  # the GPU layout's codes (kept on the CPU until module())
    rows.add_float(0, w)
    bias = torch.randn(40)
    gpu = QuantLinear(fmt, rows.codes, rows.scales, rows.zeros, bias).to(DEVICE)
    if fmt == "int4":
        want = qm.dequantize_int4(rows.codes, rows.scales.bfloat16(), rows.zeros.bfloat16())
    else:
        want = rows.codes.float() * rows.scales.bfloat16().float()[:, None]
    assert torch.equal(gpu.dequantize().cpu(), want)
    x = torch.randn(2, 3, 96)
    y = gpu(x.to(DEVICE), "triton")  # [2, 3, 40]
    operands = (gpu.nibbles, gpu.scales, gpu.zeros) if fmt == "int4" else (gpu.codes, gpu.scales, None)
    assert torch.equal(y, qm.quant_matmul(x.to(DEVICE), fmt, *operands, backend="triton") + bias.to(DEVICE))


# ---------------------------------------------------------------------------------------------- compiler
@pytest.mark.skipif(not dispatch.triton_compiles_for_nvidia(), reason="triton's nvidia backend is not installed")
def test_kernel_compiles_for_sm90():
    """The interpreter forgives what the compiler rejects: compile both formats for sm_90 (no GPU needed)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def _compile_for_sm90():
    from test_kernels import _compile_recorded

    x = torch.zeros(5, 64, dtype=torch.bfloat16)
    nibbles, scales = torch.zeros(40, 32, dtype=torch.uint8), torch.zeros(40, 2, dtype=torch.bfloat16)
    codes, row_scales = torch.zeros(40, 64, dtype=torch.int8), torch.zeros(40, dtype=torch.bfloat16)
    with contextlib.ExitStack() as patches:
        _compile_recorded(patches, qm, "_quant_matmul_kernel", lambda: (
            qm.quant_matmul_triton(x, "int4", nibbles, scales, scales.clone()),
            qm.quant_matmul_triton(x.float(), "int4", nibbles, scales, scales.clone()),
            qm.quant_matmul_triton(x, "int8", codes, row_scales)))
    print("compiled quant_matmul for sm_90")


if __name__ == "__main__":
    _compile_for_sm90()


@needs_triton
def test_quantized_model_on_the_kernel_is_batch_invariant_bitwise(llama_pair, monkeypatch):
    """A whole int4 model with the GPU layout, every linear through the Triton kernel (interpreter): a prompt's
    last logits are the same bits alone and in a batch of prompts of other lengths."""
    from specdec.models import load_model
    from specdec.models import quant

    if not GPU:  # the GPU layout, on the CPU (on a GPU the model is loaded there and has it already)
        monkeypatch.setattr(quant.QuantRows, "uses_blocks", staticmethod(lambda device, fmt: False))
        monkeypatch.setattr(quant.QuantRows, "module", lambda self, bias=None, device="cpu": QuantLinear(
            self.fmt, self.codes, self.scales, self.zeros, bias))
    launches = []

    def kernel(*args, **kwargs):
        launches.append(1)
        return qm.quant_matmul(*args, **{**kwargs, "backend": "triton"})

    monkeypatch.setattr(quant, "quant_matmul", kernel)
    model = load_model(llama_pair[0], quantize="int4", device=DEVICE)
    assert model.layers[0].mlp.gate_up_proj.nibbles.shape[1] == model.layers[0].mlp.gate_up_proj.in_features // 2
    rows = [[5, 17, 3, 99, 42], [7, 1, 100, 8, 8, 64, 9, 30], [11]]
    with torch.no_grad():
        alone = [model(torch.tensor([r], device=DEVICE), model.new_cache(1, 16), logits="last")[0, -1] for r in rows]
        batch = torch.zeros(len(rows), 8, dtype=torch.int64, device=DEVICE)
        for i, r in enumerate(rows):
            batch[i, : len(r)] = torch.tensor(r)
        together = model(batch, model.new_cache(len(rows), 16), num_new=[len(r) for r in rows], logits="last")
    assert launches  # the kernel ran
    for i in range(len(rows)):
        assert torch.equal(together[i, -1], alone[i]), i
