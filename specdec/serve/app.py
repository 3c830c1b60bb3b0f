"""The FastAPI application: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, with /health and
/metrics. Every error is an OpenAI-shaped JSON body (`{"error": {"message", "type", "param", "code"}}`)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specdec.options import positions_needed
from specdec.sampling import SamplingParams

from .generation import Generation, collect, until_disconnect
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (ApiError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionRequest, CompletionResponse,
                       ModelCard, ModelList, Usage, parse_request)
from .worker import EngineWorker

log = logging.getLogger("specdec.serve")

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def build_app(llm, engine, model_name: str, max_waiting: int) -> FastAPI:
    """The server of `engine` (an Engine on `llm`), answering to the model name `model_name`."""
    worker = EngineWorker(engine, max_waiting)
    metrics = ServerMetrics(worker, llm.options.k_max)
    tokenizer = llm.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start(asyncio.get_running_loop())
        yield
        worker.stop()

    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    def error_response(e: ApiError) -> JSONResponse:
        metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):  # unknown route, wrong method
        return error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))

    # ------------------------------------------------------------------------------------ requests
    def check_model(body) -> None:
        if body.model != model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def sampling(body, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else max(default_max_tokens, 1),
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
                ignore_eos=bool(body.ignore_eos))
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def start(body, prompt_ids: list[int], params: SamplingParams, prefix: str) -> Generation:
        arrival = time.perf_counter()
        request_id, queue = worker.add(prompt_ids, params, prefix)
        metrics.prompt_tokens.inc(len(prompt_ids))
        return Generation(worker, metrics, tokenizer.decode, request_id, queue, prompt_ids, body.stops, arrival)

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

    def sse(generation: Generation, chunks, usage_chunk, include_usage: bool) -> StreamingResponse:
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
                metrics.rejected.labels(str(e.status)).inc()
                yield f"data: {json.dumps(e.body())}\n\n"
            finally:
                generation.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def usage_of(generation: Generation) -> Usage:
        return Usage.of(*generation.usage)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_request(CompletionRequest, await request.body())
        check_model(body)
        prompt = body.prompt
        prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = sampling(body, body.max_tokens, COMPLETIONS_MAX_TOKENS)
        g = start(body, prompt_ids, params, "cmpl")
        ids = bool(body.return_token_ids)

        def choice(text: str, token_ids: list[int], reason: str | None, first: bool = False) -> CompletionChoice:
            extra = {"token_ids": token_ids} if ids else {}
            if ids and first:
                extra["prompt_token_ids"] = g.prompt_ids
            return CompletionChoice(text=text, finish_reason=reason, **extra)

        if not body.stream:
            return await answer(request, g, lambda text: CompletionResponse(
                id=g.request_id, model=model_name, usage=usage_of(g),
                choices=[choice(text, g.token_ids, g.finish_reason, first=True)]))
        sent = []

        def chunks(piece):
            if piece is None:
                return []
            first, sent[:] = not sent, [True]
            return [CompletionResponse(id=g.request_id, model=model_name,
                                       choices=[choice(piece.text, piece.token_ids, piece.finish_reason, first)])]

        return sse(g, chunks, lambda: CompletionResponse(id=g.request_id, model=model_name, choices=[],
                                                         usage=usage_of(g)), body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_request(ChatCompletionRequest, await request.body())
        check_model(body)
        prompt_ids = chat_prompt_ids(tokenizer, [m.as_template_message() for m in body.messages])
        default = llm.max_context - positions_needed(len(prompt_ids), 0, llm.options.k_max)  # the rest of the context
        params = sampling(body, body.output_limit, default)
        g = start(body, prompt_ids, params, "chatcmpl")
        ids = bool(body.return_token_ids)

        if not body.stream:
            def respond(text: str) -> ChatCompletionResponse:
                extra = {"token_ids": g.token_ids, "prompt_token_ids": g.prompt_ids} if ids else {}
                choice = ChatChoice(message=ChatDelta(role="assistant", content=text), finish_reason=g.finish_reason,
                                    **extra)
                return ChatCompletionResponse(id=g.request_id, model=model_name, choices=[choice], usage=usage_of(g))

            return await answer(request, g, respond)

        def chunks(piece):
            if piece is None:  # OpenAI's first chunk: the role, no content yet
                extra = {"token_ids": [], "prompt_token_ids": g.prompt_ids} if ids else {}
                delta, reason = ChatDelta(role="assistant", content=""), None
            else:
                extra = {"token_ids": piece.token_ids} if ids else {}
                delta, reason = ChatDelta(content=piece.text), piece.finish_reason
            return [ChatCompletionChunk(id=g.request_id, model=model_name,
                                        choices=[ChatChunkChoice(delta=delta, finish_reason=reason, **extra)])]

        return sse(g, chunks, lambda: ChatCompletionChunk(id=g.request_id, model=model_name, choices=[],
                                                          usage=usage_of(g)), body.include_usage)

    # ------------------------------------------------------------------------------------ the rest
    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=llm.max_context)]).model_dump()

    @app.get("/health")
    async def health():
        if worker.broken:
            raise ApiError(503, f"the engine failed: {worker.broken}", code="unavailable")
        if not worker.accepting:
            raise ApiError(503, "the server is shutting down", code="unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


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
