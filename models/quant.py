"""Weight-only quantized layers, kept quantized in memory and multiplied without a float copy of the weight.

**On the CPU: `BlockLinear`**, a GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as the file
stores them, decomposed exactly and packed in 16-row tiles (models/ggml_blocks.py), multiplied by the C++
kernel of kernels/qmm_cpu.py: x quantized to int8 per block of 32 (llama.cpp's rule for these types), integer
products, each group's scales applied in float32 in a fixed order, each weight read once per call whatever the
number of rows. A layer may hold several parts of different types (a Q4_K_M file's fused q/k/v: q and k Q4_K,
v Q6_K). Float checkpoints quantized at load (`quantize=`) become the same kernel's blocks, quantized the
llama.cpp way: int4 as Q4_1 (a float16 scale and minimum per 32), int8 as Q8_0 (a float16 scale per 32); the
embedding and head Q8_0. Before (issue 48), the CPU ran torch's weight-only kernels, whose time grows
linearly in the rows (a verify of k + 1 tokens cost ~k + 1 steps), on int4 groups with bfloat16 scales and
int8 rows with one scale each (a Q8_0 or Q6_K file re-quantized: 94.8% top-1 agreement on SmolLM2).

**On other devices: `QuantLinear`**, the Triton layout (kernels/quant_matmul.py): int4 codes 0..15 in groups of
`GROUP` = 32 inputs with a bfloat16 scale and zero (w = (code - 8) scale + zero; a GGUF's Q4_0, Q4_1 and Q4_K
blocks map onto it, their float16 scales rounded to bfloat16: models/gguf.py `int4_codes`), int8 codes
-127..127 with a bfloat16 scale per row; on CUDA a Triton kernel that dequantizes each weight tile in
registers and sums each row in a fixed order, elsewhere (a `QuantLinear` built by hand on the CPU: the loaders
build `BlockLinear` there) its torch reference.

Exactness: both kernels compute each row on its own, but their inputs are rounded (to int8 on the CPU, to
bfloat16 on a GPU), which turns the last-bit differences of the ordinary float32 attention (its blocks depend
on how many tokens share the forward) into different codes: measured on SmolLM2-135M int4, AR at batch 1 and 4
then differed on 1 of 8 prompts within 48 tokens. So a quantized model loads with its batch-invariant mode on
(models/numerics.py; attention and SiLU in a fixed order): greedy speculative output then equals the quantized
target's AR output bit for bit. `model.batch_invariant = False` turns it off (a draft model does not need it:
`LLM` turns it off there unless batch_invariant=True).

The embedding and a tied head share one table (`QuantEmbedding` looks up and dequantizes rows). Quantization
happens while loading (models/loader.py and models/gguf.py fill a `QuantRows` per weight), a bounded chunk of
rows at a time, so a float32 copy of the model is never held.
"""
from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

from specdec.kernels.quant_matmul import (FORMATS, GROUP, INT4_OFFSET, dequantize_int4, k_major, pack_nibbles,
                                          quant_matmul, unpack_nibbles)

from specdec.kernels import qmm_cpu
from specdec.kernels.bi_matmul import bi_linear, pack_weight

from .errors import CheckpointError
from .finite import check_finite
from .ggml_blocks import TILE_ROWS, Decomposed, Packed, pack, quantize_rows, select_rows
from .ggml_blocks import dequantize as dequantize_packed
from .ggml_blocks import dequantize_rows as dequantize_packed_rows

# FORMATS ("int8", "int4"), GROUP (32: int4's inputs per (scale, zero) group, llama.cpp's Q4 block size),
# INT4_OFFSET and the (un)packing of nibbles are the kernel's (kernels/quant_matmul.py), imported above
SCALE_DTYPE = torch.bfloat16  # the GPU layout's scales and zeros
# --quantize on the CPU: float weights quantized the llama.cpp way into one of the kernel's block types
REQUANTIZED_AS = {"int4": "Q4_1", "int8": "Q8_0"}
AS_STORED = "gguf"  # a GGUF's quantized tensors, loaded as the file holds them (models/gguf.py)
PACKED_FIELDS = ("codes", "da", "db", "sa", "sb")  # a Packed's tensors, in its order (models/ggml_blocks.py)


class QuantizationError(ValueError):
    """A weight that cannot be quantized as asked (one line naming the tensor)."""


def check_format(fmt) -> str | None:
    """`load_model(quantize=...)` checked by the `quantize` option's own rule (specdec/options.py: one rule,
    whether the value comes through `LLM` or straight to the loader); "none" is None."""
    from specdec.options import check_value, option_field

    fmt = None if fmt == "none" else fmt
    check_value(option_field("quantize"), fmt)
    return fmt


# ------------------------------------------------------------------------------------------ quantizing rows
def quantize_int4_rows(w: torch.Tensor):
    """w [N, K] float (K % GROUP == 0) -> codes uint8 [N, K] (0..15), scales and zeros float32 [N, K/GROUP]:
    each group's [min, max] mapped onto 0..15, w ~ (code - 8) * scale + zero."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)  # [N, G, 32]
    lo, hi = g.amin(-1), g.amax(-1)  # [N, G]
    scale = ((hi - lo) / 15).clamp_min(1e-10)  # a constant group gets a tiny scale and codes 0
    scale = scale.to(SCALE_DTYPE).float()  # the scale and zero the kernel will use: codes chosen against them
    zero = (lo + INT4_OFFSET * scale).to(SCALE_DTYPE).float()  # w = code * scale + lo = (code - 8) * scale + zero
    codes = torch.round((g - zero[..., None]) / scale[..., None] + INT4_OFFSET).clamp_(0, 15)  # [N, G, 32]
    return codes.to(torch.uint8).reshape(N, K), scale, zero


def quantize_int8_rows(w: torch.Tensor):
    """w [N, K] float -> codes int8 [N, K] (-127..127) and scales float32 [N] (max |w| / 127 per row)."""
    w = w.float()
    scale = (w.abs().amax(-1) / 127).clamp_min(1e-10).to(SCALE_DTYPE).float()  # [N]
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return codes, scale


# ------------------------------------------------------------------------------------------ modules
class QuantLinear(nn.Module):
    """A linear layer y = x W^T + b whose W is int8 or int4 in the Triton kernel's layout (see the module
    docstring): an int4 weight as nibbles (`nibbles` [N, K/2]: weight 2j in the low nibble of byte j) with
    `scales` and `zeros` [N, K/32], an int8 weight as `codes` [N, K] with `scales` [N]; each K-major (`k_major`:
    a group's codes for many rows contiguous)."""

    def __init__(self, fmt: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.format = fmt
        self.out_features, self.in_features = codes.shape
        if fmt == "int4":
            self.register_buffer("nibbles", k_major(pack_nibbles(codes)), persistent=False)  # [N, K/2] uint8
            self.register_buffer("scales", k_major(scales.to(SCALE_DTYPE)), persistent=False)  # [N, G]
            self.register_buffer("zeros", k_major(zeros.to(SCALE_DTYPE)), persistent=False)  # [N, G]
        elif fmt == "int8":
            self.register_buffer("codes", k_major(codes), persistent=False)  # [N, K] int8
            self.register_buffer("scales", scales.to(SCALE_DTYPE), persistent=False)  # [N]
        else:
            raise ValueError(f"unknown quantized format {fmt!r}")
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def extra_repr(self) -> str:
        return f"{self.format}, in_features={self.in_features}, out_features={self.out_features}"

    @property
    def weight_bytes(self) -> int:
        """Bytes a step reads for this weight (codes, scales and zeros)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """W [N, K] in `dtype`: the values the kernel multiplies by (for checks and one-off copies: a feature
        draft's head)."""
        if self.format == "int8":
            return self.codes.to(dtype) * self.scales.to(dtype)[:, None]
        return dequantize_int4(unpack_nibbles(self.nibbles), self.scales, self.zeros, dtype)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """y [..., N] in x's dtype: kernels/quant_matmul.py (Triton on CUDA, else its torch reference, or what
        `backend` says), float32 sums. The Triton kernel computes each row on its own, so a token's result never
        depends on what else is in the matmul (not so its torch reference, which runs only where Triton does
        not: a device other than CUDA, or kernel backend "torch")."""
        shape = x.shape
        if self.format == "int4":
            out = quant_matmul(x.reshape(-1, self.in_features), "int4", self.nibbles, self.scales, self.zeros,
                               backend=backend)
        else:
            out = quant_matmul(x.reshape(-1, self.in_features), "int8", self.codes, self.scales,
                               backend=backend)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)


class BlockLinear(nn.Module):
    """A linear layer y = x W^T + b whose W is held in models/ggml_blocks.py's packed tiles (a GGUF's own
    block types, or float weights quantized to Q4_1 / Q8_0 by --quantize), multiplied on the CPU by
    kernels/qmm_cpu.py: each weight read once per call however many rows x has, each row computed on its own
    (the same bits alone or in any batch). `parts`: (first output row, Packed) in row order, one per run of rows
    of one type (a fused q/k/v whose v is Q6_K and q, k Q4_K has two). Where the kernel is not built, a
    float32 copy of W is made once (the loader says so in one line) and multiplied by torch."""

    def __init__(self, parts: list[tuple[int, Packed]], bias: torch.Tensor | None = None, fmt: str = AS_STORED):
        super().__init__()
        self.format = fmt
        self.out_features = sum(p.n for _, p in parts)
        self.in_features = parts[0][1].k
        first = 0
        for i, (row, p) in enumerate(parts):
            if row != first or p.k != self.in_features:
                raise ValueError(f"BlockLinear: part {i} starts at row {row} with {p.k} columns; expected row "
                                 f"{first} and {self.in_features}")
            first += p.n
            for field in PACKED_FIELDS:
                t = getattr(p, field)
                if t is not None:  # float16 scales held as their int16 bits: a dtype cast (.float()) leaves them be
                    self.register_buffer(f"part{i}_{field}", t.view(torch.int16) if t.dtype == torch.float16 else t,
                                         persistent=False)
        self.part_shapes = [(row, p.qtype, p.n) for row, p in parts]  # the parts' tensors are the buffers
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._bind()

    def _bind(self) -> None:
        """The kernel's view of each part (`qmm_cpu.Weight`, which checks the buffers), from the buffers as they are
        now: again whenever they may have been replaced (`.to()`, a copy), so that the kernel never reads another
        module's memory. Where the kernel is not built, the fallback's float32 copy of W is made here (at load)."""
        self.weights = [(row, qmm_cpu.Weight(p, f"part {i}")) for i, (row, p) in enumerate(self.parts)]
        self.float_weight = self.float_packed = None  # the fallback's float32 copy [N, K] and oneDNN's packing of it
        # x [M, K] -> float32 [M, N], chosen once for this host and these parts
        if not qmm_cpu.available():
            self.float_weight = self.dequantize()  # [N, K]
            self.float_packed = pack_weight(self.float_weight)
            self.multiply = self.multiply_float_copy
        elif len(self.weights) == 1:
            self.multiply = self.multiply_one_part
        else:
            self.multiply = self.multiply_parts

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._bind()
        return self

    def __setstate__(self, state):  # copy.deepcopy and pickle: the copy's own buffers
        super().__setstate__(state)
        self._bind()

    @property
    def parts(self) -> list[tuple[int, Packed]]:
        """(first row, Packed) of each part, over the module's buffers as they are now."""
        def field(i: int, name: str):
            t = self._buffers.get(f"part{i}_{name}")
            return t.view(torch.float16) if t is not None and name in ("da", "db") else t

        return [(row, Packed(qtype, n, self.in_features, *(field(i, name) for name in PACKED_FIELDS)))
                for i, (row, qtype, n) in enumerate(self.part_shapes)]

    def select_rows(self, ids) -> "BlockLinear":
        """A BlockLinear of rows `ids` (ascending) of this one: the same blocks, so the same numbers (a head restricted
        to a subset of the vocabulary: models/transformer.py `restrict_head`)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # [N']
        if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("select_rows takes ascending, distinct row ids")
        parts, first = [], 0
        for row, p in self.parts:
            mine = ids[(ids >= row) & (ids < row + p.n)] - row  # [n'] this part's rows
            if mine.numel():
                parts.append((first, select_rows(p, mine)))
                first += mine.numel()
        bias = None if self.bias is None else self.bias.detach()[ids].clone()
        return BlockLinear(parts, bias, self.format)

    def extra_repr(self) -> str:
        types = "+".join(p.qtype for _, p in self.parts)
        return f"{types}, in_features={self.in_features}, out_features={self.out_features}"

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for _, p in self.parts)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """W [N, K] in `dtype`, exactly as the blocks mean it (for checks and one-off copies, not for steps)."""
        return torch.cat([dequantize_packed(p) for _, p in self.parts]).to(dtype)

    def rows(self, index, dtype=torch.float32) -> torch.Tensor:
        """Rows `index` (ids or a slice) of W, dequantized: [len, K] (an embedding's lookup)."""
        ids = torch.arange(self.out_features)[index] if isinstance(index, slice) else torch.as_tensor(index)
        flat = ids.reshape(-1)
        if len(self.parts) == 1:
            out = dequantize_packed_rows(self.parts[0][1], flat)
        else:
            out = torch.empty(flat.numel(), self.in_features)
            for row, p in self.parts:
                mine = (flat >= row) & (flat < row + p.n)
                out[mine] = dequantize_packed_rows(p, flat[mine] - row)
        return out.reshape(*ids.shape, self.in_features).to(dtype)

    def multiply_one_part(self, x2: torch.Tensor) -> torch.Tensor:
        return qmm_cpu.qmm(x2, self.weights[0][1])  # [M, N] float32

    def multiply_parts(self, x2: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x2.shape[0], self.out_features)  # [M, N] float32, each part's columns written
        for row, w in self.weights:
            qmm_cpu.qmm(x2, w, out=out[:, row: row + w.n])
        return out

    def multiply_float_copy(self, x2: torch.Tensor) -> torch.Tensor:
        """The fallback where the kernel is not built: the activations as the kernel multiplies them (int8 per block
        of 32 times its scale, `qmm_cpu.activations_as_multiplied`, rounded to float32) times the float32 copy of W,
        through bi_matmul's batch-invariant linear: each row on its own, so greedy output still equals AR (other bits
        than the kernel's, which it approximates to float32 rounding)."""
        xs = qmm_cpu.activations_as_multiplied(x2).float()  # [M, K]
        return bi_linear(xs, self.float_weight, None, packed=self.float_packed)  # [M, N]

    @property
    def float_copy_bytes(self) -> int:
        """Bytes the fallback's float32 copies take (0 where the kernel runs)."""
        return sum(t.numel() * t.element_size() for t in (self.float_weight, self.float_packed)
                   if isinstance(t, torch.Tensor))

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """y [..., N] in x's dtype. One path for every row count (see the class docstring); `backend`: the
        Triton kernels' setting, which this CPU kernel has no use for."""
        flat = x.dim() == 2  # the forward's [M, K]: no reshapes
        out = self.multiply(x if flat else x.reshape(-1, self.in_features))  # [M, N] float32
        if self.bias is not None:
            out = out + self.bias
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)


QUANTIZED_LINEAR = (QuantLinear, BlockLinear)  # the layers that run their own kernels (models/numerics.py)


class QuantEmbedding(nn.Module):
    """An embedding table held as int8 rows with a scale each (shared with a tied `QuantLinear` head)."""

    def __init__(self, head: nn.Module, dtype: torch.dtype):
        super().__init__()
        if not isinstance(head, BlockLinear) and head.format != "int8":
            raise ValueError("a quantized embedding is int8 or in blocks")
        self.table = head  # a submodule: a tied head is this same module (its buffers, one copy)
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, BlockLinear):
            return self.table.rows(input_ids, self.dtype)  # [..., E]
        rows = self.table.codes[input_ids].to(self.dtype)  # [..., E]
        return rows * self.table.scales[input_ids].to(self.dtype)[..., None]

    def rows(self, index) -> torch.Tensor:
        """Rows `index` of the table, dequantized to the activations' dtype: [len(index), E]."""
        if isinstance(self.table, BlockLinear):
            return self.table.rows(index, self.dtype)
        return self.table.codes[index].to(self.dtype) * self.table.scales[index].to(self.dtype)[:, None]


def linear_weight(layer: nn.Module, dtype=None) -> torch.Tensor:
    """A linear layer's weight [N, K] as floats (dequantized for a `QuantLinear` or `BlockLinear`)."""
    if isinstance(layer, QUANTIZED_LINEAR):
        return layer.dequantize(dtype or torch.float32)
    return layer.weight if dtype is None else layer.weight.to(dtype)


def embedding_rows(embedding: nn.Module, index) -> torch.Tensor:
    """Rows `index` (a slice or ids) of an embedding's table as floats (dequantized for a `QuantEmbedding`,
    those rows only)."""
    if isinstance(embedding, QuantEmbedding):
        return embedding.rows(index)
    return embedding.weight[index]


# ------------------------------------------------------------------------------------------ while loading
class QuantRows:
    """The quantized rows of one weight, filled a chunk of rows at a time (rows of fused parts included).

    On the CPU (`blocks`) the rows become models/ggml_blocks.py's packed tiles as they arrive: each part (a run
    of rows of one block type: a GGUF's blocks as stored, `add_blocks`; float rows quantized to Q4_1 (int4) or
    Q8_0 (int8, and `AS_STORED`'s float tensors), `add_float`) has its final buffers, filled a whole tile of 16
    rows at a time (the rows of a tile that arrive in two chunks wait, decomposed, for the rest), so that the
    decomposed form of at most one chunk is ever held, and `module` only wraps the buffers in a `BlockLinear`.
    `types`: (first row, rows, block type) of each run of rows, covering the weight (default: one run of the
    type `add_float` makes). Elsewhere, int4 / int8 codes for the GPU layout's `QuantLinear` (`add_codes`)."""

    def __init__(self, fmt: str, shape: tuple[int, int], name: str, check: bool = False, device="cpu",
                 types: list[tuple[int, int, str]] | None = None):
        N, K = shape
        self.blocks = self.uses_blocks(device, fmt)
        if (fmt == "int4" or self.blocks) and K % GROUP:
            raise QuantizationError(f"{name}: {fmt} needs an input size divisible by {GROUP}, got {K}")
        self.fmt, self.shape, self.name = fmt, shape, name
        self.filled = 0
        self.check = check  # `check_weights`: NaN/inf in a part's floats (or a block's scales) is an error
        self.check_s = 0.0
        if self.blocks:
            self._plan_parts(name, N, [(0, N, self.float_type(fmt))] if types is None else types)
            return
        groups = K // GROUP if fmt == "int4" else 1
        self.codes = torch.empty(N, K, dtype=torch.uint8 if fmt == "int4" else torch.int8)
        self.scales = torch.empty(N, groups) if fmt == "int4" else torch.empty(N)
        self.zeros = torch.empty(N, groups) if fmt == "int4" else None

    @staticmethod
    def uses_blocks(device, fmt: str) -> bool:
        """The CPU kernel's blocks (on the CPU; and a GGUF's as stored), or the GPU layout's codes."""
        return torch.device(device).type == "cpu" or fmt == AS_STORED

    @staticmethod
    def float_type(fmt: str) -> str:
        """The block type float rows become on the CPU (`add_float`)."""
        return REQUANTIZED_AS.get(fmt, "Q8_0")

    def _plan_parts(self, name: str, n: int, types) -> None:
        """The parts (first row, rows, block type): consecutive runs of `types` of one type joined; each part's
        packed buffers (allocated at its first packed tiles), its waiting rows and its count of tiles written."""
        parts: list[tuple[int, int, str]] = []
        for first, rows, qtype in sorted(types):
            expected = parts[-1][0] + parts[-1][1] if parts else 0
            if first != expected or rows <= 0:
                raise ValueError(f"{name}: the block types of rows {expected}.. are not given (a run of {rows} "
                                 f"rows at {first})")
            if parts and parts[-1][2] == qtype:
                parts[-1] = (parts[-1][0], parts[-1][1] + rows, qtype)
            else:
                parts.append((first, rows, qtype))
        if (parts[-1][0] + parts[-1][1] if parts else 0) != n:
            raise ValueError(f"{name}: the block types given cover {sum(p[1] for p in parts)} of {n} rows")
        self.part_rows = parts
        self.packed: list[Packed | None] = [None] * len(parts)  # each part's final buffers (None: no tile yet)
        self.waiting: list[dict[int, list]] = [{} for _ in parts]  # per part: tile -> [(row in part, Decomposed)]
        self.tiles_written = [0] * len(parts)

    def add_float(self, first: int, w: torch.Tensor, label: str | None = None) -> None:
        """Quantize float rows w [r, K] into rows first..first+r-1 (`label`: the source tensor, for errors)."""
        if self.check:
            self.check_s += check_finite(w, label or self.name)
        if self.blocks:
            qtype = self.float_type(self.fmt)
            self.add_blocks(first, quantize_rows(w, qtype), qtype)
        elif self.fmt == "int4":
            self.add_codes(first, *quantize_int4_rows(w))
        else:
            self.add_codes(first, *quantize_int8_rows(w))

    def add_blocks(self, first: int, rows: Decomposed, qtype: str, label: str | None = None) -> None:
        """Rows first..first+r-1 as decomposed blocks of `qtype` (a GGUF's, as stored), packed into their
        part's tiles: the whole tiles among them at once, the rows of a tile shared with another chunk when
        the tile is complete."""
        if self.check and label is not None:
            self.check_s += sum(check_finite(t.float(), label) for t in (rows.da, rows.db) if t is not None)
        r = rows.u.shape[0]
        index = next((i for i, (start, n, _) in enumerate(self.part_rows) if start <= first < start + n), None)
        if index is None or first + r > sum(self.part_rows[index][:2]) or self.part_rows[index][2] != qtype:
            raise ValueError(f"{self.name}: rows {first}..{first + r - 1} of {qtype} do not fit the parts "
                             f"{self.part_rows}")
        start, n, _ = self.part_rows[index]
        lo, hi = first - start, first - start + r  # rows within the part
        a = min(-(-lo // TILE_ROWS) * TILE_ROWS, hi)  # the first tile boundary at or after lo
        b = hi if hi == n else max(a, hi // TILE_ROWS * TILE_ROWS)  # whole tiles: rows a..b-1
        if a < b:
            self._write_tiles(index, a // TILE_ROWS, pack(self._rows_of(rows, a - lo, b - lo), qtype))
        for w0, w1 in ((lo, a), (b, hi)):  # rows of a tile only partly in this chunk: each within one tile
            if w0 < w1:
                self._wait(index, w0, self._rows_of(rows, w0 - lo, w1 - lo, copy=True))
        self.filled += r

    def _wait(self, index: int, row: int, rows: Decomposed) -> None:
        """Rows row.. of part `index` (within one tile) wait for the rest of their tile; a complete tile is
        packed (its rows in order) and written."""
        tile = row // TILE_ROWS
        start, n, qtype = self.part_rows[index]
        waiting = self.waiting[index].setdefault(tile, [])
        waiting.append((row, rows))
        if sum(d.u.shape[0] for _, d in waiting) < min(TILE_ROWS, n - tile * TILE_ROWS):
            return
        del self.waiting[index][tile]
        fields = zip(*(d for _, d in sorted(waiting, key=lambda w: w[0])))  # per field: its pieces in row order
        joined = Decomposed(*(None if pieces[0] is None else torch.cat(pieces) for pieces in fields))
        self._write_tiles(index, tile, pack(joined, qtype))

    def _write_tiles(self, index: int, tile: int, chunk: Packed) -> None:
        """Packed tiles `chunk` into part `index`'s buffers from tile `tile` on (the buffers allocated at the
        first chunk, each field [tiles, ...] as the chunk's)."""
        start, n, qtype = self.part_rows[index]
        tensors = {f: x for f, x in zip(chunk._fields, chunk) if isinstance(x, torch.Tensor)}
        count = next(iter(tensors.values())).shape[0]
        if self.packed[index] is None:
            tiles = -(-n // TILE_ROWS)
            self.packed[index] = chunk._replace(n=n, **{f: torch.empty((tiles, *x.shape[1:]), dtype=x.dtype)
                                                        for f, x in tensors.items()})
        packed = self.packed[index]
        for f, x in tensors.items():
            getattr(packed, f)[tile: tile + count] = x
        self.tiles_written[index] += count

    @property
    def complete(self) -> bool:
        if self.blocks:
            return self.tiles_written == [-(-n // TILE_ROWS) for _, n, _ in self.part_rows]
        return self.filled >= self.shape[0]

    def add_codes(self, first: int, codes, scales, zeros=None, label: str | None = None) -> None:
        """Rows already quantized in this format (a GGUF's Q4 blocks): codes [r, K], scales (and zeros)."""
        if self.check and label is not None:
            self.check_s += check_finite(scales, label) + (check_finite(zeros, label) if zeros is not None else 0.0)
        r = codes.shape[0]
        self.codes[first: first + r] = codes
        self.scales[first: first + r] = scales
        if self.zeros is not None:
            self.zeros[first: first + r] = zeros
        self.filled += r

    def module(self, bias=None, device="cpu") -> nn.Module:
        if self.blocks:
            if not self.complete:
                raise QuantizationError(f"{self.name}: {self.filled} of {self.shape[0]} rows written")
            parts = [(start, packed) for (start, _, _), packed in zip(self.part_rows, self.packed)]
            self.packed = [None] * len(parts)  # the module holds them now
            return BlockLinear(parts, bias, self.fmt)
        dev = torch.device(device)
        zeros = None if self.zeros is None else self.zeros.to(dev)
        return QuantLinear(self.fmt, self.codes.to(dev), self.scales.to(dev), zeros, bias)

    @staticmethod
    def _rows_of(rows: Decomposed, first: int, last: int, copy: bool = False) -> Decomposed:
        """Rows first..last-1 of a decomposed chunk: views, or copies (`copy`: rows that wait must not keep
        their whole chunk alive)."""
        return Decomposed(*(None if x is None else x[first:last].clone() if copy else x[first:last] for x in rows))


def quantized_parameters(model: nn.Module, fmt: str) -> dict[str, str]:
    """The weights a model quantized to `fmt` keeps quantized: parameter name -> its format. Every linear
    layer's weight in `fmt`; the embedding and the head int8 whatever `fmt` is (int4 there costs the most
    quality; llama.cpp's Q4 files keep the embedding at Q8_0 too). `AS_STORED`: every one as the file has it."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out[f"{name}.weight"] = "int8" if name == "lm_head" and fmt != AS_STORED else fmt
        elif isinstance(module, nn.Embedding):
            out[f"{name}.weight"] = fmt if fmt == AS_STORED else "int8"
    return out


def install_quantized(model: nn.Module, rows: dict[str, QuantRows], floats: dict[str, torch.Tensor], device,
                      dtype: torch.dtype, tied: bool) -> None:
    """Replace each quantized weight's module of `model` (built on the meta device) by its quantized module
    (a linear layer's float bias, from `floats`, goes with it); a tied head and the embedding share one
    table. The remaining float parameters are the caller's to load."""
    embed_name = "embed_tokens.weight"
    modules = dict(model.named_modules())
    built: dict[str, QuantLinear] = {}
    for name, part in rows.items():
        if not part.complete:
            raise QuantizationError(f"{name}: {part.filled} of {part.shape[0]} rows written")
        module_name = name.rsplit(".", 1)[0]
        built[name] = layer = part.module(floats.pop(f"{module_name}.bias", None), device)
        if name != embed_name:  # the embedding becomes a QuantEmbedding over its table, below
            parent, _, attr = module_name.rpartition(".")
            setattr(modules[parent] if parent else model, attr, layer)
    if embed_name in built:
        table = built[embed_name]
        model.embed_tokens = QuantEmbedding(table, dtype)
        if tied:
            model.lm_head = table


def release_freed_memory() -> None:
    """Hand the loader's freed temporaries back to the system (glibc keeps freed heap memory, and after large
    frees it raises its mmap threshold, so chunk-sized temporaries land on the heap): measured on the Qwen2.5
    1.5B Q4_K_M file, resident memory after loading 2.53 -> 1.60 GB. The GGUF loader calls it after each
    quantized tensor too (SmolLM2's peak while loading 1.26x -> 1.17x its file). A no-op where there is no
    glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def finish_loading(model: nn.Module, floats: dict, rows: dict[str, QuantRows], tied: bool, dtype, device,
                   quantize: str | None, check_s: float | None) -> nn.Module:
    """Put the loaded weights into `model` (built on the meta device; shared by both loaders): the quantized
    modules first (`install_quantized`), then the float parameters; a float tied head shares the embedding.
    `check_s`: the float weights' NaN/inf scan seconds (None: not checked); the quantized rows' scans are
    added. A parameter left on the meta device is an error (nothing half-loaded is returned)."""
    if check_s is not None:
        check_s += sum(part.check_s for part in rows.values())
    if rows:
        install_quantized(model, rows, floats, device, dtype, tied)
    model.load_state_dict(floats, strict=not tied and not rows, assign=True)
    if tied and not rows:
        model.lm_head.weight = model.embed_tokens.weight
    unset = [name for name, p in model.named_parameters() if p.is_meta]
    if unset:
        raise CheckpointError(f"weights not loaded: {', '.join(unset[:5])}")
    model.weights_check_s = check_s
    model.quantize = quantize if rows else None
    release_freed_memory()
    if any(part.blocks for part in rows.values()) and not qmm_cpu.available():
        copies = sum(m.float_copy_bytes for m in model.modules() if isinstance(m, BlockLinear))
        print(f"specdec: {qmm_cpu.unavailable_reason()}; multiplying float32 copies of the quantized weights instead "
              f"({copies / 2**30:.2f} GiB, made at load), each row on its own (greedy output still equals AR) but "
              f"slower and in other bits than the kernel's", file=sys.stderr)
    if rows:  # see the module docstring ("Exactness"): the ops around the bfloat16 roundings must be invariant
        model.batch_invariant = True
    return model.eval()
