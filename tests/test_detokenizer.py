"""Incremental detokenization: a step decodes a few tokens, not the request's whole output, and the deltas
still concatenate to the final text (byte-fallback pieces and multi-byte characters included)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.detokenizer import INCOMPLETE, IncrementalDetokenizer
from specdec.models import load_tokenizer
from specdec.prompts import DEFAULT_TARGET

MULTIBYTE = ["日本語 中文测试 ゐ", "emoji 😀🚀 🦙!", "café naïve — résumé", "def f():\n\treturn '✓'"]


@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


def stream(tokenizer, ids, chunks):
    """Feed ids in chunks as steps would; returns (deltas, final text, detokenizer)."""
    detok, deltas, n, i = IncrementalDetokenizer(tokenizer), [], 0, 0
    while n < len(ids):
        n = min(n + chunks[i % len(chunks)], len(ids))
        i += 1
        if n < len(ids):
            deltas.append(detok.step(ids[:n]))
    last, final = detok.finish(ids)
    return deltas + [last], final, detok


def check_stream(tokenizer, ids, chunks):
    deltas, final, detok = stream(tokenizer, ids, chunks)
    assert "".join(deltas) == final == tokenizer.decode(ids)
    assert all(INCOMPLETE not in d for d in deltas[:-1]) or INCOMPLETE in tokenizer.decode(ids)
    return detok


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 80), chunks=st.lists(st.integers(1, 6), min_size=1))
def test_deltas_concatenate_to_the_final_text(default_tokenizer, seed, length, chunks):
    rng = random.Random(seed)
    text = rng.choice(MULTIBYTE) + " " + " ".join(rng.choice(("x", "def", "😀", "é", "\n")) for _ in range(length))
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    check_stream(default_tokenizer, ids, chunks)
    # random ids too (byte pieces in any order: U+FFFD may be the final text itself)
    ids = [rng.randrange(3, default_tokenizer.vocab_size) for _ in range(length)]
    check_stream(default_tokenizer, ids, chunks)


def test_a_step_decodes_a_few_tokens_not_the_whole_output(default_tokenizer):
    """The cost is O(new tokens) per step: 2,000 tokens a token at a time decode a few tokens each, not
    1 + 2 + .. + 2000."""
    ids = default_tokenizer.encode(" ".join(f"word{i % 50}" for i in range(1400)), add_special_tokens=False)[:2000]
    detok = IncrementalDetokenizer(default_tokenizer)
    for n in range(1, len(ids)):
        detok.step(ids[:n])
    per_step = detok.decoded_tokens / len(ids)
    assert per_step < 8, per_step  # a whole-output decode would be ~1,000 per step
    _, final = detok.finish(ids)
    assert detok.sent == final


@pytest.mark.real_model
@pytest.mark.slow
def test_deltas_of_a_byte_level_tokenizer(default_tokenizer):
    """The real model's GPT-2 style byte-level tokenizer (SmolLM2): multi-byte characters span tokens."""
    from real_model import real_gguf

    tokenizer = load_tokenizer(real_gguf())
    rng = random.Random(0)
    for text in MULTIBYTE:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(5):
            check_stream(tokenizer, ids, [rng.randint(1, 3) for _ in range(4)])
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    check_stream(tokenizer, ids, [1, 2, 1, 3])
