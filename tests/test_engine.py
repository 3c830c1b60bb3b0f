"""The incremental Engine: requests that arrive while others run, aborts, streaming deltas, threads.

Every finished greedy output must equal AR's (float64), whatever the arrival steps, the method, k and
the aborts of other rows; `check_invariants` is on (conftest), so every row is checked before each step.
"""
import random
import threading

import pytest
from hypothesis import given, settings, strategies as st

from specdec import LLM, SamplingParams
from specdec.detokenizer import INCOMPLETE, text_delta
from specdec.models import load_tokenizer
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def pair(llama_pair):
    return llama_pair


def prompts_of(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 131) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def mixed_params(n, seed=0):
    """Greedy rows and seeded sampling rows, some with top-k, some stopping early (max_tokens)."""
    rng = random.Random(seed)
    return [SamplingParams(max_tokens=rng.randint(1, MAX_TOKENS), temperature=0.0 if i % 3 else 0.9,
                           top_k=0 if i % 2 else 12, seed=100 + i, ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def reference(pair):
    """AR one prompt at a time, float64: the greedy truth."""
    target, _ = pair
    prompts, params = prompts_of(14), mixed_params(14)
    outs = LLM(target, method="ar", batch_size=1, dtype="float64").generate(prompt_token_ids=prompts,
                                                                           sampling_params=params)
    return prompts, params, [o.token_ids for o in outs]


def run_arrivals(llm, prompts, params, arrive_at, abort_at=None, max_steps=2000):
    """Step an engine, adding request i at step arrive_at[i] and aborting it at abort_at[i] (if any).
    Returns {i: (RequestOutput, concatenated token deltas)}."""
    engine = llm.engine()
    abort_at = abort_at or {}
    added, results, streamed = set(), {}, {}
    for step in range(max_steps):
        for i, when in enumerate(arrive_at):
            if when == step:
                engine.add_request(prompts[i], params[i], request_id=f"r{i}")
                added.add(i)
        for i, when in abort_at.items():
            if when == step and i in added:
                engine.abort(f"r{i}")
        for d in engine.step():
            i = int(d.request_id[1:])
            streamed.setdefault(i, []).extend(d.token_ids)
            if d.finished:
                results[i] = (d.output, streamed[i])
        if len(added) == len(prompts) and not engine.has_unfinished():
            return results
    raise AssertionError("the engine did not finish")


def check_results(results, reference, params, aborted=()):
    prompts, _, ref = reference
    assert sorted(results) == list(range(len(prompts)))
    for i, (out, streamed) in results.items():
        assert streamed == out.token_ids, f"request {i}: deltas do not add up to the output"
        if out.finish_reason == "abort":
            assert i in aborted
            if params[i].greedy:  # an aborted row emitted a prefix of what AR emits
                assert out.token_ids == ref[i][: len(out.token_ids)], f"aborted request {i}"
            continue
        assert len(out.token_ids) == params[i].max_tokens
        if params[i].greedy:
            assert out.token_ids == ref[i], f"request {i} differs from AR"


METHODS_K = [("ar", None), ("eqspec", 3), ("eqspec", "auto"), ("ragged", 3), ("ragged", "auto"),
             ("exspec", 2), ("exspec", "auto")]


def make_llm(pair, method, k, batch_size=4, **kwargs):
    target, draft = pair
    if method == "ar":
        return LLM(target, method="ar", batch_size=batch_size, dtype="float64", **kwargs)
    return LLM(target, draft, method=method, num_speculative_tokens=k, max_speculative_tokens=4,
               batch_size=batch_size, dtype="float64", cost_cache="", window_size=8, **kwargs)


@pytest.mark.parametrize("method,k", METHODS_K)
def test_arrivals_and_aborts_equal_ar(pair, reference, method, k):
    prompts, params, _ = reference
    rng = random.Random(hash((method, str(k))) % 1000)
    arrive_at = [0, 0, 0] + sorted(rng.randrange(0, 30) for _ in prompts[3:])
    aborted = {3: arrive_at[3] + 2, 7: arrive_at[7], 11: arrive_at[11] + 5}  # mid-run, at once, later
    llm = make_llm(pair, method, k)
    assert llm.options.scheduler.check_invariants
    results = run_arrivals(llm, prompts, params, arrive_at, aborted)
    check_results(results, reference, params, aborted)
    assert any(results[i][0].finish_reason == "abort" for i in aborted)


@settings(max_examples=8)
@given(data=st.data())
def test_arrivals_property(pair, reference, data):
    prompts, params, _ = reference
    method, k = data.draw(st.sampled_from(METHODS_K[1:]), label="method, k")
    n = data.draw(st.integers(4, len(prompts)), label="requests")
    arrive_at = data.draw(st.lists(st.integers(0, 25), min_size=n, max_size=n), label="arrival steps")
    aborted = data.draw(st.dictionaries(st.integers(0, n - 1), st.integers(0, 30), max_size=3), label="aborts")
    batch_size = data.draw(st.integers(1, 5), label="batch size")
    sub = (prompts[:n], params[:n], reference[2][:n])
    llm = make_llm(pair, method, k, batch_size=batch_size)
    results = run_arrivals(llm, sub[0], sub[1], arrive_at, aborted)
    check_results(results, sub, sub[1], aborted)


def test_add_and_abort_from_another_thread(pair, reference):
    """add_request and abort from a second thread while the main thread steps."""
    prompts, params, _ = reference
    llm = make_llm(pair, "ragged", 3)
    engine = llm.engine()
    engine.add_request(prompts[0], params[0], request_id="r0")
    go = threading.Event()

    def feeder():
        for i in range(1, len(prompts)):
            go.wait(5)
            engine.add_request(prompts[i], params[i], request_id=f"r{i}")
        engine.abort("r5")

    thread = threading.Thread(target=feeder)
    thread.start()
    results, streamed = {}, {}
    for _ in range(5000):
        go.set()
        for d in engine.step():
            streamed.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                results[int(d.request_id[1:])] = (d.output, streamed[d.request_id])
        if not thread.is_alive() and not engine.has_unfinished():
            break
    thread.join()
    check_results(results, reference, params, aborted={5})


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_two_engines_on_one_llm_do_not_interfere(pair, reference, method):
    """Two engines on one LLM, stepped in turn: each gives exactly what it gives alone -- the tokens and
    the k of every step (auto k, here a scripted chooser: a chooser shared by the engines would hand each
    engine every other k of the script) -- and the acceptance statistics stay on each engine's requests."""
    from choosers import ScriptedChooser

    prompts, params, _ = reference
    # suffix_store_tokens=0: the suffix lookup beside the draft keeps to each request's own text (its cross-request
    # store is the LLM's, shared by its engines by design: what one engine's answers offer the other is not this)
    llm = make_llm(pair, method, "auto", suffix_store_tokens=0)
    llm.chooser = ScriptedChooser((3, 0, 2, 1, 4), 4)
    works = {"a": range(0, 6), "b": range(6, 14)}

    def start(name):
        engine = llm.engine()
        for i in works[name]:
            engine.add_request(prompts[i], params[i], request_id=f"{name}{i}")
        return engine

    def finished(engine, results):
        for d in engine.step():
            if d.finished:
                results[d.request_id] = (d.output.token_ids, d.output.speculative_tokens, d.output.accepted_counts)

    alone = {}
    for name in works:
        engine = start(name)
        while engine.has_unfinished():
            finished(engine, alone)
    engines, together = [start("a"), start("b")], {}
    while any(e.has_unfinished() for e in engines):
        for engine in engines:
            if engine.has_unfinished():
                finished(engine, together)
    assert together == alone
    assert all(any(ks) for _, ks, _ in alone.values())  # the script's k > 0 steps ran
    assert engines[0].chooser is not engines[1].chooser is not llm.chooser


def test_counts_and_errors(pair, reference):
    prompts, params, _ = reference
    engine = make_llm(pair, "ragged", 3, batch_size=2).engine()
    assert not engine.has_unfinished() and engine.step() == []
    for i in range(4):
        engine.add_request(prompts[i], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), request_id=f"r{i}")
    assert (engine.num_waiting, engine.num_running) == (4, 0)
    engine.step()
    assert (engine.num_waiting, engine.num_running) == (2, 2)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompts[0], request_id="r0")
    with pytest.raises(TypeError, match="not an integer"):
        engine.add_request([3, 2.7])
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([3, 4], {"max_tokens": 3})
    assert engine.abort("r3") and not engine.abort("nope")
    deltas = {d.request_id: d for d in engine.step()}
    assert deltas["r3"].finished and deltas["r3"].finish_reason == "abort"
    assert engine.num_waiting == 1


SLOW_CALIBRATION_S = 0.5


@pytest.fixture
def slow_calibration(monkeypatch):
    """Auto k's calibration made SLOW_CALIBRATION_S slower (it runs inside Engine.step)."""
    import time

    import specdec.engine

    prepare = specdec.engine.prepare_chooser

    def slow(*args, **kwargs):
        time.sleep(SLOW_CALIBRATION_S)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(specdec.engine, "prepare_chooser", slow)


def test_calibration_is_not_in_any_requests_ttft_or_latency(pair, reference, slow_calibration):
    """Calibration is timed apart, as the wall time keeps it apart: a request waiting for it, running through
    a later one (the batch grew), or arriving in its middle has none of it in its time to first token or latency
    (what --metrics reports)."""
    prompts, _, _ = reference
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = make_llm(pair, "ragged", "auto").generate(prompt_token_ids=prompts[:3], sampling_params=params)
    assert outs.metrics.calibration_s >= SLOW_CALIBRATION_S
    assert max(outs.metrics.ttfts_s) < SLOW_CALIBRATION_S
    assert max(outs.metrics.latencies_s) < outs.metrics.wall_time_s + 0.25
    assert sorted(outs.metrics.ttfts_s) == sorted(o.time_to_first_token_s for o in outs)

    engine = make_llm(pair, "ragged", "auto").engine()
    engine.add_request(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True), request_id="first")
    engine.step()  # calibrates for 1 row, then prefills "first"
    engine.add_request(prompts[1], params, request_id="second")
    engine.add_request(prompts[2], params, request_id="third")
    outputs = {}
    while engine.has_unfinished():  # the next step calibrates for 4 rows while "first" runs
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    assert engine.metrics.calibration_s >= 2 * SLOW_CALIBRATION_S
    assert all(o.time_to_first_token_s < SLOW_CALIBRATION_S for o in outputs.values())
    assert all(o.latency_s < engine.metrics.wall_time_s + 0.25 for o in outputs.values())


# ------------------------------------------------------------------------------------------ streaming text
@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


MULTIBYTE = ["日本語 中文测试 ゐ", "emoji 😀🚀 🦙!", "café naïve — résumé", "def f():\n\treturn '✓'"]


def test_text_deltas_hold_back_incomplete_characters(default_tokenizer):
    tok = default_tokenizer
    for text in MULTIBYTE:
        ids = tok.encode(text, add_special_tokens=False)
        byte_pieces = [i for i in ids if tok.decode([i]) in ("", INCOMPLETE) or INCOMPLETE in tok.decode([i])]
        sent = ""
        for n in range(1, len(ids) + 1):
            delta = text_delta(tok.decode(ids[:n]), sent, final=n == len(ids))
            assert INCOMPLETE not in delta, f"{text!r}: a broken character was emitted after {n} tokens"
            sent += delta
        assert sent == tok.decode(ids) == text
        if "😀" in text or "ゐ" in text:
            assert byte_pieces, f"{text!r} should need byte-fallback pieces"


def test_streamed_text_equals_final_text():
    """Sampling near-uniformly (temperature 50) from the default pair emits byte-fallback pieces in random orders: the text deltas
    still concatenate to each request's final text."""
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method="ragged", num_speculative_tokens=3, batch_size=4,
              check_invariants=False)
    prompts = [p + " " for p in MULTIBYTE] * 2
    params = [SamplingParams(max_tokens=40, temperature=50.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    texts, finals, ids = {}, {}, {}
    for d in llm.stream(prompts, params):
        texts[d.request_id] = texts.get(d.request_id, "") + d.text
        ids.setdefault(d.request_id, []).extend(d.token_ids)
        if d.finished:
            finals[d.request_id] = d.output.text
    assert len(finals) == len(prompts)
    for rid, final in finals.items():
        assert texts[rid] == final
    byte_range = range(3 + 0x80, 3 + 0x100)  # the tokenizer's non-ASCII byte pieces <0x80>..<0xFF>
    assert any(t in byte_range for seq in ids.values() for t in seq), "no byte-fallback piece was emitted"


def test_first_tokens_are_handed_over_before_the_steps_decoding_run(pair):
    """`Engine.on_first_tokens` gets a step's admissions' deltas (their first tokens) before the step decodes;
    the step then returns only what its run added, and the tokens are the same as without the hook."""
    target, draft = pair
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(target, draft, method="ragged", num_speculative_tokens=2, batch_size=4, dtype="float64")
    plain = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=params)
    engine = llm.engine()
    early, tokens = [], {}

    def hook(deltas):
        early.append([(d.request_id, list(d.token_ids)) for d in deltas])
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)

    engine.on_first_tokens = hook
    engine.add_request([5, 6, 7], params, request_id="0")
    for step in range(40):
        if step == 2:
            engine.add_request([8, 9], params, request_id="1")
        seen = len(early)
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
        if step in (0, 2):  # the admissions' steps: the first token came through the hook, alone
            assert len(early) == seen + 1 and early[-1] == [(str(step // 2), tokens[str(step // 2)][:1])]
        else:
            assert len(early) == seen
        if not engine.has_unfinished():
            break
    assert [tokens["0"], tokens["1"]] == [o.token_ids for o in plain]
