"""Loading GGUF files (llama.cpp's single-file format) into our Transformer.

`load_gguf_model(path, dtype)` reads the file's header (`GGUFFile`: metadata and tensor table; the large
tokenizer arrays are skipped unless asked for, where `gguf.GGUFReader` would hold ~100k small numpy arrays,
~160 MB for a 49k vocabulary), builds the config from its metadata (architectures llama, qwen2, qwen3;
others are refused by name), and reads every tensor from a read-only memory map of the file, a bounded chunk
of rows at a time, the chunk's file pages released as soon as it is read. By default on the CPU a quantized
file is loaded as stored: every tensor of a type models/ggml_blocks.py knows is decomposed into its exact
blocks a chunk at a time, and each chunk's whole 16-row tiles are packed straight into the weight's final
buffers (models/quant.py `QuantRows`), never dequantized, never held decomposed; so the peak memory of a load
is the model itself plus one chunk's temporaries (measured: peak 1.05x the file, the loaded model 1.03x, on
the 1.1 GB Qwen2.5-1.5B Q4_K_M file; docs/benchmarks/loader-memory.md). A float load (`dtype` given)
dequantizes each chunk with the `gguf` library's `gguf.quants.dequantize` (every type it can dequantize: F32,
F16, BF16, the Q types, the K-quants, the IQ types) straight into its final buffer in the caller's dtype; for
the GPU layout (`quantize="int4"` on CUDA), Q4_0, Q4_1 and Q4_K tensors are taken as int4 codes (`int4_codes`).
llama.cpp's converter permutes the rows of a llama model's Q and K projections (it rotates adjacent pairs, HF
rotates halves); `unpermute_rows` undoes that, on codes, scales and zeros (and decomposed blocks) alike. A file
without `output.weight` ties the head to the embedding.

A hostile or broken file is one CheckpointError naming the file and what is wrong, and no model is returned:
before any weight is read, a truncated header, counts and lengths larger than the bytes left, more than 4
dimensions, an unknown type id, a tensor larger than the file, starting past its end or cut off by its end, a
tensor named twice, metadata of the wrong kind (counts must be integers >= 1, ...), metadata that disagrees
with the tensors (each shape against the one the metadata makes, naming the keys; the layer count against the
layers present; the token list against the embedding's rows), an unsupported architecture, a missing tensor,
a type the gguf library cannot dequantize (each tensor's first row is read); while reading, always (not only
with `check_weights`), a non-finite value in a float tensor and a non-finite block scale (the float16 d / dmin
/ m fields, a small fraction of the bytes: with them finite, every weight of a block is).
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import re
import struct
from typing import NamedTuple

import numpy as np
import torch

from .config import ConfigKeys, ModelConfig, shown
from .errors import CheckpointError
from .feature_draft import fingerprint_rows, fingerprint_weights
from .finite import check_finite, count_non_finite
from .ggml_blocks import TYPES as BLOCK_TYPES
from .ggml_blocks import Decomposed, decompose, say_unsupported_types
from .quant import AS_STORED, QuantRows, finish_loading, quantized_parameters, release_freed_memory
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
MAX_ARRAY_NESTING = 8  # metadata arrays of arrays: deeper is a broken file (a deep recursion otherwise)
MAX_DIMS = 4  # GGML_MAX_DIMS
KV_LEAST_BYTES = 8 + 4 + 1  # a metadata entry: key length, value type, the smallest value
TENSOR_LEAST_BYTES = 8 + 4 + 4 + 8  # a tensor's entry: name length, dimension count, type, offset
FAULT_AROUND_BYTES = 1 << 16  # Linux maps up to this much around a page read from a file mapping
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's length


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
    """Sequential little-endian reads of a GGUF header from the file's bytes (`buf`: the file mapped, read in
    place: a tokenizer's 300k strings are skipped without a read call each); a short read is a truncated file.
    Every length and count is checked against the bytes the file has left before anything is read or allocated
    for it."""

    def __init__(self, buf, path: str, size: int):
        self.buf, self.path, self.size = buf, path, size
        self.pos = 0  # the next byte to read

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: cannot read GGUF file ({what})")

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int) -> bytes:
        if n > self.left():
            self.fail(f"file is truncated inside its header: {n} bytes wanted at byte {self.pos}, "
                      f"{self.left()} left")
        data = self.buf[self.pos:self.pos + n]
        self.pos += n
        return data

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings (a length, then its bytes) without decoding them."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _LENGTH.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.fail("file is truncated inside its header")
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            self.fail(f"file is truncated inside its header: a string ends at byte {pos}, the file has {size}")
        self.pos = pos

    def count(self, n: int, item_bytes: int, what: str) -> int:
        """`n` items of at least `item_bytes` bytes each, refused where the rest of the file cannot hold them."""
        if n * item_bytes > self.left():
            self.fail(f"file is truncated inside its header, or a count is wrong: an array of {n} {what}, more than "
                      f"the {self.left()} bytes left can hold")
        return n

    def scalar(self, kind: int):
        fmt = _SCALARS.get(kind)
        if fmt is None:
            self.fail(f"unknown metadata value type {kind}")
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        data = self.take(self.scalar(10))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.fail("a string is not UTF-8")

    def value(self, kind: int, keep: bool, depth: int = 0):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(kind)
        if depth >= MAX_ARRAY_NESTING:
            self.fail(f"metadata arrays nested more than {MAX_ARRAY_NESTING} deep")
        item = self.scalar(4)
        if item not in _SCALARS and item not in (_STRING, _ARRAY):
            self.fail(f"unknown metadata value type {item}")
        least = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8 if item == _STRING else 12  # bytes an item
        count = self.count(self.scalar(10), least, "items")
        keep = keep or count <= ARRAY_KEEP_LIMIT
        if item in _SCALARS:
            raw = self.take(struct.calcsize(_SCALARS[item]) * count)
            return np.frombuffer(raw, dtype=np.dtype(_SCALARS[item])).tolist() if keep else SkippedArray(count)
        if item == _STRING and not keep:
            self.skip_strings(count)
            return SkippedArray(count)
        items = [self.value(item, keep, depth + 1) for _ in range(count)]
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
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
                try:
                    infos, start = self._read_header(_Header(buf, path, size), arrays)
                finally:
                    if size:
                        buf.close()
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read GGUF file ({err.strerror or err})") from None
        self.tensors = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise CheckpointError(f"{path}: tensor {name!r} appears twice in the tensor table")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise CheckpointError(f"{path}: tensor {name!r} has unknown quantization type {raw_type}") from None
            if not dims or dims[0] % block:
                raise CheckpointError(f"{path}: tensor {name!r} has row length {dims[0] if dims else None}, not a "
                                      f"multiple of {qtype.name}'s block of {block}")
            nbytes = math.prod(dims) * type_size // block  # exact (Python integers): dimensions may be hostile
            shape = tuple(reversed(dims))
            if nbytes > size:
                raise CheckpointError(f"{path}: tensor {name!r} of shape {shape} ({qtype.name}) needs {nbytes} "
                                      f"bytes, more than the whole file ({size} bytes)")
            if start + offset >= size and nbytes:
                raise CheckpointError(f"{path}: tensor {name!r} starts at byte {start + offset}, past the end of "
                                      f"the file ({size} bytes)")
            if start + offset + nbytes > size:
                raise CheckpointError(f"{path}: file is truncated: tensor {name!r} ends at byte "
                                      f"{start + offset + nbytes}, the file has {size}")
            self.tensors.append(TensorInfo(name, dims, qtype, start + offset, nbytes))
        self.data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def _read_header(self, h: _Header, arrays) -> tuple[list, int]:
        """The metadata (into `self.metadata`), the tensor table [(name, dims, type id, offset)] and the byte
        where the tensor data begins."""
        if h.take(4) != GGUF_MAGIC:
            h.fail("not a GGUF file: bad magic")
        version = h.scalar(4)
        if version not in (2, 3):
            h.fail(f"version {version}; only 2 and 3, little-endian")
        n_tensors, n_kv = h.scalar(10), h.scalar(10)
        if n_tensors * TENSOR_LEAST_BYTES + n_kv * KV_LEAST_BYTES > h.left():
            h.fail(f"file is truncated inside its header, or its counts are wrong: it declares {n_tensors} tensors "
                   f"and {n_kv} metadata entries, more than the {h.left()} bytes left can hold")
        self.metadata = {}
        for _ in range(n_kv):
            key = h.string()
            self.metadata[key] = h.value(h.scalar(4), key in arrays)
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            n_dims = h.scalar(4)
            if n_dims > MAX_DIMS:
                h.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
            dims = tuple(h.scalar(10) for _ in range(n_dims))
            infos.append((name, dims, h.scalar(4), h.scalar(10)))
        alignment = self.metadata.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 \
                or alignment & (alignment - 1):
            raise CheckpointError(f"{self.path}: GGUF metadata general.alignment is {alignment!r}, not a power of 2")
        return infos, -(-h.pos // alignment) * alignment  # tensor data begins at the next aligned byte

    def raw_rows(self, t: TensorInfo, first: int, last: int) -> np.ndarray:
        """Rows first..last-1 of tensor `t` as stored: uint8 [rows, bytes per row]."""
        row_bytes = t.nbytes // max(1, math.prod(t.dims[1:]))
        return self.data[t.offset + first * row_bytes: t.offset + last * row_bytes].reshape(-1, row_bytes)

    def release(self, t: TensorInfo, first: int = 0, last: int | None = None) -> None:
        """Drop the file pages of tensor `t`'s rows first..last-1 (default: all of it) from this process's memory
        (read again from the file, or the page cache, if touched again): a chunk's pages once it is read."""
        mapped = getattr(self.data, "_mmap", None)
        if mapped is None or not hasattr(mapped, "madvise"):
            return
        row_bytes = t.nbytes // max(1, math.prod(t.dims[1:]))
        # the kernel maps the pages around each one read (fault-around, 64 KiB): they go too, neighbours' or not
        start = max(0, t.offset + first * row_bytes - FAULT_AROUND_BYTES)
        end = t.offset + (t.nbytes if last is None else last * row_bytes) + FAULT_AROUND_BYTES
        page = mmap.PAGESIZE
        start = start // page * page
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, min(len(mapped), end) - start)
        except (OSError, ValueError):
            pass  # only an optimisation

    def release_all(self) -> None:
        """Drop every file page this process holds (the kernel maps pages around each one touched: the first
        rows read to check each tensor's type bring in ~64 KiB each)."""
        mapped = getattr(self.data, "_mmap", None)
        if mapped is not None and hasattr(mapped, "madvise") and len(mapped):
            try:
                mapped.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass  # only an optimisation


def open_gguf(path: str, arrays=()) -> GGUFFile:
    return GGUFFile(os.fspath(path), arrays)


def config_from_metadata(meta: dict, path: str) -> ModelConfig:
    """Our ModelConfig from GGUF metadata (`{arch}.block_count`, `.embedding_length`, ...). Every value used is
    checked for its kind and range (counts integers >= 1, real numbers finite and > 0): one line naming the
    file and the key otherwise."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {list(ARCHITECTURES)}")
    keys = ConfigKeys(meta, f"{path}: GGUF metadata")

    def need(key):
        if meta.get(f"{arch}.{key}") is None:
            raise CheckpointError(f"{path}: missing GGUF metadata key {arch}.{key!r}")
        return keys.count(f"{arch}.{key}")

    if meta.get(f"{arch}.attention.layer_norm_rms_epsilon") is None:
        raise CheckpointError(f"{path}: missing GGUF metadata key {arch}.'attention.layer_norm_rms_epsilon'")
    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = keys.count(f"{arch}.attention.head_count_kv", default=heads)
    head_dim = keys.count(f"{arch}.attention.key_length", default=0) or None
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.embedding_length {hidden} is not a multiple of "
                                  f"{arch}.attention.head_count {heads}, and there is no {arch}.attention.key_length")
        head_dim = hidden // heads
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raise CheckpointError(f"{path}: partial rotary ({arch}.rope.dimension_count {rotary!r} of head_dim "
                              f"{head_dim}) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = 1.0
    if scaling == "linear":
        factor = keys.real(f"{arch}.rope.scaling.factor", 1.0)
    elif scaling not in ("none", None):
        raise CheckpointError(f"{path}: rope scaling {scaling!r} is not supported (only none and linear)")
    if heads % kv_heads:
        raise CheckpointError(f"{path}: head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    if meta.get(f"{arch}.vocab_size") is not None:
        vocab = keys.count(f"{arch}.vocab_size")
    else:  # older files: the vocabulary's length
        tokens = meta.get("tokenizer.ggml.tokens")  # a SkippedArray keeps its length
        if not isinstance(tokens, (list, SkippedArray)) or not len(tokens):
            raise CheckpointError(f"{path}: no {arch}.vocab_size and no tokenizer.ggml.tokens in the metadata")
        vocab = len(tokens)
    special = {}
    for name in ("bos", "eos"):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
            raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.{name}_token_id is {shown(value)}, not a "
                                  f"token id of the vocabulary of {vocab}")
        special[name] = value
    return ModelConfig(
        family="qwen3" if arch == "qwen3" else "llama",  # qwen2 is llama with q/k/v biases
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=keys.real(f"{arch}.attention.layer_norm_rms_epsilon", 0.0),
        rope_theta=keys.real(f"{arch}.rope.freq_base", 10000.0),
        rope_linear_factor=factor,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_word_embeddings=False,  # set by `read_tensors` from whether output.weight is present
        max_position_embeddings=keys.count(f"{arch}.context_length", default=4096),
        bos_token_id=special["bos"],
        eos_token_ids=() if special["eos"] is None else (special["eos"],),
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
                why = f" ({self.arch}.block_count is {cfg.num_layers})" if name is not None else ""
                raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for GGUF architecture "
                                      f"{self.arch!r}{why}")
            self.names[name] = t
        layers = {int(name.split(".")[1]) for name in self.names if name.startswith("layers.")}
        if cfg.num_layers > len(layers):  # before a model of that many layers is built, even on the meta device
            raise CheckpointError(f"{path}: GGUF metadata {self.arch}.block_count is {cfg.num_layers}, but the file "
                                  f"has tensors for {len(layers)} layer(s)")
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
                raise CheckpointError(f"{path}: tensor {self.names[name].name!r} has shape {shape}, but the metadata "
                                      f"makes it {expected[name]} ({self._shape_reason(name)})")
        missing = sorted(set(expected) - set(self.names))
        if missing:
            shown = ", ".join(repr(gguf_name(m)) for m in missing[:5])
            raise CheckpointError(f"{path}: missing tensor(s) {shown}{' ...' if len(missing) > 5 else ''}")
        tokens = self.file.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, (list, SkippedArray)) and len(tokens) != self.cfg.vocab_size:
            raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.tokens has {len(tokens)} tokens, but tensor "
                                  f"'token_embd.weight' has {self.cfg.vocab_size} rows (one per token)")
        for name in self.names:  # dequantize every tensor's first row: a type the library cannot read fails here
            self._rows(name, 0, 1)
        self.file.release_all()

    def _shape_reason(self, name: str) -> str:
        """Which metadata values make weight `name`'s expected shape (for a message)."""
        a, c, meta = self.arch, self.cfg, self.file.metadata
        source = f"{a}.vocab_size" if meta.get(f"{a}.vocab_size") is not None else "tokenizer.ggml.tokens"
        vocab = f"a vocabulary of {c.vocab_size} from {source}"
        hidden = f"{a}.embedding_length {c.hidden_size}"
        ffn = f"{a}.feed_forward_length {c.intermediate_size}"
        q = f"{a}.attention.head_count {c.num_heads} x head dim {c.head_dim}"
        kv = f"{a}.attention.head_count_kv {c.num_kv_heads} x head dim {c.head_dim}"
        module = name.rsplit(".", 2)[-2]  # embed_tokens, q_proj, input_layernorm, ...
        reasons = {"embed_tokens": [vocab, hidden], "lm_head": [vocab, hidden], "q_proj": [q, hidden],
                   "k_proj": [kv, hidden], "v_proj": [kv, hidden], "o_proj": [hidden, q], "gate_proj": [ffn, hidden],
                   "up_proj": [ffn, hidden], "down_proj": [hidden, ffn], "q_norm": [f"head dim {c.head_dim}"],
                   "k_norm": [f"head dim {c.head_dim}"]}.get(module, [hidden])
        return ", ".join(reasons[:1] if name.endswith(".bias") else reasons)

    def _refuse_non_finite(self, name: str, values: torch.Tensor, rows: tuple[int, int] | None,
                           what: str = "value(s)") -> None:
        """Raise CheckpointError naming the file and tensor where `values` (of tensor `name`'s rows `rows`, as
        the file holds them: its float values, or its blocks' float16 scales) are not all finite."""
        bad = count_non_finite(values)
        if bad:
            t = self.names[name]
            where = "" if rows is None or len(self.shape(name)) < 2 else f" in rows {rows[0]}..{rows[1] - 1}"
            raise CheckpointError(f"{self.path}: tensor {t.name!r} ({t.qtype.name}) has {bad} non-finite "
                                  f"{what} (NaN/inf){where}")

    def block_type(self, name: str, fmt: str) -> str:
        """The block type weight `name` takes in a `QuantRows` of `fmt` on the CPU: its own where
        models/ggml_blocks.py knows it (as stored), else the type float rows are quantized to."""
        qtype = self.names[name].qtype.name
        return qtype if qtype in BLOCK_TYPES else QuantRows.float_type(fmt)

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
            with np.errstate(all="ignore"):  # a non-finite scale is refused by name (`_refuse_non_finite`)
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
            values = torch.from_numpy(self._rows(name, 0, 1))  # [1, length] float32
            self._refuse_non_finite(name, values, None)
            out.copy_(values.reshape(shape))
            self.file.release(self.names[name])
            return
        for first, last, heads in self._chunks(name):
            block = torch.from_numpy(self._rows(name, first, last))  # [rows, cols] float32
            self._refuse_non_finite(name, block, (first, last))
            if heads is not None:
                block = unpermute_rows(block, heads)
            out[first: last].copy_(block)
            self.file.release(self.names[name], first, last)

    def read_quantized(self, name: str, rows: QuantRows, offset: int = 0, label: str | None = None) -> None:
        """Weight `name` into the quantized rows `rows` from row `offset` on (a fused projection's part). On the
        CPU (`rows.blocks`) every block type of models/ggml_blocks.py as stored, decomposed a bounded chunk of
        rows at a time (never dequantized); for the GPU layout, Q4_0, Q4_1 and Q4_K blocks as stored when
        `rows` is int4. Any other type is dequantized a bounded chunk at a time and quantized."""
        t = self.names[name]
        if rows.blocks and t.qtype.name in BLOCK_TYPES:
            for first, last, heads in self._chunks(name):
                parts = decompose(self.file.raw_rows(t, first, last), t.qtype.name)
                for field in parts:  # the blocks' float16 scales (d, dmin / m): every weight is finite if they are
                    if field is not None and field.is_floating_point():
                        self._refuse_non_finite(name, field.float(), (first, last), "block scale(s)")
                if heads is not None:
                    parts = Decomposed(*(None if p is None else unpermute_rows(p, heads) for p in parts))
                rows.add_blocks(offset + first, parts, t.qtype.name, label)
                self.file.release(t, first, last)
            return
        as_stored = rows.fmt == "int4" and t.qtype.name in INT4_AS_STORED
        for first, last, heads in self._chunks(name):
            if as_stored:
                parts = int4_codes(self.file.raw_rows(t, first, last), t.qtype.name)  # codes [r, K], scales, zeros
                for field in parts[1:]:  # float32 [r, K/32], from the blocks' float16 d (and m / dmin)
                    self._refuse_non_finite(name, field, (first, last), "block scale(s)")
            else:
                parts = (torch.from_numpy(self._rows(name, first, last)),)  # [r, K] float32
                self._refuse_non_finite(name, parts[0], (first, last))
            if heads is not None:
                parts = tuple(unpermute_rows(p, heads) for p in parts)
            if as_stored:
                rows.add_codes(offset + first, *parts, label=label)
            else:
                rows.add_float(offset + first, parts[0], label)
            self.file.release(t, first, last)

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
    int4). Non-finite values and block scales as the file holds them are always refused (the module docstring);
    `check_weights` also scans the weights as loaded (a float16 load's overflow) and records the scan's seconds."""
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
        say_unsupported_types(path, [t.qtype.name for t in weights.names.values()])  # one line naming them
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
                types = [((placement[n][1] or 0), weights.shape(n)[0], weights.block_type(n, quantized[param]))
                         for n in weights.names if placement[n][0] == param]  # (first row, rows, type) of each part
                rows[param] = QuantRows(quantized[param], tuple(params[param].shape), label, check_weights, device,
                                        types)
            weights.read_quantized(name, rows[param], row or 0, label)
            release_freed_memory()  # the chunks' temporaries: glibc would keep up to 64 MiB of them
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
