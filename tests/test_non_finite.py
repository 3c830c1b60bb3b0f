"""Non-finite numbers never pass silently (docs/api.md, failure behaviour): NaN/inf target logits are an
error naming the model, the request and the step; a non-finite draft never changes the output (its drafts
are rejected, the target's own token stands) and is warned about once."""
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.batch import NonFiniteLogitsError
from specdec.models import load_model

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def pair(llama_pair):
    return llama_pair


def poisoned_copy(src, dst, key, index=None):
    """A copy of checkpoint `src` with NaN in weight `key` (a whole tensor, or one row)."""
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    if index is None:
        weights[key].fill_(float("nan"))
    else:
        weights[key][index] = float("nan")
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def nan_draft(draft_dir):
    model = load_model(draft_dir, dtype="float64")
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    return model


@pytest.mark.parametrize("method", ["ar", "ragged"])
def test_nan_target_at_prefill_names_model_and_request(pair, tmp_path, method):
    target = poisoned_copy(pair[0], tmp_path / "t", "lm_head.weight")
    llm = LLM(target, None if method == "ar" else pair[1], method=method, num_speculative_tokens=3, dtype="float64")
    with pytest.raises(NonFiniteLogitsError, match=rf"target .*/t produced non-finite logits .* request 0 at prefill"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=8))


@pytest.mark.parametrize("method", ["ar", "eqspec", "exspec"])
def test_nan_target_mid_run_names_the_step(pair, tmp_path, method):
    """A token whose embedding is NaN: the step that feeds it fails, naming the request that produced it."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    clean = LLM(pair[0], method="ar", dtype="float64").generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)
    token = clean[0].token_ids[3]  # emitted by a decoding step, fed to the target by a later one
    assert token not in PROMPTS[0]
    target = poisoned_copy(pair[0], tmp_path / "t", "model.embed_tokens.weight", token)
    llm = LLM(target, None if method == "ar" else pair[1], method=method, num_speculative_tokens=2, batch_size=1,
              dtype="float64")
    with pytest.raises(NonFiniteLogitsError, match=r"request 0 at decoding step \d+"):
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
def test_nan_draft_greedy_output_is_the_targets(pair, method):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = LLM(pair[0], method="ar", dtype="float64").generate(prompt_token_ids=PROMPTS, sampling_params=params)
    llm = LLM(pair[0], nan_draft(pair[1]), method=method, num_speculative_tokens=3, batch_size=2, dtype="float64")
    with pytest.warns(RuntimeWarning, match="draft model produced non-finite logits") as record:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert outs.metrics.accepted_drafts == 0
    assert len([w for w in record if "non-finite" in str(w.message)]) == 1  # warned once per run


def test_nan_draft_sampled_rows_keep_sampling(pair):
    """The issue's case: sampled rows with a NaN draft used to emit token 0 forever."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)] * 3
    llm = LLM(pair[0], nan_draft(pair[1]), method="ragged", num_speculative_tokens=3, batch_size=3, dtype="float64")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for o in outs:
        assert len(set(o.token_ids)) > 3, o.token_ids  # not one token repeated
    assert all(a == 0 for o in outs for a in o.accepted_counts)
