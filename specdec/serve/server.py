"""uvicorn, with the graceful shutdown the server promises: on SIGINT/SIGTERM stop admitting at once (503),
let running responses finish for up to --shutdown-timeout seconds, abort the rest, and exit 0."""
from __future__ import annotations

import ctypes
import os
import signal

import uvicorn

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


class GracefulServer(uvicorn.Server):
    """uvicorn's server that also closes the engine worker's admission the moment a signal arrives; uvicorn
    itself then waits for running responses (up to `timeout_graceful_shutdown`) and cancels the rest, which
    aborts their requests in the engine."""

    def __init__(self, config: uvicorn.Config, worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.accepting = False
        super().handle_exit(sig, frame)


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas, as MALLOC_ARENA_MAX=2 does (which wins when set). glibc gives threads their
    own arenas; the engine thread's tensors of ever-changing shapes and the event loop's objects then fragment
    several of them, and RSS creeps up with every request: `bench/serve.py soak`, 2,000 requests: 778 -> 893
    MiB with glibc's default, 685 -> 704 MiB with 2 arenas, flat after the first 300 (docs/benchmarks/serving.md).
    Call before the engine thread starts."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, arenas)
    except (OSError, AttributeError):  # not glibc: nothing to cap
        pass


def run(app, host: str, port: int, log_level: str, access_log: bool, shutdown_timeout: float) -> bool:
    """Serve `app` until a signal; True if it had started (False: e.g. the port was taken)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout)
    server = GracefulServer(config, app.state.worker)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these no-op handlers in place
    # (the ones it restores) that does nothing, and a graceful shutdown returns normally
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return server.started
