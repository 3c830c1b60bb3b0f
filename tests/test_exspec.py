"""EXSPEC: exact equality with AR (float64, greedy) over the three families and a covering selection of
k, batch and window sizes; same-length prompts group, all-different prompts stay exact, bounded waiting
holds against an adversarial mix, sampling with seeds does not depend on the batching. Invariant checks
run after every step (tests/conftest.py gives every LLM check_invariants=True)."""
import random

import pytest

from checkpoints import FAMILIES
from specdec import LLM, SamplingParams
from specdec.schedulers import exspec

pytestmark = pytest.mark.slow  # not in the fast lane (pytest.ini)

PARAMS = SamplingParams(max_tokens=48)
VOCAB = 131

# (k, batch_size, window_size, max_wait_steps, fold_shift) per family: every k in {1, 3, 5}, batch size
# in {1, 2, 3, 8, 16} and window in {batch_size, 16, 48} occurs at least once; the folded shift runs too.
CONFIGS = {
    "llama": [(5, 1, 48, 8, False), (3, 8, 16, 8, True), (1, 16, 16, 8, False)],
    "qwen3": [(1, 2, 2, 8, False), (5, 16, 48, 4, False), (3, 3, 48, 2, True)],
    "glm4": [(3, 3, 3, 8, False), (1, 8, 48, 8, False), (5, 2, 16, 1, True)],
}


def mixed_prompts(n=24, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def ar(target, prompts, params=PARAMS):
    outs = LLM(target, method="ar", batch_size=1, dtype="float64").generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.token_ids for o in outs]


def exspec_llm(target, draft, k, batch_size, window_size, max_wait_steps=8, **options):
    """The draft model's k drafts every step (no lookup beside it, no stop when unsure), so that the forwards
    are counted exactly; tests/test_speculation_cpu.py runs EXSPEC with the defaults' composed proposers."""
    options = {"lookup": None, "draft_confidence": 0, **options}
    return LLM(target, draft, method="exspec", num_speculative_tokens=k, batch_size=batch_size,
               window_size=window_size, max_wait_steps=max_wait_steps, dtype="float64", profile=True, **options)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, checkpoint_pairs):
    family = request.param
    target, draft = checkpoint_pairs(family)
    prompts = mixed_prompts()
    return family, target, draft, prompts, ar(target, prompts)


def check_metrics(outs, k, reference, max_wait_steps):
    m = outs.metrics
    assert m.generated_tokens == sum(len(r) for r in reference)
    prefills = m.target_forwards - m.steps
    assert prefills >= 1 and m.draft_forwards == prefills + k * m.steps  # forwards counted like speculative_step
    assert 0 <= m.grouped_steps <= m.steps
    assert (m.phase_time_s["realign"] > 0) == (m.grouped_steps < m.steps)  # only mixed batches realign
    assert max(o.longest_wait_steps for o in outs) <= max_wait_steps
    assert m.row_steps == sum(len(o.accepted_counts) for o in outs)
    assert m.target_forwards < m.generated_tokens


def test_exspec_equals_ar(setup):
    family, target, draft, prompts, reference = setup
    for k, batch_size, window, max_wait, fold in CONFIGS[family]:
        outs = exspec_llm(target, draft, k, batch_size, window, max_wait, fold_shift=fold).generate(
            prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.index for o in outs] == list(range(len(prompts)))
        for o, ref in zip(outs, reference):
            assert o.token_ids == ref, f"{family} k={k} B={batch_size} W={window} fold={fold}: request {o.index}"
        assert 0.3 <= outs.metrics.acceptance_rate <= 0.95
        check_metrics(outs, k, reference, max_wait)


@pytest.fixture(scope="module")
def llama(llama_pair):
    return llama_pair


def test_same_length_prompts_group(llama, monkeypatch):
    """All prompts of one length: full same-length groups at first (32 rows, batches of 8), and groups keep
    forming as the lengths spread (rows that accept alike stay together)."""
    target, draft = llama
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(20)] for _ in range(32)]
    reference = ar(target, prompts)
    picks = []

    def spy(*args):
        chosen, grouped = schedule(*args)
        picks.append((len(chosen), grouped))
        return chosen, grouped

    schedule = exspec.schedule
    monkeypatch.setattr(exspec, "schedule", spy)
    outs = exspec_llm(target, draft, 3, 8, 48).generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert picks[:4] == [(8, True)] * 4
    m = outs.metrics
    assert m.grouped_steps == sum(g for _, g in picks) and m.grouping_rate >= 0.35, f"{m.grouping_rate:.2f}"
    check_metrics(outs, 3, reference, 8)


def test_all_different_lengths(llama):
    """No two prompts share a length: no group at the start, still exact (mixed, realigned batches)."""
    target, draft = llama
    rng = random.Random(2)
    lengths = rng.sample(range(1, 61), 24)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    reference = ar(target, prompts)
    for fold in (False, True):
        outs = exspec_llm(target, draft, 5, 4, 24, 3, fold_shift=fold).generate(
            prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == reference, f"fold={fold}"
        assert outs.metrics.grouped_steps < outs.metrics.steps
        check_metrics(outs, 5, reference, 3)


def test_bounded_wait_adversarial(llama):
    """Many rows of one length (groups always available and preferred) and a few odd ones that only a
    mixed step or the wait bound would schedule: no row waits more than max_wait_steps, and the bound
    is what got them scheduled (some row waited exactly max_wait_steps)."""
    target, draft = llama
    rng = random.Random(3)
    lengths = [12] * 30 + [1, 5, 33, 47, 59, 60]
    rng.shuffle(lengths)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=24)
    reference = ar(target, prompts, params)
    worst = float("inf")  # realign cost: any group beats a mixed batch, the worst case for waits
    for max_wait in (0, 2):
        outs = exspec_llm(target, draft, 3, 4, 48, max_wait, realign_cost_ratio=worst).generate(
            prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == reference
        waits = [o.longest_wait_steps for o in outs]
        assert max(waits) == max_wait, waits
    assert outs.metrics.grouped_steps > 0


def test_schedule_keeps_waits_bounded():
    """The scheduler alone, on random pools: never over the bound, never an infeasible state."""
    rng = random.Random(4)
    for trial in range(300):
        B, m = rng.randint(1, 6), rng.randint(0, 5)
        limit = exspec.pool_limit(rng.randint(B, 40), B, m)
        lengths, waits = [], []
        for step in range(40):
            while len(lengths) < limit and rng.random() < 0.7:  # refill
                lengths.append(rng.randint(1, 6)), waits.append(0)
            if not lengths:
                continue
            min_group = rng.choice([0, 1, B, exspec.min_group_size(B, len(lengths), rng.choice([0.0, 0.175, 1.0]))])
            chosen, grouped = exspec.schedule(lengths, waits, B, m, min_group)
            assert 1 <= len(chosen) <= B and len(set(chosen)) == len(chosen)
            assert grouped == (len({lengths[i] for i in chosen}) == 1)
            for i in range(len(lengths)):
                if i in chosen:
                    waits[i], lengths[i] = 0, lengths[i] + rng.randint(1, 3)
                else:
                    waits[i] += 1
                assert waits[i] <= m
            for i in sorted((i for i in range(len(lengths)) if rng.random() < 0.1), reverse=True):
                del lengths[i], waits[i]  # finished


def test_schedule_prefers_largest_group_then_waiting():
    # lengths 5 x3, 7 x3, 9 x1: groups of 5 and 7 tie on size; the 7s have waited longer
    chosen, grouped = exspec.schedule([5, 5, 5, 7, 7, 7, 9], [0, 0, 1, 2, 0, 0, 0], 3, 8, 1)
    assert grouped and sorted(chosen) == [3, 4, 5]
    chosen, grouped = exspec.schedule([5, 5, 7], [0, 0, 3], 2, 8, 1)  # the larger group wins over waiting
    assert grouped and sorted(chosen) == [0, 1]
    chosen, grouped = exspec.schedule([5, 5, 7], [0, 0, 3], 2, 3, 1)  # ... unless row 2 is due
    assert grouped and chosen == [2]
    chosen, grouped = exspec.schedule([5, 5, 7], [0, 0, 3], 2, 3, 2)  # ... and alone it is not worth a step
    assert not grouped and sorted(chosen) == [0, 2]
    chosen, grouped = exspec.schedule([5, 5, 7, 8], [0, 0, 0, 0], 4, 8, 3)  # no group of 3: mixed
    assert not grouped and sorted(chosen) == [0, 1, 2, 3]
    assert exspec.pool_limit(48, 1, 8) == 9 and exspec.pool_limit(48, 8, 8) == 48


def test_min_group_size():
    assert [exspec.min_group_size(b, 100, 0.175) for b in (1, 2, 4, 8, 16)] == [1, 2, 3, 4, 5]
    assert exspec.min_group_size(8, 3, 0.175) == 2  # a mixed step could only run the 3 live rows
    assert exspec.min_group_size(8, 100, 0.0) == 8 and exspec.min_group_size(8, 100, float("inf")) == 1


def test_sampling_same_seed_same_output_any_batching(llama):
    target, draft = llama
    prompts = mixed_prompts(12, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i)
              for i in range(len(prompts))]
    runs = []
    for k, batch_size, window, fold in ((3, 2, 2, False), (3, 4, 12, True), (3, 8, 48, False)):
        outs = exspec_llm(target, draft, k, batch_size, window, fold_shift=fold).generate(
            prompt_token_ids=prompts, sampling_params=params)
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] != ar(target, prompts, SamplingParams(max_tokens=24))  # really sampled, not greedy


def test_requests_that_stop_early(llama):
    """Per-request max_tokens (1: done at the prefill) and EOS inside accepted blocks: slots are freed and
    refilled mid-run, and every row still stops exactly where AR does."""
    target, draft = llama
    prompts = mixed_prompts()
    params = [SamplingParams(max_tokens=(1, 2, 7, 48)[i % 4]) for i in range(len(prompts))]
    reference = LLM(target, method="ar", batch_size=1, dtype="float64").generate(
        prompt_token_ids=prompts, sampling_params=params)
    assert any(o.finish_reason == "stop" for o in reference), "no prompt hits EOS: the stop path is untested"
    outs = exspec_llm(target, draft, 3, 3, 5).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in reference]


def test_rejects_negative_max_wait(llama):
    target, draft = llama
    with pytest.raises(ValueError, match="max_wait_steps"):
        exspec_llm(target, draft, 3, 2, 4, -1)
