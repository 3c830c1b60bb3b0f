"""The real Qwen pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B-Instruct draft, Q4_K_M GGUF files) where it is
cached: loaded as stored (the file's Q4_K / Q6_K / Q5_0 / Q8_0 blocks on kernels/qmm_cpu.py), and every method's
output equal to the target's AR output, greedy and seeded. The pair is 1.6 GB: it is never fetched here (nor in
CI, which runs from a clean clone without it); `python -m bench.fetch_qwen` caches it once, and the module skips
naming that command where it is missing."""
from __future__ import annotations

import os

import pytest

from bench.fetch_qwen import FETCH_COMMAND, cached_pair
from specdec import LLM, SamplingParams
from specdec.models import load_model, load_tokenizer
from specdec.models.quant import BlockLinear, QuantEmbedding

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Write a function `is_palindrome(s)` in Python.",
           "What does `git rebase` do? One sentence."]


@pytest.fixture(scope="module")
def pair():
    found = cached_pair()
    if found is None:
        pytest.skip(f"the Qwen pair is not cached: run `{FETCH_COMMAND}` (1.6 GB, once)")
    return found


@pytest.fixture(scope="module")
def models(pair):
    return load_model(pair[0]), load_model(pair[1])


@pytest.fixture(scope="module")
def prompt_ids(pair):
    tok = load_tokenizer(pair[0])
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in PROMPTS]


def test_the_pair_loads_as_stored(pair, models):
    target, draft = models
    assert target.quantize == draft.quantize == "gguf" and target.batch_invariant
    qkv = target.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, BlockLinear) and [p.qtype for _, p in qkv.parts] == ["Q4_K", "Q6_K"]  # v is Q6_K
    assert isinstance(target.embed_tokens, QuantEmbedding) and target.lm_head.parts[0][1].qtype == "Q6_K"
    assert draft.lm_head.parts[0][1].qtype == "Q8_0"
    weights = sum(b.numel() * b.element_size() for b in (*target.buffers(), *target.parameters()))
    assert weights <= 1.05 * os.path.getsize(pair[0])  # the file's size, not a float copy (6 GB in float32)


def generate(target, draft, ids, method, k, batch, params):
    llm = LLM(target, draft, method=method, num_speculative_tokens=k, batch_size=batch, window_size=4)
    return [o.token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params)]


def test_every_method_gives_the_target_s_greedy_tokens(models, prompt_ids):
    target, draft = models
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = generate(target, None, prompt_ids, "ar", None, 1, params)
    assert len({tuple(r) for r in reference}) == len(reference)
    for method, k, batch in [("eqspec", 4, 3), ("ragged", 3, 2), ("exspec", 2, 3), ("eqspec", "auto", 1)]:
        got = generate(target, draft, prompt_ids, method, k, batch, params)
        assert got == reference, f"{method} k={k} B={batch}"


def test_seeded_sampling_gives_the_target_s_seeded_tokens(models, prompt_ids):
    target, draft = models
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(prompt_ids))]
    llm = LLM(target, method="ar", batch_size=1)
    reference = [o.token_ids for o in llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)]
    spec = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=3)
    got = [o.token_ids for o in spec.generate(prompt_token_ids=prompt_ids, sampling_params=params)]
    assert got == reference
