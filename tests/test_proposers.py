"""Proposers without a model (ngram prompt lookup, suffix decoding) and beside one (--lookup): their indexes
against brute force, the bounded thread-safe store, and exactness -- greedy output equals AR token for
token for every method, fixed and auto k, rows joining and leaving, on prompts with planted repeats so
that long, partial and missing matches all occur."""
import random
import threading
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.proposers import NgramProposer, SuffixProposer, SuffixStore, host_proposal, one_hot_probs
from specdec.proposers.ngram import NgramIndex
from specdec.proposers.suffix import SuffixTrie

FEW = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MODEL_RUNS = settings(max_examples=3, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------- indexes
def brute_ngram(seq, k, ngram_min, ngram_max):
    """The continuation of the latest earlier occurrence of the longest matching suffix (rescanning)."""
    for n in range(ngram_max, ngram_min - 1, -1):
        if n > len(seq):
            continue
        suffix = seq[len(seq) - n:]
        for e in range(len(seq) - 1, n - 1, -1):  # the n-gram ends at e (exclusive), seq[e] follows it
            if seq[e - n:e] == suffix:
                return seq[e:e + k]
    return []


@FEW
@given(seq=st.lists(st.integers(0, 4), max_size=60), chunks=st.lists(st.integers(1, 7), min_size=1),
       sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)), k=st.integers(1, 6))
def test_ngram_index_equals_a_rescan(seq, chunks, sizes, k):
    """Fed in chunks (as rows gain tokens step by step), the incremental index proposes what a rescan of
    the whole sequence finds, after every chunk."""
    ngram_min, ngram_max = sizes[0], sizes[0] + sizes[1]
    index, fed, i = NgramIndex(ngram_min, ngram_max), 0, 0
    while fed < len(seq):
        step = chunks[i % len(chunks)]
        index.extend(seq[fed:fed + step])
        fed = min(fed + step, len(seq))
        i += 1
        assert index.lookup(k) == brute_ngram(seq[:fed], k, ngram_min, ngram_max)


def substring_counts(seqs, depth):
    counts = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for n in range(1, depth + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i:i + n])] += 1
    return counts


def trie_counts(trie):
    counts, stack = Counter(), [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


@FEW
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=4),
       depth=st.integers(2, 6), split=st.integers(0, 25))
def test_suffix_trie_counts_every_substring_and_forgets_exactly(seqs, depth, split):
    trie = SuffixTrie(depth)
    first = seqs[0]
    active = trie.add(first[:split])  # a sequence added in two parts, as a row grows
    trie.add(first[split:], active)
    for seq in seqs[1:]:
        trie.add(seq)
    assert trie_counts(trie) == +substring_counts(seqs, depth)
    for seq in seqs[1:]:
        trie.remove(seq)
    assert trie_counts(trie) == +substring_counts(seqs[:1], depth)
    trie.remove(first)
    assert not trie.root.children


def test_suffix_continuation_follows_the_most_frequent_path_and_adapts_its_length():
    trie = SuffixTrie(8)
    for _ in range(3):
        trie.add([1, 2, 3, 4, 5])
    trie.add([1, 2, 3, 9])
    # after [1, 2]: 3 follows 4 of 4 times, then 4 (3 of 4), then 5: products 1, 0.75, 0.75
    tokens, score = trie.continuation([7, 1, 2], k=5, max_spec_factor=2.0, min_token_prob=0.1)
    assert tokens == [3, 4, 5] and score == pytest.approx(2.5)
    # the draft length is capped at max_spec_factor x the match length (2 here) ...
    assert trie.continuation([7, 1, 2], k=5, max_spec_factor=1.0, min_token_prob=0.1)[0] == [3, 4]
    # ... and stops where the path's probability falls below min_token_prob
    assert trie.continuation([7, 1, 2], k=5, max_spec_factor=2.0, min_token_prob=0.8)[0] == [3]
    assert trie.continuation([6, 6], k=5, max_spec_factor=2.0, min_token_prob=0.1) == ([], 0.0)


def test_a_row_matches_its_own_earlier_text_not_its_current_end():
    """A row's trie holds its current suffix too (with nothing after it): the match is the longest suffix
    that occurred earlier followed by something."""
    proposer = SuffixProposer(store=None, max_spec_factor=4.0)
    request = type("R", (), {"request_id": "0", "key": ("0", 0), "prompt_ids": [5, 1, 2, 3, 8, 6, 1, 2, 3], "output_ids": []})()
    assert proposer.drafts(request, 4) == [8, 6, 1, 2]
    request.output_ids = [8]
    assert proposer.drafts(request, 2) == [6, 1]


def test_suffix_store_is_bounded_and_safe_across_threads():
    store = SuffixStore(max_tokens=500, depth=8)
    rng = random.Random(0)
    errors = []

    def writer(seed):
        r = random.Random(seed)
        try:
            for _ in range(60):
                store.add([r.randrange(20) for _ in range(r.randint(1, 40))])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def reader():
        try:
            for _ in range(300):
                store.continuation([rng.randrange(20) for _ in range(5)], 4, 1.0, 0.1)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.tokens == sum(map(len, store.outputs)) <= 500
    assert trie_counts(store.trie) == +substring_counts(list(store.outputs), 8)  # eviction forgot exactly
    off = SuffixStore(max_tokens=0)
    off.add([1, 2, 3])
    assert off.tokens == 0 and not off.trie.root.children


def test_one_hot_proposal_pads_rows_and_carries_their_lengths():
    params = type("P", (), {"any_rejection": True})()
    p = host_proposal([[4, 5, 6], [], [7]], 2, params, 10, torch.float32, "cpu")
    assert p.tokens.tolist() == [[4, 5], [0, 0], [7, 0]] and p.lengths == [2, 0, 1] and p.length.tolist() == [2, 0, 1]
    assert p.probs.shape == (3, 2, 10) and p.probs.sum(-1).tolist() == [[1, 1], [1, 1], [1, 1]]
    assert one_hot_probs(p.tokens, 10, p.probs.dtype)[0, 1, 5] == 1


def test_bad_proposer_settings_get_one_line(checkpoint_pairs):
    target = checkpoint_pairs("llama")[0]
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="ngram_min \\(5\\) must be <= ngram_max \\(4\\)"):
        LLM(target, draft="ngram", ngram_min=5)
    with pytest.raises(ValueError, match=r"lookup \(--lookup\) must be 'auto' or one of .ngram., .suffix., .none. or None"):
        LLM(target, draft=checkpoint_pairs("llama")[1], lookup="bigram")
    with pytest.raises(ValueError, match="lookup= goes beside a draft model"):
        LLM(target, draft="ngram", lookup="suffix")
    with pytest.raises(ValueError, match=r"suffix_store_tokens \(--suffix-store-tokens\) must be an integer >= 0"):
        LLM(target, draft="suffix", suffix_store_tokens=-1)


# ---------------------------------------------------------------------------------------- exactness
def planted_prompts(rng: random.Random, n: int, vocab: int = 131):
    """Prompts with repeats planted: a motif appears twice (a long match), a cut copy (a partial match),
    or not at all."""
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 10))]
        noise = lambda: [rng.randrange(3, vocab) for _ in range(rng.randint(0, 8))]  # noqa: E731
        kind = rng.choice(("long", "partial", "none"))
        if kind == "long":
            prompt = noise() + motif + noise() + motif + noise() + motif[: rng.randint(1, len(motif))]
        elif kind == "partial":
            prompt = noise() + motif + noise() + motif[: rng.randint(1, len(motif) - 1)]
        else:
            prompt = noise() + motif
        prompts.append(prompt or [3])
    return prompts


@pytest.fixture(scope="module")
def ar_reference(checkpoint_pairs):
    target, draft = checkpoint_pairs("llama")
    ar = LLM(target, method="ar", batch_size=4, dtype="float64")
    cache = {}

    def reference(prompts, max_tokens):
        key = (tuple(map(tuple, prompts)), max_tokens)
        if key not in cache:
            cache[key] = [o.token_ids for o in ar.generate(prompt_token_ids=prompts,
                                                           sampling_params=SamplingParams(max_tokens=max_tokens))]
        return cache[key]

    return target, draft, reference


DRAFTERS = ("ngram", "suffix", "model+ngram", "model+suffix")


def build(target, draft, drafter, method, k, batch_size, tmp_path, dtype="float64"):
    kwargs = dict(method=method, num_speculative_tokens=k, batch_size=batch_size, dtype=dtype,
                  check_invariants=True, cost_cache=str(tmp_path / "costs.json"), max_speculative_tokens=5)
    if drafter.startswith("model+"):
        return LLM(target, draft, lookup=drafter.split("+")[1], **kwargs)
    return LLM(target, draft=drafter, **kwargs)


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
@pytest.mark.parametrize("drafter", DRAFTERS)
@MODEL_RUNS
@given(seed=st.integers(0, 10_000), k=st.sampled_from([1, 3, "auto"]), batch_size=st.sampled_from([1, 3, 4]))
def test_lookup_drafters_equal_ar(ar_reference, tmp_path, method, drafter, seed, k, batch_size):
    """Six prompts on fewer rows: rows join and leave mid-run; the rows' draft lengths differ every step."""
    target, draft, reference = ar_reference
    prompts = planted_prompts(random.Random(seed), 6)
    expected = reference(prompts, 24)
    llm = build(target, draft, drafter, method, k, batch_size, tmp_path)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == expected, (drafter, method, k, batch_size)
    assert outs.metrics.drafter == drafter


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_lookup_drafters_equal_ar_in_float32_and_draft_unevenly(checkpoint_pairs, tmp_path, drafter):
    target = checkpoint_pairs("llama")[0]
    prompts = planted_prompts(random.Random(1), 8)
    params = SamplingParams(max_tokens=32)
    expected = [o.token_ids for o in LLM(target, method="ar", dtype="float32").generate(
        prompt_token_ids=prompts, sampling_params=params)]
    for method in ("eqspec", "ragged"):
        outs = build(target, None, drafter, method, 4, 4, tmp_path, dtype="float32").generate(
            prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == expected
        m = outs.metrics
        assert m.proposed_drafts > 0 and 0 < m.acceptance_rate < 1
        offered = {k for o in outs for k in o.speculative_tokens}
        assert len(offered) >= 3, offered  # rows offered different draft lengths (0 included) in one run
        assert m.draft_forwards == 0  # no model ran


def test_the_store_drafts_for_the_next_request(checkpoint_pairs):
    """The same prompt asked again: with the cross-request store its second run drafts from the first's
    output; per-request only, it cannot (a prompt without repeats offers nothing of its own)."""
    target = checkpoint_pairs("llama")[0]
    prompt = [[7, 19, 33, 58, 71, 90, 104, 118]]
    params = SamplingParams(max_tokens=24)
    for tokens, expect_more in ((16384, True), (0, False)):
        llm = LLM(target, draft="suffix", num_speculative_tokens=4, batch_size=1, dtype="float64",
                  suffix_store_tokens=tokens)
        first = llm.generate(prompt_token_ids=prompt, sampling_params=params)
        second = llm.generate(prompt_token_ids=prompt, sampling_params=params)
        assert second[0].token_ids == first[0].token_ids
        gained = second.metrics.accepted_drafts - first.metrics.accepted_drafts
        assert (gained > 8) == expect_more, (tokens, first.metrics.accepted_drafts, second.metrics.accepted_drafts)


def test_two_engines_share_the_store_but_not_row_state(checkpoint_pairs):
    """Two Engines on one LLM: each has its own proposer (request ids "0", "1" .. overlap), one store."""
    target = checkpoint_pairs("llama")[0]
    llm = LLM(target, draft="suffix", num_speculative_tokens=3, batch_size=2, dtype="float64")
    a, b = llm.engine(), llm.engine()
    assert a.proposer is not b.proposer and a.proposer.store is b.proposer.store is llm.suffix_store
    prompts = planted_prompts(random.Random(5), 4)
    expected = [o.token_ids for o in LLM(target, method="ar", dtype="float64").generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=16))]
    for p in prompts[:2]:
        a.add_request(p, SamplingParams(max_tokens=16))
    for p in prompts[2:]:
        b.add_request(p, SamplingParams(max_tokens=16))
    got = {}
    while a.has_unfinished() or b.has_unfinished():  # interleaved steps
        for name, engine in (("a", a), ("b", b)):
            if engine.has_unfinished():
                for d in engine.step():
                    if d.finished:
                        got[(name, d.request_id)] = d.output.token_ids
    assert [got[("a", "0")], got[("a", "1")], got[("b", "0")], got[("b", "1")]] == expected
    assert not a.proposer.rows and not b.proposer.rows  # row state freed with the rows


# ---------------------------------------------------------------------------- a drafter brought by the user
class Oracle:
    """A drafter that knows AR's continuation of every prompt and declares a random length of it per row,
    with the true continuation in the padding too: a row that accepted past its own length, or a batch
    truncated to its shortest row, would show. Brought through `LLM(proposer=...)` (docs/api.md)."""

    uses_draft_model = False
    name = "oracle"

    def __init__(self, continuations, seed=0):
        self.continuations, self.rng = continuations, random.Random(seed)
        self.rows = set()
        self.declared, self.steps = [], []  # this step's declared lengths; (declared, accepted) of every row-step

    def plan(self, batch, k_max):
        self.rows |= {r.request_id for r in batch.requests}
        return [self.continuations[tuple(r.prompt_ids)][len(r.output_ids):][:k_max] for r in batch.requests]

    def propose(self, ctx, batch, k, noise, plan):
        proposal = host_proposal(plan, k, batch.params, ctx.vocab_size, ctx.probs_dtype, ctx.device)
        proposal.lengths = self.declared = [self.rng.randint(0, n) for n in proposal.lengths]
        proposal.length = torch.tensor(proposal.lengths, device=ctx.device)
        return proposal

    def observe(self, batch, k, seq_before, counts, num_accepted, kept=None):
        self.steps += list(zip(self.declared, counts))

    def release(self, request):
        self.rows.discard(request.request_id)


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
def test_each_row_accepts_exactly_its_own_length(ar_reference, method):
    target, _, reference = ar_reference
    prompts = planted_prompts(random.Random(3), 6)
    expected = reference(prompts, 24)
    oracle = {tuple(p): e for p, e in zip(prompts, expected)}
    made = []
    llm = LLM(target, method=method, num_speculative_tokens=4, batch_size=3, dtype="float64", check_invariants=True,
              proposer=lambda: made.append(Oracle(oracle)) or made[-1])
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == expected
    steps = made[0].steps  # the oracle is always right: a row accepts all it declared, and never more
    assert steps and all(a == n for n, a in steps), steps
    assert len({n for n, _ in steps}) >= 3 and outs.metrics.drafter == "oracle" and not made[0].rows


def test_a_row_that_takes_the_lookups_drafts_keeps_its_draft_cache_true(ar_reference, monkeypatch):
    """Beside a draft model, rows that take a lookup's drafts (always right here: the oracle) accept tokens
    the model did not draft; its cache must then keep only the sequence before the step (invariants on)."""
    target, draft, reference = ar_reference
    prompts = planted_prompts(random.Random(4), 4)
    expected = reference(prompts, 24)
    oracle = {tuple(p): e for p, e in zip(prompts, expected)}
    for method in ("eqspec", "ragged"):
        llm = LLM(target, draft, lookup="ngram", method=method, num_speculative_tokens=4, batch_size=2,
                  dtype="float64", check_invariants=True)
        monkeypatch.setattr(llm, "_lookup_proposer", lambda kind: Oracle(oracle))
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24))
        assert [o.token_ids for o in outs] == expected
        m = outs.metrics
        assert m.lookup_rows > 0 and set(m.drafts_by_drafter) <= {"model", "oracle"}
        assert m.drafts_by_drafter["oracle"][1] > 0


# ----------------------------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    from checkpoints import make_pair

    # a small vocabulary: frequencies can be compared with the exact distribution, and lookups find matches
    return make_pair("llama", tmp_path_factory.mktemp("small-lookup"), noise=0.3, vocab_size=12, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)[0]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
@pytest.mark.parametrize("seeded", [True, False])
def test_lookup_sampling_matches_target_distribution(small_vocab_target, drafter, seeded):
    """Deterministic drafts are one-hot distributions: rejection sampling (unseeded) and the coupled
    sampler (seeded) keep the target's distribution exactly."""
    from test_sampling import exact_marginal, total_variation

    prompt, n, V = [1, 5, 7, 5], 2000, 12
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s if seeded else None, ignore_eos=True)
              for s in range(n)]
    llm = LLM(small_vocab_target, draft=drafter, method="ragged", num_speculative_tokens=2, batch_size=64,
              dtype="float64", cost_cache="")
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    assert 0.05 < outs.metrics.acceptance_rate < 0.95 and outs.metrics.proposed_drafts > n / 2
    for position in (1, 2):  # produced by speculative steps (position 0 comes from the prefill)
        exact = exact_marginal(small_vocab_target, prompt, position + 1)
        empirical = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=V).double() / n
        assert total_variation(empirical, exact) < 0.06, f"token {position}: TV {total_variation(empirical, exact):.3f}"


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model+suffix"])
def test_seeded_requests_reproduce_seeded_ar_with_lookups(ar_reference, drafter, tmp_path):
    """The position-keyed coupled sampler: a seeded request's tokens are target-only AR's with that seed,
    whatever the lookups proposed, at any batch size, fixed or auto k."""
    target, draft, _ = ar_reference
    prompts = planted_prompts(random.Random(11), 6)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=100 + i) for i in range(6)]
    expected = [o.token_ids for o in LLM(target, method="ar", dtype="float64").generate(
        prompt_token_ids=prompts, sampling_params=params)]
    for k, batch_size in ((3, 4), ("auto", 2)):
        llm = build(target, draft, drafter, "ragged", k, batch_size, tmp_path)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == expected, (drafter, k, batch_size)
