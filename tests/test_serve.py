"""`python -m specdec.serve` (issue 21), started as a subprocess on 127.0.0.1 and driven with the real `openai`
client, sync and async, streaming and not: greedy output equals `LLM.generate`'s token for token, streams
concatenate to the non-streamed text, 32 concurrent streams get their offline outputs, a dropped client frees
its row, bad requests get their status and OpenAI-shaped error, SIGTERM shuts down gracefully (exit 0).

Server and offline reference run the embedded pair in float32 with `batch_invariant` (a row's tokens do not
depend on what shares its batch), so greedy equality is exact whatever the server's batches were."""
import asyncio
import json
import re
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_PROMPTS, DEFAULT_TARGET, read_prompts  # noqa: E402
from specdec.serve.__main__ import set_chat_template  # noqa: E402

from bench import serve as launcher  # noqa: E402  (free_port, launch, stop)

pytestmark = pytest.mark.slow  # not in the fast lane (pytest.ini)

MODEL = "default"
MAX_TOKENS = 24
BATCH = 8
MAX_WAITING = 32  # 32 concurrent clients fit (at most 31 wait); 96 at once do not
# the embedded pair has no chat template: a plain one, rendered as Python comments for this code model
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
ENGINE_FLAGS = ("--method", "eqspec", "--batch-size", str(BATCH), "--batch-invariant")
PROMPTS = read_prompts(DEFAULT_PROMPTS)  # 32 held-out prompts of the embedded pair


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return str(path)


def start_server(tmp_path_factory, template_file, *flags):
    port = launcher.free_port()
    log = str(tmp_path_factory.mktemp("serve-log") / "server.log")
    command = launcher.specdec_command(port, *ENGINE_FLAGS, "--chat-template", template_file, *flags)
    return launcher.launch(command, port, log), f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def server(tmp_path_factory, template_file):
    proc, url, log = start_server(tmp_path_factory, template_file, "--max-waiting", str(MAX_WAITING))
    yield url
    launcher.stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(template_file):
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method="eqspec", batch_size=BATCH, batch_invariant=True,
              check_invariants=False)
    set_chat_template(llm.tokenizer, template_file)
    return llm


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def chat_ids(llm, messages):
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample of Prometheus text exposition (labels as written, e.g. 'finish_reason="abort"')."""
    pattern = rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    match = re.search(pattern, text, re.M)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


# ----------------------------------------------------------------------------------------- exactness


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_greedy_completions_equal_generate(client, offline):
    prompts = PROMPTS[:6]
    expected = offline.generate(prompts, greedy())
    for prompt, out in zip(prompts, expected):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.token_ids == out.token_ids and choice.text == out.text
        assert choice.prompt_token_ids == out.prompt_token_ids
        assert choice.finish_reason == out.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(out.prompt_token_ids), len(out.token_ids))
    # a prompt given as token ids is taken as it is
    ids = expected[0].prompt_token_ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected[0].text


def test_greedy_chat_completions_equal_generate(client, offline):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[6:9]]
    conversations.append([{"role": "system", "content": "Python only."}, {"role": "user", "content": PROMPTS[9]}])
    expected = offline.generate(prompt_token_ids=[chat_ids(offline, m) for m in conversations],
                                sampling_params=greedy())
    for messages, out in zip(conversations, expected):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == out.text
        assert choice.token_ids == out.token_ids and choice.prompt_token_ids == out.prompt_token_ids
        assert r.usage.completion_tokens == len(out.token_ids) and choice.finish_reason == out.finish_reason


def test_streamed_chunks_concatenate_to_the_non_streamed_text(client):
    prompt = PROMPTS[10]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1]) and len(text_chunks) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # the usage chunk comes last

    messages = [{"role": "user", "content": PROMPTS[11]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_32_concurrent_streaming_clients_get_their_offline_outputs(server, offline):
    expected = offline.generate(PROMPTS, greedy())
    assert len(PROMPTS) == 32

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True})
        text, ids = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            ids += chunk.choices[0].token_ids
        return text, ids

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    got = asyncio.run(all_of_them())
    assert [g[1] for g in got] == [o.token_ids for o in expected]
    assert [g[0] for g in got] == [o.text for o in expected]


def test_stop_strings_cut_the_text_and_end_the_request(client, offline):
    prompt = PROMPTS[12]
    (full,) = offline.generate([prompt], greedy())
    stop = full.text[8:11]  # a stop string that first appears after some text
    cut = full.text.index(stop)
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      stop=[stop, "\x00never"], stream=stream, extra_body={"return_token_ids": True})
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        ids = [t for c in chunks for t in c.choices[0].token_ids]
        assert text == full.text[:cut] and chunks[-1].choices[0].finish_reason == "stop"
        # the tokens up to the one that completed the stop string, whatever the speculative step sizes were
        n = len(ids)
        assert ids == full.token_ids[:n] and len(offline.tokenizer.decode(ids)) >= cut + len(stop)
        assert len(offline.tokenizer.decode(ids[:-1])) < cut + len(stop)


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPTS[13], max_tokens=MAX_TOKENS, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"top_k": 50}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


# ----------------------------------------------------------------------------------------- logprobs and n


@pytest.fixture(scope="module")
def ar_offline(template_file):
    """Target-only AR, batch-invariant float32 like the server: the reference for logprobs."""
    llm = LLM(DEFAULT_TARGET, method="ar", batch_size=BATCH, batch_invariant=True, check_invariants=False)
    set_chat_template(llm.tokenizer, template_file)
    return llm


def test_logprobs_through_the_openai_client_equal_ar_logprobs(client, ar_offline):
    """Completions (logprobs=3) and streamed chat (logprobs, top_logprobs=3): the server's speculative
    (eqspec) logprobs are AR's for the same tokens, top entries included (the same bits here: both
    batch-invariant; a JSON float round-trips exactly)."""
    strings = [ar_offline.tokenizer.token_bytes(i).decode("utf-8", "replace") for i in range(4000)]
    prompt = PROMPTS[19]
    (ref,) = ar_offline.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, logprobs=3))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True})
    got = r.choices[0]
    assert got.token_ids == ref.token_ids
    assert got.logprobs.tokens == [strings[t] for t in ref.token_ids]
    assert got.logprobs.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-6)
    for top, e in zip(got.logprobs.top_logprobs, ref.logprobs):
        assert top == pytest.approx({**{strings[i]: v for i, v in e.top}, strings[e.token_id]: e.logprob}, abs=1e-6)

    messages = [{"role": "user", "content": PROMPTS[20]}]
    (ref,) = ar_offline.generate(prompt_token_ids=[chat_ids(ar_offline, messages)],
                                 sampling_params=SamplingParams(max_tokens=MAX_TOKENS, logprobs=3))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [bytes(e.bytes) for e in entries] == [ar_offline.tokenizer.token_bytes(t) for t in ref.token_ids]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-6)
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries] == [
        [(strings[i], pytest.approx(v, abs=1e-6)) for i, v in e.top] for e in ref.logprobs]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_n_choices_through_the_openai_client(client):
    """n = 3 seeded: choices 0..2, choice 0 is the n = 1 sample of the seed, choice j the sample of
    choice_seed(seed, j); streamed, every chunk names its choice and each choice's text is the same."""
    from specdec.sampling import choice_seed

    def ask(**fields):
        return client.completions.create(model=MODEL, prompt=PROMPTS[21], max_tokens=MAX_TOKENS, temperature=1.0,
                                         **fields)

    r = ask(n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3
    assert texts == [ask(seed=choice_seed(7, j)).choices[0].text for j in range(3)]
    assert r.usage.completion_tokens == sum(ask(seed=choice_seed(7, j)).usage.completion_tokens for j in range(3))
    streamed = ["", "", ""]
    for chunk in ask(n=3, seed=7, stream=True):
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
    assert streamed == texts


def test_best_of_through_the_openai_client(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[22], max_tokens=8, temperature=1.0, seed=3, n=2,
                                  best_of=4, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1]


# ----------------------------------------------------------------------------------------- rows and metrics


def test_dropped_client_frees_its_row_and_the_server_goes_on(server, client):
    before = httpx.get(f"{server}/metrics").text
    aborted = metric(before, "specdec_requests_finished_total", 'finish_reason="abort"') \
        if 'finish_reason="abort"' in before else 0.0
    body = {"model": MODEL, "prompt": PROMPTS[14], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            text = httpx.get(f"{server}/metrics").text
            assert metric(text, "specdec_num_requests_running") + metric(text, "specdec_num_requests_waiting") >= 1
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics").text
        if metric(text, "specdec_num_requests_running") == 0 and 'finish_reason="abort"' in text:
            break
        time.sleep(0.05)
    assert metric(text, "specdec_num_requests_running") == 0
    assert metric(text, "specdec_num_requests_waiting") == 0
    assert metric(text, "specdec_requests_finished_total", 'finish_reason="abort"') == aborted + 1
    # it was stopped well before the 150 tokens it asked for
    assert metric(text, "specdec_generation_tokens_total") - metric(before, "specdec_generation_tokens_total") < 150
    r = client.completions.create(model=MODEL, prompt=PROMPTS[15], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_dropped_client_of_n_choices_frees_every_row(server):
    """A stream of n = 3 closed mid-way: all three choices are aborted and their rows freed."""
    def aborted(text):
        return metric(text, "specdec_requests_finished_total", 'finish_reason="abort"') \
            if 'finish_reason="abort"' in text else 0.0

    before = aborted(httpx.get(f"{server}/metrics").text)
    body = {"model": MODEL, "prompt": PROMPTS[23], "max_tokens": 150, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "n": 3}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data: ")).startswith("data: {")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics").text
        if metric(text, "specdec_num_requests_running") == 0 and aborted(text) == before + 3:
            break
        time.sleep(0.05)
    assert metric(text, "specdec_num_requests_running") == metric(text, "specdec_num_requests_waiting") == 0
    assert aborted(text) == before + 3


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[16], max_tokens=MAX_TOKENS, temperature=0)
    r = httpx.get(f"{server}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("specdec_num_requests_running", "specdec_num_requests_waiting", "specdec_generation_tokens_total",
                 "specdec_spec_decode_acceptance_rate", "specdec_spec_decode_proposed_drafts_total",
                 "specdec_spec_decode_accepted_drafts_total", "specdec_speculative_k_count",
                 "specdec_time_to_first_token_seconds_count", "specdec_inter_token_latency_seconds_count",
                 "specdec_prompt_tokens_total"):
        metric(text, name)
    assert metric(text, "specdec_generation_tokens_total") >= MAX_TOKENS
    assert 0 < metric(text, "specdec_spec_decode_acceptance_rate") <= 1
    assert metric(text, "specdec_spec_decode_accepted_drafts_total") <= metric(
        text, "specdec_spec_decode_proposed_drafts_total")
    # the k histogram is cumulative over k = 0..k_max and its count is the engine's steps
    buckets = [metric(text, "specdec_speculative_k_bucket", f'le="{k}.0"') for k in range(9)]
    assert buckets == sorted(buckets) and buckets[-1] == metric(text, "specdec_speculative_k_count") > 0
    assert metric(text, "specdec_speculative_k_count") == metric(text, "specdec_engine_steps_total")
    assert metric(text, "specdec_time_to_first_token_seconds_count") >= 1
    assert metric(text, "specdec_requests_finished_total", 'finish_reason="length"') >= 1
    # acceptance per drafter: the embedded pair's draft model and, free drafts first, the suffix lookup beside it
    drafters = re.findall(r'^specdec_spec_decode_drafter_proposed_drafts_total\{drafter="([^"]+)"\}', text, re.M)
    assert set(drafters) <= {"model", "suffix"} and "model" in drafters, drafters
    assert sum(metric(text, "specdec_spec_decode_drafter_proposed_drafts_total", f'drafter="{d}"')
               for d in drafters) == metric(text, "specdec_spec_decode_proposed_drafts_total")
    assert 0 < metric(text, "specdec_spec_decode_drafter_acceptance_rate", 'drafter="model"') <= 1
    # why steps ran without drafts (issue 56): at most the k = 0 steps, each with its reason
    off = re.findall(r'^specdec_drafting_off_steps_total\{reason="[^"]+"\} (\S+)$', text, re.M)
    assert sum(float(n) for n in off) <= metric(text, "specdec_speculative_k_bucket", 'le="0.0"')
    # what runs the target's steps (issue 57): the embedded pair's float weights run the torch forward, no kernel
    assert re.search(r'^specdec_forward_info\{forward="torch",isa="none",reason="[^"]+"\} 1\.0$', text, re.M), text


def test_a_server_drafting_with_suffix_answers_as_ar(tmp_path_factory, template_file):
    """`--draft suffix` (the server takes every drafter flag): outputs equal AR's, /metrics labels them."""
    proc, url, _ = start_server(tmp_path_factory, template_file, "--target", DEFAULT_TARGET, "--draft", "suffix",
                                "-k", "3")
    try:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        served = api.models.list().data[0].id
        ar = LLM(DEFAULT_TARGET, method="ar", batch_invariant=True)
        for prompt in PROMPTS[:2] * 2:  # asked twice: the second time the store has the first's output
            r = api.completions.create(model=served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            expected = ar.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0].text
            assert r.choices[0].text == expected
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "specdec_spec_decode_drafter_proposed_drafts_total", 'drafter="suffix"') > 0
        assert metric(text, "specdec_spec_decode_drafter_accepted_drafts_total", 'drafter="suffix"') > 0
    finally:
        launcher.stop(proc)


# ----------------------------------------------------------------------------------------- errors


def completion(**fields):
    return {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, **fields}


BAD_REQUESTS = {
    # name: (path, raw body, status, param, a piece of the message)
    "malformed JSON": ("/v1/completions", b'{"model": "default", "prompt": ', 400, None, "not valid JSON"),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    "unknown model": ("/v1/completions", completion(model="gpt-4"), 400, "model", "'gpt-4' is not served"),
    "string for an int": ("/v1/completions", completion(max_tokens="5"), 400, "max_tokens", "valid integer"),
    "bool for an int": ("/v1/completions", completion(max_tokens=True), 400, "max_tokens", "valid integer"),
    "n above its maximum": ("/v1/completions", completion(n=17), 400, "n", "less than or equal to 16"),
    "negative max_tokens": ("/v1/completions", completion(max_tokens=-3), 400, "max_tokens",
                            "greater than or equal to 1"),
    "negative temperature": ("/v1/completions", completion(temperature=-0.5), 400, "temperature",
                             "greater than or equal to 0"),
    "NaN temperature": ("/v1/completions", b'{"model": "default", "prompt": "x", "temperature": NaN}', 400,
                        "temperature", "finite"),
    "infinite top_p": ("/v1/completions", b'{"model": "default", "prompt": "x", "top_p": Infinity}', 400, "top_p",
                       "finite"),
    "negative top_k": ("/v1/completions", completion(top_k=-1), 400, "top_k", "greater than or equal to 0"),
    "top_p above 1": ("/v1/completions", completion(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    "unknown field": ("/v1/completions", completion(temprature=0), 400, "temprature", "Extra inputs"),
    "logprobs above its maximum": ("/v1/completions", completion(logprobs=21), 400, "logprobs",
                                   "less than or equal to 20"),
    "unsupported echo": ("/v1/completions", completion(echo=True), 400, "echo", "not supported"),
    "two prompts": ("/v1/completions", completion(prompt=["a", "b"]), 400, "prompt", "one prompt per request"),
    "bad prompt type": ("/v1/completions", completion(prompt={"text": "a"}), 400, "prompt", "a string or a list"),
    "empty prompt": ("/v1/completions", completion(prompt=""), 400, "prompt", "must not be empty"),
    "empty prompt in a list": ("/v1/completions", completion(prompt=[""]), 400, "prompt", "must not be empty"),
    "empty token ids": ("/v1/completions", completion(prompt=[]), 400, "prompt", "a string or a list"),
    "token id outside the vocabulary": ("/v1/completions", completion(prompt=[1, 4000]), 400, "prompt", "vocabulary"),
    "over the context": ("/v1/completions", completion(max_tokens=250), 400, "prompt", "max_tokens=250"),
    "a one-token prompt over the context": ("/v1/completions", completion(prompt=[5], max_tokens=250), 400, "prompt",
                                            "has 1 token;"),
    "chat over the context": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 250,
                              "messages": [{"role": "user", "content": "x"}]}, 400, "messages", "max_tokens=250"),
    "empty chat content": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}]},
                           400, "messages", "every message's content is empty"),
    "missing messages": ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "Field required"),
    "empty messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    "unknown role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
                     "messages", "role"),
    "chat n above its maximum": ("/v1/chat/completions", {"model": MODEL, "n": 30,
                                 "messages": [{"role": "user", "content": "x"}]}, 400, "n", "less than or equal to 16"),
    "chat top_logprobs above its maximum": ("/v1/chat/completions", {"model": MODEL, "logprobs": True, "top_logprobs": 21,
                                            "messages": [{"role": "user", "content": "x"}]}, 400, "top_logprobs",
                                            "less than or equal to 20"),
    "chat top_logprobs without logprobs": ("/v1/chat/completions", {"model": MODEL, "top_logprobs": 2,
                                           "messages": [{"role": "user", "content": "x"}]}, 400, "top_logprobs",
                                           "needs logprobs: true"),
    "negative max_completion_tokens": ("/v1/chat/completions", {"model": MODEL, "max_completion_tokens": -1,
                                       "messages": [{"role": "user", "content": "x"}]}, 400,
                                       "max_completion_tokens", "greater than or equal to 1"),
    "unknown route": ("/v1/embeddings", completion(), 404, None, "Not Found"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_and_error_json(server, case):
    path, body, status, param, message = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]


def test_context_error_names_both_numbers(client):
    prompt = " ".join(["x"] * 120)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=200)
    n = len(openai_prompt_ids(client, prompt))
    message = e.value.body["message"]
    assert f"{n} tokens" in message and "max_tokens=200" in message and "256" in message


def openai_prompt_ids(client, prompt):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"return_token_ids": True})
    return r.choices[0].prompt_token_ids


def test_overload_gets_429_with_retry_after(server):
    """96 long streams at once against 8 rows and --max-waiting 32: some are refused with 429 and
    Retry-After, the others are served; then all are closed and the server is idle again."""
    body = {"model": MODEL, "prompt": PROMPTS[17], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def one(http, answered, everyone_answered):
        async with http.stream("POST", f"{server}/v1/completions", json=body) as r:
            answered.append(r.status_code)  # the headers go out as soon as the request is queued
            if len(answered) == 96:
                everyone_answered.set()
            await everyone_answered.wait()  # hold every accepted stream open until all 96 have an answer
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
            return 200, None, None  # leaving the block hangs up: the request is aborted

    async def burst():
        answered, everyone_answered = [], asyncio.Event()
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, answered, everyone_answered) for _ in range(96)))

    results = asyncio.run(burst())
    refused = [r for r in results if r[0] == 429]
    assert refused and len(refused) < 96, [r[0] for r in results]
    assert {r[0] for r in results} <= {200, 429}
    for _, retry_after, body in refused:
        assert int(retry_after) >= 1
        assert body["error"]["type"] == "rate_limit_error" and "--max-waiting 32" in body["error"]["message"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics").text
        if metric(text, "specdec_num_requests_running") == metric(text, "specdec_num_requests_waiting") == 0:
            break
        time.sleep(0.1)
    assert metric(text, "specdec_num_requests_running") == metric(text, "specdec_num_requests_waiting") == 0
    assert metric(text, "specdec_requests_rejected_total", 'status="429"') == len(refused)
    assert httpx.get(f"{server}/health").status_code == 200


# ----------------------------------------------------------------------------------------- shutdown


def test_sigterm_finishes_running_requests_then_exits_0(tmp_path_factory, template_file, offline):
    proc, url, log = start_server(tmp_path_factory, template_file, "--max-waiting", "4")
    try:
        body = {"model": MODEL, "prompt": PROMPTS[18], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [first] + [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        (expected,) = offline.generate([PROMPTS[18]], SamplingParams(max_tokens=60, temperature=0.0,
                                                                      ignore_eos=True))
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        launcher.stop(proc)
