"""specdec.models.tokenizer against transformers.AutoTokenizer on tiny tokenizers built here.

Checkpoint directories made once per session:
  sp            tokenizer.model only (a byte-fallback BPE sentencepiece model, Llama style)
  sp_legacy     the same with "legacy": true (a "▁" before every chunk between special tokens)
  sp_no_prefix  the same with "add_prefix_space": false (no "▁" prepended)
  sp_json       the same tokenizer saved by HF: tokenizer.json + tokenizer.model, LlamaTokenizer
  llama2        sp_json with a transformers-v4 style tokenizer.json (Prepend normalizer)
  qwen          tokenizer.json byte-level BPE, no BOS, <|im_start|>/<|im_end|> specials (Qwen style)
  llama3        tokenizer.json byte-level BPE whose post_processor puts <|begin_of_text|> first
Needs protobuf: transformers reads tokenizer.model with it.
"""
import io
import json
import random
import re
import shutil

import pytest

sentencepiece = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("google.protobuf", reason="transformers needs protobuf to read tokenizer.model")

from specdec.models.errors import CheckpointError  # noqa: E402
from specdec.models.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, café naïve résumé über straße.",
    "日本語のテキストです。中文测试，你好世界。",
    "Emoji time 😀 🚀 and more text here.",
    "    indented   lines\twith\ttabs and  double  spaces",
    "def foo(x):\n    return x + 1\n",
    "Speculative decoding drafts tokens and verifies them in one batch.",
    "Numbers 12345 and 67890, prices $3.50 and 100%.",
]

TEXTS = [
    "",
    " ",
    "  ",
    "hello",
    " hello",
    "  hello  world ",
    "The quick brown fox",
    "a\nb",
    "\n\nline\n",
    "\tx\ty\t",
    "café naïve résumé",
    "日本語 中文测试 ゐ",  # ゐ is not in the corpus: byte fallback
    "emoji 😀🚀 🦙!",
    "mixed  \t \n spaces",
    "x<s>y",
    "<s>hello</s> there",
    "<|im_start|>user\nhi<|im_end|>",
    "▁already",
]

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _train_sp(vocab_size: int) -> bytes:
    # Llama's tokenizer.model settings: identity normalization, spaces kept, byte fallback.
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 10),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,  # 256 byte pieces + 3 specials + the corpus' characters and merges
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def _write_json(path, obj):
    path.write_text(json.dumps(obj, ensure_ascii=False), encoding="utf-8")


def _make_sp_dir(root, vocab_size=400):
    root.mkdir()
    (root / "tokenizer.model").write_bytes(_train_sp(vocab_size))
    # add_bos_token is explicit: HF v5 defaults it to False when absent, LLaMA configs set it.
    _write_json(
        root / "tokenizer_config.json",
        {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": TEMPLATE,
        },
    )
    return root


def _make_bpe_dir(root, specials, post_processor, config):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 10, trainer=trainer)
    if post_processor is not None:
        tok.post_processor = post_processor(tok)
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    _write_json(root / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **config})
    return root


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    from tokenizers import processors

    base = tmp_path_factory.mktemp("tok")
    sp = _make_sp_dir(base / "sp")
    # HF's own save of the Llama tokenizer: tokenizer.json next to tokenizer.model.
    sp_json = base / "sp_json"
    transformers.AutoTokenizer.from_pretrained(sp).save_pretrained(sp_json)
    qwen = _make_bpe_dir(
        base / "qwen",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": TEMPLATE},
    )
    llama3 = _make_bpe_dir(
        base / "llama3",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        lambda t: processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", t.token_to_id("<|begin_of_text|>"))]
        ),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    )
    # A Llama-2 style tokenizer.json as transformers v4 wrote it: the "▁" prefix in the normalizer,
    # no pre_tokenizer. HF v5 ignores both for a LlamaTokenizer (and so do we).
    llama2 = base / "llama2"
    shutil.copytree(sp_json, llama2)
    spec = json.loads((llama2 / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    spec["pre_tokenizer"] = None
    _write_json(llama2 / "tokenizer.json", spec)
    # The sentencepiece directory with the other two Llama prefix settings.
    variants = {}
    for name, extra in {"sp_legacy": {"legacy": True}, "sp_no_prefix": {"add_prefix_space": False}}.items():
        variants[name] = base / name
        shutil.copytree(sp, variants[name])
        cfg = json.loads((sp / "tokenizer_config.json").read_text(encoding="utf-8"))
        _write_json(variants[name] / "tokenizer_config.json", {**cfg, **extra})
    return {"sp": sp, "sp_json": sp_json, "llama2": llama2, "qwen": qwen, "llama3": llama3, **variants}


@pytest.fixture(scope="session")
def pairs(dirs):
    """name -> (ours, HF's) tokenizer for each directory."""
    return {k: (load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)) for k, d in dirs.items()}


KINDS = ["sp", "sp_json", "llama2", "qwen", "llama3", "sp_legacy", "sp_no_prefix"]


@pytest.mark.parametrize("kind", KINDS)
def test_encode_decode_match_hf(pairs, kind):
    ours, hf = pairs[kind]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], (kind, text, hf.convert_ids_to_tokens(hf(text)["input_ids"]))
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), (kind, text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), (kind, text)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), (kind, text)


@pytest.mark.parametrize("kind", KINDS)
def test_attributes_match_hf(pairs, kind):
    ours, hf = pairs[kind]
    assert isinstance(ours, Tokenizer)
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.add_bos == (ours.bos_token_id is not None and hf("x")["input_ids"][0] == ours.bos_token_id)
    assert ours.add_bos == (kind != "qwen")


def test_random_strings_match_hf(pairs):
    # Random mixes of pieces that stress spaces, special-token text and byte fallback.
    alphabet = [*"abcxyz \t\n", "  ", "the ", "quick", "é", "日", "😀", "ゐ", "▁", "\u00a0", "\r\n"]
    alphabet += ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
    rng = random.Random(0)
    texts = ["".join(rng.choices(alphabet, k=rng.randint(0, 10))) for _ in range(150)]
    for kind in KINDS:
        ours, hf = pairs[kind]
        for text in texts:
            ids = ours.encode(text)
            assert ids == hf(text)["input_ids"], (kind, text)
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), (kind, text)


def test_decode_arbitrary_ids_match_hf(pairs):
    # Ids that encode never produces in this order: lone byte pieces, specials in the middle.
    for kind in KINDS:
        ours, hf = pairs[kind]
        for ids in ([5, 6, 7], [200, 1, 2, 250], list(range(0, ours.vocab_size, 7)), [ours.vocab_size - 1, 3]):
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), (kind, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_token_bytes_concatenate_to_the_decoded_text(pairs, kind):
    """`token_bytes` (the server's logprob `bytes`): each token's own bytes, byte-level and byte-fallback
    pieces possibly part of a character; together they are the text (less the one leading space a Llama
    decode strips)."""
    ours, _ = pairs[kind]
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        joined = b"".join(ours.token_bytes(i) for i in ids).decode("utf-8")
        decoded = ours.decode(ids, skip_special_tokens=False)
        assert joined in (decoded, " " + decoded), (kind, text, [ours.token_bytes(i) for i in ids])
    assert ours.token_bytes(ours.vocab_size + 10) == b""


@pytest.mark.parametrize("kind", ["sp", "qwen"])
def test_chat_template_matches_hf(pairs, kind):
    ours, hf = pairs[kind]
    messages = [{"role": "user", "content": "Hi 😀"}, {"role": "assistant", "content": "Hello!"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    with pytest.raises(CheckpointError, match="chat_template"):
        pairs["llama3"][0].apply_chat_template(messages)


def test_add_bos_defaults_true_for_sentencepiece(dirs, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(dirs["sp"], d)
    _write_json(d / "tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer"})
    tok = load_tokenizer(d)
    assert tok.add_bos and tok.bos_token_id == 1 and tok.encode("hi")[0] == 1
    assert tok.eos_token_ids == {2}


def test_eos_union(dirs, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(dirs["sp"], d)
    _write_json(d / "config.json", {"model_type": "llama", "eos_token_id": 7})
    _write_json(d / "generation_config.json", {"eos_token_id": [7, 9]})
    tok = load_tokenizer(d)
    assert tok.eos_token_ids == frozenset({2, 7, 9})
    d2 = tmp_path / "ck2"
    shutil.copytree(dirs["qwen"], d2)
    _write_json(d2 / "generation_config.json", {"eos_token_id": 0})
    tok2 = load_tokenizer(d2)
    assert tok2.eos_token_ids == frozenset({0, tok2.token_to_id("<|im_end|>")})


def test_fingerprint(dirs, tmp_path):
    same = tmp_path / "copy"
    shutil.copytree(dirs["sp"], same)
    fp = load_tokenizer(dirs["sp"]).fingerprint()
    assert len(fp) == 64 and fp == load_tokenizer(same).fingerprint()
    other = _make_sp_dir(tmp_path / "other", vocab_size=380)
    assert load_tokenizer(other).fingerprint() != fp
    assert load_tokenizer(dirs["qwen"]).fingerprint() != load_tokenizer(dirs["llama3"]).fingerprint()
    _write_json(same / "generation_config.json", {"eos_token_id": [2, 5]})
    assert load_tokenizer(same).fingerprint() != fp  # special ids count too


def test_errors_name_the_path(dirs, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        load_tokenizer(missing)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=re.escape(str(empty))):
        load_tokenizer(empty)

    truncated = tmp_path / "truncated"
    shutil.copytree(dirs["sp"], truncated)
    data = (truncated / "tokenizer.model").read_bytes()
    (truncated / "tokenizer.model").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(str(truncated))):
        load_tokenizer(truncated)

    garbage = tmp_path / "garbage"
    shutil.copytree(dirs["sp"], garbage)
    (garbage / "tokenizer.model").write_bytes(b"\xff\x00not a model" * 10)
    with pytest.raises(CheckpointError, match=re.escape(str(garbage))):
        load_tokenizer(garbage)

    bad_json = tmp_path / "bad_json"
    shutil.copytree(dirs["qwen"], bad_json)
    (bad_json / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError, match=re.escape(str(bad_json))):
        load_tokenizer(bad_json)

    bad_cfg = tmp_path / "bad_cfg"
    shutil.copytree(dirs["sp"], bad_cfg)
    (bad_cfg / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=re.escape(str(bad_cfg))):
        load_tokenizer(bad_cfg)
