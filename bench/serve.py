"""Serving under load: `python -m specdec.serve` (auto k), the same with `--method ar`, and `transformers serve
--continuous-batching` on the same target, SpecBench chat prompts and template, side by side.

`load` (default): Poisson arrivals per rate, streamed greedy chat completions; throughput, TTFT and inter-token
latency per server and rate, interleaved repeats (docs/benchmarks/serving.md). Writes serve.jsonl and serve.md
to --out, the plot to --plot. `soak`: one specdec server under --soak-requests mixed requests, its RSS read
every --every finished ones; writes soak.json.

    python -m bench.serve --quick                                       # smoke test: seconds
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from bench.common import (REPO, HelpFormatter, command_line, git_revision, parse_with_quick, pyplot, read_jsonl,
                          rss_mib, write_json, write_jsonl)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(args) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(args.threads))  # the wait policy: bench/__init__.py


def specdec_command(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "specdec.serve", "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
            "--log-level", "warning", *flags]


def launch(command: list[str], port: int, log_path: str, env: dict | None = None,
           timeout_s: float = 300.0, health: str = "/health") -> subprocess.Popen:
    """Start a server (output to `log_path`) and wait, at most `timeout_s`, until GET `health` answers 200.
    Raises RuntimeError with the log's tail if it exits or does not come up."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"http://127.0.0.1:{port}{health}", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop(proc)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    raise RuntimeError(f"{' '.join(command)} did not come up on port {port} (exit {proc.returncode}):\n{tail}")


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# ------------------------------------------------------------------------------------------------ load


SERVERS = ("specdec", "specdec-ar", "hf")
LABELS = {"specdec": "specdec (auto k)", "specdec-ar": "specdec --method ar", "hf": "transformers serve --cb"}
# the embedded pair ships no chat template: this one (every server renders it) writes messages as Python
# comments, which the code model then continues
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
QUICK = dict(servers="specdec", rates="2", requests=4, max_tokens=8, repeats=1, plot="", soak_requests=40, every=10)
K_MAX = 8  # specdec's default --max-speculative-tokens: the context a request needs beyond its tokens


def model_with_template(tmp: str) -> str:
    """A copy of the embedded target with CHAT_TEMPLATE as its chat_template.jinja (read by our tokenizer and
    by transformers alike). Copied, not linked: our loader refuses links that lead out of a checkpoint."""
    from specdec.prompts import DEFAULT_TARGET

    path = os.path.join(tmp, "target")
    shutil.copytree(DEFAULT_TARGET, path)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    return path


def server_command(name: str, port: int, model: str, args) -> tuple[list[str], str]:
    """The command that serves `model` as server `name`, and the model name its requests carry."""
    from specdec.prompts import DEFAULT_DRAFT

    if name == "hf":
        return (["transformers", "serve", model, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                 "--dtype", "float32", "--device", "cpu", "--log-level", "warning"], model)
    method = "ar" if name == "specdec-ar" else args.method
    return (specdec_command(port, "--target", model, "--draft", DEFAULT_DRAFT, "--method", method, "-k", "auto",
                            "--batch-size", str(args.batch_size), "--max-waiting", "100000",
                            "--served-model-name", "bench"), "bench")


def chat_questions(path: str, model: str, max_tokens: int) -> list[list[dict]]:
    """SpecBench first turns as one-message chats, those that fit the context with max_tokens."""
    from specdec.models import load_tokenizer
    from specdec.prompts import read_prompts

    tokenizer = load_tokenizer(model)
    room = 256 - max_tokens - K_MAX - 1
    chats = [[{"role": "user", "content": q}] for q in read_prompts(path)]
    fit = [c for c in chats
           if len(tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False)) <= room]
    if not fit:
        raise SystemExit(f"{path}: no question fits the context with --max-tokens {max_tokens}")
    return fit


@dataclass
class Record:
    sent: float  # seconds from the run's start
    first: float | None = None  # first content chunk
    last: float | None = None  # last content chunk
    tokens: int = 0  # completion tokens (the server's usage)
    error: str | None = None


async def chat_stream(http: httpx.AsyncClient, base: str, model: str, messages: list[dict], max_tokens: int,
                      start: float) -> Record:
    record = Record(sent=time.perf_counter() - start)
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter() - start
                        record.first = now if record.first is None else record.first
                        record.last = now
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


async def run_load(base: str, model: str, chats: list, arrivals: list[float], max_tokens: int,
                   max_time: float) -> tuple[list[Record], int]:
    """Send chats[i] at arrivals[i] (seconds), none after max_time; wait for them at most max_time more.
    Returns the records of the requests that finished and the number cancelled unfinished."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(max_time * 2 + 60), limits=limits) as http:
        start, tasks = time.perf_counter(), []
        for at, chat in zip(arrivals, chats):
            if at > max_time:
                break
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(chat_stream(http, base, model, chat, max_tokens, start)))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, start + 2 * max_time - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in tasks if t in done], len(pending)


def percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record], cancelled: int) -> dict:
    ok = [r for r in records if r.error is None and r.first is not None]
    itl = [(r.last - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1]
    span = max((r.last for r in ok), default=0.0) - min((r.sent for r in records), default=0.0)
    return {"completed": len(ok), "errors": sum(r.error is not None for r in records), "cancelled": cancelled,
            "tokens": sum(r.tokens for r in ok), "throughput": sum(r.tokens for r in ok) / span if span > 0 else 0.0,
            "ttft_p50": percentile([r.first - r.sent for r in ok], 50),
            "ttft_p99": percentile([r.first - r.sent for r in ok], 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "first_error": next((r.error for r in records if r.error), None)}


def load_main(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    servers = args.servers.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    tmp = tempfile.mkdtemp(prefix="specdec-serve-bench-")
    model = model_with_template(tmp)
    chats = chat_questions(args.prompts, model, args.max_tokens)
    env = server_env(args)
    procs, bases = {}, {}
    meta = {"type": "meta", "command": command_line("bench.serve"), "git": git_revision(), "servers": servers,
            "rates": rates, "requests": args.requests, "max_time": args.max_time, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "threads": args.threads, "batch_size": args.batch_size, "method": args.method,
            "questions": len(chats), "loadavg_before": list(os.getloadavg())}
    rows = []
    try:
        for name in servers:
            port = free_port()
            command, model_name = server_command(name, port, model, args)
            meta[f"command_{name}"] = shlex.join(command)
            print(f"starting {name}: {shlex.join(command)}", flush=True)
            procs[name] = launch(command, port, os.path.join(args.out, f"server-{name}.log"), env, timeout_s=600)
            bases[name] = (f"http://127.0.0.1:{port}", model_name)
            # warm-up: first-call costs (transformers' first continuous batch, allocations) stay out of the runs
            warm = asyncio.run(run_load(*bases[name], chats[:4], [0.0] * 4, args.max_tokens, 600))
            print(f"  warmed up: {summarize(*warm)['completed']}/4 requests", flush=True)
        for repeat in range(args.repeats):
            for i, rate in enumerate(rates):
                seed = 1000 * repeat + i
                arrivals = poisson_arrivals(rate, args.requests, seed)
                picked = random.Random(seed).sample(chats, min(args.requests, len(chats)))
                picked = [picked[j % len(picked)] for j in range(args.requests)]
                shift = (repeat + i) % len(servers)
                for name in servers[shift:] + servers[:shift]:
                    records, cancelled = asyncio.run(run_load(*bases[name], picked, arrivals, args.max_tokens,
                                                              args.max_time))
                    row = {"type": "run", "server": name, "rate": rate, "repeat": repeat,
                           **summarize(records, cancelled)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_after"] = list(os.getloadavg())
    write_jsonl(os.path.join(args.out, "serve.jsonl"), [meta, *rows])
    with open(os.path.join(args.out, "serve.md"), "w") as f:
        f.write(show([meta], rows, args.plot))


def show(metas: list[dict], rows: list[dict], plot_path: str) -> str:
    """Prints (and returns) the tables of one or more runs; plots them all together to plot_path unless ''."""
    servers = [s for s in SERVERS if any(r["server"] == s for r in rows)]
    table = "\n".join(report(meta, [r for r in rows if r["rate"] in meta["rates"]], servers, meta["rates"])
                      for meta in metas)
    print(table)
    if plot_path:
        plot(rows, servers, sorted({r["rate"] for r in rows}), plot_path)
    return table


def report_main(args) -> None:
    """The table and plot of the runs in args.from_jsonl together."""
    lines = [x for path in args.from_jsonl for x in read_jsonl(path)]
    show([x for x in lines if x["type"] == "meta"], [x for x in lines if x["type"] == "run"], args.plot)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}" if x >= 0.1 else f"{1000 * x:.1f}"


def _ratio(rows, rate, key, a, b) -> str:
    """The median over repeats of a's key / b's key, each ratio from one repeat's side-by-side runs."""
    by = {(r["server"], r["repeat"]): r[key] for r in rows if r["rate"] == rate}
    ratios = [by[a, rep] / by[b, rep] for (s, rep) in by if s == a and (b, rep) in by and by[a, rep] and by[b, rep]]
    return f"{statistics.median(ratios):.2f}" if ratios else "-"


def report(meta: dict, rows: list[dict], servers: list[str], rates: list[float]) -> str:
    lines = [f"`{meta['command']}` (git {meta['git']}; {meta['requests']} requests per run, at most "
             f"{meta['max_time']:g} s of arrivals; {meta['max_tokens']} tokens at most; {meta['repeats']} repeats; "
             f"{meta['threads']} thread(s) per server; load average {meta['loadavg_before'][0]:.1f} before, "
             f"{meta['loadavg_after'][0]:.1f} after)", "",
             "| rate (req/s) | server | throughput tok/s: median (min-max) | TTFT p50 / p99 ms | ITL p50 / p99 ms "
             "| finished / sent |", "|---:|---|---:|---:|---:|---:|"]
    for rate in rates:
        for name in servers:
            runs = [r for r in rows if r["server"] == name and r["rate"] == rate]
            if not runs:
                continue
            tp = [r["throughput"] for r in runs]
            m = {k: _median([r[k] for r in runs]) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
            sent = sum(r["completed"] + r["errors"] + r["cancelled"] for r in runs)
            lines.append(f"| {rate:g} | {LABELS[name]} | {statistics.median(tp):.0f} ({min(tp):.0f}-{max(tp):.0f}) | "
                         f"{_ms(m['ttft_p50'])} / {_ms(m['ttft_p99'])} | {_ms(m['itl_p50'])} / {_ms(m['itl_p99'])} | "
                         f"{sum(r['completed'] for r in runs)} / {sent} |")
    lines += ["", "Ratios per rate (median over repeats of the side-by-side ratio):", "",
              "| rate (req/s) | ITL p50: specdec / transformers | throughput: specdec / transformers | "
              "throughput: auto k / ar | ITL p50: auto k / ar |", "|---:|---:|---:|---:|---:|"]
    for rate in rates:
        lines.append(f"| {rate:g} | {_ratio(rows, rate, 'itl_p50', 'specdec', 'hf')} | "
                     f"{_ratio(rows, rate, 'throughput', 'specdec', 'hf')} | "
                     f"{_ratio(rows, rate, 'throughput', 'specdec', 'specdec-ar')} | "
                     f"{_ratio(rows, rate, 'itl_p50', 'specdec', 'specdec-ar')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], servers: list[str], rates: list[float], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("throughput", None, "throughput (tokens/s)", 1), ("ttft_p50", "ttft_p99", "TTFT (ms)", 1000),
              ("itl_p50", "itl_p99", "inter-token latency (ms)", 1000))
    for ax, (key, key99, title, scale) in zip(axes, panels):
        for name in servers:
            for k, style in ((key, "-o"), (key99, "--")):
                if k is None:
                    continue
                ys = [_median([r[k] for r in rows if r["server"] == name and r["rate"] == rate]) for rate in rates]
                label = LABELS[name] + (" p99" if k == key99 else " p50" if key99 else "")
                ax.plot(rates, [None if y is None else y * scale for y in ys], style, label=label,
                        color=f"C{SERVERS.index(name)}")
        ax.set_xscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=7)
    fig.suptitle("Streaming chat completions under load: embedded target, SpecBench questions, greedy")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------- chat and mixed (GGUF)
# Issue 43: the real model (SmolLM2-135M-Instruct, the Q4_1 GGUF) served by specdec (int4, its defaults) with and
# without the prefix cache and chunked prefill, and by llama-cpp-python's OpenAI server on the same file.
GGUF = os.path.join(os.environ.get("SPECDEC_TEST_CACHE") or os.path.join(REPO, ".cache", "real_model"),
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


def gguf_server_command(name: str, port: int, args) -> list[str]:
    """`llamacpp`: `python -m llama_cpp.server` (its `Llama.generate` keeps the KV of the last prompt and reuses
    its longest common prefix with the next one: llama.cpp's prompt cache); `specdec[+cache][+chunk=N]`: our
    server, int4, with --prefix-cache-gb and --prefill-chunk N."""
    threads = str(args.threads)
    if name == "llamacpp":
        return [sys.executable, "-m", "llama_cpp.server", "--model", args.gguf, "--host", "127.0.0.1", "--port",
                str(port), "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "8192", "--model_alias",
                "bench", "--interrupt_requests", "False", "--verbose", "False"]
    flags = ["--target", args.gguf, "--quantize", "int4", "--batch-size", str(args.batch_size), "--max-waiting",
             "1000", "--served-model-name", "bench"]
    for part in name.split("+")[1:]:
        if part == "cache":
            flags += ["--prefix-cache-gb", str(args.prefix_cache_gb)]
        elif part.startswith("chunk="):
            flags += ["--prefill-chunk", part.split("=")[1]]
        else:
            raise SystemExit(f"unknown server {name!r}")
    return specdec_command(port, *flags)


def question_texts(path: str) -> list[str]:
    """Every turn of every SpecBench question, in file order."""
    with open(path, encoding="utf-8") as f:
        return [t for line in f if line.strip() for t in json.loads(line)["turns"]]


def user_messages(texts: list[str], tokenizer, count: int, tokens: int, offset: int) -> list[str]:
    """`count` user messages of about `tokens` tokens each: consecutive questions from `offset` joined."""
    out, i = [], offset
    for _ in range(count):
        parts = []
        while len(tokenizer.encode("\n\n".join(parts), add_special_tokens=False)) < tokens:
            parts.append(texts[i % len(texts)])
            i += 1
        out.append("\n\n".join(parts))
    return out


async def stream_events(http, base: str, path: str, body: dict, events: list, started: float) -> None:
    """Stream a request, appending (seconds since `started`, tokens in the chunk) for every chunk with text to
    `events` (tokens: the chunk's `token_ids` where the server sends them, else 1)."""
    async with http.stream("POST", f"{base}{path}", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                ids = choice.get("token_ids")
                if text or ids:
                    events.append((time.perf_counter() - started, len(ids) if ids else 1))


async def chat_turn(http, base: str, history: list[dict], max_tokens: int, tokenizer) -> dict:
    """One turn: send `history` (ending with the new question), stream the answer, append it to `history`.
    Returns the prompt tokens (our tokenizer), TTFT (to the first content chunk), the answer's time."""
    prompt = len(tokenizer.encode(tokenizer.apply_chat_template(history), add_special_tokens=False))
    body = {"model": "bench", "messages": history, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    events, text = [], []
    started = time.perf_counter()
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        events.append(time.perf_counter() - started)
                        text.append(piece)
    history.append({"role": "assistant", "content": "".join(text)})
    return {"prompt_tokens": prompt, "ttft": events[0] if events else None, "total": time.perf_counter() - started,
            "chunks": len(events), "answer_chars": len("".join(text))}


async def chat_sessions(bases: dict, order: list[str], messages: list[str], max_tokens: int, tokenizer):
    """One conversation per server, turn by turn and interleaved: turn t goes to every server in turn (the
    order rotating each turn), each server continuing its own conversation with its own answers, so that a
    turn's times on the servers are taken seconds apart (the machine's load drifts). Yields (server, turn, row)."""
    histories = {name: [] for name in order}
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600)) as http:
        for turn, question in enumerate(messages, 1):
            shift = (turn - 1) % len(order)
            for name in order[shift:] + order[:shift]:
                histories[name].append({"role": "user", "content": question})
                yield name, turn, await chat_turn(http, bases[name], histories[name], max_tokens, tokenizer)


async def chat_session(base: str, messages: list[str], max_tokens: int, tokenizer) -> list[dict]:
    """One conversation on one server; per turn what `chat_turn` returns, with the turn."""
    return [{"turn": turn, **row} async for _, turn, row in chat_sessions({"one": base}, ["one"], messages,
                                                                        max_tokens, tokenizer)]


def start_servers(names: list[str], args) -> tuple[dict, dict]:
    """Start the servers (each alone: one at a time); if one fails to come up, stop those already started."""
    procs, bases = {}, {}
    try:
        for name in names:
            port = free_port()
            command = gguf_server_command(name, port, args)
            print(f"starting {name}: {shlex.join(command)}", flush=True)
            procs[name] = launch(command, port, os.path.join(args.out, f"server-{name}.log"), server_env(args),
                                 timeout_s=900, health="/v1/models" if name == "llamacpp" else "/health")
            bases[name] = f"http://127.0.0.1:{port}"
    except BaseException:
        for proc in procs.values():
            stop(proc)
        raise
    return procs, bases


def write_results(out: str, name: str, meta: dict, rows: list[dict], report) -> None:
    """A run's end: the load average after it in `meta`, NAME.jsonl (meta, then the rows), the table
    `report(meta, rows)` printed and written to NAME.md."""
    meta["loadavg_after"] = list(os.getloadavg())
    write_jsonl(os.path.join(out, f"{name}.jsonl"), [meta, *rows])
    table = report(meta, rows)
    print(table)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table)


def chat_main(args) -> None:
    """`chat`: per repeat, a 10-turn conversation on every server, interleaved turn by turn (`chat_sessions`;
    only the server answering works, the others are idle); each repeat with other questions, so that no
    server finds an earlier repeat's conversation in its cache."""
    from specdec.models import load_tokenizer

    os.makedirs(args.out, exist_ok=True)
    tokenizer = load_tokenizer(args.gguf)
    texts = question_texts(args.prompts)
    servers = args.servers.split(",")
    meta = {"type": "meta", "mode": "chat", "command": command_line("bench.serve"), "git": git_revision(),
            "servers": servers, "turns": args.turns, "question_tokens": args.question_tokens,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": args.threads,
            "loadavg_before": list(os.getloadavg())}
    rows = []
    procs, bases = start_servers(servers, args)
    try:
        for name in servers:  # warm-up: one short conversation each (first-call costs stay out)
            asyncio.run(chat_session(bases[name], user_messages(texts, tokenizer, 2, 40, 10_000), 8, tokenizer))
        for repeat in range(args.repeats):
            messages = user_messages(texts, tokenizer, args.turns, args.question_tokens, 997 * repeat)

            async def run_repeat():
                order = servers[repeat % len(servers):] + servers[: repeat % len(servers)]
                async for name, turn, row in chat_sessions(bases, order, messages, args.max_tokens, tokenizer):
                    rows.append({"type": "turn", "server": name, "repeat": repeat, "turn": turn, **row,
                                 "loadavg": os.getloadavg()[0]})
                    print(json.dumps(rows[-1]), flush=True)

            asyncio.run(run_repeat())
    finally:
        for proc in procs.values():
            stop(proc)
    write_results(args.out, "chat", meta, rows, chat_report)


def chat_report(meta: dict, rows: list[dict]) -> str:
    servers = meta["servers"]
    by = {}
    for r in rows:
        by.setdefault((r["server"], r["turn"]), []).append(r)

    def med(server, turn, key):
        values = [r[key] for r in by.get((server, turn), []) if r[key] is not None]
        return statistics.median(values) if values else None

    lines = [f"`{meta['command']}` (git {meta['git']}; {meta['turns']} turns of ~{meta['question_tokens']}-token questions, "
             f"{meta['max_tokens']} tokens per answer at most, greedy; {meta['repeats']} conversations per server; "
             f"{meta['threads']} thread(s) per server; load average {meta['loadavg_before'][0]:.1f} before, "
             f"{meta['loadavg_after'][0]:.1f} after)", "",
             "TTFT per turn, seconds (median over the conversations; prompt tokens as our tokenizer counts them):", "",
             "| turn | prompt tokens | " + " | ".join(servers) + " |", "|---:|---:|" + "---:|" * len(servers)]
    turns = sorted({r["turn"] for r in rows})
    for t in turns:
        prompt = med(servers[0], t, "prompt_tokens")
        cells = [f"{v:.2f}" if (v := med(s, t, "ttft")) is not None else "-" for s in servers]
        lines.append(f"| {t} | {prompt:.0f} | " + " | ".join(cells) + " |")
    late = [t for t in turns if t >= 5]
    lines += ["", "Turns 5-10, the per-turn ratio of TTFTs (each conversation's turn against the same turn of the "
              "other server's conversation in the same repeat), median and max over turns and repeats:", ""]
    pairs = [(a, b) for a in servers for b in servers if a != b and a.startswith("specdec+cache")]
    for a, b in pairs:
        ratios = []
        for t in late:
            xs = {r["repeat"]: r["ttft"] for r in by.get((a, t), [])}
            ys = {r["repeat"]: r["ttft"] for r in by.get((b, t), [])}
            ratios += [xs[k] / ys[k] for k in xs if k in ys and xs[k] and ys[k]]
        if ratios:
            lines.append(f"- {a} / {b}: median {statistics.median(ratios):.3f}, max {max(ratios):.3f} "
                         f"({len(ratios)} turns)")
    return "\n".join(lines) + "\n"


def itl_tokens(events: list, lo: float, hi: float) -> list[float]:
    """Per-token inter-token latencies of a stream's chunks (time, tokens) whose gap overlaps [lo, hi]: each
    token of a chunk that brings n tokens dt after the previous one counts dt / n."""
    out = []
    for (t0, _), (t1, n) in zip(events, events[1:]):
        if t1 > lo and t0 < hi:
            out += [(t1 - t0) / n] * n
    return out


async def mixed_run(base: str, stream_prompts: list[list[int]], long_prompt: list[int], args) -> dict:
    """Running streams, then a long admission among them: the streams' per-token ITL in steady state (a window
    of --steady-s before the admission, from each stream's 8th token on, and one after its first token and its
    4 tokens: the streams' contexts grow meanwhile, so both) and during it (from its arrival to its first
    token), and its TTFT."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=httpx.Limits(max_connections=100)) as http:
        started = time.perf_counter()
        streams = [[] for _ in stream_prompts]
        tasks = [asyncio.create_task(stream_events(http, base, "/v1/completions", {
            "model": "bench", "prompt": p, "max_tokens": args.stream_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, events, started)) for p, events in zip(stream_prompts, streams)]
        while min(sum(n for _, n in e) for e in streams) < 8:
            await asyncio.sleep(0.05)
            for task in tasks:
                if task.done():
                    task.result()
        warm = time.perf_counter() - started
        await asyncio.sleep(args.steady_s)
        sent = time.perf_counter() - started
        admission: list = []
        await stream_events(http, base, "/v1/completions", {"model": "bench", "prompt": long_prompt, "max_tokens": 4,
                                                             "temperature": 0, "return_token_ids": True},
                            admission, started)
        first, done = admission[0][0], time.perf_counter() - started
        await asyncio.sleep(args.steady_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    before = [x for e in streams for x in itl_tokens(e, warm, sent)]
    after = [x for e in streams for x in itl_tokens(e, done + 0.5, done + args.steady_s)]
    steady = before + after
    during = [x for e in streams for x in itl_tokens(e, sent, first)]
    return {"admission_ttft": first - sent, "steady_p50": percentile(steady, 50), "steady_p95": percentile(steady, 95),
            "before_p95": percentile(before, 95), "after_p95": percentile(after, 95),
            "during_p50": percentile(during, 50), "during_p95": percentile(during, 95),
            "steady_tokens": len(steady), "during_tokens": len(during),
            "stalls_max": max((b - a for e in streams for (a, _), (b, _) in zip(e, e[1:]) if b > sent and a < first),
                              default=None)}


def mixed_main(args) -> None:
    """`mixed`: --streams streaming completions decode; after --steady-s seconds a --long-tokens prompt arrives.
    Each server (a fresh process, alone on the machine) per repeat, the order rotating."""
    from specdec.models import load_tokenizer

    os.makedirs(args.out, exist_ok=True)
    tokenizer = load_tokenizer(args.gguf)
    texts = question_texts(args.prompts)
    ids = tokenizer.encode("\n\n".join(texts[:400]), add_special_tokens=False)
    stream_prompts = [tokenizer.encode(t, add_special_tokens=False)[:48] for t in texts[500:500 + args.streams]]
    servers = args.servers.split(",")
    meta = {"type": "meta", "mode": "mixed", "command": command_line("bench.serve"), "git": git_revision(),
            "servers": servers, "streams": args.streams, "long_tokens": args.long_tokens, "steady_s": args.steady_s,
            "repeats": args.repeats, "threads": args.threads, "loadavg_before": list(os.getloadavg())}
    rows = []
    for repeat in range(args.repeats):
        long_prompt = ids[repeat * 97: repeat * 97 + args.long_tokens]  # another prompt each repeat
        for name in servers[repeat % len(servers):] + servers[: repeat % len(servers)]:
            procs, bases = start_servers([name], args)
            try:
                asyncio.run(chat_session(bases[name], user_messages(texts, tokenizer, 1, 20, 10_000), 8, tokenizer))
                row = {"type": "mixed", "server": name, "repeat": repeat,
                       **asyncio.run(mixed_run(bases[name], stream_prompts, long_prompt, args))}
            finally:
                stop(procs[name])
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_results(args.out, "mixed", meta, rows, mixed_report)


def mixed_report(meta: dict, rows: list[dict]) -> str:
    lines = [f"`{meta['command']}` (git {meta['git']}; {meta['streams']} running streams, a {meta['long_tokens']}-token "
             f"admission after {meta['steady_s']:g} s; {meta['repeats']} repeats; {meta['threads']} thread(s); load "
             f"average {meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after)", "",
             "Steady: a window before the admission and one after it, pooled (p95 before / after apart).", "",
             "| server | repeat | steady ITL p50 / p95 ms (p95 before / after) | during the admission ITL p50 / p95 ms "
             "| p95 during / steady | longest stall s | admission TTFT s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["during_p95"] / r["steady_p95"] if r["during_p95"] and r["steady_p95"] else None
        stall = "-" if r["stalls_max"] is None else f"{r['stalls_max']:.2f}"
        lines.append(f"| {r['server']} | {r['repeat']} | {_ms(r['steady_p50'])} / {_ms(r['steady_p95'])} "
                     f"({_ms(r.get('before_p95'))} / {_ms(r.get('after_p95'))}) | "
                     f"{_ms(r['during_p50'])} / {_ms(r['during_p95'])} | {'-' if ratio is None else f'{ratio:.2f}'} | "
                     f"{stall} | {r['admission_ttft']:.1f} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ soak


async def soak_requests(base: str, n: int, concurrency: int, every: int, max_tokens: int, pid: int) -> dict:
    """n mixed requests, `concurrency` at a time; the server's RSS after every `every` finished ones."""
    from specdec.prompts import DEFAULT_PROMPTS, read_prompts

    prompts = read_prompts(DEFAULT_PROMPTS)
    statuses, samples, state = {}, [], {"finished": 0}
    gate = asyncio.Semaphore(concurrency)

    async def one(http, i):
        chat = i % 4 >= 2
        stream = i % 2 == 1
        body = {"model": "default", "max_tokens": max_tokens, "temperature": 0 if i % 3 else 0.8, "seed": i,
                "stream": stream}
        if i % 7 == 0:
            body["stop"] = ["\n    "]
        if chat:
            body["messages"] = [{"role": "user", "content": prompts[i % len(prompts)]}]
        else:
            body["prompt"] = prompts[i % len(prompts)]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with gate:
            async with http.stream("POST", base + path, json=body) as r:
                status = r.status_code
                if stream and i % 10 == 9:  # the client goes away after the first chunk
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            status = "dropped"
                            break
                else:
                    await r.aread()
        statuses[status] = statuses.get(status, 0) + 1
        state["finished"] += 1
        if state["finished"] % every == 0:
            samples.append({"finished": state["finished"], "rss_mib": round(rss_mib(pid), 1),
                            "t": round(time.perf_counter() - start, 2)})

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency * 2)) as http:
        await asyncio.gather(*(one(http, i) for i in range(n)))
    return {"statuses": {str(k): v for k, v in statuses.items()}, "samples": samples,
            "wall_s": round(time.perf_counter() - start, 1)}


def soak_main(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="specdec-serve-soak-")
    template = os.path.join(tmp, "chat.jinja")
    with open(template, "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    port = free_port()
    command = specdec_command(port, "--chat-template", template, "--batch-size", str(args.batch_size),
                              "--max-waiting", "100000", "--method", args.method)
    proc = launch(command, port, os.path.join(args.out, "server-soak.log"), server_env(args))
    try:
        rss_start = rss_mib(proc.pid)
        result = asyncio.run(soak_requests(f"http://127.0.0.1:{port}", args.soak_requests, args.concurrency,
                                           args.every, args.max_tokens, proc.pid))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        running = [line for line in metrics.splitlines() if line.startswith("specdec_num_requests_")]
    finally:
        exit_status = stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    samples = result["samples"]
    first, last = samples[0]["rss_mib"], samples[-1]["rss_mib"]
    summary = {"command": command_line("bench.serve"), "server": shlex.join(command), "rss_after_warm_up_mib":
               round(rss_start, 1), "rss_first_block_mib": first, "rss_last_block_mib": last,
               "growth_mib": round(last - first, 1), "after": running, "exit_status": exit_status, **result}
    write_json(os.path.join(args.out, "soak.json"), summary)
    print("| finished requests | server RSS MiB | seconds |\n|---:|---:|---:|")
    for s in samples:
        print(f"| {s['finished']} | {s['rss_mib']} | {s['t']} |")
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("mode", nargs="?", choices=("load", "soak", "chat", "mixed"), default="load")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="request rates (req/s), comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per run (server x rate x repeat)")
    p.add_argument("--max-time", type=float, default=90.0, help="seconds of arrivals per run at most; unfinished "
                   "requests are cancelled the same time after")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request at most")
    p.add_argument("--repeats", type=int, default=3, help="runs per server and rate")
    p.add_argument("--batch-size", type=int, default=8, help="specdec: rows decoding at once")
    p.add_argument("--method", default="eqspec", help="specdec's method for the auto-k server (and the soak)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every server")
    p.add_argument("--prompts", default=os.path.join(os.path.dirname(REPO), "shared", "data", "spec_bench",
                                                     "question.jsonl"), help="SpecBench question.jsonl")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "serve"), help="output directory")
    p.add_argument("--plot", default=os.path.join(REPO, "docs", "img", "serve_latency.png"),
                   help="latency and throughput vs rate ('' for none)")
    p.add_argument("--soak-requests", type=int, default=1000, help="soak: requests in all")
    p.add_argument("--concurrency", type=int, default=16, help="soak: requests in flight")
    p.add_argument("--every", type=int, default=100, help="soak: read the server's RSS every N finished requests")
    p.add_argument("--gguf", default=GGUF, help="chat, mixed: the GGUF file every server loads")
    p.add_argument("--turns", type=int, default=10, help="chat: turns per conversation")
    p.add_argument("--question-tokens", type=int, default=130, help="chat: tokens per user message (about)")
    p.add_argument("--prefix-cache-gb", type=float, default=1.0, help="chat, mixed: servers named +cache")
    p.add_argument("--streams", type=int, default=3, help="mixed: running streams")
    p.add_argument("--stream-tokens", type=int, default=4000, help="mixed: max_tokens of each running stream")
    p.add_argument("--long-tokens", type=int, default=4000, help="mixed: the admission's prompt tokens")
    p.add_argument("--steady-s", type=float, default=15.0, help="mixed: seconds of steady decoding before it")
    p.add_argument("--from-jsonl", metavar="FILE", nargs="+", help="no runs: the table and plot of earlier runs' "
                   "serve.jsonl files together (e.g. a low-rate and a high-rate run)")
    p.add_argument("--quick", action="store_true", help="smoke test: " + ", ".join(
        f"--{k.replace('_', '-')} {v!r}" for k, v in QUICK.items()))
    args = parse_with_quick(p, QUICK, argv)
    if args.from_jsonl:
        report_main(args)
    else:
        {"soak": soak_main, "chat": chat_main, "mixed": mixed_main}.get(args.mode, load_main)(args)


if __name__ == "__main__":
    main()
