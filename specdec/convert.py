"""Convert a GGUF file to an HF-format checkpoint directory that our loader and transformers both read.

    python -m specdec.convert model.gguf OUT_DIR [--dtype float32|bfloat16|float16|float64]

Writes model.safetensors (the dequantized weights, Q/K rows in HF's order, `model.`-prefixed names;
no lm_head.weight when the embedding is tied), config.json, generation_config.json, tokenizer.json,
tokenizer_config.json (special tokens and the chat template). OUT_DIR must not exist or be empty; the files
are written to a temporary directory beside it and moved into place only when all of them are written.
The whole model is held in memory once (safetensors writes one file from a dict of tensors).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from specdec.flags import Parser
from specdec.models import CheckpointError
from specdec.models.gguf import GGUFTensors
from specdec.models.gguf_tokenizer import build_gguf_tokenizer
from specdec.models.loader import DTYPES, resolve_dtype

HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                    "qwen3": ("Qwen3ForCausalLM", "qwen3")}


def hf_config(weights: GGUFTensors, tokenizer_cfg: dict, tok, dtype_name: str) -> dict:
    """config.json for the GGUF file's model."""
    cfg = weights.cfg
    architecture, model_type = HF_ARCHITECTURES[weights.arch]
    ids = {f"{key}_token_id": tok.token_to_id(tokenizer_cfg[f"{key}_token"])
           for key in ("bos", "eos", "pad") if f"{key}_token" in tokenizer_cfg}
    raw = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "mlp_bias": False, "dtype": dtype_name, **ids,
    }
    if cfg.rope_linear_factor != 1.0:
        raw["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_linear_factor}
    return raw


def convert(gguf_path: str, out_dir: str, dtype="float32") -> str:
    """Write the HF directory for `gguf_path` at `out_dir` (see the module docstring); returns out_dir."""
    from safetensors.torch import save_file

    gguf_path, out_dir = os.fspath(gguf_path), os.fspath(out_dir)
    torch_dtype = resolve_dtype(dtype)
    dtype_name = next(name for name, d in DTYPES.items() if d == torch_dtype)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointError(f"{out_dir}: output directory exists and is not empty")
    weights = GGUFTensors(gguf_path)
    tok, tokenizer_cfg = build_gguf_tokenizer(gguf_path)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would stay on the renamed directory
    try:
        tensors = {(name if name == "lm_head.weight" else "model." + name): weights.read(name, torch_dtype)
                   for name in sorted(weights.names)}
        save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        del tensors
        config = hf_config(weights, tokenizer_cfg, tok, dtype_name)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                      "model_max_length": weights.cfg.max_position_embeddings, **tokenizer_cfg}
        tok.save(os.path.join(staging, "tokenizer.json"))
        for name, content in (("config.json", config), ("generation_config.json", generation),
                              ("tokenizer_config.json", tok_config)):
            with open(os.path.join(staging, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2, ensure_ascii=False)
                f.write("\n")
        for name in os.listdir(staging):  # safetensors writes its file 0600
            os.chmod(os.path.join(staging, name), 0o666 & ~umask)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m specdec.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", help="the .gguf file to convert (architectures llama, qwen2, qwen3)")
    parser.add_argument("out_dir", help="the HF checkpoint directory to write (must not exist, or be empty)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="dtype of the written weights (default float32; GGUF weights are dequantized to it)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        convert(args.gguf, args.out_dir, args.dtype)
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        print(f"specdec.convert: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
