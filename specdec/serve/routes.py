"""The server's routes, as the methods of one `Routes` object holding what they share (the engine worker, the
metrics, the tokenizer, the served model's name and limits); `app.build_app` registers them. A route can be
called alone on a `Routes` built over a stand-in worker, without FastAPI's app or uvicorn."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.options import positions_needed
from specdec.sampling import SamplingParams

from .generation import Generation, collect, until_disconnect
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
        g = self.start(body, prompt_ids, sampling(body, body.max_tokens, COMPLETIONS_MAX_TOKENS), "cmpl")
        ids = bool(body.return_token_ids)

        def choice(text: str, token_ids: list[int], reason: str | None, first: bool = False) -> CompletionChoice:
            extra = {"token_ids": token_ids} if ids else {}
            if ids and first:
                extra["prompt_token_ids"] = g.prompt_ids
            return CompletionChoice(text=text, finish_reason=reason, **extra)

        if not body.stream:
            return await answer(request, g, lambda text: CompletionResponse(
                id=g.request_id, model=self.model_name, usage=usage_of(g),
                choices=[choice(text, g.token_ids, g.finish_reason, first=True)]))
        sent = []

        def chunks(piece):
            if piece is None:
                return []
            first, sent[:] = not sent, [True]
            return [CompletionResponse(id=g.request_id, model=self.model_name,
                                       choices=[choice(piece.text, piece.token_ids, piece.finish_reason, first)])]

        return self.sse(g, chunks, lambda: CompletionResponse(id=g.request_id, model=self.model_name, choices=[],
                                                              usage=usage_of(g)), body.include_usage)

    async def chat_completions(self, request: Request):
        body = parse_request(ChatCompletionRequest, await request.body())
        self.check_model(body)
        prompt_ids = chat_prompt_ids(self.tokenizer, [m.as_template_message() for m in body.messages])
        default = self.max_context - positions_needed(len(prompt_ids), 0, self.k_max)  # the rest of the context
        g = self.start(body, prompt_ids, sampling(body, body.output_limit, default), "chatcmpl")
        ids = bool(body.return_token_ids)

        if not body.stream:
            def respond(text: str) -> ChatCompletionResponse:
                extra = {"token_ids": g.token_ids, "prompt_token_ids": g.prompt_ids} if ids else {}
                choice = ChatChoice(message=ChatDelta(role="assistant", content=text), finish_reason=g.finish_reason,
                                    **extra)
                return ChatCompletionResponse(id=g.request_id, model=self.model_name, choices=[choice],
                                              usage=usage_of(g))

            return await answer(request, g, respond)

        def chunks(piece):
            if piece is None:  # OpenAI's first chunk: the role, no content yet
                extra = {"token_ids": [], "prompt_token_ids": g.prompt_ids} if ids else {}
                delta, reason = ChatDelta(role="assistant", content=""), None
            else:
                extra = {"token_ids": piece.token_ids} if ids else {}
                delta, reason = ChatDelta(content=piece.text), piece.finish_reason
            return [ChatCompletionChunk(id=g.request_id, model=self.model_name,
                                        choices=[ChatChunkChoice(delta=delta, finish_reason=reason, **extra)])]

        return self.sse(g, chunks, lambda: ChatCompletionChunk(id=g.request_id, model=self.model_name, choices=[],
                                                               usage=usage_of(g)), body.include_usage)

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

    def start(self, body, prompt_ids: list[int], params: SamplingParams, prefix: str) -> Generation:
        arrival = time.perf_counter()
        try:
            request_id, queue = self.worker.add(prompt_ids, params, prefix)
        except ApiError as e:
            if e.status == 400 and e.param is None:  # the engine refused the prompt: empty, ids outside the
                e.param = "messages" if prefix == "chatcmpl" else "prompt"  # vocabulary, or beyond the context
                if positions_needed(len(prompt_ids), params.max_tokens, self.k_max) > self.max_context:
                    e.code = "context_length_exceeded"  # OpenAI's code
            raise
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return Generation(self.worker, self.metrics, self.tokenizer.decode, request_id, queue, prompt_ids,
                          body.stops, arrival)

    def sse(self, generation: Generation, chunks, usage_chunk, include_usage: bool) -> StreamingResponse:
        """A streamed response: `chunks(None)` first, then `chunks(piece)` for every piece, then (if asked)
        `usage_chunk()`, each as a server-sent event, and `[DONE]`."""
        async def events():
            try:
                for chunk in chunks(None):
                    yield f"data: {chunk.model_dump_json()}\n\n"
                async for piece in generation.pieces():
                    for chunk in chunks(piece):
                        yield f"data: {chunk.model_dump_json()}\n\n"
                if include_usage:
                    yield f"data: {usage_chunk().model_dump_json()}\n\n"
            except ApiError as e:  # after the 200 has gone out: the error travels as an event
                self.metrics.rejected.labels(str(e.status)).inc()
                yield f"data: {json.dumps(e.body())}\n\n"
            finally:
                generation.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sampling(body, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    """The request's sampling parameters; ApiError(400) for a combination SamplingParams refuses."""
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max(default_max_tokens, 1),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
            ignore_eos=bool(body.ignore_eos))
    except ValueError as e:
        raise ApiError(400, str(e)) from None


async def answer(request: Request, generation: Generation, respond):
    """Non-streamed: collect the text, unless the client goes away first (then the request is aborted)."""
    result = asyncio.ensure_future(collect(generation))
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not result.done():
        result.cancel()
        generation.close()
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(respond(result.result()).model_dump())


def usage_of(generation: Generation) -> Usage:
    return Usage.of(*generation.usage)


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
