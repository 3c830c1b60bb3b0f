"""The engine thread: one background thread steps the `Engine`; HTTP handlers on the event loop add and abort
requests (both thread-safe in the engine) and read each request's deltas from its own asyncio.Queue (one per
choice of a request of n), filled from the thread with `loop.call_soon_threadsafe`."""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid

from specdec.models.numerics import warm_packed

from .protocol import ApiError

log = logging.getLogger("specdec.serve")

FAILURES_BEFORE_BROKEN = 3  # consecutive failed steps after which the engine is declared unusable


class EngineWorker:
    """Owns the engine's stepping thread and the per-request queues.

    A queue receives `(time, RequestDelta)` items of one choice of one request, the last one with
    `finished=True`, or one Exception if a step failed. `max_waiting` bounds the requests added but not yet
    holding a row (a request of n choices counts n): beyond it `add` refuses with 429 and Retry-After."""

    def __init__(self, engine, max_waiting: int):
        self.engine = engine
        self.max_waiting = max_waiting
        self.broken: str | None = None  # why the engine cannot serve any more (repeated step failures)
        self.accepting = True  # False from the start of a graceful shutdown: new requests get 503
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[tuple[str, int], asyncio.Queue] = {}  # (request id, choice) -> its queue
        self._lock = threading.Lock()  # guards _streams and _stats
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._stats = self._read_stats()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # ---------------------------------------------------------------------------------- event loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.engine.on_first_tokens = self._publish  # first tokens leave before the step's decoding run
        self._thread.start()

    def add(self, prompt_ids: list[int], params, prefix: str) -> tuple[str, list[asyncio.Queue]]:
        """Queue a request (of `params.n` choices); returns its id (also the response's id) and the queues
        its choices' deltas arrive on, choice by choice. Raises ApiError: 503 while shutting down or broken,
        429 when its choices would make more than `max_waiting` requests wait, 400 for n above `max_waiting`
        and for a request the engine refuses (its ValueError's message: empty prompt, ids outside the
        vocabulary, prompt + max_tokens beyond the context)."""
        if not self.accepting or self.broken:
            raise ApiError(503, f"the engine failed and cannot serve: {self.broken}" if self.broken
                           else "the server is shutting down", code="unavailable")
        n = params.n
        if n > self.max_waiting:
            raise ApiError(400, f"n={n} choices are {n} requests, more than may wait for a row (--max-waiting "
                           f"{self.max_waiting})", param="n")
        waiting = self.engine.num_waiting
        if waiting + n > self.max_waiting:
            raise ApiError(429, f"{waiting} requests are already waiting for a batch row (--max-waiting "
                           f"{self.max_waiting}); retry later", code="too_many_waiting_requests",
                           headers={"Retry-After": "1"})
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        queues = [asyncio.Queue() for _ in range(n)]
        with self._lock:  # registered first, so that no delta can arrive before its queue exists
            for choice, queue in enumerate(queues):
                self._streams[(request_id, choice)] = queue
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except ValueError as e:
            with self._lock:
                for choice in range(n):
                    del self._streams[(request_id, choice)]
            # the engine names the request by its id ("request 'cmpl-...' has ..."); a client knows it as its prompt
            raise ApiError(400, re.sub(r"^(prompt \d+|request \S+) ", "the prompt ", str(e))) from None
        self._wake.set()
        return request_id, queues

    def release(self, request_id: str, abort: bool, choice: int = 0) -> None:
        """The response is done with choice `choice` of `request_id`; `abort`: the engine should stop
        generating it (client gone, stop string found). Its row is freed at the engine's next step."""
        with self._lock:
            self._streams.pop((request_id, choice), None)
        if abort:
            self.engine.abort(request_id, choice)
            self._wake.set()

    def stats(self) -> dict:
        """The engine's counters as of its last step, with the live row and queue counts."""
        with self._lock:
            stats = dict(self._stats)
        stats["running"], stats["waiting"] = self.engine.num_running, self.engine.num_waiting
        return stats

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is still live, let the thread step until the engine is empty, and join it."""
        self.accepting = False
        self._closing.set()
        with self._lock:
            live = list(self._streams)
        for request_id, choice in live:
            self.engine.abort(request_id, choice)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -------------------------------------------------------------------------------------- thread side
    def _read_stats(self) -> dict:
        m = self.engine.metrics
        return {"generated_tokens": m.generated_tokens, "proposed_drafts": m.proposed_drafts,
                "accepted_drafts": m.accepted_drafts, "steps": m.steps, "acceptance_rate": m.acceptance_rate,
                "k_histogram": dict(m.k_histogram), "k0_reasons": dict(m.k0_reasons),
                "drafts_by_drafter": {name: tuple(tally) for name, tally in m.drafts_by_drafter.items()},
                "prefill_chunks": getattr(m, "prefill_chunks", 0), "prefix_cache": self._prefix_stats()}

    def _prefix_stats(self) -> dict | None:
        """The prefix cache's counters and bytes (None without one)."""
        store = getattr(getattr(self.engine, "llm", None), "prefix_cache", None)
        return None if store is None else store.stats()

    def _run(self) -> None:
        failures = 0
        while True:
            self._wake.clear()
            if not self.engine.has_unfinished():
                if self._closing.is_set():
                    return
                self._wake.wait(timeout=1.0)
                continue
            try:
                deltas = self.engine.step()
            except Exception as e:  # noqa: BLE001 -- reported to every live request, never kills the server
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                self._fail_all(e)
                if failures >= FAILURES_BEFORE_BROKEN:
                    self.broken = f"{type(e).__name__}: {e}"
                    return
                continue
            failures = 0
            self._publish(deltas)

    def _publish(self, deltas) -> None:
        """Hand each delta to its request's queue (a step's, or its admissions' first tokens mid-step:
        `Engine.on_first_tokens`), with the engine's counters as of now."""
        now = time.perf_counter()
        stats = self._read_stats()
        with self._lock:
            self._stats = stats
            targets = [(self._streams.pop((d.request_id, d.choice), None) if d.finished
                        else self._streams.get((d.request_id, d.choice)), d) for d in deltas]
        for queue, delta in targets:
            if queue is not None:
                self._loop.call_soon_threadsafe(queue.put_nowait, (now, delta))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for (request_id, choice), queue in streams.items():
            self.engine.abort(request_id, choice)
            self._loop.call_soon_threadsafe(queue.put_nowait, error)


def warm_up(engine, prompt_ids: list[int], params, copies: int) -> None:
    """Run short requests through the engine before serving, one alone and then `copies` together, so that the
    first clients do not pay for auto k's calibration (its costs at one row, what a single client runs, and at
    `copies` rows), lazy allocations or compilation; and every packed linear layer at every row count it will see
    (`numerics.warm_packed`), so that the server's memory stays flat."""
    for model in (engine.llm.target, engine.llm.draft):
        if model is not None:
            warm_packed(model)
    for count in sorted({1, copies}):
        for i in range(count):
            engine.add_request(prompt_ids, params, request_id=f"warm-up-{count}-{i}")
        while engine.has_unfinished():
            engine.step()
