"""Strict loading of HF safetensors checkpoints into our Transformer.

The model is built on the meta device, already fused (one `qkv_proj`, one `gate_up_proj`), and each
checkpoint tensor is written straight into its final buffer (a fused projection's rows, or a buffer of its
own), converted to the caller's dtype one bounded chunk at a time (`shard_reader`). A weight that needs
neither conversion nor fusion, on the CPU, is used in place from the memory-mapped file (zero copy). So the
peak memory of a load is the final model plus one staging chunk. Keys must match exactly: a missing,
unexpected or wrongly shaped weight is an error naming the key and the file; shard paths must stay inside
the checkpoint directory.
"""
from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig, read_json
from .errors import CheckpointError
from .feature_draft import fingerprint_rows, fingerprint_weights
from .finite import check_finite
from .gguf import DEQUANT_CHUNK_ELEMENTS, load_gguf_model
from .quant import QuantRows, check_format, finish_loading, quantized_parameters
from .shard_reader import ShardReader
from .transformer import Transformer, fusion_layout

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _allowed_roots(path: str) -> list[str]:
    """Where shard files may really live: the checkpoint directory, and for a Hugging Face cache snapshot
    (`<repo>/snapshots/<revision>`, whose files are symlinks) that repository's `blobs` folder."""
    root = os.path.realpath(path)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    return roots


def _shard_path(path: str, index_path: str, key: str, shard) -> str:
    """The file of one index entry; refuses entries that are not relative paths inside the directory."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index_path}: weight_map entry for {key!r} is not a file name: {shard!r}")
    lexical = os.path.normpath(shard)
    if os.path.isabs(shard) or lexical == ".." or lexical.startswith(".." + os.sep):
        raise CheckpointError(f"{index_path}: shard {shard!r} (for {key!r}) is outside the checkpoint directory")
    file = os.path.join(path, lexical)
    real = os.path.realpath(file)
    if not _inside(path, real):
        raise CheckpointError(f"{index_path}: shard {shard!r} (for {key!r}) resolves to {real}, outside the "
                              f"checkpoint directory")
    return file


def _inside(path: str, real: str) -> bool:
    """Whether the resolved file `real` lies in one of the checkpoint `path`'s allowed roots."""
    return any(os.path.commonpath([root, real]) == root for root in _allowed_roots(path))


def weight_files(path: str) -> dict[str, list[str] | None]:
    """Map each safetensors file of the checkpoint to the keys it should hold (None: all of them)."""
    single = os.path.join(path, "model.safetensors")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        index = read_json(index_path, required=True)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{index_path}: missing key 'weight_map'")
        files: dict[str, list[str]] = {}
        for key, shard in index["weight_map"].items():
            files.setdefault(_shard_path(path, index_path, key, shard), []).append(key)
        return files
    if os.path.lexists(single):
        real = os.path.realpath(single)
        if not _inside(path, real):  # the rule for shards: a symlink may not lead out of the checkpoint
            raise CheckpointError(f"{single}: resolves to {real}, outside the checkpoint directory")
        return {single: None}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json found")


def load_model(path, dtype=None, device="cpu", fuse: bool = True, check_weights: bool = False,
               quantize: str | None = None) -> Transformer:
    """Load an HF checkpoint directory (Llama/Vicuna, Qwen3, GLM-4) into our Transformer.

    `fuse` (default) loads q/k/v and gate/up into fused projections: same numbers, fewer matmuls.
    `check_weights` scans every weight, after conversion to `dtype`, for NaN/inf and raises naming the file
    and key; the model's `weights_check_s` records the scan's seconds (None when not checked).
    `quantize` "int8" / "int4" keeps the linear weights (and the embedding, int8) quantized, each quantized
    a bounded chunk of rows at a time as it is read (models/quant.py); `dtype` is then the activations'.
    `dtype` None: float32, except that a quantized GGUF file keeps its blocks as stored (models/gguf.py)."""
    path = os.fspath(path)
    quantize = check_format(quantize)
    if path.endswith(".gguf") and not os.path.isdir(path):  # a llama.cpp file (models/gguf.py)
        return load_gguf_model(path, None if dtype is None else resolve_dtype(dtype), device, fuse, check_weights,
                               quantize)
    cfg = ModelConfig.from_dir(path)
    dtype = resolve_dtype("float32" if dtype is None else dtype)
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(cfg, fused=fuse)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = cfg.tie_word_embeddings
    if tied:
        params.pop("lm_head.weight")
    # checkpoint name -> (parameter it goes to, first row or None for the whole parameter, expected shape)
    layout = fusion_layout(cfg) if fuse else {}
    fused_names = {dst for dst, _, _ in layout.values()}
    placement = {name: (name, None, tuple(p.shape)) for name, p in params.items() if name not in fused_names}
    placement.update(layout)

    quantized = quantized_parameters(model, quantize) if quantize else {}
    rows: dict[str, QuantRows] = {}  # quantized parameter name -> its rows, filled as the parts are read
    final: dict[str, torch.Tensor] = {}  # parameter name -> its tensor (filled in place)
    origin: dict[str, str] = {}  # checkpoint name -> file
    samples = {}  # a quantized load: the fingerprint's sample of the weights (models/feature_draft.py)
    check_s = 0.0
    for file, keys in weight_files(path).items():
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: shard listed in model.safetensors.index.json does not exist" if keys
                                  is not None else f"{file}: broken symlink (its target does not exist)")
        try:
            with open(file, "rb"):  # the true reason a file cannot be read (safe_open says "No such file" for all)
                pass
            with safe_open(file, framework="pt", device="cpu") as f, ShardReader(file) as reader:
                present = set(f.keys())
                listed = present if keys is None else set(keys)
                for key in sorted(listed - present):
                    raise CheckpointError(f"{file}: key {key!r} listed in the index is not in the file")
                for key in sorted(present - listed):
                    raise CheckpointError(f"{file}: unexpected weight {key!r} (not listed in the index)")
                for key in sorted(present):
                    name = key[len("model."):] if key.startswith("model.") else key
                    if tied and name == "lm_head.weight":
                        continue  # HF ties it to the embedding anyway
                    if name not in placement:
                        raise CheckpointError(f"{file}: unexpected weight {key!r} for {cfg.family}")
                    if name in origin:
                        raise CheckpointError(f"{file}: weight {key!r} also defined in {origin[name]}")
                    mapped = f.get_tensor(key)  # memory-mapped: nothing is read until it is touched
                    if not mapped.is_floating_point():
                        raise CheckpointError(f"{file}: weight {key!r} has non-float dtype {mapped.dtype}")
                    param, row, shape = placement[name]
                    if tuple(mapped.shape) != shape:
                        raise CheckpointError(
                            f"{file}: weight {key!r} has shape {tuple(mapped.shape)}, expected {shape}")
                    if param in quantized:
                        if name in fingerprint_weights(cfg):  # as the file holds it, before quantizing
                            samples[name] = mapped[fingerprint_rows(shape[0])].float()
                        label = f"{file}: weight {key!r}"
                        if param not in rows:
                            rows[param] = QuantRows(quantized[param], tuple(params[param].shape), label, check_weights,
                                                    device)
                        step = max(1, DEQUANT_CHUNK_ELEMENTS // shape[1])
                        for first in range(0, shape[0], step):  # bounded float32 temporaries
                            rows[param].add_float((row or 0) + first, mapped[first: first + step].float(), label)
                        del mapped
                        origin[name] = file
                        continue
                    if row is None and mapped.dtype == dtype and device.type == "cpu":
                        final[param] = written = mapped  # zero copy
                    else:
                        if param not in final:
                            final[param] = torch.empty(params[param].shape, dtype=dtype, device=device)
                        written = final[param] if row is None else final[param][row: row + shape[0]]
                        reader.read_into(key, mapped.dtype, written)
                    del mapped
                    origin[name] = file
                    if check_weights:
                        check_s += check_finite(written, f"{file}: weight {key!r}")
        except SafetensorError as err:
            raise CheckpointError(f"{file}: cannot read safetensors file ({err})") from None
        except OSError as err:
            raise CheckpointError(f"{file}: cannot read ({err.strerror or err})") from None
    missing = sorted(set(placement) - set(origin))
    if missing:
        shown = ", ".join(repr("model." + m if m != "lm_head.weight" else m) for m in missing[:5])
        raise CheckpointError(f"{path}: missing weight(s) {shown}{' ...' if len(missing) > 5 else ''}")
    model = finish_loading(model, final, rows, tied, dtype, device, quantize, check_s if check_weights else None)
    if set(samples) == set(fingerprint_weights(cfg)):  # every sampled weight was quantized
        model.fingerprint_samples = [samples[name] for name in fingerprint_weights(cfg)]
    return model

