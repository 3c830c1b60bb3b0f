"""Every way a checkpoint directory can be wrong gives a `CheckpointError` that names the file or the key.

One good tiny Llama checkpoint (and one sharded one) is built per module; each test copies it and breaks
the copy in one way.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from checkpoints import build_hf_model, save_checkpoint
from safetensors.torch import load_file, save_file

from specdec.models import CheckpointError, ModelConfig, load_model

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Paths of a good single-file and a good sharded tiny Llama checkpoint, and a Qwen3 one."""
    root = tmp_path_factory.mktemp("good")
    hf = build_hf_model("llama", seed=0)
    qwen = build_hf_model("qwen3", seed=0)
    return {
        "single": save_checkpoint(hf, root / "single"),
        "sharded": save_checkpoint(hf, root / "sharded", max_shard_size="20KB"),
        "qwen3": save_checkpoint(qwen, root / "qwen3"),
    }


@pytest.fixture
def ckpt(good, tmp_path):
    """A fresh copy of one of the good checkpoints: ckpt("single") -> path."""

    def copy(kind="single"):
        dst = tmp_path / kind
        shutil.copytree(good[kind], dst)
        return str(dst)

    return copy


def edit_config(path, edit):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    edit(raw)
    with open(cfg_path, "w") as f:
        json.dump(raw, f)


def rewrite_weights(path, edit):
    """Load model.safetensors, apply edit(dict of tensors), save it back."""
    file = os.path.join(path, SINGLE)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def named(path: str, *more: str) -> str:
    """A `match=` pattern: the message contains `path` (escaped), then each of `more` (escaped)."""
    return ".*".join(re.escape(p) for p in (path, *more))


def test_good_checkpoints_load(good):
    for path in good.values():
        load_model(path)


# --------------------------------------------------------------------------- directory and config.json


def test_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=named(missing, "does not exist")):
        load_model(missing)


def test_missing_config_json(ckpt):
    path = ckpt()
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match=named(os.path.join(path, "config.json"), "not found")):
        load_model(path)


def test_bad_json(ckpt):
    path = ckpt()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(CheckpointError, match=named(os.path.join(path, "config.json"), "JSON")):
        load_model(path)


def test_bad_generation_config_json(ckpt):
    path = ckpt()
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write("not json")
    with pytest.raises(CheckpointError, match=named(os.path.join(path, "generation_config.json"), "JSON")):
        load_model(path)


def test_unknown_architecture(ckpt):
    path = ckpt()
    edit_config(path, lambda raw: raw.update(architectures=["MistralForCausalLM"], model_type="mistral"))
    with pytest.raises(CheckpointError, match=named("config.json", "MistralForCausalLM")):
        load_model(path)


def test_no_architectures_key(ckpt):
    path = ckpt()
    edit_config(path, lambda raw: raw.pop("architectures"))
    with pytest.raises(CheckpointError, match=named("config.json", "architectures")):
        load_model(path)


def test_remote_code_chatglm(ckpt):
    path = ckpt()
    edit_config(path, lambda raw: raw.update(
        architectures=["ChatGLMModel"], model_type="chatglm",
        auto_map={"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                  "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"}))
    with pytest.raises(CheckpointError, match=named("config.json", "remote-code", "chatglm")):
        load_model(path)


def test_remote_code_auto_map_with_known_architecture(ckpt):
    """auto_map means custom modelling code even under a familiar architecture name."""
    path = ckpt()
    edit_config(path, lambda raw: raw.update(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}))
    with pytest.raises(CheckpointError, match=named("config.json", "remote-code")):
        load_model(path)


def test_sliding_window_qwen3(ckpt):
    path = ckpt("qwen3")
    load_model(path)  # sliding_window null, use_sliding_window false: fine
    edit_config(path, lambda raw: raw.update(use_sliding_window=True, sliding_window=4096))
    with pytest.raises(CheckpointError, match=named("config.json", "sliding")):
        load_model(path)


def test_sliding_window_llama(ckpt):
    path = ckpt()
    edit_config(path, lambda raw: raw.update(sliding_window=4096))
    with pytest.raises(CheckpointError, match=named("config.json", "sliding")):
        load_model(path)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 512},
    {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
])
def test_unsupported_rope_type(ckpt, rope):
    path = ckpt()
    edit_config(path, lambda raw: raw.update(rope_parameters=rope))
    with pytest.raises(CheckpointError, match=named("config.json", repr(rope["rope_type"]))):
        load_model(path)


def test_unsupported_rope_type_legacy_rope_scaling(ckpt):
    path = ckpt()
    edit_config(path, lambda raw: (raw.pop("rope_parameters"),
                                   raw.update(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0})))
    with pytest.raises(CheckpointError, match=named("config.json", "'yarn'")):
        load_model(path)


def test_unsupported_activation(ckpt):
    path = ckpt()
    edit_config(path, lambda raw: raw.update(hidden_act="gelu"))
    with pytest.raises(CheckpointError, match=named("config.json", "gelu")):
        load_model(path)


def test_missing_required_config_key(ckpt):
    path = ckpt()
    edit_config(path, lambda raw: raw.pop("hidden_size"))
    with pytest.raises(CheckpointError, match=named("config.json", "'hidden_size'")):
        ModelConfig.from_dir(path)


# --------------------------------------------------------------------------- weights


def test_missing_weight(ckpt):
    path = ckpt()
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=named(path, "missing", "'model.layers.1.self_attn.k_proj.weight'")):
        load_model(path)


def test_missing_lm_head_untied(ckpt):
    path = ckpt()
    rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=named(path, "missing", "'lm_head.weight'")):
        load_model(path)


def test_extra_weight(ckpt):
    path = ckpt()
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.extra": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=named(os.path.join(path, SINGLE), "unexpected",
                                                   "'model.layers.0.self_attn.rotary_emb.extra'")):
        load_model(path)


def test_wrongly_shaped_weight(ckpt):
    path = ckpt()
    key = "model.layers.2.mlp.up_proj.weight"
    rewrite_weights(path, lambda t: t.update({key: t[key][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=named(os.path.join(path, SINGLE), repr(key), "shape")):
        load_model(path)


def test_truncated_safetensors(ckpt):
    path = ckpt()
    file = os.path.join(path, SINGLE)
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=named(file)):
        load_model(path)


def test_garbage_safetensors(ckpt):
    path = ckpt()
    file = os.path.join(path, SINGLE)
    with open(file, "wb") as f:
        f.write(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=named(file)):
        load_model(path)


def test_missing_safetensors_file(ckpt):
    path = ckpt()
    os.remove(os.path.join(path, SINGLE))
    with pytest.raises(CheckpointError, match=named(path, SINGLE)):
        load_model(path)


# --------------------------------------------------------------------------- sharded


def test_shard_listed_in_index_absent(ckpt):
    path = ckpt("sharded")
    with open(os.path.join(path, INDEX)) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match=named(os.path.join(path, shard), "index")):
        load_model(path)


def test_index_names_key_absent_from_shard(ckpt):
    path = ckpt("sharded")
    index_path = os.path.join(path, INDEX)
    with open(index_path) as f:
        index = json.load(f)
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.0.mlp.bias_that_is_not_there"] = shard
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match=named(os.path.join(path, shard),
                                                   "'model.layers.0.mlp.bias_that_is_not_there'")):
        load_model(path)


def test_index_without_weight_map(ckpt):
    path = ckpt("sharded")
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(CheckpointError, match=named(os.path.join(path, INDEX), "'weight_map'")):
        load_model(path)


def test_index_bad_json(ckpt):
    path = ckpt("sharded")
    with open(os.path.join(path, INDEX), "w") as f:
        f.write("{")
    with pytest.raises(CheckpointError, match=named(os.path.join(path, INDEX), "JSON")):
        load_model(path)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)
