"""`python -m specdec.serve`: an OpenAI-compatible server streaming speculative decoding (docs/serve.md).

Modules: `protocol` (request/response bodies, errors), `routes` (the routes), `app` (the FastAPI app
registering them), `generation` (one request's deltas as response pieces), `stops` (stop strings), `worker`
(the engine thread), `metrics` (Prometheus), `server` (uvicorn with graceful shutdown), `__main__` (the CLI).
Needs the `serve` extra."""
