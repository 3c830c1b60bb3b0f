"""Property test (issue 12): random request mixes thrown at `LLM.generate`.

Every method, k 1..8, batch sizes 1..17, 1..12 requests mixing greedy and seeded sampled rows, prompt
lengths from 1 to what the context allows, max_tokens, stop ids and ignore_eos. For valid input: no
exception, every request answered exactly once (callback) and returned in prompt order, each output
well formed (length, stop semantics, vocabulary), greedy rows token for token what AR decoding gives
(float64 tiny models, so exactly). For invalid input (a bad prompt, bad sampling values, bad engine
arguments): a ValueError naming the argument, raised before any request is answered.

CI runs the "ci" profile of tests/conftest.py (few examples, derandomized); a long run:
`python -m pytest tests/test_properties.py --hypothesis-profile long`.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints import make_pair
from specdec import LLM, SamplingParams
from specdec.models import load_model

CONTEXT = 40  # max_position_embeddings of the tiny pair: long prompts stay cheap
VOCAB = 131
METHODS = ("ar", "eqspec", "exspec", "ragged")
EXAMPLES = settings.default.max_examples  # of the loaded profile


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny float64 Llama pair, loaded once; every engine below wraps these objects (no reloading)."""
    target, draft = make_pair("llama", tmp_path_factory.mktemp("properties"), max_position_embeddings=CONTEXT)
    return load_model(target, dtype="float64"), load_model(draft, dtype="float64")


def engine(models, method: str, k: int, batch_size: int, **overrides) -> LLM:
    target, draft = models
    kwargs = dict(target=target, draft=None if method == "ar" else draft, method=method, num_speculative_tokens=k,
                  batch_size=batch_size, dtype="float64", window_size=max(48, batch_size), check_invariants=True)
    kwargs.update(overrides)
    return LLM(**kwargs)


def room(max_tokens: int, k: int, method: str) -> int:
    """The longest prompt that fits the context with max_tokens and k (+1 for the bonus position)."""
    return CONTEXT - max_tokens - (0 if method == "ar" else k) - 1


@st.composite
def sampling(draw, max_tokens: int) -> SamplingParams:
    greedy = draw(st.booleans())
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0 if greedy else draw(st.floats(0.05, 3.0)),
        top_k=draw(st.integers(0, VOCAB + 5)), top_p=draw(st.floats(0.01, 1.0)),
        seed=draw(st.integers(0, 2**32)), stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
        ignore_eos=draw(st.booleans()))


@st.composite
def request_mix(draw):
    method = draw(st.sampled_from(METHODS))
    k = draw(st.integers(1, 8))
    batch_size = draw(st.integers(1, 17))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        max_tokens = draw(st.integers(1, 12))
        length = draw(st.integers(1, room(max_tokens, k, method)))
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
        requests.append((prompt, draw(sampling(max_tokens))))
    return method, k, batch_size, requests


def check_well_formed(output, prompt, params, eos_ids) -> None:
    ids = output.token_ids
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    assert output.prompt_token_ids == prompt
    assert 1 <= len(ids) <= params.max_tokens and all(0 <= t < VOCAB for t in ids)
    assert not any(t in stop for t in ids[:-1]), "decoding went on past a stop token"
    if ids[-1] in stop:
        assert output.finish_reason == "stop"
    else:
        assert output.finish_reason == "length" and len(ids) == params.max_tokens


@settings(max_examples=EXAMPLES)
@given(mix=request_mix())
def test_valid_mixes_answer_every_request_once_and_greedy_rows_equal_ar(models, mix):
    method, k, batch_size, requests = mix
    llm = engine(models, method, k, batch_size)
    prompts = [p for p, _ in requests]
    params = [s for _, s in requests]
    answered = []
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, on_output=lambda o: answered.append(o.index))
    assert sorted(answered) == list(range(len(requests)))
    assert [o.index for o in outs] == list(range(len(requests)))
    for o, prompt, p in zip(outs, prompts, params):
        check_well_formed(o, prompt, p, llm.eos_token_ids)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        reference = engine(models, "ar", 1, 4).generate(prompt_token_ids=[prompts[i] for i in greedy],
                                                        sampling_params=[params[i] for i in greedy])
        for i, ref in zip(greedy, reference):
            assert outs[i].token_ids == ref.token_ids, f"{method} k={k} B={batch_size}: greedy request {i} != AR"


BAD_SAMPLING = [  # (field, value): SamplingParams must refuse each, naming the field
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1.0), ("top_k", -1),
    ("top_p", 0.0), ("top_p", float("nan")), ("top_p", 1.01), ("max_tokens", 0), ("stop_token_ids", (-3,)),
    ("seed", 0.5),
]
BAD_ENGINE = [  # (argument, value): LLM must refuse each, naming the argument
    ("batch_size", 0), ("num_speculative_tokens", 0), ("method", "medusa"), ("device", "gpu0"),
]


@st.composite
def invalid_case(draw):
    """(what to call, the text the ValueError must contain)."""
    method = draw(st.sampled_from(METHODS[1:]))  # speculative: k matters for the context
    k, batch_size = draw(st.integers(1, 8)), draw(st.integers(1, 17))
    n = draw(st.integers(1, 6))
    max_tokens = draw(st.integers(1, 8))
    prompts = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=room(max_tokens, k, method)))
               for _ in range(n)]
    params = SamplingParams(max_tokens=max_tokens)
    bad = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(["empty", "vocab", "too long", "count", "sampling", "engine", "both", "neither"]))
    call = dict(prompt_token_ids=prompts, sampling_params=params)
    build = dict(method=method, k=k, batch_size=batch_size)
    if kind == "empty":
        prompts[bad] = []
        message = f"prompt {bad} "
    elif kind == "vocab":
        prompts[bad] = prompts[bad] + [draw(st.sampled_from([VOCAB, VOCAB + 7, -1]))]
        message = f"prompt {bad} "
    elif kind == "too long":
        prompts[bad] = [5] * draw(st.integers(room(max_tokens, k, method) + 1, CONTEXT + 4))
        message = f"prompt {bad} "
    elif kind == "count":
        call["sampling_params"] = [params] * ((n + draw(st.sampled_from([-1, 1]))) if n > 1 else 2)
        message = "sampling_params"
    elif kind == "sampling":
        field, value = draw(st.sampled_from(BAD_SAMPLING))
        return (lambda: SamplingParams(**{field: value})), f"SamplingParams.{field}"
    elif kind == "engine":
        argument, value = draw(st.sampled_from(BAD_ENGINE))
        overrides = {"method": value} if argument == "method" else {argument: value}
        names = {"batch_size": "batch_size", "num_speculative_tokens": "k", "method": "method"}
        if argument in names:
            build[names[argument]] = value
            overrides = {}
        return ("engine", build, overrides), argument
    elif kind == "both":
        call["prompts"] = ["text"]
        message = "prompts"
    else:
        del call["prompt_token_ids"]
        message = "prompts"
    return ("generate", build, call), message


@settings(max_examples=3 * EXAMPLES)
@given(case=invalid_case())
def test_invalid_input_is_a_value_error_naming_the_argument(models, case):
    action, message = case
    answered = []
    with pytest.raises(ValueError) as info:
        if callable(action):
            action()
        elif action[0] == "engine":
            _, build, overrides = action
            engine(models, build["method"], build["k"], build["batch_size"], **overrides)
        else:
            _, build, call = action
            llm = engine(models, build["method"], build["k"], build["batch_size"])
            llm.generate(**call, on_output=lambda o: answered.append(o.index))
    assert message in str(info.value)
    assert answered == []  # refused before anything was decoded
