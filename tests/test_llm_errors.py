"""LLM refuses bad set-ups at construction, and bad requests before running anything."""
import shutil

import pytest

from checkpoints import make_checkpoint, make_pair
from checkpoints import write_wordlevel_tokenizer as write_tokenizer
from specdec import LLM, SamplingParams
from specdec.models import CheckpointError


@pytest.fixture(scope="module")
def pair(llama_pair):
    return llama_pair


def test_method_and_k_and_batch_size(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="method"):
        LLM(target, draft, method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(target, draft, method="eqspec", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="batch_size"):
        LLM(target, draft, batch_size=0)
    assert LLM(target, None, method="ragged").drafter == "suffix"  # no draft, none shipped: suffix decoding
    LLM(target, None, method="ar", num_speculative_tokens=0)  # AR needs neither


def test_mismatched_vocabularies(tmp_path, pair):
    target, _ = pair
    other = make_checkpoint("llama", tmp_path / "other", vocab_size=200)
    with pytest.raises(CheckpointError, match=r"draft \S+ has a vocabulary of 200 ids and target \S+ one of 131"):
        LLM(target, other)


def test_mismatched_tokenizers(tmp_path):
    target, draft = make_pair("llama", tmp_path)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(128)]
    write_tokenizer(tmp_path / "llama-target", words)
    write_tokenizer(tmp_path / "llama-draft", words[:3] + words[3:][::-1])
    with pytest.raises(CheckpointError, match="different tokenizers"):
        LLM(str(tmp_path / "llama-target"), str(tmp_path / "llama-draft"))
    shutil.copy(tmp_path / "llama-target" / "tokenizer.json", tmp_path / "llama-draft" / "tokenizer.json")
    llm = LLM(str(tmp_path / "llama-target"), str(tmp_path / "llama-draft"))  # same tokenizer: fine
    outs = llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=4))
    assert outs[0].prompt_token_ids == [4, 5, 6] and isinstance(outs[0].text, str)


def test_padded_embedding_alone_is_fine(tmp_path):
    """Same tokenizer, one model's embedding padded: accepted, logits cut to the tokenizer's size."""
    target = make_checkpoint("llama", tmp_path / "t", vocab_size=131)
    draft = make_checkpoint("llama", tmp_path / "d", vocab_size=160, seed=3)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(120)]
    write_tokenizer(tmp_path / "t", words)
    write_tokenizer(tmp_path / "d", words)
    llm = LLM(target, draft, num_speculative_tokens=2, dtype="float64")
    assert llm.vocab_size == len(words)
    outs = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=8))
    assert all(t < len(words) for t in outs[0].token_ids)


def test_prompt_longer_than_context(pair):
    target, draft = pair  # max_position_embeddings = 512
    llm = LLM(target, draft, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="prompt 1 has 500 tokens"):
        llm.generate(prompt_token_ids=[[5], [5] * 500], sampling_params=SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[5, 10_000]])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"])


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_api_types_are_checked_at_the_door(pair):
    """Issue 26: wrong types are refused where they enter, naming the argument and the prompt."""
    target, draft = pair
    with pytest.raises(ValueError, match=r"batch_size \(--batch-size\) must be an integer"):
        LLM(target, draft, batch_size=2.5)
    llm = LLM(target, draft, num_speculative_tokens=2)
    with pytest.raises(TypeError, match="prompt 0 has a token id that is not an integer: 2.7"):
        llm.generate(prompt_token_ids=[[5, 2.7]])
    with pytest.raises(TypeError, match="prompt 1 must be a string, got int"):
        llm.generate(["ok", 7])
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params={"max_tokens": 3})
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate(prompt_token_ids=[[5, 6], [7]], sampling_params=[SamplingParams(), None])


def test_llm_without_a_target_runs_the_embedded_pair():
    """`LLM()` reaches the embedded pair the command line runs without flags (a newcomer's report, issue 51: it
    was a TypeError); a draft without a target is refused in one line."""
    from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET

    llm = LLM(batch_size=2, num_speculative_tokens=2)
    assert llm.specs == (DEFAULT_TARGET, DEFAULT_DRAFT) and llm.draft is not None
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=6, temperature=0.0))
    ar = LLM(method="ar").generate(["def add(a, b):"], SamplingParams(max_tokens=6, temperature=0.0))
    assert out[0].token_ids == ar[0].token_ids and len(out[0].token_ids) == 6
    with pytest.raises(ValueError, match="draft= needs target="):
        LLM(draft="suffix")
