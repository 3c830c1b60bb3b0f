"""Loading GGUF files (llama.cpp's single-file format) into our Transformer.

`load_gguf_model(path, dtype)` reads the file's header (`GGUFFile`: metadata and tensor table; the large
tokenizer arrays are skipped unless asked for, where `gguf.GGUFReader` would hold ~100k small numpy arrays,
~160 MB for a 49k vocabulary), builds the config from its metadata (architectures llama, qwen2, qwen3;
others are refused by name), and dequantizes each tensor with the `gguf` library's
`gguf.quants.dequantize` (every type it can dequantize: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
K-quants, the IQ types) a bounded chunk of rows at a time, straight into its final buffer in the caller's
dtype, from a memory map whose pages are released after each tensor. So the peak memory is the final
model plus one chunk's float32 temporaries: the float load (`dtype` given). By default on the CPU a quantized
file is loaded as stored instead: every tensor of a type models/ggml_blocks.py knows (Q4_0 ... Q6_K) is
decomposed into its exact blocks a chunk of rows at a time and packed for kernels/qmm_cpu.py (models/quant.py's
`BlockLinear`), never dequantized; for the GPU layout (`quantize="int4"` on CUDA), Q4_0, Q4_1 and Q4_K tensors
are taken as int4 codes (`int4_codes`). llama.cpp's
converter permutes the rows of a llama model's Q and K projections (it rotates adjacent pairs, HF rotates
halves); `unpermute_rows` undoes that, on codes, scales and zeros (and decomposed blocks) alike. A file
without `output.weight` ties the head to the embedding.

Every tensor's name, type, shape, extent in the file and first row (dequantized) are checked before any
weight is written into the model: a truncated file, an unknown or undequantizable type, an unsupported
architecture or a missing tensor raise one CheckpointError naming the file, and no model is returned.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct
from typing import NamedTuple

import numpy as np
import torch

from .config import ModelConfig
from .errors import CheckpointError
from .feature_draft import fingerprint_rows, fingerprint_weights
from .finite import check_finite
from .ggml_blocks import TYPES as BLOCK_TYPES
from .ggml_blocks import Decomposed, decompose
from .quant import AS_STORED, QuantRows, finish_loading, quantized_parameters
from .transformer import Transformer, fusion_layout

ARCHITECTURES = ("llama", "qwen2", "qwen3")
DEQUANT_CHUNK_ELEMENTS = 1 << 22  # weights dequantized at a time (float32 temporaries of ~16 MB each)

# GGUF tensor name -> HF state-dict name (without "model."); "{i}" is the layer index.
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """The HF state-dict name (without `model.`) of GGUF tensor `name`, or None for a name we do not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m[2] in _LAYER_NAMES:
        return f"layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    return None


GGUF_MAGIC = b"GGUF"
ARRAY_KEEP_LIMIT = 64  # arrays longer than this are skipped unless their key is asked for
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class SkippedArray(NamedTuple):
    """A metadata array that was not read into memory (longer than ARRAY_KEEP_LIMIT and not asked for)."""

    length: int

    def __len__(self) -> int:
        return self.length


class TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    qtype: object  # gguf.GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class _Header:
    """Sequential little-endian reads of a GGUF header; a short read is a truncated file."""

    def __init__(self, f, path: str):
        self.f, self.path = f, path

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise CheckpointError(f"{self.path}: cannot read GGUF file (file is truncated inside its header)")
        return data

    def scalar(self, kind: int):
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise CheckpointError(f"{self.path}: cannot read GGUF file (unknown metadata value type {kind})")
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        data = self.take(self.scalar(10))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: cannot read GGUF file (a string is not UTF-8)") from None

    def value(self, kind: int, keep: bool):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        keep = keep or count <= ARRAY_KEEP_LIMIT
        if item in _SCALARS:
            raw = self.take(struct.calcsize(_SCALARS[item]) * count)
            return np.frombuffer(raw, dtype=np.dtype(_SCALARS[item])).tolist() if keep else SkippedArray(count)
        if item == _STRING and not keep:
            for _ in range(count):
                self.take(self.scalar(10))
            return SkippedArray(count)
        items = [self.value(item, keep) for _ in range(count)]
        return items if keep else SkippedArray(count)


class GGUFFile:
    """The header of a GGUF file (v2/v3, little-endian): `metadata` (key -> value; arrays longer than
    ARRAY_KEEP_LIMIT only for the keys in `arrays`), `tensors` (TensorInfo, in file order), and `data`, the
    file memory-mapped (uint8). A missing, malformed or truncated file, or a tensor of a type the gguf
    library does not know, raises one CheckpointError naming the file."""

    def __init__(self, path: str, arrays=()):
        try:
            import gguf
        except ImportError as err:
            raise CheckpointError(f"{path}: reading GGUF files needs the gguf package (pip install gguf)") from err
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: GGUF file does not exist")
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            h = _Header(f, path)
            if h.take(4) != GGUF_MAGIC:
                raise CheckpointError(f"{path}: cannot read GGUF file (not a GGUF file: bad magic)")
            version = h.scalar(4)
            if version not in (2, 3):
                raise CheckpointError(f"{path}: cannot read GGUF file (version {version}; only 2 and 3, little-endian)")
            n_tensors, n_kv = h.scalar(10), h.scalar(10)
            self.metadata = {}
            for _ in range(n_kv):
                key = h.string()
                self.metadata[key] = h.value(h.scalar(4), key in arrays)
            infos = []
            for _ in range(n_tensors):
                name = h.string()
                dims = tuple(h.scalar(10) for _ in range(h.scalar(4)))
                infos.append((name, dims, h.scalar(4), h.scalar(10)))
            alignment = int(self.metadata.get("general.alignment", 32))
            start = -(-f.tell() // alignment) * alignment  # tensor data begins at the next aligned byte
        self.tensors = []
        for name, dims, raw_type, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise CheckpointError(f"{path}: tensor {name!r} has unknown quantization type {raw_type}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if not dims or dims[0] % block:
                raise CheckpointError(f"{path}: tensor {name!r} has row length {dims[0] if dims else None}, not a "
                                      f"multiple of {qtype.name}'s block of {block}")
            nbytes = int(np.prod(dims)) * type_size // block
            if start + offset + nbytes > size:
                raise CheckpointError(f"{path}: file is truncated: tensor {name!r} ends at byte "
                                      f"{start + offset + nbytes}, the file has {size}")
            self.tensors.append(TensorInfo(name, dims, qtype, start + offset, nbytes))
        self.data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def raw_rows(self, t: TensorInfo, first: int, last: int) -> np.ndarray:
        """Rows first..last-1 of tensor `t` as stored: uint8 [rows, bytes per row]."""
        row_bytes = t.nbytes // max(1, int(np.prod(t.dims[1:])))
        return self.data[t.offset + first * row_bytes: t.offset + last * row_bytes].reshape(-1, row_bytes)

    def release(self, t: TensorInfo) -> None:
        """Drop tensor `t`'s file pages from memory (read again from the file if touched again)."""
        mapped = getattr(self.data, "_mmap", None)
        if mapped is None or not hasattr(mapped, "madvise"):
            return
        page = mmap.PAGESIZE
        first = t.offset // page * page
        try:
            mapped.madvise(mmap.MADV_DONTNEED, first, min(len(mapped), t.offset + t.nbytes) - first)
        except (OSError, ValueError):
            pass  # only an optimisation


def open_gguf(path: str, arrays=()) -> GGUFFile:
    return GGUFFile(os.fspath(path), arrays)


def config_from_metadata(meta: dict, path: str) -> ModelConfig:
    """Our ModelConfig from GGUF metadata (`{arch}.block_count`, `.embedding_length`, ...)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {list(ARCHITECTURES)}")

    def need(key):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{path}: missing GGUF metadata key {arch}.{key!r}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise CheckpointError(f"{path}: partial rotary ({arch}.rope.dimension_count {rotary} of head_dim "
                              f"{head_dim}) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = 1.0
    if scaling == "linear":
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    elif scaling not in ("none", None):
        raise CheckpointError(f"{path}: rope scaling {scaling!r} is not supported (only none and linear)")
    if heads % kv_heads:
        raise CheckpointError(f"{path}: head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:  # older files: the vocabulary's length
        tokens = meta.get("tokenizer.ggml.tokens")  # a SkippedArray keeps its length
        if tokens is None:
            raise CheckpointError(f"{path}: no {arch}.vocab_size and no tokenizer.ggml.tokens in the metadata")
        vocab = len(tokens)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        family="qwen3" if arch == "qwen3" else "llama",  # qwen2 is llama with q/k/v biases
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_linear_factor=factor,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_word_embeddings=False,  # set by `read_tensors` from whether output.weight is present
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


Q4_TYPES = {"Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 weights


def q4_codes(raw: np.ndarray, qtype: str):
    """Q4_0 / Q4_1 rows as int4 codes (models/quant.py): raw uint8 [r, bytes per row] -> codes uint8 [r, K],
    scales and zeros float32 [r, K/32], with w = (code - 8) * scale + zero exactly as the file means it.
    A block is a float16 d (Q4_1: then a float16 m) and 16 bytes: weight j in the low nibble of byte j,
    weight j + 16 in the high nibble. Q4_0: w = d (q - 8); Q4_1: w = d q + m = (q - 8) d + (m + 8 d)."""
    size = Q4_TYPES[qtype]
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, size)  # [r, G, bytes]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [r, G]
    start = 2 if qtype == "Q4_0" else 4
    qs = blocks[..., start: start + 16]  # [r, G, 16]
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(r, -1)  # [r, K]
    if qtype == "Q4_0":
        zeros = np.zeros_like(d)
    else:
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)  # [r, G]
        zeros = m + 8 * d
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zeros)


Q4_K_BLOCK_BYTES = 144  # 256 weights: float16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
INT4_AS_STORED = (*Q4_TYPES, "Q4_K")  # loaded into int4 as stored (never dequantized)


def q4k_scales_mins(packed: np.ndarray):
    """Q4_K's 8 sub-block scales and mins (6 bits each) from their 12 bytes: uint8 [..., 12] -> two
    uint8 [..., 8]. Bytes 0-3: scale j (low 6 bits) and the top 2 bits of scale j + 4; bytes 4-7: the same
    for the mins; bytes 8-11: the low 4 bits of scale j + 4 (low nibble) and of min j + 4 (high nibble)."""
    lo_sc, lo_m, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # [..., 4] each
    scales = np.concatenate((lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)), axis=-1)  # [..., 8]
    mins = np.concatenate((lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)), axis=-1)  # [..., 8]
    return scales, mins


def q4k_codes(raw: np.ndarray):
    """Q4_K rows as int4 codes (models/quant.py): raw uint8 [r, bytes per row] -> codes uint8 [r, K], scales
    and zeros float32 [r, K/32]. A super-block of 256 weights is 8 sub-blocks of 32 with w = d sc q - dmin m
    (sc, m its sub-block's 6-bit scale and min, d and dmin the block's float16s): exactly our group of 32
    with scale = d sc and zero = 8 d sc - dmin m, since (q - 8) d sc + 8 d sc - dmin m = d sc q - dmin m.
    Nibbles: bytes 32c..32c+31 hold sub-block 2c in their low nibbles and sub-block 2c + 1 in their high."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q4_K_BLOCK_BYTES)  # [r, S, 144]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float32)  # [r, S, 1]
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float32)  # [r, S, 1]
    sc, m = q4k_scales_mins(blocks[..., 4:16])  # [r, S, 8] each
    qs = blocks[..., 16:].reshape(r, -1, 4, 1, 32)  # [r, S, 4 pairs of sub-blocks, 1, 32 bytes]
    codes = np.concatenate((qs & 15, qs >> 4), axis=-2).reshape(r, -1)  # [r, K]: sub-blocks in order
    scales = d * sc.astype(np.float32)  # [r, S, 8]: exact in float32 (11 x 6 bits)
    zeros = 8 * scales - dmin * m.astype(np.float32)  # [r, S, 8]
    return torch.from_numpy(codes), torch.from_numpy(scales.reshape(r, -1)), torch.from_numpy(zeros.reshape(r, -1))


def int4_codes(raw: np.ndarray, qtype: str):
    """Rows of a type in INT4_AS_STORED as int4 codes, scales and zeros (`q4_codes`, `q4k_codes`)."""
    return q4k_codes(raw) if qtype == "Q4_K" else q4_codes(raw, qtype)


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation. Its converter interleaves each head's two halves (HF rotates
    halves, llama.cpp rotates adjacent pairs): HF row r + h * D/2 of a head (h = 0, 1) becomes row 2r + h.
    weight: [heads * D, E] -> the same shape, HF's row order."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFTensors:
    """The weights of a GGUF file, checked and named as HF names them, dequantized on demand.

    `names`: HF name -> the file's TensorInfo. `tied`: the file has no output.weight."""

    def __init__(self, path: str, file: GGUFFile | None = None):
        self.path = path
        self.file = file if file is not None else open_gguf(path)
        cfg = config_from_metadata(self.file.metadata, path)
        self.arch = self.file.metadata["general.architecture"]
        self.names: dict[str, TensorInfo] = {}
        for t in self.file.tensors:
            name = hf_name(t.name)
            if name is None or (name.startswith("layers.") and int(name.split(".")[1]) >= cfg.num_layers):
                raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for GGUF architecture {self.arch!r}")
            self.names[name] = t
        self.tied = "lm_head.weight" not in self.names
        self.cfg = dataclasses.replace(cfg, tie_word_embeddings=self.tied)
        with torch.device("meta"):
            expected = {n: tuple(p.shape) for n, p in Transformer(self.cfg).named_parameters(remove_duplicate=False)}
        if self.tied:
            expected.pop("lm_head.weight")
        for name in sorted(self.names):
            if name not in expected:
                raise CheckpointError(f"{path}: unexpected tensor {self.names[name].name!r} for this "
                                      f"{self.arch} configuration")
            shape = self.shape(name)
            if shape != expected[name]:
                raise CheckpointError(f"{path}: tensor {self.names[name].name!r} has shape {shape}, expected "
                                      f"{expected[name]}")
        missing = sorted(set(expected) - set(self.names))
        if missing:
            shown = ", ".join(repr(gguf_name(m)) for m in missing[:5])
            raise CheckpointError(f"{path}: missing tensor(s) {shown}{' ...' if len(missing) > 5 else ''}")
        for name in self.names:  # dequantize every tensor's first row: a type the library cannot read fails here
            self._rows(name, 0, 1)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self.names[name].dims))

    def _rows(self, name: str, first: int, last: int) -> np.ndarray:
        """Rows first..last-1 of weight `name`, dequantized to float32: [rows, row length]."""
        from gguf import quants

        t = self.names[name]
        try:
            data = self.file.raw_rows(t, first, last)  # uint8 [rows, bytes per row]
            if t.qtype.name in ("F32", "F16"):  # the library dequantizes these from their own dtype
                data = data.view(np.float32 if t.qtype.name == "F32" else np.float16)
            values = quants.dequantize(data, t.qtype)  # [rows, row length]
            return np.require(values, dtype=np.float32, requirements="W")
        except NotImplementedError:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} has quantization type {t.qtype.name}, which the "
                                  f"gguf library cannot dequantize") from None
        except (ValueError, IndexError, OSError, TypeError) as err:
            raise CheckpointError(f"{self.path}: cannot dequantize tensor {t.name!r} ({t.qtype.name}): {err}") from None

    def _chunks(self, name: str):
        """(first, last, permuted heads or None): the row chunks of 2-D weight `name`, bounded in elements;
        whole heads at a time where llama.cpp's Q/K row permutation must be undone (llama architecture)."""
        shape = self.shape(name)
        rows = shape[0]
        permuted_heads = None
        if self.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            permuted_heads = self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
        if permuted_heads is not None:  # the permutation mixes rows within a head: whole heads at a time
            per_chunk = max(1, DEQUANT_CHUNK_ELEMENTS // (rows // permuted_heads * shape[1])) * (rows // permuted_heads)
        else:
            per_chunk = max(1, DEQUANT_CHUNK_ELEMENTS // int(np.prod(shape[1:])))
        for first in range(0, rows, per_chunk):
            last = min(rows, first + per_chunk)
            yield first, last, None if permuted_heads is None else (last - first) * permuted_heads // rows

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Dequantize weight `name` into `out` (its shape, any float dtype), a bounded chunk of rows at a
        time, undoing llama.cpp's Q/K row permutation (llama architecture)."""
        shape = self.shape(name)
        if len(shape) == 1:
            out.copy_(torch.from_numpy(self._rows(name, 0, 1)).reshape(shape))
            self.file.release(self.names[name])
            return
        for first, last, heads in self._chunks(name):
            block = torch.from_numpy(self._rows(name, first, last))  # [rows, cols] float32
            if heads is not None:
                block = unpermute_rows(block, heads)
            out[first: last].copy_(block)
        self.file.release(self.names[name])

    def read_quantized(self, name: str, rows: QuantRows, offset: int = 0, label: str | None = None) -> None:
        """Weight `name` into the quantized rows `rows` from row `offset` on (a fused projection's part). On the
        CPU (`rows.blocks`) every block type of models/ggml_blocks.py as stored, decomposed a bounded chunk of
        rows at a time (never dequantized); for the GPU layout, Q4_0, Q4_1 and Q4_K blocks as stored when
        `rows` is int4. Any other type is dequantized a bounded chunk at a time and quantized."""
        t = self.names[name]
        if rows.blocks and t.qtype.name in BLOCK_TYPES:
            for first, last, heads in self._chunks(name):
                parts = decompose(self.file.raw_rows(t, first, last), t.qtype.name)
                if heads is not None:
                    parts = Decomposed(*(None if p is None else unpermute_rows(p, heads) for p in parts))
                rows.add_blocks(offset + first, parts, t.qtype.name, label)
            self.file.release(t)
            return
        as_stored = rows.fmt == "int4" and t.qtype.name in INT4_AS_STORED
        for first, last, heads in self._chunks(name):
            if as_stored:
                parts = int4_codes(self.file.raw_rows(t, first, last), t.qtype.name)  # codes [r, K], scales, zeros
            else:
                parts = (torch.from_numpy(self._rows(name, first, last)),)  # [r, K] float32
            if heads is not None:
                parts = tuple(unpermute_rows(p, heads) for p in parts)
            if as_stored:
                rows.add_codes(offset + first, *parts, label=label)
            else:
                rows.add_float(offset + first, parts[0], label)
        self.file.release(t)

    def read_rows(self, name: str, rows: slice) -> torch.Tensor:
        """Rows `rows` of 2-D weight `name` as the float load reads them, one row at a time: [len, K] float32
        (a weight whose rows llama.cpp permuted, Q and K, is refused: its rows move by head)."""
        if next(self._chunks(name))[2] is not None:
            raise ValueError(f"{name}: llama.cpp permuted its rows; read it whole")
        return torch.from_numpy(np.concatenate([self._rows(name, i, i + 1) for i in range(self.shape(name)[0])[rows]]))

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=dtype)
        self.read_into(name, out)
        return out


def gguf_name(hf: str) -> str:
    """The GGUF tensor name of HF name `hf` (without `model.`), for messages."""
    for g, h in _GLOBAL_NAMES.items():
        if h == hf:
            return g
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    if m:
        for g, h in _LAYER_NAMES.items():
            if h == m[2]:
                return f"blk.{m[1]}.{g}.{m[3]}"
    return hf


def load_gguf_model(path, dtype=None, device="cpu", fuse: bool = True,
                    check_weights: bool = False, quantize: str | None = None) -> Transformer:
    """Load a GGUF file into our Transformer (see the module docstring). `dtype` None (the default) on the
    CPU keeps every quantized tensor of a block type models/ggml_blocks.py knows as the file stores it (the
    activations float32), multiplied by kernels/qmm_cpu.py; a torch dtype asks for float weights (dequantized).
    `quantize` "int8" / "int4" keeps the linear weights quantized (models/quant.py: on the CPU the file's blocks
    as stored and float tensors quantized to Q4_1 / Q8_0; elsewhere Q4_0 / Q4_1 / Q4_K tensors as stored when
    int4)."""
    path = os.fspath(path)
    device = torch.device(device)
    weights = GGUFTensors(path)
    cfg = weights.cfg
    if dtype is None and quantize is None and device.type == "cpu":
        quantize = AS_STORED
    dtype = torch.float32 if dtype is None else dtype
    with torch.device("meta"):
        model = Transformer(cfg, fused=fuse)
    params = dict(model.named_parameters(remove_duplicate=False))
    if weights.tied:
        params.pop("lm_head.weight")
    layout = fusion_layout(cfg) if fuse else {}
    fused_names = {dst for dst, _, _ in layout.values()}
    placement = {name: (name, None) for name in params if name not in fused_names}
    placement.update({src: (dst, row) for src, (dst, row, _) in layout.items()})
    quantized = quantized_parameters(model, quantize) if quantize else {}
    if quantize == AS_STORED:  # a parameter stays quantized where every tensor it is made of is of a block type
        floats = {placement[name][0] for name, t in weights.names.items() if t.qtype.name not in BLOCK_TYPES}
        quantized = {param: fmt for param, fmt in quantized.items() if param not in floats}
    final: dict[str, torch.Tensor] = {}
    rows: dict[str, QuantRows] = {}
    samples = {}  # a quantized load: the fingerprint's sample of the weights as the file holds them
    check_s = 0.0
    for name in sorted(weights.names):
        param, row = placement[name]
        label = f"{path}: tensor {weights.names[name].name!r}"
        if param in quantized:
            if name in fingerprint_weights(cfg):
                samples[name] = weights.read_rows(name, fingerprint_rows(weights.shape(name)[0]))
            if param not in rows:
                rows[param] = QuantRows(quantized[param], tuple(params[param].shape), label, check_weights, device)
            weights.read_quantized(name, rows[param], row or 0, label)
            continue
        if param not in final:
            final[param] = torch.empty(params[param].shape, dtype=dtype, device=device)
        written = final[param] if row is None else final[param][row: row + weights.shape(name)[0]]
        weights.read_into(name, written)
        if check_weights:
            check_s += check_finite(written, label)
    model = finish_loading(model, final, rows, weights.tied, dtype, device, quantize,
                           check_s if check_weights else None)
    if set(samples) == set(fingerprint_weights(cfg)):  # every sampled weight was quantized
        model.fingerprint_samples = [samples[name] for name in fingerprint_weights(cfg)]
    return model
