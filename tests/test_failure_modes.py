"""The paper's failure modes, each injected on purpose: each must make a check here fail.

- positions that count padding (I2), caught by the invariant check and by the output;
- rejected drafts left visible in the KV cache (I4), caught by the invariant check and by the output;
- the bonus token taken from the draft instead of the target (I1), caught by AR equivalence;
- acceptance truncated to the batch minimum (I5), caught by per-request acceptance independence.
"""
import random

import pytest

import specdec.kernels.positions as positions
import specdec.speculative as speculative
from specdec import LLM, SamplingParams
from specdec.invariants import InvariantError
from specdec.proposers import ModelProposer, Proposal

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(llama_pair):
    target, draft = llama_pair
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    reference = LLM(target, method="ar", batch_size=1, dtype="float64").generate(
        prompt_token_ids=prompts, sampling_params=PARAMS)
    return target, draft, prompts, [o.token_ids for o in reference]


def run(pair, method="eqspec", batch_size=8, check=False):
    target, draft, prompts, _ = pair
    llm = LLM(target, draft, method=method, num_speculative_tokens=3, batch_size=batch_size, dtype="float64",
              check_invariants=check)
    return llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)


def matches_ar(pair, outs):
    return all(o.token_ids == ref for o, ref in zip(outs, pair[3]))


def test_correct_runtime_passes_every_check(pair):
    assert matches_ar(pair, run(pair, check=True))
    assert matches_ar(pair, run(pair, method="ragged", check=True))


def test_positions_counting_padding(pair, monkeypatch):
    original = positions.step_plan_reference

    def broken(start, length, num_new, T, left_padded, width, mask=True):
        pos, cols, visible = original(start, length, num_new, T, left_padded, width, mask)
        return cols.clone(), cols, visible  # position = cache column: padding counted

    monkeypatch.setattr(positions, "step_plan_reference", broken)
    with pytest.raises(InvariantError, match="I2 positions"):
        run(pair, check=True)
    assert not matches_ar(pair, run(pair))


def test_rejected_drafts_left_visible(pair, monkeypatch):
    original = speculative.accept

    def broken(ctx, batch, *args):
        verified = batch.target_cache.length.clone()  # after verification: every draft cached
        out = original(ctx, batch, *args)
        batch.target_cache.set_rows(length=verified, host_length=verified.tolist())  # "forget" the rejected ones
        return out  # what each row emitted (the engine commits it)

    monkeypatch.setattr(speculative, "accept", broken)
    with pytest.raises(InvariantError, match="lengths: target"):
        run(pair, check=True)
    try:  # unchecked, the stale drafts are attended to (wrong tokens) until the cache overflows
        outs = run(pair)
    except ValueError as err:
        assert "KV cache overflow" in str(err)
    else:
        assert not matches_ar(pair, outs)


def test_bonus_token_from_the_draft(pair, monkeypatch):
    propose, sample = ModelProposer.propose, speculative.rejection_sample
    extra = {}

    def propose_one_more(self, ctx, batch, k, noise, plan=None):
        p = propose(self, ctx, batch, k + 1, noise)  # noise has k + 1 columns: enough for k + 1 drafts
        extra["draft_bonus"] = p.tokens[:, -1]  # the draft's guess after its k-th token
        return Proposal(p.tokens[:, :-1], p.length.clamp(max=k), [k] * len(batch),
                        None if p.probs is None else p.probs[:, :-1], p.finite)

    def bonus_from_draft(draft_ids, *args, **kwargs):
        output, accepted = sample(draft_ids, *args, **kwargs)
        k = draft_ids.shape[1]
        full = accepted == k
        output[full, k] = extra["draft_bonus"][full]
        return output, accepted

    monkeypatch.setattr(ModelProposer, "propose", propose_one_more)
    monkeypatch.setattr(speculative, "rejection_sample", bonus_from_draft)
    outs = run(pair, check=True)  # the caches stay consistent: only the content is wrong
    assert not matches_ar(pair, outs)


def test_acceptance_truncated_to_batch_minimum(pair, monkeypatch):
    alone = [o.accepted_counts for o in run(pair, batch_size=1)]
    assert [o.accepted_counts for o in run(pair, batch_size=8)] == alone  # I5: a row's acceptance is its own

    sample = speculative.rejection_sample

    def truncated(draft_ids, target_argmax, *args, **kwargs):
        output, accepted = sample(draft_ids, target_argmax, *args, **kwargs)
        a = int(accepted.min())
        output[:, a + 1:] = -1
        output[:, a] = target_argmax[:, a]
        return output, accepted.clamp(max=a)

    monkeypatch.setattr(speculative, "rejection_sample", truncated)
    outs = run(pair, batch_size=8)
    assert matches_ar(pair, outs)  # truncation keeps the content right ...
    assert [o.accepted_counts for o in outs] != alone  # ... but breaks independence, and this test sees it
