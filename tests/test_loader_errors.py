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
    """Paths of a good single-file and a good sharded tiny Llama checkpoint, a Qwen3 and a GLM-4 one."""
    root = tmp_path_factory.mktemp("good")
    hf = build_hf_model("llama", seed=0)
    qwen = build_hf_model("qwen3", seed=0)
    glm = build_hf_model("glm4", seed=0)
    return {
        "single": save_checkpoint(hf, root / "single"),
        "sharded": save_checkpoint(hf, root / "sharded", max_shard_size="20KB"),
        "qwen3": save_checkpoint(qwen, root / "qwen3"),
        "glm4": save_checkpoint(glm, root / "glm4"),
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
    """Each good checkpoint loads into a model that decodes (finite logits over its vocabulary), and the
    sharded copy of the Llama holds exactly the single file's weights."""
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    logits = {}
    for name, path in good.items():
        model = load_model(path, dtype="float64")
        cache = model.new_cache(1, 8)
        cache.set_prefill([ids.shape[1]], ids.shape[1])
        logits[name] = model.forward(ids, cache)  # [1, T, V]
        assert logits[name].shape == (1, ids.shape[1], model.vocab_size), name
        assert torch.isfinite(logits[name]).all(), name
    assert torch.equal(logits["single"], logits["sharded"])


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


def test_no_architectures_key_uses_model_type(ckpt):
    """As in transformers: without `architectures`, a supported `model_type` says what the model is."""
    path = ckpt()
    reference = load_model(path, dtype="float64")
    edit_config(path, lambda raw: raw.pop("architectures"))
    model = load_model(path, dtype="float64")
    assert model.cfg == reference.cfg and model.cfg.family == "llama"
    edit_config(path, lambda raw: raw.update(model_type="mistral"))
    with pytest.raises(CheckpointError, match=named("config.json", "architectures", "'mistral'")):
        load_model(path)
    edit_config(path, lambda raw: raw.pop("model_type"))
    with pytest.raises(CheckpointError, match=named("config.json", "architectures", "model_type")):
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


# --------------------------------------------------------------------------- shard paths (issue 12, defect 8)


def _move_shard_out(path, tmp_path, make_entry):
    """Move one shard of a sharded checkpoint to a folder beside it and point the index at it via make_entry."""
    index_path = os.path.join(path, INDEX)
    with open(index_path) as f:
        index = json.load(f)
    shard = index["weight_map"]["model.norm.weight"]
    outside = tmp_path / "elsewhere"
    outside.mkdir(exist_ok=True)
    shutil.move(os.path.join(path, shard), outside / shard)
    entry = make_entry(str(outside / shard), shard)
    index["weight_map"] = {k: (entry if v == shard else v) for k, v in index["weight_map"].items()}
    with open(index_path, "w") as f:
        json.dump(index, f)
    return index_path, shard


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_shard_path_leaving_the_directory_is_refused(ckpt, tmp_path, kind):
    path = ckpt("sharded")
    make = (lambda abs_path, shard: f"../elsewhere/{shard}") if kind == "dotdot" else (lambda abs_path, shard: abs_path)
    index_path, shard = _move_shard_out(path, tmp_path, make)
    with pytest.raises(CheckpointError, match=named(index_path, shard, "outside the checkpoint directory")):
        load_model(path)


def test_shard_symlink_pointing_out_is_refused(ckpt, tmp_path):
    path = ckpt("sharded")
    index_path, shard = _move_shard_out(path, tmp_path, lambda abs_path, shard: shard)
    os.symlink(tmp_path / "elsewhere" / shard, os.path.join(path, shard))
    with pytest.raises(CheckpointError, match=named(index_path, shard, "outside the checkpoint directory")):
        load_model(path)


def test_symlinks_inside_the_directory_and_hf_cache_blobs_load(good, tmp_path):
    """Symlinked shards are fine when they stay inside: in the directory itself, or in the blobs folder of a
    Hugging Face cache snapshot (`<repo>/snapshots/<rev>/*` -> `../../blobs/<hash>`)."""
    repo = tmp_path / "models--x--y"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(sorted(os.listdir(good["sharded"]))):
        shutil.copy(os.path.join(good["sharded"], name), blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    reference = load_model(good["sharded"], dtype="float64")
    model = load_model(snapshot, dtype="float64")
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- fused, in-place loading (defect 7)


@pytest.mark.parametrize("kind", ["single", "sharded", "qwen3", "glm4"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_loaded_weights_are_the_files_converted(good, monkeypatch, kind, dtype):
    """Every parameter, fused or not, holds exactly the file's tensors converted to `dtype` (q/k/v and gate/up
    stacked in order), also when conversions go through many small staging chunks."""
    from specdec.models import shard_reader

    monkeypatch.setattr(shard_reader, "STAGING_BYTES", 80)  # 20 float32 values per chunk: rows split across chunks
    path = good[kind]
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    tensors = {}
    for file in files:
        tensors.update({k.removeprefix("model."): v for k, v in load_file(file).items()})
    model = load_model(path, dtype=dtype)
    target = getattr(torch, dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    for i in range(model.cfg.num_layers):
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
            for kind_ in ("weight", "bias"):
                names = [f"layers.{i}.{fused.split('.')[0]}.{p}.{kind_}" for p in parts]
                if all(n in tensors for n in names):
                    tensors[f"layers.{i}.{fused}.{kind_}"] = torch.cat([tensors.pop(n) for n in names])
    if model.cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    assert set(params) == set(tensors)
    for name, p in params.items():
        assert p.dtype == target and torch.equal(p, tensors[name].to(target)), name


# --------------------------------------------------------------------------- --check-weights (defect 1, at load)


def test_check_weights_names_a_nan_weight(ckpt):
    path = ckpt()
    key = "model.layers.1.self_attn.v_proj.weight"

    def poison(tensors):
        tensors[key][3, 5] = float("nan")
        tensors[key][0, 0] = float("inf")

    rewrite_weights(path, poison)
    load_model(path)  # not checked: loads (the runtime guards against non-finite logits)
    with pytest.raises(CheckpointError, match=named(os.path.join(path, SINGLE), repr(key), "2 non-finite")):
        load_model(path, check_weights=True)


def test_check_weights_catches_overflow_of_the_conversion(ckpt):
    """A finite float32 weight too large for float16 becomes inf only after conversion: checked as loaded."""
    path = ckpt()
    key = "model.layers.0.mlp.down_proj.weight"
    rewrite_weights(path, lambda t: t[key].__setitem__((0, 0), 1e6))
    model = load_model(path, dtype="float32", check_weights=True)
    assert model.weights_check_s is not None and model.weights_check_s >= 0
    with pytest.raises(CheckpointError, match=named(repr(key), "non-finite", "float16")):
        load_model(path, dtype="float16", check_weights=True)


def test_count_non_finite_across_chunks_and_overflowing_sums(monkeypatch):
    from specdec.models import finite

    monkeypatch.setattr(finite, "FINITE_SCAN_ELEMENTS", 7)
    x = torch.zeros(50, dtype=torch.bfloat16)
    x[[3, 6, 7, 49]] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")], dtype=torch.bfloat16)
    assert finite.count_non_finite(x.view(5, 10)) == 4
    big = torch.full((50,), 60000.0, dtype=torch.float16)  # finite, but every chunk's float16 sum overflows
    assert finite.count_non_finite(big) == 0
