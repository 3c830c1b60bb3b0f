"""The draft's lag rule (`Batch.set_draft_lag`, `DRAFT_LAG`) has one home, and every prefill and every draft
model's step follows it: after the one prefill (whole or in chunks, with or without the prefix cache, in either
layout) and after every step, a draft model holds each row's sequence but its last `DRAFT_LAG` tokens (a feature
draft: all but the last), K/V as a recomputation gives them. A wrong lag is caught: one token less leaves the
draft claiming the K/V of a draft it never fed."""
import random

import pytest

import specdec.batch
import specdec.engine
from specdec import LLM, SamplingParams
from specdec.batch import DRAFT_LAG
from specdec.commit import commit
from specdec.invariants import InvariantError, check_cache, check_invariants
from specdec.models import load_model
from specdec.models.cache import LEFT_PADDED, RAGGED
from specdec.prefill import ChunkedPrefill, prefill
from specdec.request import Request
from test_feature_draft import make_feature_draft


@pytest.fixture(scope="module")
def feature_pair(llama_pair):
    target = load_model(llama_pair[0], dtype="float32")
    return target, make_feature_draft(target)


def prompts_of(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 131) for _ in range(rng.randint(6, 20))] for _ in range(n)]


def requests_of(prompts):
    return [Request(i, p, SamplingParams(max_tokens=4, ignore_eos=True), frozenset(), request_id=str(i))
            for i, p in enumerate(prompts)]


def context(llama_pair, feature_pair, drafter, prefix):
    target, draft = feature_pair if drafter == "feature" else llama_pair
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=2, batch_size=4, dtype="float32",
              cost_cache="", prefix_cache_gb=0.01 if prefix else None)
    return llm.engine().ctx


def prefilled(ctx, requests, layout, chunk):
    """The batch of `requests` after the prefill (their first tokens committed), whole or a chunk per call."""
    if chunk is None:
        batch, first = prefill(ctx, requests, layout, 64)
    else:
        job = ChunkedPrefill(ctx, requests, chunk, layout)
        while (out := job.advance()) is None:
            pass
        batch, first = out
    commit(ctx, batch.requests, first)
    return batch


@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("prefix", [False, True], ids=["uncached", "prefix-cache"])
@pytest.mark.parametrize("drafter", ["model", "feature"])
@pytest.mark.parametrize("layout", [LEFT_PADDED, RAGGED])
def test_every_prefill_leaves_the_draft_the_lag_behind(llama_pair, feature_pair, layout, drafter, prefix, chunk):
    ctx = context(llama_pair, feature_pair, drafter, prefix)
    lag = 1 if drafter == "feature" else DRAFT_LAG
    prompts = prompts_of(3)
    prompts.append(prompts[0][:5] + [7, 8, 9])  # shares a prefix with the first
    rounds = 2 if prefix else 1  # the second round's prompts are in the prefix cache, the draft's part too
    for _ in range(rounds):
        groups = [requests_of(prompts)] if chunk is None else [[r] for r in requests_of(prompts)]
        for requests in groups:
            batch = prefilled(ctx, requests, layout, chunk)
            draft = batch.draft_cache
            assert draft.host_length == [r.sequence_length - lag for r in batch.requests]
            assert draft.length.tolist() == draft.host_length
            check_invariants(ctx, batch)  # the K/V it holds are the recomputation's
    if prefix:
        assert ctx.metrics.prefix_hit_tokens > 0


def lags_before_each_step(monkeypatch):
    """Records, before every step the engine takes, each row's lag (sequence length less draft cache length)."""
    seen, real = [], specdec.engine.check_invariants

    def spy(ctx, batch):
        seen.append([r.sequence_length - n for r, n in zip(batch.requests, batch.draft_cache.host_length)])
        real(ctx, batch)

    monkeypatch.setattr(specdec.engine, "check_invariants", spy)
    return seen


def generate(llama_pair, method, **kwargs):
    target, draft = llama_pair
    if method == "ar":
        llm = LLM(target, method="ar", batch_size=3, dtype="float32")
    else:
        # lookup=None: the model drafts every step (free drafts first would skip it where a lookup covers a row)
        llm = LLM(target, draft, method=method, num_speculative_tokens=2, batch_size=3, window_size=6,
                  dtype="float32", cost_cache="", check_invariants=True, lookup=None, **kwargs)
    outs = llm.generate(prompt_token_ids=prompts_of(5, seed=1),
                        sampling_params=SamplingParams(max_tokens=12, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method,options", [("eqspec", {}), ("exspec", {}),
                                            ("ragged", dict(prefix_cache_gb=0.01, prefill_chunk=4))],
                         ids=["eqspec", "exspec", "ragged-prefix-chunked"])
def test_every_site_takes_the_lag_from_the_one_rule(llama_pair, method, options, monkeypatch):
    """With a fixed k every step drafts, so every row lags exactly `DRAFT_LAG` before each step, whether a
    prefill or a step put it there; with the constant changed to 3, every row lags 3: no site has its own."""
    reference = generate(llama_pair, "ar")
    for lag in (DRAFT_LAG, 3):
        monkeypatch.setattr(specdec.batch, "DRAFT_LAG", lag)
        seen = lags_before_each_step(monkeypatch)
        assert generate(llama_pair, method, **options) == reference  # a longer lag only re-feeds tokens
        assert seen and all(row == lag for rows in seen for row in rows), (lag, seen)


def test_one_token_less_lag_leaves_stale_draft_kv(llama_pair, monkeypatch):
    """Lag 1: after a step that accepted every draft, the draft would claim the K/V of the k-th draft, which
    it proposed but never fed: the cache no longer agrees with a recomputation (the target's tokens stay AR's)."""
    def draft_kv_only(ctx, batch):  # whatever the length, what the draft claims must be what it computed
        sequences = [r.prompt_ids + r.output_ids for r in batch.requests]
        check_cache("draft", ctx.draft, batch.draft_cache, sequences, lag=1, exact=False)

    monkeypatch.setattr(specdec.engine, "check_invariants", draft_kv_only)
    generate(llama_pair, "eqspec")  # the rule as it is: the draft's K/V check out
    monkeypatch.setattr(specdec.batch, "DRAFT_LAG", 1)
    with pytest.raises(InvariantError, match="draft .*differs from recomputation"):
        generate(llama_pair, "eqspec")
