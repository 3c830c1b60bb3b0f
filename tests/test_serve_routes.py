"""The server's routes alone (`specdec.serve.routes.Routes`), without uvicorn or an engine: a stand-in worker
hands each request a queue already holding its deltas, the way the engine thread would fill it; FastAPI's
TestClient drives the app in process. tests/test_serve.py drives the real server end to end."""
import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402

from specdec.logprobs import TokenLogprob  # noqa: E402
from specdec.serve.app import app_serving  # noqa: E402
from specdec.serve.metrics import ServerMetrics  # noqa: E402
from specdec.serve.routes import COMPLETIONS_MAX_TOKENS, Routes  # noqa: E402

MODEL = "tiny"
MAX_CONTEXT = 64


class CharTokenizer:
    """One token per character, its code point."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class ScriptedWorker:
    """Stands in for EngineWorker: every request "generates" `reply` (choice j of n: `reply` with each
    character shifted by j), one character a step, finishing with `finish_reason`; with `params.logprobs`
    each token's logprob is -(its position + 1) / (8 (j + 1)) and its top entries are the token and the next
    ids, each 1 less likely;
    records what was added and released."""

    def __init__(self, reply: str, finish_reason: str = "length"):
        self.reply, self.finish_reason = reply, finish_reason
        self.broken, self.accepting = None, True
        self.added, self.released = [], []

    def add(self, prompt_ids, params, prefix):
        request_id = f"{prefix}-{len(self.added)}"
        self.added.append((prompt_ids, params))
        queues = []
        for choice in range(params.n):
            queue = asyncio.Queue()
            for i, c in enumerate(self.reply):
                last = i == len(self.reply) - 1
                token = ord(c) + choice
                logprobs = None
                if params.logprobs is not None:
                    value = -(i + 1) / (8 * (choice + 1))  # later choices are likelier: best_of's order
                    top = tuple((token + t, value - t) for t in range(params.logprobs))
                    logprobs = [TokenLogprob(token, value, top)]
                queue.put_nowait((time.perf_counter(), SimpleNamespace(
                    request_id=request_id, choice=choice, token_ids=[token], text=chr(token), finished=last,
                    finish_reason=self.finish_reason if last else None, logprobs=logprobs)))
            queues.append(queue)
        return request_id, queues

    def release(self, request_id, abort, choice=0):
        self.released.append((request_id, abort) if choice == 0 else (request_id, abort, choice))

    def stats(self):
        return {"running": 0, "waiting": 0, "generated_tokens": 0, "proposed_drafts": 0, "accepted_drafts": 0,
                "steps": 0, "acceptance_rate": 0.0, "k_histogram": {}, "k0_reasons": {}}

    def start(self, loop):
        pass

    def stop(self):
        pass


def routes_over(worker) -> Routes:
    return Routes(worker, ServerMetrics(worker, k_max=4), CharTokenizer(), MODEL, MAX_CONTEXT, k_max=4,
                  created=1234)


def test_models_lists_the_served_model_with_its_context():
    body = asyncio.run(routes_over(ScriptedWorker("")).models())
    assert body["object"] == "list"
    assert [(m["id"], m["created"], m["max_model_len"]) for m in body["data"]] == [(MODEL, 1234, MAX_CONTEXT)]


def test_health_is_503_once_the_worker_stops_accepting():
    worker = ScriptedWorker("")
    routes = routes_over(worker)
    assert asyncio.run(routes.health()) == {"status": "ok"}
    worker.accepting = False
    client = TestClient(app_serving(routes))
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "unavailable"


@pytest.mark.parametrize("body, param, words", [
    ({"model": "other", "prompt": "hi"}, "model", "is not served here"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature", "temperature"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, "n", "less than or equal to 16"),
])
def test_a_bad_completion_request_gets_an_openai_shaped_400(body, param, words):
    worker = ScriptedWorker("never")
    routes = routes_over(worker)
    response = TestClient(app_serving(routes)).post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]
    assert worker.added == []  # refused before reaching the engine
    assert 'specdec_requests_rejected_total{status="400"} 1.0' in routes.metrics.render().decode()


def test_invalid_json_is_a_400_naming_it():
    response = TestClient(app_serving(routes_over(ScriptedWorker("")))).post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_a_completion_returns_the_generated_text_ids_and_usage():
    worker = ScriptedWorker(" world")
    response = TestClient(app_serving(routes_over(worker))).post("/v1/completions", json={
        "model": MODEL, "prompt": "hello", "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200
    body = response.json()
    (choice,) = body["choices"]
    assert choice["text"] == " world" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == [ord(c) for c in " world"]
    assert choice["prompt_token_ids"] == [ord(c) for c in "hello"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert body["id"] == "cmpl-0" and body["model"] == MODEL
    ((prompt_ids, params),) = worker.added
    assert prompt_ids == [ord(c) for c in "hello"]
    assert params.max_tokens == COMPLETIONS_MAX_TOKENS and params.temperature == 0.0
    assert worker.released == [("cmpl-0", False)]  # finished by the engine: nothing to abort


def test_a_stop_string_cuts_the_completion_and_aborts_the_request():
    worker = ScriptedWorker("abc.def")
    response = TestClient(app_serving(routes_over(worker))).post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "stop": ".", "max_tokens": 10})
    (choice,) = response.json()["choices"]
    assert choice["text"] == "abc" and choice["finish_reason"] == "stop"
    assert worker.released == [("cmpl-0", True)]  # the engine was still generating it


def test_a_streamed_completion_concatenates_to_the_text_and_ends_with_done():
    worker = ScriptedWorker("xyz")
    response = TestClient(app_serving(routes_over(worker))).post("/v1/completions", json={
        "model": MODEL, "prompt": "p", "stream": True, "stream_options": {"include_usage": True}})
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "xyz"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------------------ n, logprobs, best_of


def openai_client(routes):
    """The `openai` client over the app in process (FastAPI's TestClient is an httpx client)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                         http_client=TestClient(app_serving(routes)))


def test_completions_n_choices_with_logprobs_in_openais_shape():
    worker = ScriptedWorker("abc")
    r = openai_client(routes_over(worker)).completions.create(model=MODEL, prompt="hi", n=2, logprobs=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, "abc"), (1, "bcd")]
    first = r.choices[1].logprobs
    assert first.tokens == ["b", "c", "d"] and first.text_offset == [0, 1, 2]
    assert first.token_logprobs == [-1 / 16, -2 / 16, -3 / 16]
    # the top entries by text, and the token itself (it is one of them here: 2 entries, not 3)
    assert first.top_logprobs[0] == {"b": -1 / 16, "c": -1 / 16 - 1}
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 2
    ((_, params),) = worker.added
    assert params.n == 2 and params.logprobs == 2


def test_completions_logprobs_zero_gives_the_token_alone_and_omitted_logprobs_none():
    client = openai_client(routes_over(ScriptedWorker("ab")))
    r = client.completions.create(model=MODEL, prompt="hi", logprobs=0)
    assert r.choices[0].logprobs.top_logprobs == [{"a": -1 / 8}, {"b": -2 / 8}]
    assert client.completions.create(model=MODEL, prompt="hi").choices[0].logprobs is None


def test_streamed_chat_choices_carry_their_index_and_their_tokens_logprobs():
    client = openai_client(routes_over(ScriptedWorker("abc")))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    for j, reply in enumerate(("abc", "bcd")):
        mine = [c.choices[0] for c in chunks[2:-1] if c.choices[0].index == j]
        assert "".join(c.delta.content for c in mine) == reply and mine[-1].finish_reason == "length"
        entries = [e for c in mine for e in c.logprobs.content]
        assert [(e.token, e.bytes, e.logprob) for e in entries] == [
            (ch, [ord(ch)], -(i + 1) / (8 * (j + 1))) for i, ch in enumerate(reply)]
        assert [[t.token for t in e.top_logprobs] for e in entries] == [[ch, chr(ord(ch) + 1)] for ch in reply]


def test_chat_logprobs_without_top_logprobs_give_empty_top_lists():
    r = openai_client(routes_over(ScriptedWorker("ab"))).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert [(e.token, e.top_logprobs) for e in r.choices[0].logprobs.content] == [("a", []), ("b", [])]


def test_best_of_returns_the_n_likeliest_choices():
    worker = ScriptedWorker("abc")
    r = openai_client(routes_over(worker)).completions.create(model=MODEL, prompt="hi", n=2, best_of=3)
    # choice 2 ("cde") is the likeliest, then choice 1; logprobs were not asked for: none are returned
    assert [(c.index, c.text, c.logprobs) for c in r.choices] == [(0, "cde", None), (1, "bcd", None)]
    assert r.usage.completion_tokens == 9  # every choice generated counts
    ((_, params),) = worker.added
    assert params.n == 3 and params.logprobs == 0  # ranked by the engine's logprobs


def test_a_stop_string_in_one_choice_cuts_that_choice_and_its_logprobs_only():
    worker = ScriptedWorker("abc.def")  # choice 1 is "bcd/efg": no "."
    response = TestClient(app_serving(routes_over(worker))).post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "stop": ".", "max_tokens": 10, "n": 2, "logprobs": 1})
    first, second = response.json()["choices"]
    assert (first["text"], first["finish_reason"]) == ("abc", "stop")
    assert first["logprobs"]["tokens"] == ["a", "b", "c", "."]  # the tokens through the stop string
    assert (second["text"], second["finish_reason"]) == ("bcd/efg", "length")
    assert len(second["logprobs"]["tokens"]) == 7
    assert sorted(worker.released, key=len) == [("cmpl-0", True), ("cmpl-0", False, 1)]  # only choice 0 aborted


CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, fields, param, words", [
    ("/v1/completions", {"n": 17}, "n", "less than or equal to 16"),
    ("/v1/completions", {"n": 0}, "n", "greater than or equal to 1"),
    ("/v1/chat/completions", {"n": 17}, "n", "less than or equal to 16"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "valid integer"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "valid boolean"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of", "must be >= n"),
    ("/v1/completions", {"best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ("/v1/completions", {"best_of": 17}, "best_of", "less than or equal to 16"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of", "not supported"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs", "Extra inputs"),
])
def test_n_logprobs_and_best_of_out_of_range_get_one_400_naming_the_field(path, fields, param, words):
    worker = ScriptedWorker("never")
    body = {"model": MODEL, **({"messages": CHAT} if "chat" in path else {"prompt": "hi"}), **fields}
    response = TestClient(app_serving(routes_over(worker))).post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error
    assert worker.added == []


def test_the_openai_client_sees_the_400_and_its_param():
    openai = pytest.importorskip("openai")
    client = openai_client(routes_over(ScriptedWorker("x")))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=40)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=25)
    assert e.value.body["param"] == "top_logprobs"


def test_the_worker_counts_every_choice_as_a_waiting_request():
    """n choices are n requests: 429 when they would make more than --max-waiting wait, and a 400 naming n
    when n alone is more than may wait."""
    from specdec.sampling import SamplingParams
    from specdec.serve.protocol import ApiError
    from specdec.serve.worker import EngineWorker

    metrics = SimpleNamespace(generated_tokens=0, proposed_drafts=0, accepted_drafts=0, steps=0,
                              acceptance_rate=0.0, k_histogram={}, k0_reasons={}, drafts_by_drafter={})
    added = []
    engine = SimpleNamespace(metrics=metrics, num_waiting=60, add_request=lambda *a, **k: added.append(a))
    worker = EngineWorker(engine, max_waiting=64)
    request_id, queues = worker.add([1, 2], SamplingParams(n=4), "cmpl")
    assert len(queues) == 4 and len(added) == 1
    with pytest.raises(ApiError) as e:
        worker.add([1, 2], SamplingParams(n=5), "cmpl")
    assert e.value.status == 429
    with pytest.raises(ApiError) as e:
        EngineWorker(engine, max_waiting=4).add([1, 2], SamplingParams(n=5), "cmpl")
    assert (e.value.status, e.value.param) == (400, "n")


# --------------------------------------------------------------------------- issue 44: a newcomer's first hour


class RefusingWorker(ScriptedWorker):
    """Refuses every prompt as EngineWorker does when the engine's check fails (an ApiError 400 without param)."""

    def add(self, prompt_ids, params, prefix):
        from specdec.options import positions_needed
        from specdec.serve.protocol import ApiError

        need = positions_needed(len(prompt_ids), params.max_tokens, 4)
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; with max_tokens={params.max_tokens} and k=4 "
                       f"it needs {need} positions but the model context is {MAX_CONTEXT}" if need > MAX_CONTEXT
                       else "the prompt has token ids outside the vocabulary [0, 100)")


@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 60}, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5, 700], "max_tokens": 2}, "prompt", None),
])
def test_a_prompt_the_engine_refuses_names_its_param(path, body, param, code, monkeypatch):
    """A prompt too long for the context is OpenAI's `context_length_exceeded` on `prompt` / `messages`, not
    `param: null`; ids outside the vocabulary name `prompt`."""
    import specdec.serve.routes as routes_module

    monkeypatch.setattr(routes_module, "chat_prompt_ids", lambda tokenizer, messages: [1, 2, 3])
    response = TestClient(app_serving(routes_over(RefusingWorker("")))).post(path, json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error


@pytest.mark.parametrize("content", ["", [], [{"type": "text", "text": ""}]])
def test_a_chat_request_with_no_text_is_a_400_like_an_empty_prompt(content):
    worker = ScriptedWorker("never")
    response = TestClient(app_serving(routes_over(worker))).post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "system", "content": ""}, {"role": "user", "content": content}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "every message's content is empty" in error["message"]
    assert worker.added == []


def serve_main(argv, monkeypatch, capsys):
    """`python -m specdec.serve ARGV` in process, with the model load replaced by a failure: what it refuses,
    it refuses before loading."""
    import specdec.serve.__main__ as serve

    def no_load(args):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(serve, "build_llm", no_load)
    try:
        code = serve.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_one_line_before_loading(port, monkeypatch, capsys):
    code, err = serve_main(["--port", port], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "argument --port" in err, err


def test_a_port_in_use_is_one_line_before_loading(monkeypatch, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = serve_main(["--port", str(port)], monkeypatch, capsys)
    assert code == 2 and err == f"specdec.serve: error: --port {port}: cannot listen on 127.0.0.1:{port} " \
                                "(Address already in use)\n"


def test_port_0_binds_a_free_port_where_nobody_waits_while_the_model_loads():
    import socket

    from specdec.serve.server import bind

    (sock,) = bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # bound, not listening: a client is refused rather than left hanging in a backlog
    finally:
        sock.close()


@pytest.mark.parametrize("argv, name", [
    ([], "default"),
    (["--target", "models/../.cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf"], "SmolLM2-135M-Instruct.Q4_1"),
    (["--target", "/ckpt/my-llama/"], "my-llama"),
    (["--target", "/ckpt/my-llama", "--served-model-name", "mine"], "mine"),
])
def test_the_served_name_is_the_models_not_the_path_as_typed(argv, name):
    import specdec.serve.__main__ as serve

    args = serve.build_parser().parse_args(argv)
    assert serve.served_name(args, default_pair=not argv) == name
