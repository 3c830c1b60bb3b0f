"""Log-probabilities (`SamplingParams.logprobs`) and n completions per prompt (`SamplingParams.n`).

Logprobs are the target's raw log_softmax at each emitted position, never the draft's: every method (AR,
eqspec, ragged, exspec, a lookup drafter) gives AR's numbers for the same tokens -- bit for bit in float32
with `batch_invariant=True`, within rounding without it -- and AR's are those of a plain forward over the
whole sequence. They are cut exactly where the tokens are (stop ids, max_tokens), and rows that do not ask
get none. n choices are n requests of the prompt: choice 0 is the n = 1 sample of the seed, choice j the
sample of `choice_seed(seed, j)`."""
import dataclasses
import random

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models.cache import RAGGED
from specdec.sampling import MAX_LOGPROBS, MAX_N, choice_seed

TOP = 4


@pytest.fixture(scope="module")
def pair(llama_pair):
    return llama_pair


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    out = [[rng.randrange(3, 131) for _ in range(rng.randint(2, 20))] for _ in range(n)]
    return [p + p for p in out]  # repeats: a lookup drafter finds matches


def llm(pair, method, dtype="float32", batch_invariant=True, **kwargs):
    target, draft = pair
    if method == "suffix":
        return LLM(target, "suffix", method="ragged", num_speculative_tokens=3, dtype=dtype, batch_size=4,
                   batch_invariant=batch_invariant, cost_cache="", **kwargs)
    return LLM(target, None if method == "ar" else draft, method=method,
               num_speculative_tokens=None if method == "ar" else 3, batch_size=4, window_size=8, dtype=dtype,
               batch_invariant=batch_invariant, cost_cache="", **kwargs)


def as_tuples(out):
    return [(e.token_id, e.logprob, e.top) for e in out.logprobs]


@pytest.fixture(scope="module")
def ar_greedy(pair):
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=TOP)
    return params, llm(pair, "ar").generate(prompt_token_ids=prompts(), sampling_params=params)


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec", "suffix"])
def test_speculative_logprobs_equal_ar_bitwise(pair, ar_greedy, method):
    """Accepted drafts, corrections and bonus tokens alike: the target's numbers at that position, the same
    bits as AR's (batch-invariant float32), top entries included."""
    params, expected = ar_greedy
    outs = llm(pair, method).generate(prompt_token_ids=prompts(), sampling_params=params)
    assert outs.metrics.accepted_drafts > 0  # drafts were accepted: their positions were read from the verify pass
    for o, ref in zip(outs, expected):
        assert o.token_ids == ref.token_ids
        assert as_tuples(o) == as_tuples(ref), f"{method} request {o.index}"
        assert [e.token_id for e in o.logprobs] == o.token_ids and all(len(e.top) == TOP for e in o.logprobs)


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_logprobs_without_the_batch_invariant_mode_are_close_to_ar(pair, method):
    """float64, the ordinary numerics: tokens equal AR's, logprobs within rounding."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    ar = llm(pair, "ar", "float64", False).generate(prompt_token_ids=prompts(4), sampling_params=params)
    outs = llm(pair, method, "float64", False).generate(prompt_token_ids=prompts(4), sampling_params=params)
    for o, ref in zip(outs, ar):
        assert o.token_ids == ref.token_ids
        for e, r in zip(o.logprobs, ref.logprobs):
            assert e.logprob == pytest.approx(r.logprob, abs=1e-9)
            assert [i for i, _ in e.top] == [i for i, _ in r.top]
            assert [v for _, v in e.top] == pytest.approx([v for _, v in r.top], abs=1e-9)


def full_forward_logprobs(model, prompt, output) -> torch.Tensor:
    """log_softmax of the target's raw logits [len(output), V] at the positions that produced `output`: one
    forward over the whole sequence (float64), the reference."""
    ids = torch.tensor([prompt + output])
    cache = model.new_cache(1, ids.shape[1] + 1, RAGGED)
    logits = model.forward(ids, cache)[0, len(prompt) - 1: -1]  # [T, V]
    return logits.double().log_softmax(-1)


def test_logprobs_are_the_targets_raw_distribution(pair):
    """Sampled at temperature 0.6 with top-k 5 (seeded): the logprobs are log_softmax of the raw logits --
    not of the tempered, filtered distribution -- as a plain forward over the sequence gives them."""
    params = SamplingParams(max_tokens=10, temperature=0.6, top_k=5, seed=11, ignore_eos=True, logprobs=3)
    for method in ("ar", "ragged"):
        engine = llm(pair, method, "float64", False)
        for prompt, out in zip(prompts(3), engine.generate(prompt_token_ids=prompts(3), sampling_params=params)):
            reference = full_forward_logprobs(engine.target, prompt, out.token_ids)  # [T, V]
            tempered = (reference / 0.6).log_softmax(-1)
            got = [entry.logprob for entry in out.logprobs]
            assert got == pytest.approx(reference[range(len(got)), out.token_ids].tolist(), abs=1e-9)
            assert got != pytest.approx(tempered[range(len(got)), out.token_ids].tolist(), abs=1e-3)  # not processed
            for t, entry in enumerate(out.logprobs):
                values, ids = reference[t].topk(3)
                assert [i for i, _ in entry.top] == ids.tolist()
                assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-9)


def test_seeded_sampling_logprobs_equal_ar(pair):
    """Seeded sampling (the coupled sampler) emits AR's tokens; their logprobs are AR's too, bit for bit."""
    params = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, logprobs=TOP)
    ar = llm(pair, "ar").generate(prompt_token_ids=prompts(), sampling_params=params)
    outs = llm(pair, "eqspec").generate(prompt_token_ids=prompts(), sampling_params=params)
    assert [as_tuples(o) for o in outs] == [as_tuples(o) for o in ar]


def test_logprobs_are_cut_where_the_tokens_are_and_only_rows_that_ask_get_them(pair, ar_greedy):
    """A stop id inside an accepted block ends the row where AR ends it, and its logprobs there; max_tokens
    likewise; in the same batch, rows without `logprobs` get None and `logprobs=0` gives no top entries."""
    _, expected = ar_greedy
    counts = {}
    for o in expected:
        for t in o.token_ids[2:]:
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)
    asked = [None, 0, TOP, 1, None, TOP]
    params = [SamplingParams(max_tokens=16 - i, stop_token_ids=(stop,), ignore_eos=True, logprobs=n)
              for i, n in enumerate(asked)]
    outs = llm(pair, "ragged").generate(prompt_token_ids=prompts(), sampling_params=params)
    assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)
    for o, ref, n in zip(outs, expected, asked):
        assert o.token_ids == ref.token_ids[:len(o.token_ids)]
        if n is None:
            assert o.logprobs is None and o.cumulative_logprob is None
            continue
        assert [e.token_id for e in o.logprobs] == o.token_ids
        assert [e.logprob for e in o.logprobs] == [e.logprob for e in ref.logprobs[:len(o.token_ids)]]
        assert [e.top for e in o.logprobs] == [e.top[:n] for e in ref.logprobs[:len(o.token_ids)]]
        assert o.cumulative_logprob == pytest.approx(sum(e.logprob for e in o.logprobs))


def test_stream_deltas_carry_each_steps_logprobs(pair, ar_greedy):
    params, expected = ar_greedy
    got: dict = {}
    for delta in llm(pair, "eqspec").stream(prompt_token_ids=prompts(), sampling_params=params):
        assert len(delta.logprobs) == len(delta.token_ids)
        got.setdefault(delta.request_id, []).extend(delta.logprobs)
    assert [got[str(i)] for i in range(len(expected))] == [o.logprobs for o in expected]


# ------------------------------------------------------------------------------------------------- n


def test_n_choices_are_n_requests_with_derived_seeds(pair):
    """Seeded: choice 0 is the n = 1 request's sample, choice j the sample of choice_seed(seed, j); the
    outputs come prompt by prompt, choices in order (`Outputs.by_prompt`)."""
    engine = llm(pair, "ragged")
    ps = prompts(3)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True, logprobs=1)
    params = [dataclasses.replace(sampled, n=n) for n in (3, 1, 2)]
    outs = engine.generate(prompt_token_ids=ps, sampling_params=params)
    assert [(o.index, o.choice) for o in outs] == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]
    assert [[o.choice for o in group] for group in outs.by_prompt()] == [[0, 1, 2], [0], [0, 1]]
    first = outs.by_prompt()[0]
    assert len({tuple(o.token_ids) for o in first}) == 3  # three different samples
    for choice, out in enumerate(first):
        alone = SamplingParams(max_tokens=10, temperature=1.0, seed=choice_seed(42, choice), ignore_eos=True,
                               logprobs=1)
        (expected,) = engine.generate(prompt_token_ids=[ps[0]], sampling_params=alone)
        assert out.token_ids == expected.token_ids and out.logprobs == expected.logprobs
    assert choice_seed(42, 0) == 42 and len({choice_seed(42, j) for j in range(MAX_N)}) == MAX_N
    assert choice_seed(42, 1) != choice_seed(43, 0)


def test_engine_aborts_one_choice_or_all_and_the_id_stays_in_use_until_all_are_done(pair):
    engine = llm(pair, "ragged").engine()
    engine.add_request(prompts(1)[0], SamplingParams(max_tokens=30, ignore_eos=True, n=3), request_id="a")
    engine.step()
    assert engine.abort("a", choice=1) and not engine.abort("a", choice=7)
    finished = {}
    while engine.has_unfinished():
        for d in engine.step():
            assert d.request_id == "a"
            if d.finished:
                finished[d.choice] = d.finish_reason
                if len(finished) == 1:  # some choices still run: the id is taken
                    with pytest.raises(ValueError, match="already in use"):
                        engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="a")
                    assert engine.abort("a")  # the rest
    assert finished[1] == "abort" and set(finished) == {0, 1, 2}
    assert not engine.abort("a")
    engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="a")  # free again


@pytest.mark.parametrize("field, value", [("n", 0), ("n", MAX_N + 1), ("n", 2.0), ("n", True),
                                          ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", True)])
def test_sampling_params_refuse_n_and_logprobs_out_of_range(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})
