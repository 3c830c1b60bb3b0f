"""Hostile GGUF files (issue 57, item 7): each broken the way a bad download, a buggy converter or an attacker would
break it, starting from a small valid file. Each is refused with one line naming the file and what is wrong: by
the library (one CheckpointError, nothing returned), by `python -m specdec.run --target BAD.gguf` (that line on
stderr, exit status 2, no traceback, no signal) and by `python -m specdec.serve --target BAD.gguf` (refuses to
start the same way).

The classes: truncated (in the header, in the data), offsets past the end, unknown type ids, counts and lengths
and dimensions larger than the file, non-finite weights and block scales (refused by default, not only with
check_weights), metadata that disagrees with the tensors (vocabulary vs embedding rows, head counts vs shapes,
layer count vs the layers present), a tensor named twice, tokenizer metadata the tokenizers library refuses."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from checkpoints import build_hf_model
from real_model import write_gguf
from specdec.models import CheckpointError, load_model, load_tokenizer

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# a byte-level BPE vocabulary of 131 tokens (the tiny model's), spelled in the byte alphabet, with one merge
TOKENS = [chr(c) for c in range(33, 127)] + ["Ġ", "he"] + [f"<pad{i}>" for i in range(131 - 96)]
MERGES = ["h e"]
F16_INF, F16_NAN = 0x7C00, 0x7E00


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """Valid tiny llama GGUFs (3 layers, hidden 64, 4 heads / 2 kv heads of 16, vocab 131, a tokenizer):
    Q8_0 and Q4_1 linear weights (F32 norms), and one whose token list is one short of the embedding."""
    root = tmp_path_factory.mktemp("hostile")
    hf = build_hf_model("llama", seed=0)
    with pytest.MonkeyPatch.context() as mp:  # write_gguf writes no merges; a gpt2 tokenizer needs them
        mp.setattr(gguf.GGUFWriter, "add_token_merges",
                   lambda self, merges: self.add_array(gguf.Keys.Tokenizer.MERGES, MERGES))
        files = {"Q8_0": write_gguf(root / "ok-q8_0.gguf", hf.config, hf.state_dict(), qtype=Q.Q8_0, tokens=TOKENS),
                 "Q4_1": write_gguf(root / "ok-q4_1.gguf", hf.config, hf.state_dict(), qtype=Q.Q4_1, tokens=TOKENS),
                 "short": write_gguf(root / "short.gguf", hf.config, hf.state_dict(), qtype=Q.Q8_0,
                                     tokens=TOKENS[:-1])}
    return root, files


class Edit:
    """A copy of a valid file, its header located with the gguf library's reader, bytes overwritten."""

    def __init__(self, src: str):
        self.reader = gguf.GGUFReader(src)
        with open(src, "rb") as f:
            self.data = bytearray(f.read())

    def put(self, offset: int, fmt: str, value) -> "Edit":
        raw = struct.pack(fmt, value)
        self.data[offset: offset + len(raw)] = raw
        return self

    def field(self, key: str, part: int) -> int:
        """The byte offset of part `part` of metadata field `key` (scalar value: part 3; array count: part 4)."""
        f = self.reader.fields[key]
        return f.offset + sum(p.nbytes for p in f.parts[:part])

    def tensor(self, name: str):
        return next(t for t in self.reader.tensors if t.name == name)

    def tensor_part(self, name: str, part: int) -> int:
        """Part `part` of a tensor's entry: 0 name length, 1 name, 2 dimension count, 3 dims, 4 type, 5 offset."""
        f = self.tensor(name).field
        return f.offset + sum(p.nbytes for p in f.parts[:part])

    def write(self, path, keep: int | None = None) -> str:
        with open(path, "wb") as f:
            f.write(self.data if keep is None else self.data[:keep])
        return str(path)


def q8_scale(e: Edit, name: str, row: int, block: int) -> int:
    """The byte offset of the float16 d of block `block` of row `row` of Q8_0 tensor `name` (34-byte blocks)."""
    t = e.tensor(name)
    return int(t.data_offset) + (row * (int(t.shape[0]) // 32) + block) * 34


def q41_min(e: Edit, name: str, row: int, block: int) -> int:
    """The byte offset of the float16 m of a Q4_1 block (20-byte blocks: d, m, 16 bytes of nibbles)."""
    t = e.tensor(name)
    return int(t.data_offset) + (row * (int(t.shape[0]) // 32) + block) * 20 + 2


def f32_value(e: Edit, name: str, index: int) -> int:
    return int(e.tensor(name).data_offset) + 4 * index


# class id -> (which valid file, how to break it, what the library raises: fragments of its one line; "tokenizer"
# where only the tokenizer reads the broken part)
CASES = {
    "header truncated": ("Q8_0", lambda e, p: e.write(p, keep=700),
                         ["cannot read GGUF file (file is truncated inside its header"]),
    "string longer than the file": ("Q8_0", lambda e, p: e.put(e.field("tokenizer.ggml.model", 3), "<Q", 1 << 60)
                                    .write(p), ["truncated inside its header: 1152921504606846976 bytes wanted"]),
    "data truncated": ("Q8_0", lambda e, p: e.write(p, keep=len(e.data) - 100),
                       ["file is truncated: tensor", "ends at byte"]),
    "offset past the end": ("Q8_0", lambda e, p: e.put(e.tensor_part("blk.1.ffn_up.weight", 5), "<Q", 1 << 40)
                            .write(p), ["tensor 'blk.1.ffn_up.weight' starts at byte", "past the end of the file"]),
    "unknown type id": ("Q8_0", lambda e, p: e.put(e.tensor_part("blk.0.attn_v.weight", 4), "<I", 99).write(p),
                        ["tensor 'blk.0.attn_v.weight' has unknown quantization type 99"]),
    "tensor count larger than the file": ("Q8_0", lambda e, p: e.put(8, "<Q", 1 << 40).write(p),
                                          ["its counts are wrong: it declares 1099511627776 tensors",
                                           "bytes left can hold"]),
    "array count larger than the file": ("Q8_0", lambda e, p: e.put(e.field("tokenizer.ggml.tokens", 4), "<Q",
                                                                      1 << 50).write(p),
                                         ["a count is wrong: an array of 1125899906842624 items, more than the"]),
    "dimension larger than the file": ("Q8_0", lambda e, p: e.put(e.tensor_part("token_embd.weight", 3) + 8, "<Q",
                                                                   1 << 40).write(p),
                                       ["tensor 'token_embd.weight' of shape (1099511627776, 64) (Q8_0) needs",
                                        "more than the whole file"]),
    "too many dimensions": ("Q8_0", lambda e, p: e.put(e.tensor_part("blk.0.ffn_up.weight", 2), "<I", 9).write(p),
                            ["tensor 'blk.0.ffn_up.weight' has 9 dimensions; GGUF allows at most 4"]),
    "non-finite weight": ("Q8_0", lambda e, p: e.put(f32_value(e, "blk.0.attn_norm.weight", 5), "<f", float("nan"))
                          .write(p), ["tensor 'blk.0.attn_norm.weight' (F32) has 1 non-finite value(s) (NaN/inf)"]),
    "non-finite scale": ("Q8_0", lambda e, p: e.put(q8_scale(e, "blk.1.ffn_up.weight", 3, 1), "<H", F16_INF)
                         .write(p), ["tensor 'blk.1.ffn_up.weight' (Q8_0) has 1 non-finite block scale(s) (NaN/inf) "
                                     "in rows 0..95"]),
    "non-finite min": ("Q4_1", lambda e, p: e.put(q41_min(e, "blk.2.attn_output.weight", 0, 0), "<H", F16_NAN)
                       .write(p), ["tensor 'blk.2.attn_output.weight' (Q4_1) has 1 non-finite block scale(s)"]),
    "vocabulary size vs embedding rows": ("Q8_0", lambda e, p: e.put(e.field("llama.vocab_size", 3), "<I", 140)
                                          .write(p), ["tensor 'token_embd.weight' has shape (131, 64), but the "
                                                      "metadata makes it (140, 64) (a vocabulary of 140 from "
                                                      "llama.vocab_size, llama.embedding_length 64)"]),
    "token list vs embedding rows": ("short", lambda e, p: e.write(p),
                                     ["tokenizer.ggml.tokens has 130 tokens, but tensor 'token_embd.weight' has 131 "
                                      "rows"]),
    "head counts vs shapes": ("Q8_0", lambda e, p: e.put(e.field("llama.attention.head_count_kv", 3), "<I", 4)
                              .write(p), ["tensor 'blk.0.attn_k.weight' has shape (32, 64), but the metadata makes "
                                          "it (64, 64) (llama.attention.head_count_kv 4 x head dim 16, "
                                          "llama.embedding_length 64)"]),
    "zero heads": ("Q8_0", lambda e, p: e.put(e.field("llama.attention.head_count", 3), "<I", 0).write(p),
                   ["'llama.attention.head_count' must be an integer >= 1, got 0"]),
    "layer count vs the layers present": ("Q8_0", lambda e, p: e.put(e.field("llama.block_count", 3), "<I", 10**6)
                                          .write(p), ["llama.block_count is 1000000, but the file has tensors for 3 "
                                                      "layer(s)"]),
    "a tensor named twice": ("Q8_0", lambda e, p: e.put(e.tensor_part("blk.0.attn_k.weight", 1), "19s",
                                                        b"blk.0.attn_q.weight").write(p),
                             ["tensor 'blk.0.attn_q.weight' appears twice in the tensor table"]),
    "tokenizer metadata": ("Q8_0", lambda e, p: e.put(e.field("tokenizer.ggml.merges", 6), "3s", b"x y").write(p),
                           ["cannot build the tokenizer from the GGUF metadata"]),
}
TOKENIZER_ONLY = {"tokenizer metadata"}
# the commands load the target's weights, then note which draft they use, then load its tokenizer: a case the
# weights pass would show that note above its error line, so those run with the draft given
QUIET_DRAFT = ["--draft", "suffix"]


@pytest.fixture(scope="module")
def broken(valid):
    """class -> (path of the broken file, the fragments its line must hold)."""
    root, files = valid
    out = {}
    for name, (source, damage, fragments) in CASES.items():
        path = root / (name.replace(" ", "-") + ".gguf")
        out[name] = (damage(Edit(files[source]), path), fragments)
    return out


def test_the_valid_files_load_and_run(valid):
    """The files the broken ones come from are fine: what breaks each case is its own damage."""
    import torch

    _, files = valid
    for path in (files["Q8_0"], files["Q4_1"]):  # ("short" is the token-list case's file as written)
        model = load_model(path)
        logits = model(torch.tensor([[5, 17, 3]]), model.new_cache(1, 3))
        assert torch.isfinite(logits).all() and model.quantize == "gguf"
    tok = load_tokenizer(files["Q8_0"])
    assert tok.encode("he") == [TOKENS.index("he")]


@pytest.mark.parametrize("case", list(CASES))
def test_the_library_refuses_with_one_line(broken, case):
    path, fragments = broken[case]
    with pytest.raises(CheckpointError) as info:
        (load_tokenizer if case in TOKENIZER_ONLY else load_model)(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_non_finite_is_refused_on_every_load_path(broken):
    """By default and with check_weights (its scan still runs: it also catches a conversion's overflow), as
    stored, dequantized to float32 and bfloat16, and quantized again with --quantize."""
    for case in ("non-finite weight", "non-finite scale", "non-finite min"):
        path, fragments = broken[case]
        for kwargs in ({}, {"check_weights": True}, {"dtype": "float32"}, {"dtype": "bfloat16"},
                       {"quantize": "int8"}):
            with pytest.raises(CheckpointError, match="non-finite") as info:
                load_model(path, **kwargs)
            assert str(info.value).startswith(f"{path}: tensor '"), (kwargs, str(info.value))


def one_line_refusal(command: list[str], prefix: str, path: str, fragments) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=300, env=env)
    err = result.stderr.strip()
    assert result.returncode == 2, (result.returncode, err)  # not a signal (negative) nor a crash (1)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{prefix}: error: {path}: "), err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("case", list(CASES))
def test_run_exits_with_one_line(broken, case):
    path, fragments = broken[case]
    one_line_refusal(["specdec.run", "--target", path, "--prompt", "hello", "--max-tokens", "2",
                      *(QUIET_DRAFT if case in TOKENIZER_ONLY else [])], "specdec.run", path, fragments)


@pytest.mark.parametrize("case", ["header truncated", "unknown type id", "non-finite scale", "head counts vs shapes",
                                  "tokenizer metadata"])
def test_serve_refuses_to_start_with_one_line(broken, case):
    pytest.importorskip("uvicorn")
    path, fragments = broken[case]
    one_line_refusal(["specdec.serve", "--target", path, "--port", "0", *(QUIET_DRAFT if case in TOKENIZER_ONLY else
                                                                          [])], "specdec.serve", path, fragments)
