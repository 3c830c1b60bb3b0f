"""uvicorn, with the graceful shutdown the server promises: on SIGINT/SIGTERM stop admitting at once (503),
let running responses finish for up to --shutdown-timeout seconds, abort the rest, and exit 0."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket

import uvicorn

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
logger = logging.getLogger("specdec.serve")


class GracefulServer(uvicorn.Server):
    """uvicorn's server that also closes the engine worker's admission the moment a signal arrives; uvicorn
    itself then waits for running responses (up to `timeout_graceful_shutdown`) and cancels the rest, which
    aborts their requests in the engine."""

    def __init__(self, config: uvicorn.Config, worker, name: str = ""):
        super().__init__(config)
        self.worker, self.name = worker, name

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn says where it listens only for sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            where = f"[{host}]" if ":" in host else host
            logger.info("serving %r on http://%s:%d (Ctrl-C to stop)", self.name, where, port)

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


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to host:port, one per address `host` resolves to, not listening yet (a client that comes
    while the model loads is refused, as before): a port another server listens on, or a host that does not
    resolve, is said in one line (ValueError naming the flag) before minutes of loading. (With SO_REUSEADDR,
    as uvicorn binds, a second process may still bind the port until this one listens: two servers started
    together on one port are told apart only then, by `run`.)"""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"--host {host}: cannot resolve it ({err})") from None
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):  # each address once
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # beside an IPv4 socket of the same port
            sock.bind((address[0], port, *address[2:]))
            port = port or sock.getsockname()[1]  # --port 0: every address on the port the first one got
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({err.strerror or err})") from None
    return sockets


def run(app, sockets: list[socket.socket], name: str, log_level: str, access_log: bool,
        shutdown_timeout: float) -> bool:
    """Serve `app` on `sockets` (from `bind`) until a signal; True if it had started."""
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=shutdown_timeout)
    server = GracefulServer(config, app.state.worker, name)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these no-op handlers in place
    # (the ones it restores) that does nothing, and a graceful shutdown returns normally
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=sockets)
    except OSError as err:  # listen() refused: another server took the port while this one loaded
        logger.error("cannot listen on port %s: %s", sockets[0].getsockname()[1], err.strerror or err)
        return False
    return server.started
