"""A real trained model end to end: SmolLM2-135M-Instruct from its GGUF file (tests/real_model.py fetches
it), against transformers loading the same file as the oracle.

Parity of the logits (float64 and float32), greedy chat answers of every method equal to transformers'
`generate`, the tokenizer built from GGUF metadata against transformers' on 2,000+ strings, the chat
template, and `python -m specdec.convert` writing a directory both libraries read to the same numbers.
"""
from __future__ import annotations

import copy
import json
import os
import random
import sysconfig
from pathlib import Path

import pytest
import torch

from real_model import real_gguf, truncated_draft
from specdec import LLM, SamplingParams
from specdec.models import load_model, load_tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GREEDY_NEW = 32
DRAFT_LAYERS = 8
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a hash table is in two sentences."]
GREEDY_PROMPTS = 2  # chat prompts per greedy run (CI time: each run decodes GREEDY_NEW tokens for each)
SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench_64.jsonl"


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """A 135M model gains from the machine's (two) cores, unlike the tiny test models conftest pins to one."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path():
    return real_gguf()


@pytest.fixture(scope="module")
def ours32(gguf_path):
    return load_model(gguf_path, dtype="float32")


@pytest.fixture(scope="module")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf32(gguf_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                      gguf_file=os.path.basename(gguf_path))


def chat(q: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def chat_prompts(tok):
    return [tok.encode(tok.apply_chat_template(chat(q))) for q in QUESTIONS[:GREEDY_PROMPTS]]


def our_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids))
    return model(torch.tensor([ids]), cache)[0]  # [T, V]


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]


def parity_prompts(tok) -> list[list[int]]:
    texts = [tok.apply_chat_template(chat(q)) for q in QUESTIONS[:2]]
    texts.append("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))")
    texts.append("東京は日本の首都です。 Émile a mangé 3 croissants 🥐 — ça va?")
    return [tok.encode(t) for t in texts]


# -- the model ------------------------------------------------------------------------------------------------


def test_config_from_metadata(ours32):
    cfg = ours32.cfg
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.max_position_embeddings) == (49152, 1536, 8192)
    assert cfg.tie_word_embeddings and ours32.lm_head.weight is ours32.embed_tokens.weight
    assert cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)
    assert ours32.dtype == torch.float32


def test_logits_float32_match_transformers(ours32, hf32, tok):
    for ids in parity_prompts(tok):
        ours, ref = our_logits(ours32, ids), hf_logits(hf32, ids)
        assert (ours - ref).abs().max().item() <= 1e-3
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_logits_float64_match_transformers(gguf_path, hf32, tok):
    ours64 = load_model(gguf_path, dtype="float64")
    hf64 = copy.deepcopy(hf32).to(torch.float64)  # the same dequantized weights (float32 values), in float64
    for ids in parity_prompts(tok)[1:3]:  # a chat prompt and code (CI time: float64 is slow)
        diff = (our_logits(ours64, ids) - hf_logits(hf64, ids)).abs().max().item()
        assert diff <= 1e-6, diff


def test_self_draft_shares_the_targets_tensors(ours32, chat_prompts):
    draft = truncated_draft(ours32, DRAFT_LAYERS)
    assert draft.cfg.num_layers == DRAFT_LAYERS and len(draft.layers) == DRAFT_LAYERS
    assert draft.layers[DRAFT_LAYERS - 1] is ours32.layers[DRAFT_LAYERS - 1]
    assert draft.lm_head.weight is ours32.embed_tokens.weight and draft.norm is ours32.norm
    assert not any(p.is_meta for p in draft.parameters())
    full = our_logits(ours32, chat_prompts[0])
    short = our_logits(draft, chat_prompts[0])
    assert short.shape == full.shape and not torch.equal(short, full)  # a different (weaker) model


# -- greedy generation --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_greedy(hf32, chat_prompts):
    """transformers' greedy continuation of each chat prompt, one prompt at a time, with the attention mask
    (SmolLM2's pad id 2 is its <|im_end|>: without the mask `generate` would mask the chat markers out)."""
    out = []
    for p in chat_prompts:
        ids = hf32.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            do_sample=False, max_new_tokens=GREEDY_NEW)
        out.append(ids[0, len(p):].tolist())
    return out


GREEDY_CASES = [("ar", None), ("eqspec", 3), ("eqspec", "auto"), ("ragged", 3), ("ragged", "auto"),
                ("exspec", 3), ("exspec", "auto")]


@pytest.mark.parametrize("method,k", GREEDY_CASES, ids=[f"{m}-{k}" for m, k in GREEDY_CASES])
def test_greedy_matches_transformers_generate(ours32, tok, chat_prompts, hf_greedy, method, k):
    draft = None if method == "ar" else truncated_draft(ours32, DRAFT_LAYERS)
    options = {} if k is None else {"num_speculative_tokens": k}
    llm = LLM(ours32, draft, tokenizer=tok, method=method, batch_size=len(chat_prompts), dtype="float32",
              check_invariants=False, **options)  # checked below, on a shorter run (CI time)
    outs = llm.generate(prompt_token_ids=chat_prompts, sampling_params=SamplingParams(max_tokens=GREEDY_NEW))
    assert [o.token_ids for o in outs] == hf_greedy
    for o, ref in zip(outs, hf_greedy):  # an answer ends at <|im_end|> or runs to the length limit
        assert o.finish_reason == ("stop" if ref[-1] == 2 else "length")


INVARIANT_TOKENS = 12


@pytest.mark.parametrize("method", ["ragged", "exspec"])
def test_invariants_hold_on_the_real_model(ours32, tok, chat_prompts, hf_greedy, method):
    """check_invariants=True (I2-I6 after every step) with the self-draft at k = 3; still transformers' tokens."""
    llm = LLM(ours32, truncated_draft(ours32, DRAFT_LAYERS), tokenizer=tok, method=method, num_speculative_tokens=3,
              batch_size=len(chat_prompts), dtype="float32", check_invariants=True)
    outs = llm.generate(prompt_token_ids=chat_prompts, sampling_params=SamplingParams(max_tokens=INVARIANT_TOKENS))
    assert [o.token_ids for o in outs] == [ref[:INVARIANT_TOKENS] for ref in hf_greedy]


SHIPPED_CASES = [("eqspec", "auto"), ("ragged", 5), ("exspec", 3)]


@pytest.mark.parametrize("method,k", SHIPPED_CASES, ids=[f"{m}-{k}" for m, k in SHIPPED_CASES])
def test_shipped_feature_draft_is_exact_and_accepts(ours32, tok, chat_prompts, hf_greedy, method, k):
    """The draft specdec ships for SmolLM2 (found by the target's fingerprint) with the invariant checks on:
    transformers' greedy tokens, and a real share of its drafts accepted: on these two prompts 9.6% at k = 5
    and 16% at k = 3, against 0% with the features zeroed (a feature path that fed wrong or no hidden states)."""
    from specdec.drafts import shipped_draft
    from specdec.models.feature_draft import load_feature_draft

    path = shipped_draft(ours32)
    assert path is not None and path.name == "smollm2-135m-instruct"
    llm = LLM(ours32, load_feature_draft(path, ours32), tokenizer=tok, method=method, num_speculative_tokens=k,
              batch_size=len(chat_prompts), dtype="float32", check_invariants=True)
    outs = llm.generate(prompt_token_ids=chat_prompts, sampling_params=SamplingParams(max_tokens=GREEDY_NEW))
    assert [o.token_ids for o in outs] == hf_greedy
    if k != "auto":
        assert outs.metrics.acceptance_rate > 0.05, outs.metrics.acceptance_rate


def test_llm_uses_the_shipped_draft_unasked(gguf_path, capsys):
    llm = LLM(gguf_path, method="ragged", num_speculative_tokens=2, batch_size=1)
    assert type(llm.draft).__name__ == "FeatureDraft"
    assert "using the draft shipped for this target (smollm2-135m-instruct" in capsys.readouterr().err
    other = truncated_draft(llm.target, DRAFT_LAYERS)  # other weights: no fingerprint match
    from specdec.drafts import shipped_draft
    assert shipped_draft(other) is None


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_a_quantized_target_gets_the_shipped_draft_too(gguf_path, chat_prompts, capsys, quantize):
    """Issue 44: `--quantize int4` used to fall back to suffix decoding, the quantized numbers' fingerprint being
    another model's; the draft it gets is exact against the quantized target's own AR."""
    llm = LLM(gguf_path, quantize=quantize, method="ragged", num_speculative_tokens=2, batch_size=1)
    assert type(llm.draft).__name__ == "FeatureDraft" and llm.target.quantize == quantize
    assert "using the draft shipped for this target (smollm2-135m-instruct" in capsys.readouterr().err
    params = SamplingParams(max_tokens=16)
    ar = LLM(llm.target, method="ar", tokenizer=llm.tokenizer, batch_size=1)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=chat_prompts[:2], sampling_params=params)] == \
        [o.token_ids for o in ar.generate(prompt_token_ids=chat_prompts[:2], sampling_params=params)]


def test_chat_answer_reads_well(ours32, tok, chat_prompts):
    out = LLM(ours32, tokenizer=tok, method="ar", batch_size=1).generate(
        prompt_token_ids=chat_prompts[:1], sampling_params=SamplingParams(max_tokens=GREEDY_NEW))[0]
    assert out.text.strip() == "The capital of France is Paris." and out.finish_reason == "stop"


# -- tokenizer ----------------------------------------------------------------------------------------------


def tokenizer_corpus(count: int = 2000) -> list[str]:
    """SpecBench turns, source code, and random mixes of words, emoji, CJK, accents, digits, chat markers and
    unusual whitespace: at least `count` strings, the same every run."""
    strings = []
    for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines():
        strings += json.loads(line)["turns"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(0)
    for name in ("json/decoder.py", "textwrap.py", "heapq.py", "bisect.py", "string.py"):
        lines = (stdlib / name).read_text(encoding="utf-8").splitlines(keepends=True)
        for first in range(0, len(lines), 3):
            strings.append("".join(lines[first: first + rng.randint(1, 8)]))
    pieces = ["hello", "World", "naïve", "café", "Straße", "don't", "we'll", "1234567", "3.14159", "x=y+1;",
              "😀", "👩‍💻", "🇫🇷", "❤️", "日本語", "中文字符", "한국어", "Привет", "مرحبا", "ελληνικά", "<|im_start|>",
              "<|im_end|>", "<|endoftext|>", "\t", "  ", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", " ", "   \n ", "...",
              "#!/usr/bin/env python", "{\"key\": [1, 2]}", "<div class=\"a\">", "$$\\int_0^1 x\\,dx$$", "ﬁ", "Å", "é"]
    while len(strings) < count:
        strings.append("".join(rng.choice(pieces) + rng.choice(["", " ", "", "\n"]) for _ in range(rng.randint(1, 12))))
    return strings


def test_encode_matches_transformers_on_2000_strings(tok, hf_tok):
    corpus = tokenizer_corpus()
    assert len(corpus) >= 2000
    mismatches = [s for s in corpus if tok.encode(s) != hf_tok(s).input_ids]
    assert not mismatches, f"{len(mismatches)} of {len(corpus)} differ, e.g. {mismatches[0]!r}"


def test_decode_round_trips_where_transformers_does(tok, hf_tok):
    checked = 0
    for s in tokenizer_corpus():
        ids = tok.encode(s)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
        if hf_tok.decode(ids, skip_special_tokens=False) == s:
            assert tok.decode(ids, skip_special_tokens=False) == s
            checked += 1
    assert checked >= 1900


def test_special_ids_and_chat_template_match_transformers(tok, hf_tok):
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_ids) == (1, 2, frozenset({2}))
    assert not tok.add_bos and tok.vocab_size == 49152
    conversations = [chat("hi"), chat("Summarise this:\n\n  indented\ttext", system="Be brief."),
                     chat("2+2?") + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]]
    for messages in conversations:
        assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


# -- conversion to an HF directory ---------------------------------------------------------------------------


def test_convert_writes_a_directory_both_libraries_read(gguf_path, ours32, hf32, tok, tmp_path):
    import transformers

    from specdec.convert import main

    out = tmp_path / "smollm2"
    assert main([gguf_path, str(out)]) == 0
    ids = parity_prompts(tok)[0]
    ours_dir = load_model(out, dtype="float32")
    assert torch.equal(our_logits(ours_dir, ids), our_logits(ours32, ids))
    hf_dir = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(hf_logits(hf_dir, ids), hf_logits(hf32, ids))

    tok_dir, hf_tok_dir = load_tokenizer(out), transformers.AutoTokenizer.from_pretrained(out)
    for s in tokenizer_corpus()[::10]:
        assert tok_dir.encode(s) == tok.encode(s) == hf_tok_dir(s).input_ids
    messages = chat("hi", system="Be brief.")
    assert tok_dir.apply_chat_template(messages) == tok.apply_chat_template(messages) == \
        hf_tok_dir.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (tok_dir.bos_token_id, tok_dir.pad_token_id, tok_dir.eos_token_ids) == (1, 2, frozenset({2}))
    assert main([gguf_path, str(out)]) == 2  # refuses to write over a directory with files (one line, exit 2)
