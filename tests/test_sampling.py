"""Sampling is exact in distribution: the rejection sampler converges to the target's distribution,
logits processing matches transformers' warpers and is safe at any temperature, speculative decoding at
temperature 1 reproduces the target's next-token frequencies with either sampler (coupled: seeded
requests, rejection: unseeded), and a seed fixes a request's output whatever the batch."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints import make_pair
from specdec import LLM, SamplingParams
from specdec.kernels.rejection import rejection_sample
from specdec.kernels.noise import RACE, exponential_noise
from specdec.sampling import RowParams, choose_tokens, probs_dtype, process_logits, request_seed, sample_race


def total_variation(p, q):
    return 0.5 * float((p - q).abs().sum())


def emitted_distribution(p, q, k, n, seed):
    """Run the sampler on n independent rows whose k+1 slots all have target p and draft q ([V]);
    returns the empirical distribution of every emitted token (accepted drafts and the final one)."""
    g = torch.Generator().manual_seed(seed)
    V = p.shape[0]
    draft_ids = torch.multinomial(q.expand(n * k, V), 1, replacement=True, generator=g).view(n, k)  # [n, k]
    target_probs = p.expand(n, k + 1, V)  # [n, k+1, V]
    draft_probs = q.expand(n, k, V)  # [n, k, V]
    uniforms = torch.rand(n, k, dtype=torch.float64, generator=g)
    noise = torch.empty(n, V, dtype=torch.float64).exponential_(generator=g)
    output, accepted = rejection_sample(draft_ids, None, target_probs, draft_probs,
                                        torch.zeros(n, dtype=torch.bool), uniforms, noise)
    tokens = output[output >= 0]
    assert len(tokens) == int((accepted + 1).sum())
    return torch.bincount(tokens, minlength=V).double() / len(tokens)


def bound(V, n):
    """Far above the expected sampling noise (about 0.4 * sqrt(V / n)), far below a wrong distribution."""
    return 1.5 * (V / n) ** 0.5 + 0.005


@pytest.mark.parametrize("V", [2, 7, 100, 257])
@pytest.mark.parametrize("k", [1, 4])
def test_rejection_sampler_converges_to_target(V, k):
    g = torch.Generator().manual_seed(V * 10 + k)
    p = torch.softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), 0)
    assert total_variation(p, q) > 0.2  # the draft alone would be far off
    counts = (1_000, 10_000, 50_000)
    distances = [total_variation(emitted_distribution(p, q, k, n, seed=n), p) for n in counts]
    assert distances[2] < distances[0]  # shrinking with the sample count
    assert distances[2] < bound(V, counts[2])


def coupled_emitted(p, q, k, n, seed):
    """The coupled sampler on n rows (keys seed + row) whose k+1 slots have target p and draft q ([V]) as the
    runtime runs it (speculative.accept): drafts and target samples are races on the same keyed noise, drafts
    accepted while equal. Returns (empirical distribution of every emitted token, accepted fraction)."""
    V = p.shape[0]
    seeds = torch.arange(n, dtype=torch.int64) + seed * n
    noise = exponential_noise(seeds, torch.zeros(n, dtype=torch.int64), k + 1, V, RACE, torch.float64)  # [n, k+1, V]
    draft_ids = sample_race(q.expand(n, k, V), noise[:, :k])  # [n, k]
    target = sample_race(p.expand(n, k + 1, V), noise)  # [n, k+1]
    output, accepted = rejection_sample(draft_ids, target, is_greedy=torch.ones(n, dtype=torch.bool))
    tokens = output[output >= 0]
    assert torch.equal(tokens, target[torch.arange(k + 1)[None, :] <= accepted[:, None]])  # the target's own
    return torch.bincount(tokens, minlength=V).double() / len(tokens), float(accepted.sum()) / (n * k)


def filtered(logits, top_k, top_p):
    n = logits.shape[0]
    return process_logits(logits, torch.ones(n, dtype=torch.float64), torch.full((n,), top_k),
                          torch.full((n,), top_p, dtype=torch.float64), torch.float64)


@pytest.mark.parametrize("V,k,top_k,top_p", [(2, 1, 0, 1.0), (7, 4, 0, 1.0), (7, 2, 3, 1.0), (100, 3, 0, 0.8),
                                           (100, 1, 5, 1.0), (257, 1, 0, 0.9)])
def test_coupled_sampler_converges_to_target(V, k, top_k, top_p):
    """The coupled sampler's tokens are distributed as the (top-k / top-p filtered) target, whatever the
    draft; and it accepts at most what rejection sampling does, sum(min(p, q)) per draft."""
    g = torch.Generator().manual_seed(V * 10 + k)
    p, q = filtered(2 * torch.randn(2, V, generator=g, dtype=torch.float64), top_k, top_p)
    assert total_variation(p, q) > 0.2  # the draft alone would be far off
    counts = (1_000, 5_000, 20_000)
    runs = [coupled_emitted(p, q, k, n, seed=n) for n in counts]
    distances = [total_variation(dist, p) for dist, _ in runs]
    assert distances[2] < distances[0]
    assert distances[2] < bound(V, counts[2])
    n = counts[2] * k
    agree = torch.minimum(p, q).sum()  # rejection sampling's acceptance of one draft
    assert runs[2][1] < agree + 3 * (agree * (1 - agree) / n) ** 0.5 + 1e-3


def test_accepting_every_draft_would_be_caught():
    """The convergence check above has teeth: the draft's own distribution fails it."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(7, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(2 * torch.randn(7, generator=g, dtype=torch.float64), 0)
    draft_only = emitted_distribution(q, q, 3, 100_000, seed=1)  # p == q: everything accepted
    assert total_variation(draft_only, p) > bound(7, 100_000)


def test_greedy_rows_follow_target_argmax():
    draft = torch.tensor([[4, 5, 6], [4, 5, 6], [1, 1, 1]])
    argmax = torch.tensor([[4, 5, 6, 9], [4, 7, 6, 9], [0, 1, 1, 2]])
    out, accepted = rejection_sample(draft, argmax, is_greedy=torch.ones(3, dtype=torch.bool))
    assert accepted.tolist() == [3, 1, 0]
    assert out.tolist() == [[4, 5, 6, 9], [4, 7, -1, -1], [0, -1, -1, -1]]  # bonus, correction, -1 placeholders


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 0.7), (5, 1.0, 1.0), (0, 0.8, 1.3), (10, 0.5, 0.9)])
def test_logits_processing_matches_transformers(top_k, top_p, temperature):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 131, generator=torch.Generator().manual_seed(3)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    expected = expected.softmax(-1)
    n = logits.shape[0]
    got = process_logits(logits, torch.full((n,), temperature, dtype=torch.float64),
                         torch.full((n,), top_k), torch.full((n,), top_p, dtype=torch.float64))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


TEMPERATURES = st.one_of(st.sampled_from([1e-45, 1e-40, 1e-38, 1e-30, 1e-8, 1e-3, 0.7, 1.0, 1e3]),
                         st.floats(min_value=1e-45, max_value=1e3))


@settings(max_examples=120)
@given(temperature=TEMPERATURES, dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       V=st.sampled_from([2, 17, 300]), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
       top_k=st.sampled_from([0, 1, 5]), top_p=st.sampled_from([1.0, 0.9, 0.3]), seed=st.integers(0, 2**32))
def test_any_temperature_gives_a_valid_token_and_the_greedy_one_when_one_hot(temperature, dtype, V, scale, top_k,
                                                                            top_p, seed):
    """1e-45 to 1e3 in every dtype: a token of positive probability, never a NaN distribution, and the
    greedy token wherever the processed distribution is numerically one-hot (`--temperature 1e-38` used to
    give token 0 for every token: the logits divided by it overflowed)."""
    B = 4
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + i) for i in range(B)]
    rows = RowParams.of(params, [request_seed(p.seed) for p in params], "cpu")
    positions = torch.arange(B, dtype=torch.int64) * 7
    tokens = choose_tokens(logits, rows, probs_dtype(dtype), positions, positions.tolist())
    probs = rows.probs(logits, probs_dtype(dtype))  # [B, V]
    assert torch.isfinite(probs).all() and torch.allclose(probs.double().sum(-1), torch.ones(B, dtype=torch.float64))
    assert ((tokens >= 0) & (tokens < V)).all()
    assert (probs.gather(1, tokens[:, None]) > 0).all()
    one_hot = probs.max(dim=-1).values == 1
    assert torch.equal(tokens[one_hot], logits.argmax(dim=-1)[one_hot])
    if temperature <= 1e-38:  # far below any gap between distinct logits: one-hot unless the top is tied
        top = logits.max(dim=-1, keepdim=True).values
        assert torch.equal(one_hot, (logits == top).sum(-1) == 1)


def test_a_tiny_temperature_decodes_as_greedy(tmp_path):
    """The CLI report: `--temperature 1e-38` gave token 0 everywhere, for every method."""
    target, draft = make_pair("llama", tmp_path)
    prompts = [[5, 9, 11], [40, 2, 7, 8]]
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=2, dtype="float32")
    greedy = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12))
    for seed in (3, None):
        tiny = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(max_tokens=12, temperature=1e-38, seed=seed))
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
    assert any(t != 0 for o in greedy for t in o.token_ids)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    # a small vocabulary so that frequencies can be compared with the exact distribution
    return make_pair("llama", tmp_path_factory.mktemp("small"), noise=0.3, vocab_size=12, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)


def exact_marginal(target_dir, prompt, steps):
    """Exact distribution of the `steps`-th generated token under the target (temperature 1, no EOS
    stop), by enumerating every path: [V]."""
    from specdec.models import load_model

    model = load_model(target_dir, dtype="float64")
    V = model.vocab_size
    paths, weights = [list(prompt)], torch.ones(1, dtype=torch.float64)
    for _ in range(steps):
        ids = torch.tensor(paths)
        cache = model.new_cache(len(paths), ids.shape[1] + 1, "ragged")
        probs = model.forward(ids, cache, logits="last")[:, -1].softmax(-1)  # [P, V]
        joint = weights[:, None] * probs  # [P, V]
        paths = [p + [t] for p in paths for t in range(V)]
        weights = joint.reshape(-1)
    return weights.view(-1, V).sum(0)


@pytest.mark.parametrize("k,seeded", [(2, True), ("auto", True), ("changing", True), (2, False), ("changing", False)])
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, k, seeded):
    """Fixed k, automatic k, and k changing every step with k = 0 steps (ScriptedChooser); seeded requests
    (coupled sampler) and unseeded ones (rejection sampling)."""
    from choosers import ScriptedChooser

    target, draft = small_vocab_pair
    prompt = [1, 5, 7]
    n = 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s if seeded else None, ignore_eos=True)
              for s in range(n)]
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=2 if k == 2 else "auto", max_speculative_tokens=3,
              batch_size=64, dtype="float64", check_invariants=False, cost_cache="")
    if k == "changing":
        llm.chooser = ScriptedChooser((2, 0, 3, 1), 3)
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    if k != "auto":  # auto may rightly choose k = 0 here (the two tiny models cost the same)
        assert 0.2 < outs.metrics.acceptance_rate < 0.95
    V = 12
    for position in (1, 2):  # produced by speculative steps (position 0 comes from the prefill)
        exact = exact_marginal(target, prompt, position + 1)
        empirical = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=V).double() / n
        assert total_variation(empirical, exact) < 0.06, f"token {position}: TV {total_variation(empirical, exact):.3f}"


@pytest.mark.parametrize("method", ["ragged", "eqspec"])
def test_seed_fixes_output_whatever_the_batch(tmp_path_factory, method):
    target, draft = make_pair("qwen3", tmp_path_factory.mktemp("seeded"))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=100 + i) for i in range(6)]

    def run(batch_size, ps, prs):
        llm = LLM(target, draft, method=method, num_speculative_tokens=3, batch_size=batch_size, dtype="float64")
        return [o.token_ids for o in llm.generate(prompt_token_ids=prs, sampling_params=ps)]

    alone = run(1, params, prompts)
    assert run(4, params, prompts) == alone
    # other requests around them (and a different order) change nothing for the seeded ones
    extra = [SamplingParams(max_tokens=16, temperature=1.0, seed=7), SamplingParams(max_tokens=16)]
    mixed = run(3, [extra[0]] + params[::-1] + [extra[1]], [[9, 9]] + prompts[::-1] + [[4]])
    assert mixed[1:-1] == alone[::-1]
    assert len({tuple(t) for t in alone}) > 1


@pytest.mark.parametrize("seeded", [True, False])
def test_non_finite_draft_keeps_the_target_distribution(small_vocab_pair, seeded):
    """A draft whose logits are NaN must not change the output distribution: its drafts are rejected and
    the target's own sample stands (it used to turn every sampled token into token 0)."""
    import warnings

    from specdec.models import load_model

    target, draft_dir = small_vocab_pair
    draft = load_model(draft_dir, dtype="float64")
    with torch.no_grad():
        draft.lm_head.weight.fill_(float("nan"))
    prompt, n, V = [1, 5, 7], 2000, 12
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s if seeded else None, ignore_eos=True)
              for s in range(n)]
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=2, batch_size=64, dtype="float64",
              check_invariants=False, lookup=None)  # the model's drafts alone (a lookup's would be accepted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    assert outs.metrics.accepted_drafts == 0
    for position in (1, 2):
        exact = exact_marginal(target, prompt, position + 1)
        empirical = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=V).double() / n
        assert total_variation(empirical, exact) < 0.06, f"token {position}: TV {total_variation(empirical, exact):.3f}"
