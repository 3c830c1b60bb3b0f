"""The CPU matmul for quantized weights (`kernels/cpu/`, C++): `y = x @ W.T` with W in models/ggml_blocks.py's
packed tiles (a GGUF's own block types as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS),
read once per call whatever the number of rows x has.

- The kernel (kernels/cpu/qmm*.cpp, built by setup.py at install as `specdec.kernels._qmm`, loaded here with
  ctypes): x quantized to int8 a row at a time (blocks of 32, a float32 scale each: llama.cpp's Q8_0 rule);
  for each tile of 16 output rows and 32 input columns the codes are unpacked once and multiplied by every row
  of x in int32 (AVX-512 VNNI `vpdpbusd`, or AVX2 `vpmaddubsw`/`vpmaddwd`, or scalar C++), and each group's
  scales applied in float32 in a fixed order (kernels/cpu/qmm_common.h). Every variant performs the same float
  operations per output: a row's result is the same bits whatever else is in the call, whatever the thread
  count, and on every instruction set. The threads are torch's (OpenMP, `torch.set_num_threads`).
- `qmm_reference`: the same quantization of x in torch, then float64 sums over the dequantized groups: equal
  to the kernel up to float32 rounding (the test's oracle), and the fallback where the kernel is not built.
- `qmm`: validate, dispatch. `available()` says whether the kernel loaded, `unavailable_reason()` why not.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

ISAS = ("scalar", "avx2", "avx512-vnni")  # index = the kernel's instruction-set number
XBLOCK = 32  # activations quantized in blocks of 32 columns


@lru_cache(maxsize=1)
def _library():
    """(ctypes library or None, why not): the built kernel next to this file."""
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("_qmm*.so")) + sorted(here.glob("_qmm*.pyd"))
    if not found:
        return None, (f"the CPU quantized kernel is not built (no {here}/_qmm*.so; `pip install -e .` builds it "
                      f"with the machine's C++ compiler)")
    try:
        lib = ctypes.CDLL(str(found[0]))
    except OSError as err:
        return None, f"the CPU quantized kernel {found[0].name} does not load ({err})"
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    try:
        lib.specdec_qmm.argtypes = [c_int, c_int, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, c_int]
        lib.specdec_qmm.restype = c_int
        lib.specdec_qmm_isa.restype = c_int
        # the native forward (kernels/cpu/forward.cpp; kernels/forward_cpu.py)
        lib.specdec_model_new.argtypes = [ptr, ctypes.c_float]
        lib.specdec_model_new.restype = ptr
        lib.specdec_model_free.argtypes = [ptr]
        lib.specdec_model_free.restype = None
        lib.specdec_model_add_part.argtypes = [ptr, i64, c_int, c_int, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
        lib.specdec_model_add_part.restype = c_int
        lib.specdec_model_set_vector.argtypes = [ptr, i64, c_int, ptr]
        lib.specdec_model_set_vector.restype = c_int
        lib.specdec_model_check.argtypes = [ptr]
        lib.specdec_model_check.restype = c_int
        lib.specdec_model_forward.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, c_int, ptr, ptr, i64, ptr, ptr, i64,
                                              c_int, ptr, c_int, ptr, c_int, c_int, i64]
        lib.specdec_model_forward.restype = c_int
        lib.specdec_model_timings.argtypes = [ptr, ptr]
        lib.specdec_model_timings.restype = None
    except AttributeError as err:  # a kernel built from older sources
        return None, f"the CPU quantized kernel {found[0].name} is out of date ({err}); `pip install -e .` rebuilds it"
    return lib, None


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str | None:
    return _library()[1]


def host_isa() -> str:
    """The instruction set the kernel runs on this host ('scalar', 'avx2' or 'avx512-vnni')."""
    lib = _library()[0]
    return ISAS[lib.specdec_qmm_isa()] if lib is not None else "unavailable"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class PackedWeightError(ValueError):
    """A packed weight's tensors the kernel cannot read as given (one line naming the weight and the tensor)."""


def _check_tensor(t, name: str, dtype: torch.dtype, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise PackedWeightError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise PackedWeightError(f"{name}: the CPU kernel reads CPU tensors, got one on {t.device}")
    if t.dtype != dtype:
        raise PackedWeightError(f"{name}: expected {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise PackedWeightError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise PackedWeightError(f"{name}: must be contiguous")


def check_packed(packed, name: str = "packed weight") -> None:
    """Every tensor of a models/ggml_blocks.py Packed the kernel reads: present, on the CPU, of its dtype and shape,
    contiguous (the C++ side trusts its pointers); raises PackedWeightError naming `name` and the tensor."""
    from specdec.models.ggml_blocks import TYPES

    bt = TYPES.get(packed.qtype)
    if bt is None:
        raise PackedWeightError(f"{name}: block type {packed.qtype} has no kernel")
    if packed.n < 1 or packed.k < 1 or packed.k % bt.superblock:
        raise PackedWeightError(f"{name}: {packed.n} x {packed.k} is not a whole number of {packed.qtype} blocks")
    tiles, where = -(-packed.n // 16), f"{name} ({packed.qtype})"
    _check_tensor(packed.codes, f"{where} codes", torch.uint8, (tiles, packed.k // 32, 256 + 64 * (bt.bits - 4)))
    _check_tensor(packed.da, f"{where} da", torch.float16, (tiles, packed.k // bt.superblock, 16))
    if bt.has_b:
        _check_tensor(packed.db, f"{where} db", torch.float16, (tiles, packed.k // bt.superblock, 16))
    if bt.sub:
        _check_tensor(packed.sa, f"{where} sa", torch.int8, (tiles, packed.k // bt.group, 16))
        if bt.has_b:
            _check_tensor(packed.sb, f"{where} sb", torch.int8, (tiles, packed.k // bt.group, 16))


class Weight:
    """A packed weight (models/ggml_blocks.py's Packed), checked (`check_packed`) and with the kernel's arguments
    for it worked out once: what a layer keeps, so that a call costs the kernel and little more. It points into
    the Packed's tensors, which it keeps: a layer binds a new one whenever its buffers change (models/quant.py)."""

    __slots__ = ("packed", "n", "k", "type_id", "pointers")

    def __init__(self, packed, name: str = "packed weight"):
        from specdec.models.ggml_blocks import TYPES

        check_packed(packed, name)
        bt = TYPES[packed.qtype]
        self.packed, self.n, self.k = packed, packed.n, packed.k
        self.type_id = bt.id
        self.pointers = (_ptr(packed.codes), _ptr(packed.da), _ptr(packed.db if bt.has_b else None),
                         _ptr(packed.sa if bt.sub else None), _ptr(packed.sb if bt.sub and bt.has_b else None),
                         packed.codes.shape[0])


def qmm(x: torch.Tensor, packed, isa: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16, CPU) -> float32 [..., n]: x times the packed weight's transpose
    (`packed`: a Packed, or its `Weight`). `isa`: force an instruction set ('scalar', 'avx2', 'avx512-vnni';
    tests); default the host's best. `out`: a float32 [M, n] view to write (rows may be strided: a slice of a
    wider output), returned."""
    weight = packed if isinstance(packed, Weight) else Weight(packed)
    packed = weight.packed
    K = packed.k
    if x.shape[-1] != K:
        raise ValueError(f"qmm: x must be [..., {K}] (the weight's in features), got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"qmm: the CPU kernel takes CPU tensors, got x on {x.device}")
    lib, why = _library()
    x2 = x.reshape(-1, K)  # [M, K]
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.to(torch.float32).contiguous()
    M = x2.shape[0]
    if out is not None and (out.shape != (M, packed.n) or out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"qmm: out must be float32 [{M}, {packed.n}] with unit column stride")
    if lib is None:
        if isa is not None:
            raise RuntimeError(why)
        y = qmm_reference(x2, packed)
        return y if out is None else out.copy_(y)
    y = torch.empty(M, packed.n, dtype=torch.float32) if out is None else out  # [M, n]
    isa_id = -1 if isa is None else ISAS.index(isa)
    code = lib.specdec_qmm(weight.type_id, isa_id, x2.data_ptr(), M, K, x2.stride(0), *weight.pointers, y.data_ptr(),
                           y.stride(0), packed.n, torch.get_num_threads())
    if code == 2:
        raise RuntimeError(f"qmm: this host cannot run instruction set {isa!r} (it runs {host_isa()!r})")
    if code != 0:
        raise ValueError(f"qmm: the kernel refused its arguments ({packed.qtype}, K {K}, n {packed.n})")
    return y if out is not None else y.view(*x.shape[:-1], packed.n)


def quantize_activations(x: torch.Tensor):
    """x [M, K] -> (xq float64 [M, K] holding int8 values, dx float32 [M, K/32]): the kernel's rule (per block
    of 32: dx = max |x| / 127, xq = round-half-even(x * (1 / dx)), 0 where dx is 0; a block holding a NaN or an
    infinity gets dx NaN and codes 0, so every output it enters is NaN), in float32 as it does."""
    M, K = x.shape
    blocks = x.float().reshape(M, K // XBLOCK, XBLOCK)  # [M, K/32, 32]
    finite = blocks.isfinite().all(-1)  # [M, K/32] a block with a NaN or an infinity: scale NaN, codes 0
    dx = torch.where(finite, blocks.abs().amax(-1) / 127.0, float("nan"))  # [M, K/32]
    inv = torch.where(finite & (dx != 0), 1.0 / dx, torch.zeros_like(dx))
    xq = torch.where(finite[..., None], torch.round(blocks * inv[..., None]), 0.0)  # [M, K/32, 32]
    return xq.reshape(M, K).double(), dx


def activations_as_multiplied(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float64 [M, K]: the values the kernel multiplies by, xq * dx (`quantize_activations`)."""
    M, K = x.shape
    xq, dx = quantize_activations(x)  # [M, K], [M, K/32]
    return (xq.reshape(M, -1, XBLOCK) * dx.double()[..., None]).reshape(M, K)


def qmm_reference(x: torch.Tensor, packed) -> torch.Tensor:
    """The torch reference of `qmm`: x quantized as the kernel does, times the exactly dequantized weight, in
    float64 (so it differs from the kernel only by the kernel's float32 roundings). float32 [..., n]."""
    from specdec.models.ggml_blocks import dequantize

    xs = activations_as_multiplied(x.reshape(-1, packed.k))  # [M, K]
    w = dequantize(packed).double()  # [n, K]
    return (xs @ w.t()).float().view(*x.shape[:-1], packed.n)
