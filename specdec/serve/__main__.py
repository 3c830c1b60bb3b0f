"""`python -m specdec.serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) streaming speculative
decoding. Without --target/--draft it serves the embedded default pair. docs/serve.md has the details."""
from __future__ import annotations

from specdec.openmp import apply_threads, default_wait_policy

default_wait_policy()  # before anything imports torch

import argparse
import logging
import os
import sys

from specdec.flags import (HelpFormatter, Parser, add_engine_arguments, add_threads_argument, build_llm,
                           checkpoint_pair, port_number, positive_int)
from specdec.prompts import CHAT_TEMPLATE_HELP, read_chat_template, set_chat_template  # noqa: F401 (tests' import)

DEFAULT_MODEL_NAME = "default"  # the embedded pair's name, when --served-model-name is not given


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m specdec.serve",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/metrics) streaming speculative decoding. Without --target/--draft it serves the embedded "
                    "default pair.",
        formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on (0: any free one)")
    p.add_argument("--served-model-name", help="the model name clients send and /v1/models lists (default: the "
                   f"--target file or directory name without .gguf, or {DEFAULT_MODEL_NAME!r} for the embedded pair)")
    p.add_argument("--max-waiting", type=positive_int, default=64, help="requests that may wait for a batch row "
                   "(beyond --batch-size running ones); more are refused with 429 and Retry-After")
    p.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP.format(what="/v1/chat/completions"))
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGINT/SIGTERM, seconds that running "
                   "requests get to finish before they are aborted")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level")
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    add_engine_arguments(p, batch_help="the most requests decoding at once (batch rows); more wait for a row, up "
                         "to --max-waiting")
    add_threads_argument(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    try:
        from .server import bind, limit_malloc_arenas, run  # uvicorn, no torch yet
    except ImportError as e:
        print(f"specdec.serve: error: {e.name} is missing: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    sockets = []
    try:  # what can be checked is checked before the imports and the load take their seconds to minutes
        _, _, default_pair = checkpoint_pair(args)
        if args.chat_template:
            read_chat_template(args.chat_template)
        sockets = bind(args.host, args.port)  # a port in use too (bound, not listening: nobody waits on it)
    except (ValueError, OSError) as e:
        print(f"specdec.serve: error: {e}", file=sys.stderr)
        return 2
    try:
        from specdec import SamplingParams

        from .app import build_app
        from .worker import warm_up
    except ImportError as e:
        close(sockets)
        print(f"specdec.serve: error: {e.name} is missing: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    limit_malloc_arenas()
    try:
        llm = build_llm(args)
        if llm.tokenizer is None:
            raise ValueError("--target has no tokenizer (tokenizer.model or tokenizer.json); the server needs one")
        if args.chat_template:
            set_chat_template(llm.tokenizer, args.chat_template)
        print(f"specdec.serve: {apply_threads(args.threads, llm.target, llm.startup, llm.specs[0])}", file=sys.stderr,
              flush=True)
        engine = llm.engine()
        # one request per row, so auto k calibrates the full batch before the first client arrives
        warm_up(engine, llm.tokenizer.encode("def main():"), SamplingParams(max_tokens=4, temperature=0.0),
                llm.batch_size)
        for line in llm.startup.summary_lines():
            print(f"specdec.serve: {line}", file=sys.stderr, flush=True)
    except (ValueError, OSError) as e:
        close(sockets)
        print(f"specdec.serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        close(sockets)
        print("specdec.serve: interrupted while loading", file=sys.stderr)
        return 130
    name = served_name(args, default_pair)
    started = run(build_app(llm, engine, name, args.max_waiting), sockets, name, args.log_level,
                  not args.no_access_log, args.shutdown_timeout)
    return 0 if started else 1


def served_name(args, default_pair: bool) -> str:
    """--served-model-name, or the target's file or directory name without `.gguf` (not the path as typed,
    which clients would have to repeat letter for letter), or "default" for the embedded pair."""
    if args.served_model_name:
        return args.served_model_name
    if default_pair:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(args.target)).removesuffix(".gguf")


def close(sockets) -> None:
    for sock in sockets:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
