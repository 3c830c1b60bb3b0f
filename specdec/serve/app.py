"""The FastAPI application: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, with /health and
/metrics (the routes are `routes.Routes`' methods). Every error is an OpenAI-shaped JSON body
(`{"error": {"message", "type", "param", "code"}}`)."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from ..summary import forward_info
from .metrics import ServerMetrics
from .protocol import ApiError
from .routes import Routes
from .worker import EngineWorker

log = logging.getLogger("specdec.serve")


def build_app(llm, engine, model_name: str, max_waiting: int) -> FastAPI:
    """The server of `engine` (an Engine on `llm`), answering to the model name `model_name`."""
    worker = EngineWorker(engine, max_waiting)
    k_max = llm.options.speculation.k_max
    metrics = ServerMetrics(worker, k_max, forward_info(llm.target))
    return app_serving(Routes(worker, metrics, llm.tokenizer, model_name, llm.max_context, k_max))


def app_serving(routes: Routes) -> FastAPI:
    """The FastAPI app of `routes`: its worker's thread runs for the app's lifespan; every error, ours or
    FastAPI's (unknown route, wrong method, a crash), answers as an OpenAI-shaped body."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        routes.worker.start(asyncio.get_running_loop())
        yield
        routes.worker.stop()

    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.worker, app.state.metrics = routes.worker, routes.metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return routes.error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):  # unknown route, wrong method
        return routes.error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return routes.error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))

    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus_metrics)
    return app
