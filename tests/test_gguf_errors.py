"""Bad GGUF files: each gives one CheckpointError line naming the file, and no weight is dequantized before
the file has been checked (nothing half-loaded)."""
from __future__ import annotations

import struct

import pytest

from checkpoints import build_hf_model
from real_model import write_gguf
from specdec.models import CheckpointError, load_model, load_tokenizer
from specdec.models.gguf import GGUFTensors


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("gguf")
    return build_hf_model("llama", seed=0)


@pytest.fixture
def reads(monkeypatch):
    """Every weight dequantized into the model (GGUFTensors.read_into calls)."""
    seen = []
    original = GGUFTensors.read_into

    def counting(self, name, out):
        seen.append(name)
        return original(self, name, out)

    monkeypatch.setattr(GGUFTensors, "read_into", counting)
    return seen


def refused(path, reads, *fragments) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    for fragment in fragments:
        assert fragment in message, message
    assert reads == []  # refused before any weight was dequantized
    return message


def test_a_good_file_loads(tiny, tmp_path, reads):
    model = load_model(write_gguf(tmp_path / "ok.gguf", tiny.config, tiny.state_dict()))
    assert model.cfg.num_layers == 3 and len(reads) > 0


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_file(tiny, tmp_path, reads, keep):
    path = write_gguf(tmp_path / "cut.gguf", tiny.config, tiny.state_dict())
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * keep)])
    refused(path, reads, "truncated")


def test_cut_inside_the_header(tiny, tmp_path, reads):
    path = write_gguf(tmp_path / "head.gguf", tiny.config, tiny.state_dict())
    (tmp_path / "head.gguf").write_bytes((tmp_path / "head.gguf").read_bytes()[:40])
    refused(path, reads, "cannot read GGUF file")


def test_not_a_gguf_file(tmp_path, reads):
    path = tmp_path / "text.gguf"
    path.write_text("hello")
    refused(str(path), reads, "cannot read GGUF file")


def test_unknown_quantization_type(tiny, tmp_path, reads):
    import gguf

    path = write_gguf(tmp_path / "q99.gguf", tiny.config, tiny.state_dict())
    tensor = gguf.GGUFReader(path).tensors[3]
    offset = tensor.field.offset + sum(part.nbytes for part in tensor.field.parts[:4])  # the type's uint32
    with open(path, "r+b") as f:
        f.seek(offset)
        assert struct.unpack("<I", f.read(4))[0] == int(tensor.tensor_type)
        f.seek(offset)
        f.write(struct.pack("<I", 99))
    refused(path, reads, "unknown quantization type 99")


def test_type_the_library_cannot_dequantize(tiny, tmp_path, reads):
    import gguf

    path = write_gguf(tmp_path / "q81.gguf", tiny.config, tiny.state_dict(),
                      types={"blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q8_1})
    refused(path, reads, "'blk.1.ffn_up.weight'", "Q8_1", "cannot dequantize")


def test_unsupported_architecture(tiny, tmp_path, reads):
    path = write_gguf(tmp_path / "falcon.gguf", tiny.config, tiny.state_dict(), arch="falcon")
    refused(path, reads, "unsupported GGUF architecture 'falcon'", "llama", "qwen2", "qwen3")


def test_missing_tensor(tiny, tmp_path, reads):
    path = write_gguf(tmp_path / "missing.gguf", tiny.config, tiny.state_dict(), drop=("blk.1.ffn_down.weight",))
    refused(path, reads, "missing tensor(s) 'blk.1.ffn_down.weight'")


def test_wrong_shape_and_unknown_tensor(tiny, tmp_path, reads):
    import torch

    state = dict(tiny.state_dict())
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 64)
    refused(write_gguf(tmp_path / "shape.gguf", tiny.config, state), reads, "'blk.0.ffn_up.weight'", "shape")
    config = type(tiny.config)(**{**tiny.config.to_dict(), "num_hidden_layers": 2})
    refused(write_gguf(tmp_path / "extra.gguf", config, tiny.state_dict()), reads, "unexpected tensor 'blk.2.")


def test_missing_file(tmp_path, reads):
    refused(str(tmp_path / "nope.gguf"), reads, "does not exist")


def test_tokenizer_errors(tiny, tmp_path):
    path = write_gguf(tmp_path / "notok.gguf", tiny.config, tiny.state_dict())
    with pytest.raises(CheckpointError, match=r"notok\.gguf: no tokenizer in the GGUF metadata"):
        load_tokenizer(path)
    with pytest.raises(CheckpointError, match=r"nope\.gguf: GGUF file does not exist"):
        load_tokenizer(tmp_path / "nope.gguf")
