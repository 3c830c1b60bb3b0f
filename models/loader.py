"""Strict loading of HF safetensors checkpoints into our Transformer.

The model is built on the meta device and every tensor is assigned straight from its shard (each shard
opened once), converted to the caller's dtype: no second copy of the weights in memory. Keys must match
exactly: a missing, unexpected or wrongly shaped weight is an error naming the key and the file.
"""
from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig, read_json
from .errors import CheckpointError
from .transformer import Transformer

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def weight_files(path: str) -> dict[str, list[str]]:
    """Map each safetensors file of the checkpoint to the keys it should hold (None: all of them)."""
    single = os.path.join(path, "model.safetensors")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        index = read_json(index_path, required=True)
        if "weight_map" not in index:
            raise CheckpointError(f"{index_path}: missing key 'weight_map'")
        files: dict[str, list[str]] = {}
        for key, shard in index["weight_map"].items():
            files.setdefault(os.path.join(path, shard), []).append(key)
        return files
    if os.path.exists(single):
        return {single: None}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json found")


def load_model(path, dtype="float32", device="cpu", fuse: bool = True) -> Transformer:
    """Load an HF checkpoint directory (Llama/Vicuna, Qwen3, GLM-4) into our Transformer.

    `fuse` (default) merges q/k/v and gate/up projections after loading: same numbers, fewer matmuls."""
    path = os.fspath(path)
    cfg = ModelConfig.from_dir(path)
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    tied = cfg.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight")

    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file, keys in weight_files(path).items():
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: shard listed in model.safetensors.index.json does not exist")
        try:
            with safe_open(file, framework="pt", device=str(device)) as f:
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
                    if name not in expected:
                        raise CheckpointError(f"{file}: unexpected weight {key!r} for {cfg.family}")
                    if name in state:
                        raise CheckpointError(f"{file}: weight {key!r} also defined in {origin[name]}")
                    tensor = f.get_tensor(key)
                    if not tensor.is_floating_point():
                        raise CheckpointError(f"{file}: weight {key!r} has non-float dtype {tensor.dtype}")
                    if tuple(tensor.shape) != tuple(expected[name]):
                        raise CheckpointError(
                            f"{file}: weight {key!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}"
                        )
                    state[name] = tensor.to(dtype)
                    origin[name] = file
        except SafetensorError as err:
            raise CheckpointError(f"{file}: cannot read safetensors file ({err})") from None
        except OSError as err:
            raise CheckpointError(f"{file}: cannot read ({err})") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(repr("model." + m if m != "lm_head.weight" else m) for m in missing[:5])
        raise CheckpointError(f"{path}: missing weight(s) {shown}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    if fuse:
        model.fuse_()
    return model.eval()


def load_generation_config(path: str) -> dict:
    return read_json(os.path.join(os.fspath(path), "generation_config.json"), required=False) or {}
