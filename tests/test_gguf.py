"""GGUF loading on small synthetic files: every quantization type the gguf library can write, llama's Q/K
permutation undone, qwen2/qwen3, tied and untied heads: our logits against transformers' on the same file;
and a SentencePiece-style (`llama`) GGUF tokenizer against transformers'."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_hf_model
from real_model import llamacpp_permute, write_gguf
from specdec.models import load_model
from specdec.models.gguf import unpermute_rows

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def hf_from_gguf(path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@torch.no_grad()
def logits_pair(path, ids):
    ours = load_model(path, dtype="float32")
    out = ours(torch.tensor([ids]), ours.new_cache(1, len(ids)))[0]
    ref = hf_from_gguf(path)(torch.tensor([ids])).logits[0]
    return ours, out, ref


def test_unpermute_inverts_llamacpp_permute():
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4 * 8, 3)  # 4 heads of 8 rows
    permuted = torch.from_numpy(llamacpp_permute(w.numpy(), 4))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, 4), w)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_llama_quantization_types_match_transformers(tmp_path, qtype):
    hf = build_hf_model("llama", seed=1, hidden_size=64, intermediate_size=96)
    path = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(path, hf.config, hf.state_dict(), qtype=Q[qtype])
    ours, out, ref = logits_pair(path, [5, 17, 3, 99, 42, 7, 1, 130])
    assert not ours.cfg.tie_word_embeddings
    assert (out - ref).abs().max().item() <= 1e-5
    if qtype == "F32":  # unquantized: the HF model's own logits, so the permutation was undone exactly
        with torch.no_grad():
            assert (out - hf(torch.tensor([[5, 17, 3, 99, 42, 7, 1, 130]])).logits[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_architectures_match_transformers(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    if family == "qwen2":
        config = transformers.Qwen2Config(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          tie_word_embeddings=True)
        hf = transformers.Qwen2ForCausalLM(config)
    else:
        hf = build_hf_model("qwen3", seed=2)  # head_dim 24 != hidden / heads: read from attention.key_length
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape) if name.endswith("norm.weight") else 0.15 * torch.randn(p.shape))
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: llama.cpp drops it
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, hf.config, state, arch=family)
    ids = [5, 17, 3, 99, 42, 7]
    if family == "qwen2":
        ours, out, ref = logits_pair(path, ids)
        assert (out - ref).abs().max().item() <= 1e-5
    else:  # transformers' GGUF config mapping gives qwen3 its default head_dim (128) whatever the file says:
        ours = load_model(path, dtype="float32")  # the model the file was written from is the oracle
        out = ours(torch.tensor([ids]), ours.new_cache(1, len(ids)))[0]
    assert ours.cfg.tie_word_embeddings and ours.lm_head.weight is ours.embed_tokens.weight
    assert ours.cfg.attention_bias == (family == "qwen2") and ours.cfg.qk_norm == (family == "qwen3")
    with torch.no_grad():
        assert (out - hf.eval()(torch.tensor([[5, 17, 3, 99, 42, 7]])).logits[0]).abs().max().item() <= 1e-5


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """A `llama` (SentencePiece BPE, scores and no merges, byte fallback) GGUF tokenizer against transformers'."""
    transformers = pytest.importorskip("transformers")
    from specdec.models import load_tokenizer

    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "th", "▁t", "he", "▁the", "in", "▁a", "an", "er", "▁in",
              "on", "re", "at", "▁an", "▁and", "ing", "▁s", "en", "▁w", "is", "▁c", "it", "▁h", "ou", "or"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = ["the cat and the hat", " leading space", "in an inn", "Zebra! ünïcode 日本 😀", "a\nb\tc  d",
             "there is it", "<s>the</s>", ""]
    for text in texts:
        assert ours.encode(text) == theirs(text).input_ids, text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.add_bos and ours.bos_token_id == 1 and ours.eos_token_ids == frozenset({2})
