"""The server's routes, as the methods of one `Routes` object holding what they share (the engine worker, the
metrics, the tokenizer, the served model's name and limits); `app.build_app` registers them. A route can be
called alone on a `Routes` built over a stand-in worker, without FastAPI's app or uvicorn."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.options import positions_needed
from specdec.sampling import SamplingParams

from .generation import Generation, collect, merged, until_disconnect
from .logprobs import CompletionLogprobsWriter, TokenStrings, chat_logprobs
from .metrics import CONTENT_TYPE
from .protocol import (ApiError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionRequest, CompletionResponse,
                       ModelCard, ModelList, Usage, parse_request)

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


@dataclass
class Routes:
    """Every route of the server. The route methods carry no return annotation: FastAPI would read one as a
    response model."""

    worker: object  # an EngineWorker (add, release, broken, accepting, stats)
    metrics: object  # its ServerMetrics
    tokenizer: object  # encode, decode, apply_chat_template
    model_name: str  # the one name requests must send, and /v1/models lists
    max_context: int  # positions per request (prompt + output + the draft's lookahead)
    k_max: int  # the most drafts per step, reserved past the output in the context
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created"
    strings: TokenStrings = field(init=False)  # token ids -> the strings and bytes logprobs show

    def __post_init__(self):
        self.strings = TokenStrings(self.tokenizer)

    # --------------------------------------------------------------------------------------------- errors
    def error_response(self, e: ApiError) -> JSONResponse:
        """`e` as its OpenAI-shaped JSON body and status, counted by status."""
        self.metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    # ------------------------------------------------------------------------------------------- requests
    async def completions(self, request: Request):
        body = parse_request(CompletionRequest, await request.body())
        self.check_model(body)
        prompt = body.prompt
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        n = body.choices
        best_of = body.best_of or n
        # best_of > n returns the n choices of highest cumulative logprob: asked for even if not returned
        top = body.logprobs if body.logprobs is not None or best_of == n else 0
        gens = self.start(body, prompt_ids, sampling(body, body.max_tokens, COMPLETIONS_MAX_TOKENS, best_of, top),
                          "cmpl")
        ids = bool(body.return_token_ids)
        writers = [None if body.logprobs is None else CompletionLogprobsWriter(self.strings, body.logprobs)
                   for _ in gens]

        def choice(j: int, index: int, text: str, token_ids: list[int], logprobs, reason: str | None,
                   first: bool = False) -> CompletionChoice:
            extra = {"token_ids": token_ids} if ids else {}
            if ids and first:
                extra["prompt_token_ids"] = prompt_ids
            written = None if writers[j] is None else writers[j].write(logprobs or [])
            return CompletionChoice(index=index, text=text, logprobs=written, finish_reason=reason, **extra)

        if not body.stream:
            def respond(texts: list[str]) -> CompletionResponse:
                order = list(range(n)) if best_of == n else best(gens)[:n]
                return CompletionResponse(id=gens[0].request_id, model=self.model_name, usage=usage_of(gens),
                                          choices=[choice(j, i, texts[j], gens[j].token_ids, gens[j].logprobs,
                                                          gens[j].finish_reason, first=True)
                                                   for i, j in enumerate(order)])

            return await answer(request, gens, respond)
        sent = set()  # choices that sent a chunk

        def chunks(j: int, piece):
            if piece is None:
                return []
            first = j not in sent
            sent.add(j)
            return [CompletionResponse(id=gens[0].request_id, model=self.model_name, choices=[
                choice(j, j, piece.text, piece.token_ids, piece.logprobs, piece.finish_reason, first)])]

        return self.sse(gens, chunks, lambda: CompletionResponse(id=gens[0].request_id, model=self.model_name,
                                                                 choices=[], usage=usage_of(gens)),
                        body.include_usage)

    async def chat_completions(self, request: Request):
        body = parse_request(ChatCompletionRequest, await request.body())
        self.check_model(body)
        prompt_ids = chat_prompt_ids(self.tokenizer, [m.as_template_message() for m in body.messages])
        default = self.max_context - positions_needed(len(prompt_ids), 0, self.k_max)  # the rest of the context
        top = (body.top_logprobs or 0) if body.logprobs else None
        gens = self.start(body, prompt_ids, sampling(body, body.output_limit, default, body.choices, top), "chatcmpl")
        ids = bool(body.return_token_ids)

        def logprobs(entries):
            return None if top is None else chat_logprobs(entries or [], self.strings, top)

        if not body.stream:
            def respond(texts: list[str]) -> ChatCompletionResponse:
                choices = []
                for j, g in enumerate(gens):
                    extra = {"token_ids": g.token_ids, "prompt_token_ids": g.prompt_ids} if ids else {}
                    choices.append(ChatChoice(index=j, message=ChatDelta(role="assistant", content=texts[j]),
                                              logprobs=logprobs(g.logprobs), finish_reason=g.finish_reason, **extra))
                return ChatCompletionResponse(id=gens[0].request_id, model=self.model_name, choices=choices,
                                              usage=usage_of(gens))

            return await answer(request, gens, respond)

        def chunks(j: int, piece):
            if piece is None:  # OpenAI's first chunk of each choice: the role, no content yet
                extra = {"token_ids": [], "prompt_token_ids": prompt_ids} if ids else {}
                choice = ChatChunkChoice(index=j, delta=ChatDelta(role="assistant", content=""), **extra)
            else:
                extra = {"token_ids": piece.token_ids} if ids else {}
                choice = ChatChunkChoice(index=j, delta=ChatDelta(content=piece.text),
                                         logprobs=logprobs(piece.logprobs), finish_reason=piece.finish_reason,
                                         **extra)
            return [ChatCompletionChunk(id=gens[0].request_id, model=self.model_name, choices=[choice])]

        return self.sse(gens, chunks, lambda: ChatCompletionChunk(id=gens[0].request_id, model=self.model_name,
                                                                  choices=[], usage=usage_of(gens)),
                        body.include_usage)

    # ----------------------------------------------------------------------------------------- the rest
    async def models(self):
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.max_context)]).model_dump()

    async def health(self):
        if self.worker.broken:
            raise ApiError(503, f"the engine failed: {self.worker.broken}", code="unavailable")
        if not self.worker.accepting:
            raise ApiError(503, "the server is shutting down", code="unavailable")
        return {"status": "ok"}

    async def prometheus_metrics(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------------------------------- helpers
    def check_model(self, body) -> None:
        if body.model != self.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def start(self, body, prompt_ids: list[int], params: SamplingParams, prefix: str) -> list[Generation]:
        """Add the request to the engine: one Generation per choice (`params.n`), in choice order."""
        arrival = time.perf_counter()
        try:
            request_id, queues = self.worker.add(prompt_ids, params, prefix)
        except ApiError as e:
            if e.status == 400 and e.param is None:  # the engine refused the prompt: empty, ids outside the
                e.param = "messages" if prefix == "chatcmpl" else "prompt"  # vocabulary, or beyond the context
                if positions_needed(len(prompt_ids), params.max_tokens, self.k_max) > self.max_context:
                    e.code = "context_length_exceeded"  # OpenAI's code
            raise
        self.metrics.prompt_tokens.inc(len(prompt_ids) * len(queues))  # n choices: n requests, n prefills
        return [Generation(self.worker, self.metrics, self.tokenizer.decode, request_id, queue, prompt_ids,
                           body.stops, arrival, choice) for choice, queue in enumerate(queues)]

    def sse(self, generations: list[Generation], chunks, usage_chunk, include_usage: bool) -> StreamingResponse:
        """A streamed response: `chunks(j, None)` for every choice j first, then `chunks(j, piece)` for every
        piece of every choice as it comes, then (if asked) `usage_chunk()`, each as a server-sent event, and
        `[DONE]`."""
        async def events():
            try:
                for j in range(len(generations)):
                    for chunk in chunks(j, None):
                        yield f"data: {chunk.model_dump_json()}\n\n"
                async with aclosing(merged(generations)) as pieces:  # closed, its waits cancelled, if we are
                    async for j, piece in pieces:
                        for chunk in chunks(j, piece):
                            yield f"data: {chunk.model_dump_json()}\n\n"
                if include_usage:
                    yield f"data: {usage_chunk().model_dump_json()}\n\n"
            except ApiError as e:  # after the 200 has gone out: the error travels as an event
                self.metrics.rejected.labels(str(e.status)).inc()
                yield f"data: {json.dumps(e.body())}\n\n"
            finally:
                for generation in generations:
                    generation.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sampling(body, max_tokens: int | None, default_max_tokens: int, n: int = 1,
             logprobs: int | None = None) -> SamplingParams:
    """The request's sampling parameters (`n` choices, `logprobs` top entries per token or None); ApiError(400)
    for a combination SamplingParams refuses."""
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max(default_max_tokens, 1),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
            ignore_eos=bool(body.ignore_eos), n=n, logprobs=logprobs)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


async def answer(request: Request, generations: list[Generation], respond):
    """Non-streamed: collect every choice's text and answer `respond(texts)`, unless the client goes away
    first (then the request is aborted) or a choice fails (then the others are aborted, the error raised)."""
    tasks = [asyncio.ensure_future(collect(g)) for g in generations]
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        while not gone.done() and not all(t.done() for t in tasks):
            await asyncio.wait([t for t in tasks if not t.done()] + [gone], return_when=asyncio.FIRST_COMPLETED)
            if any(t.done() and t.exception() is not None for t in tasks):
                break
    finally:
        gone.cancel()
    if not all(t.done() and t.exception() is None for t in tasks):
        for task in tasks:
            task.cancel()
        for generation in generations:
            generation.close()
        failed = next((t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
        if failed is not None:
            raise failed
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(respond([t.result() for t in tasks]).model_dump())


def best(generations: list[Generation]) -> list[int]:
    """The choices in order of their cumulative logprob, highest first (best_of; ties keep choice order)."""
    return sorted(range(len(generations)), key=lambda j: -sum(e.logprob for e in generations[j].logprobs or []))


def usage_of(generations: list[Generation]) -> Usage:
    """The prompt once, the completion tokens of every choice (best_of: also of those not returned)."""
    return Usage.of(len(generations[0].prompt_ids), sum(len(g.token_ids) for g in generations))


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's rendering of `messages` (with the generation prompt), encoded as it stands: the
    template writes any BOS itself."""
    from specdec.models import CheckpointError

    try:
        text = tokenizer.apply_chat_template(messages)
    except CheckpointError as e:
        raise ApiError(400, f"chat completions need a chat template: {e} (start the server with "
                       f"--chat-template FILE)", param="messages", code="no_chat_template") from None
    except Exception as e:  # noqa: BLE001 -- the template's own raise_exception(), or a template bug
        raise ApiError(400, f"the chat template refused the messages: {type(e).__name__}: {e}",
                       param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)
