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


class ScriptedWorker:
    """Stands in for EngineWorker: every request "generates" `reply`, one character a step, finishing with
    `finish_reason`; records what was added and released."""

    def __init__(self, reply: str, finish_reason: str = "length"):
        self.reply, self.finish_reason = reply, finish_reason
        self.broken, self.accepting = None, True
        self.added, self.released = [], []

    def add(self, prompt_ids, params, prefix):
        request_id = f"{prefix}-{len(self.added)}"
        self.added.append((prompt_ids, params))
        queue = asyncio.Queue()
        for i, c in enumerate(self.reply):
            last = i == len(self.reply) - 1
            queue.put_nowait((time.perf_counter(), SimpleNamespace(
                request_id=request_id, token_ids=[ord(c)], text=c, finished=last,
                finish_reason=self.finish_reason if last else None)))
        return request_id, queue

    def release(self, request_id, abort):
        self.released.append((request_id, abort))

    def stats(self):
        return {"running": 0, "waiting": 0, "generated_tokens": 0, "proposed_drafts": 0, "accepted_drafts": 0,
                "steps": 0, "acceptance_rate": 0.0, "k_histogram": {}}

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
    ({"model": MODEL, "prompt": "hi", "n": 2}, "n", "n > 1"),
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
