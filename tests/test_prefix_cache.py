"""The prefix cache and chunked prefill (issue 43).

- The radix tree alone (specdec/prefix_cache.py, on made-up K/V whose values name their token and position):
  the longest cached prefix, never the whole prompt; a split leaves every node owning exactly its bytes; the
  least recently used leaf goes first; the bytes never exceed the budget, whatever is stored.
- Through the engine, batch-invariant float32: generation with the cache equals generation without it bit
  for bit (a second turn that extends the first's prompt and output, and a prompt that leaves a cached one
  midway), for every method and drafter, greedy and seeded, with and without chunked prefill; the n choices
  of a prompt are prefilled once; the running rows step between the chunks of a long prompt; a small budget
  is never exceeded by a run that fills it. The invariant checks are on (conftest): every copied prefix is
  checked against recomputed K/V (I4).
- Bad budgets and chunk sizes: one error naming the argument and the flag (the CLIs: one line).
"""
import random
import subprocess
import sys

import pytest
import torch

from choosers import linear_costs
from specdec import LLM, SamplingParams
from specdec.autok import KChooser
from specdec.models import load_model
from specdec.prefix_cache import PrefixCache
from test_feature_draft import make_feature_draft

# ------------------------------------------------------------------------------------------ the tree alone
L, H, D = 2, 1, 3


def fake_kv(tokens, start=0):
    """[L, 2, H, n, D] K/V whose every value is token * 1000 + position (so a copy can be checked)."""
    n = len(tokens)
    values = torch.tensor([t * 1000 + start + i for i, t in enumerate(tokens)], dtype=torch.float64)  # [n]
    return values.view(1, 1, 1, n, 1).expand(L, 2, H, n, D).clone()


class Row:
    """A one-row stand-in for a KVCache (what `fetch` reads and writes)."""

    def __init__(self, capacity=64):
        self.kv = torch.full((L, 2, 1, H, capacity, D), -1.0, dtype=torch.float64)
        self.host_start, self.host_length = [0], [0]


def fetch(cache, tokens):
    row = Row()
    n, _ = cache.fetch(tokens, row, 0)
    return n, row.kv[0, 0, 0, 0, :n, 0].tolist()


def expected(tokens, n):
    return [t * 1000.0 + i for i, t in enumerate(tokens[:n])]


def check_bytes(cache):
    assert cache.bytes == sum(node.bytes for node in cache.nodes()) <= cache.budget


def test_the_longest_cached_prefix_never_the_whole_prompt():
    cache = PrefixCache(1 << 20)
    a = [5, 6, 7, 8, 9, 10]
    cache.insert(a, fake_kv(a))
    assert fetch(cache, a) == (5, expected(a, 5))  # the last token is always fed
    assert fetch(cache, a + [11, 12]) == (6, expected(a, 6))
    b = [5, 6, 7, 1, 2]
    assert fetch(cache, b) == (3, expected(b, 3))  # a match that ends inside a node
    assert fetch(cache, [4, 5, 6]) == (0, [])
    cache.insert(b, fake_kv(b))  # leaves a's node after 3 tokens: split
    assert sorted(len(n.tokens) for n in cache.nodes()) == [2, 3, 3]
    assert fetch(cache, a + [1]) == (6, expected(a, 6)) and fetch(cache, b + [3]) == (5, expected(b, 5))
    check_bytes(cache)
    assert cache.hit_tokens == 5 + 6 + 3 + 6 + 5 and cache.queried_tokens == 6 + 8 + 5 + 3 + 7 + 6


def test_the_draft_holds_a_prefix_and_is_filled_in_later():
    cache = PrefixCache(1 << 20)
    a = list(range(10, 20))
    cache.insert(a, fake_kv(a), draft_kv=fake_kv(a[:4]))  # the draft lags: 4 of 10 tokens
    assert cache.peek(a + [1]) == (10, 4)
    cache.insert(a, fake_kv(a), draft_kv=fake_kv(a[:7]))
    assert cache.peek(a + [1]) == (10, 7)
    row, draft = Row(), Row()
    assert cache.fetch(a + [1], row, 0, draft) == (10, 7)
    assert draft.kv[0, 0, 0, 0, :8, 0].tolist() == expected(a, 7) + [-1.0]  # nothing past the draft's prefix
    check_bytes(cache)


def test_the_least_recently_used_leaf_goes_first():
    per_token = fake_kv([1]).numel() * 8
    cache = PrefixCache(12 * per_token)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    for seq in (a, b, c):
        cache.insert(seq, fake_kv(seq))
    fetch(cache, a + [0])  # a is used again: b is now the oldest
    d = [13, 14, 15, 16]
    cache.insert(d, fake_kv(d))
    assert cache.peek(b + [0])[0] == 0 and all(cache.peek(s + [0])[0] == 4 for s in (a, c, d))
    assert cache.evictions == 1 and cache.evicted_tokens == 4
    check_bytes(cache)
    e = list(range(20, 40))  # longer than the whole budget: stored as far as it fits
    cache.insert(e, fake_kv(e))
    assert cache.peek(e)[0] == 12 and cache.bytes == cache.budget
    check_bytes(cache)


def test_the_budget_is_never_exceeded():
    rng = random.Random(1)
    per_token = fake_kv([1]).numel() * 8
    cache = PrefixCache(50 * per_token + 7)
    stems = [[rng.randrange(1, 6) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    for step in range(300):
        seq = rng.choice(stems) + [rng.randrange(1, 6) for _ in range(rng.randint(0, 20))]
        if rng.random() < 0.5:
            draft = rng.randint(0, len(seq))
            cache.insert(seq, fake_kv(seq), draft_kv=fake_kv(seq[:draft]) if draft else None)
        else:
            n, values = fetch(cache, seq)
            assert values == expected(seq, n)
        check_bytes(cache)
        for node in cache.nodes():  # a node holds draft K/V for all of its tokens or for none
            assert node.draft is None or node.draft.shape[3] == len(node.tokens) == node.target.shape[3]
    assert cache.evictions > 0


# ------------------------------------------------------------------------------------- through the engine
PAYING = linear_costs(10e-3, 0.05e-3, 1e-3, 0.01e-3)  # auto k: drafting pays (tests/choosers.py)


@pytest.fixture(scope="module")
def pair(llama_pair):
    return llama_pair


@pytest.fixture(scope="module")
def feature_pair(llama_pair):
    target = load_model(llama_pair[0], dtype="float32")
    return target, make_feature_draft(target)


def make_llm(pair, feature_pair, config, **kwargs):
    """LLM of a configuration: (method, drafter, k)."""
    method, drafter, k = config
    target, draft = pair
    if drafter == "feature":
        target, draft = feature_pair
    elif drafter in ("suffix", "ngram"):
        draft = drafter
    elif method == "ar":
        draft = None
    llm = LLM(target, draft, method=method, num_speculative_tokens=None if method == "ar" else k,
              max_speculative_tokens=4, batch_size=3, window_size=6, dtype="float32", batch_invariant=True,
              cost_cache="", **kwargs)
    if k == "auto":
        llm.chooser = KChooser(4, PAYING)
    return llm


def first_turns(n=5, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 131) for _ in range(rng.randint(12, 40))] for _ in range(n)]


def sampling(kind):
    if kind == "greedy":
        return [SamplingParams(max_tokens=10, ignore_eos=True)] * 5
    return [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=7 + i, ignore_eos=True) for i in range(5)]


def conversation(llm, kind):
    """Two turns: the second's prompts extend the first's prompts and outputs; the last one leaves a first-
    turn prompt midway. Returns every output's tokens and the second turn's metrics."""
    prompts, params = first_turns(), sampling(kind)
    first = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    second_prompts = [p + o.token_ids + [7, 8, 9] for p, o in zip(prompts[:4], first)]
    second_prompts.append(prompts[0][:9] + [3, 4, 5, 6])
    second = llm.generate(prompt_token_ids=second_prompts, sampling_params=params)
    return [o.token_ids for o in first] + [o.token_ids for o in second], (first.metrics, second.metrics)


CONFIGS = [("ar", None, None), ("eqspec", "model", 3), ("ragged", "model", 2), ("exspec", "model", 3),
           ("ragged", "suffix", 3), ("eqspec", "ngram", 2), ("eqspec", "feature", 2), ("exspec", "feature", 3),
           ("ragged", "model", "auto")]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(x) for x in c))
def test_tokens_with_the_cache_are_the_tokens_without_it(pair, feature_pair, config, kind):
    reference, _ = conversation(make_llm(pair, feature_pair, config), kind)
    cached, (_, second) = conversation(make_llm(pair, feature_pair, config, prefix_cache_gb=0.01), kind)
    assert cached == reference
    # the second turn found the first's prompts and outputs (all but a few tokens of each)
    assert second.prefix_hit_tokens >= 0.7 * second.prefix_queried_tokens
    chunked, (first, second) = conversation(make_llm(pair, feature_pair, config, prefix_cache_gb=0.01,
                                                     prefill_chunk=4), kind)
    assert chunked == reference and first.prefill_chunks > 0


@pytest.mark.parametrize("config", [("eqspec", "model", 3), ("exspec", "feature", 2), ("ar", None, None)],
                         ids=lambda c: "-".join(str(x) for x in c))
def test_chunked_prefill_alone_gives_the_same_tokens(pair, feature_pair, config):
    prompts, params = first_turns(seed=3), sampling("seeded")
    reference = make_llm(pair, feature_pair, config).generate(prompt_token_ids=prompts, sampling_params=params)
    outs = make_llm(pair, feature_pair, config, prefill_chunk=5).generate(prompt_token_ids=prompts,
                                                                         sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert outs.metrics.prefill_chunks >= sum(-(-len(p) // 5) for p in prompts if len(p) > 5)


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
def test_running_rows_decode_between_the_chunks(pair, feature_pair, method):
    """A long prompt admitted while another request runs: each step feeds one chunk of it and the running
    request gains tokens in every one of those steps; the newcomer's first token comes with its last chunk."""
    llm = make_llm(pair, feature_pair, (method, "model", 2), prefill_chunk=6)
    engine = llm.engine()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True), request_id="running")
    engine.step()
    engine.step()
    long_prompt = first_turns(1, seed=9)[0] + first_turns(1, seed=10)[0]
    engine.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True), request_id="long")
    chunks = -(-len(long_prompt) // 6)
    for step in range(chunks):
        deltas = {d.request_id: d for d in engine.step()}
        assert deltas["running"].token_ids, f"step {step}: the running request got no token"
        assert ("long" in deltas) == (step == chunks - 1), step  # its first token with its last chunk
    assert engine.metrics.prefill_chunks == chunks


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_aborts_during_a_chunked_prefill(pair, feature_pair, method):
    """One choice of a long prompt aborted between its chunks: the others join with their first token; all
    of them aborted: the chunked prefill is dropped and the next long prompt takes its place. The running
    request's tokens are those of a run without any of it."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    alone = make_llm(pair, feature_pair, (method, "model", 2)).generate(prompt_token_ids=[[5, 6, 7]],
                                                                       sampling_params=params)[0].token_ids
    engine = make_llm(pair, feature_pair, (method, "model", 2), prefill_chunk=4).engine()
    engine.add_request([5, 6, 7], params, request_id="running")
    got, finished = {("running", 0): list(engine.step()[0].token_ids)}, {}
    long_a, long_b = first_turns(2, seed=12)
    engine.add_request(long_a, SamplingParams(n=3, max_tokens=3, ignore_eos=True), request_id="a")
    engine.add_request(long_b, SamplingParams(max_tokens=3, ignore_eos=True), request_id="b")
    for step in range(400):
        if step == 2:
            engine.abort("a", choice=1)
        for d in engine.step():
            got.setdefault((d.request_id, d.choice), []).extend(d.token_ids)
            if d.finished:
                finished[(d.request_id, d.choice)] = d.finish_reason
        if step == 2 + -(-len(long_a) // 4):  # "a" has joined: abort all of it (two choices left) mid-decode
            engine.abort("a")
        if not engine.has_unfinished():
            break
    assert finished[("a", 1)] == "abort" and len(got.get(("a", 1), [])) == 0
    assert finished[("b", 0)] == "length" and len(got[("b", 0)]) == 3
    assert got[("running", 0)] == alone
    engine.add_request(long_b, SamplingParams(max_tokens=2), request_id="c")
    engine.step()
    engine.abort("c")  # every choice of a chunked prefill aborted: it is dropped
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.job is None


def test_n_choices_share_one_prefill(pair, feature_pair):
    prompt = first_turns(1, seed=4)[0]
    params = SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    llm = make_llm(pair, feature_pair, ("ragged", "model", 2), prefix_cache_gb=0.01)
    outs = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    assert outs.metrics.prefix_queried_tokens == len(prompt)  # one distinct prompt, looked up once
    alone = make_llm(pair, feature_pair, ("ragged", "model", 2)).generate(
        prompt_token_ids=[prompt] * 3, sampling_params=[params.for_choice(j) for j in range(3)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    # chunked, the choices share the chunks too
    llm = make_llm(pair, feature_pair, ("ragged", "model", 2), prefill_chunk=5)
    outs = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert outs.metrics.prefill_chunks == -(-len(prompt) // 5)


def test_a_run_that_fills_the_budget_never_exceeds_it(pair, feature_pair):
    llm = make_llm(pair, feature_pair, ("eqspec", "model", 2), prefix_cache_gb=2e-5)  # ~21 KB: a few prompts
    store = llm.prefix_cache
    engine = llm.engine()
    for i, prompt in enumerate(first_turns(12, seed=5)):
        engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        check_bytes(store)
    assert store.evictions > 0 and store.bytes > 0.5 * store.budget


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("value", [0, -1, 0.0, float("nan"), True, "1"])
def test_a_budget_must_be_positive(pair, value):
    with pytest.raises(ValueError, match=r"prefix_cache_gb \(--prefix-cache-gb\) must be a number of GiB > 0"):
        LLM(pair[0], method="ar", prefix_cache_gb=value)


@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_a_chunk_must_be_a_positive_int(pair, value):
    with pytest.raises(ValueError, match=r"prefill_chunk \(--prefill-chunk\) must be an integer >= 1 or None"):
        LLM(pair[0], method="ar", prefill_chunk=value)


@pytest.mark.parametrize("module,flag,value", [("specdec.serve", "--prefix-cache-gb", "0"),
                                               ("specdec.run", "--prefix-cache-gb", "-1"),
                                               ("specdec.serve", "--prefill-chunk", "0")])
def test_the_clis_refuse_a_bad_value_in_one_line(pair, module, flag, value):
    extra = ["--prompt", "x"] if module == "specdec.run" else []
    done = subprocess.run([sys.executable, "-m", module, "--target", pair[0], "--method", "ar", flag, value, *extra],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and flag in lines[0], done.stderr


# ------------------------------------------------------------------------------------------ the server
def test_two_chat_turns_through_the_server_hit_the_cache():
    """The second turn of a chat (the first's messages, its answer and a new question) finds the first turn's
    prompt and answer in the cache: /metrics counts the hit; the answers are those of an LLM without the cache;
    n choices of one prompt are looked up once."""
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from fastapi.testclient import TestClient

    from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.serve.app import build_app
    from test_serve import CHAT_TEMPLATE, chat_ids, metric

    def make(**kwargs):
        llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method="eqspec", batch_size=4, batch_invariant=True, **kwargs)
        llm.tokenizer.set_chat_template(CHAT_TEMPLATE)
        return llm

    llm, offline = make(prefix_cache_gb=0.05), make()
    turns = [[{"role": "user", "content": "def fibonacci(n):"}]]
    with TestClient(build_app(llm, llm.engine(), "default", 8)) as client:
        def ask(messages, **extra):
            body = {"model": "default", "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        first = ask(turns[0])["choices"][0]["message"]["content"]
        turns.append(turns[0] + [{"role": "assistant", "content": first},
                                 {"role": "user", "content": "Now print the first ten numbers."}])
        before = metric(client.get("/metrics").text, "specdec_prefix_cache_hit_tokens_total")
        reply = ask(turns[1])
        second = reply["choices"][0]["message"]["content"]
        text = client.get("/metrics").text
        hit = metric(text, "specdec_prefix_cache_hit_tokens_total") - before
        assert hit >= len(chat_ids(llm, turns[0])) and hit < reply["usage"]["prompt_tokens"]
        assert 0 < metric(text, "specdec_prefix_cache_bytes") <= metric(text, "specdec_prefix_cache_budget_bytes")
        for name in ("specdec_prefix_cache_queried_tokens_total", "specdec_prefix_cache_evictions_total",
                     "specdec_prefix_cache_evicted_tokens_total", "specdec_prefill_chunks_total"):
            metric(text, name)
        queried = metric(text, "specdec_prefix_cache_queried_tokens_total")
        n_reply = ask([{"role": "user", "content": "class Stack:"}], n=3, temperature=0.8, seed=1)
        queried = metric(client.get("/metrics").text, "specdec_prefix_cache_queried_tokens_total") - queried
        assert queried == n_reply["usage"]["prompt_tokens"]  # one lookup (one prefill) for the three choices
    expected = offline.generate(prompt_token_ids=[chat_ids(offline, t) for t in turns],
                                sampling_params=SamplingParams(max_tokens=16, temperature=0.0))
    assert [first, second] == [o.text for o in expected]
