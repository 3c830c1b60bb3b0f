"""One request in flight, as the HTTP handlers see it: its deltas from the engine turned into pieces of
response (text, token ids, their log-probabilities, finish reason), with stop strings applied and latencies
observed. A request of n choices is n `Generation`s (one per choice, each with its own queue and stop
strings); `merged` interleaves their pieces as they come."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .protocol import ApiError
from .stops import StopStrings, tokens_through


@dataclass
class Piece:
    text: str
    token_ids: list[int]  # the tokens this piece adds
    finish_reason: str | None  # "stop" | "length" on the last piece
    logprobs: list | None = None  # a TokenLogprob per token of token_ids, when the request asked for them


class Generation:
    """Iterate `pieces()` once; `close()` (idempotent) releases the request, aborting it in the engine
    unless the engine already finished it. Raises ApiError if the engine failed or aborted the request
    itself (shutdown)."""

    def __init__(self, worker, metrics, decode, request_id: str, queue: asyncio.Queue, prompt_ids: list[int],
                 stops: list[str], arrival: float, choice: int = 0):
        self.worker, self.metrics, self.decode = worker, metrics, decode
        self.request_id, self.queue, self.prompt_ids, self.arrival = request_id, queue, prompt_ids, arrival
        self.choice = choice  # which of the request's n choices this is
        self.stops = StopStrings(stops)
        self.token_ids: list[int] = []
        self.logprobs: list | None = None  # a TokenLogprob per token of token_ids, when asked for
        self.finish_reason: str | None = None
        self._engine_done = False  # the engine sent the request's last delta (or failed)
        self._closed = False

    async def pieces(self):
        last = self.arrival
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self._engine_done, self.finish_reason = True, "error"
                raise ApiError(500, f"the engine failed while generating: {type(item).__name__}: {item}",
                               code="engine_error")
            at, delta = item
            new = list(delta.token_ids)
            if new:  # latencies: the first token, then each token of a step of n tokens counts dt / n
                if not self.token_ids:
                    self.metrics.ttft.observe(at - self.arrival)
                else:
                    for _ in new:
                        self.metrics.inter_token.observe((at - last) / len(new))
                last = at
            before = len(self.token_ids)
            self.token_ids += new
            if delta.logprobs is not None:
                self.logprobs = (self.logprobs or []) + list(delta.logprobs)
            self._engine_done = delta.finished
            text, stopped = self.stops.feed(delta.text)
            if stopped:  # the tokens (and their logprobs) up to the one that completed the stop string
                keep = tokens_through(self.decode, self.token_ids, before + 1, self.stops.stop_end)
                del self.token_ids[keep:]
                if self.logprobs is not None:
                    del self.logprobs[keep:]
                yield self._finish(text, before, "stop")
                return
            if delta.finished:
                if delta.finish_reason not in ("stop", "length"):
                    self.finish_reason = "abort"
                    raise ApiError(503, f"the request was aborted by the server ({delta.finish_reason}): it is "
                                   f"shutting down", code="aborted")
                yield self._finish(text + self.stops.flush(), before, delta.finish_reason)
                return
            if text or new:
                yield self._piece(text, before, None)

    def _piece(self, text: str, since: int, reason: str | None) -> Piece:
        """A piece of `text` with the tokens from index `since` on."""
        return Piece(text, self.token_ids[since:], reason, None if self.logprobs is None else self.logprobs[since:])

    def _finish(self, text: str, since: int, reason: str) -> Piece:
        self.finish_reason = reason
        self.close()
        return self._piece(text, since, reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.worker.release(self.request_id, abort=not self._engine_done, choice=self.choice)
        self.metrics.finished.labels(self.finish_reason or "abort").inc()  # no reason: the client went away


async def collect(generation: Generation) -> str:
    """The whole text of a non-streamed response (token ids, logprobs and finish reason stay on
    `generation`)."""
    try:
        return "".join([piece.text async for piece in generation.pieces()])
    finally:
        generation.close()


async def merged(generations: list[Generation]):
    """(choice, piece) for every piece of every generation, as each comes (pieces of one choice in order;
    choices in order when several are ready at once)."""
    if len(generations) == 1:
        async for piece in generations[0].pieces():
            yield 0, piece
        return
    streams = [g.pieces() for g in generations]
    waiting = {asyncio.ensure_future(anext(stream)): j for j, stream in enumerate(streams)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.get):
                j = waiting.pop(task)
                try:
                    piece = task.result()
                except StopAsyncIteration:
                    continue
                yield j, piece
                waiting[asyncio.ensure_future(anext(streams[j]))] = j
    finally:
        for task in waiting:
            task.cancel()


async def until_disconnect(receive) -> None:
    """Returns when the client has gone away (its request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
