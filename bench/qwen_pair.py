"""The real pair, Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft), both Q4_K_M GGUF as stored, end to
end (prefill included) against llama.cpp's own server and transformers' assisted generation on the same two files
(issue 56, item 5): SpecBench's categories and this script's code prompts, each asked as chat, batch 1, 4 and 8,
greedy, a fixed number of new tokens, every engine interleaved in rounds (the order rotating), medians (min-max).

The full run (about 80 minutes on a quiet 2-core box at these defaults, estimated from the figures of issue 56: two
rounds of 13 SpecBench questions and 10 code prompts at batch 1 and 64 new tokens, 3 code prompts at 256, 8 prompts
at batch 4 and at batch 8; `--rounds 3` adds about 30 minutes; the plan is logged at the start, and after every
round the time left; run it on a quiet machine: with other work on the two cores llama.cpp's two threads slow down
far more than ours):

    python -m bench.qwen_pair --output bench/results/qwen-pair.json --plot docs/img/qwen-pair-categories.png \\
        > bench/results/qwen-pair.md

The quick variant (about 20 minutes: 4 SpecBench categories and 3 code prompts, batch 1 and 4, 64 new tokens, two
rounds, llama.cpp's draft-simple at n-max 3 and 8, transformers on 2 prompts):

    python -m bench.qwen_pair --quick --output bench/results/qwen-pair-quick.json > bench/results/qwen-pair-quick.md

`--dry-run` prints the prompts and cells and stops.

The serving half of issue 56 (`specdec.serve` over HTTP with one and with 8 clients, against its `--method ar` and
llama.cpp's `llama-server -np 8`) is `python -m bench.qwen_serve` (bench/qwen_serve.py, which uses this
module's prompts, llama-server pieces and summary).

Engines (`--engines`, each on or off):
- `ours`: specdec's default pair command, what `python -m specdec.run --target T --draft D --batch-size B` builds
  (its parser and `build_llm`, so its defaults are whatever the runtime's are), with `--threads` and `--profile`
  (the draft/verify phase times; no synchronisation on the CPU);
- `ours-ar`: the same with `--method ar`; `ours-suffix`: `--draft suffix` (no draft model);
- `llama-ar`, `llama-draft` (`--spec-type draft-simple -md D` at each `--draft-n-max`), `llama-ngram`
  (`--spec-type ngram-mod`): llama.cpp's `llama-server`, one per mode and batch size (`-np B`), on 127.0.0.1, sent
  the same token ids to `/completion` (`cache_prompt: false`, `ignore_eos`, greedy), B requests at once;
- `hf-assisted`: transformers' `generate(assistant_model=draft)` on the same GGUF files (dequantized to float32),
  batch 1 and the shortest length only, on the first `--hf-prompts` prompts.

What state an engine keeps across requests is fresh at every round of every cell: our suffix store is emptied and
llama.cpp's ngram-mod server (whose n-gram pool is shared by all requests for the server's life) is restarted, so no
timed request drafts from its own answer of an earlier round; within a round, requests see the earlier ones' text, as
on a server. Speed-ups (x llama.cpp AR, x our AR) are per round, over exactly the prompts and token counts the engine
ran. Greedy ids of ours are compared with our AR's ("= our AR"); llama.cpp's `ignore_eos` bans end-of-turn tokens,
while ours and transformers decode on past them.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import os
import shlex
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

from bench.common import (REPO, HelpFormatter, comma_ints, comma_list, command_line, evenly_spaced, fmt_spread, k_text,
                          log, machine, machine_line, md_table, parse_with_quick, quick_help, pyplot, save_figure,
                          shown, spread, write_json)
from bench.fetch_qwen import DRAFT as DRAFT_FILE, FETCH_COMMAND, TARGET as TARGET_FILE, cache_dir
from specdec.flags import Parser  # a refusal in one line, naming the flag

SPECBENCH = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "spec_bench", "question.jsonl"))
LLAMA_SERVER = os.environ.get("SPECDEC_LLAMA_SERVER") or \
    "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin/llama-server"
CODE = "code"  # the category of this script's own prompts (SpecBench's own is "coding")

# this script's code prompts, asked as chat like the SpecBench questions
CODE_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number using memoization, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case, spaces and punctuation.",
    "Write a Python class `LRUCache` with get and put methods, both O(1), using collections.OrderedDict.",
    "Write a Python function that parses a CSV file with a header row and returns a list of dictionaries, "
    "without using the csv module.",
    "Write a Python function that merges two sorted lists into one sorted list in linear time, and a few tests "
    "for it with pytest.",
    "Write a Python script that counts how often each word appears in a text file and prints the ten most common "
    "words with their counts.",
    "Write a Python function that performs binary search on a sorted list and returns the index of the target or "
    "-1. Explain its complexity.",
    "Write a Python async function that downloads several URLs concurrently with asyncio and aiohttp and returns "
    "their status codes.",
    "Write a Python function that flattens an arbitrarily nested list of lists into a single list, without "
    "recursion.",
    "Write a Python dataclass `Matrix` with addition, multiplication and transpose methods, and a `__str__` that "
    "prints it row by row.",
)

FAMILIES = ("ours", "ours-ar", "ours-suffix", "llama-ar", "llama-draft", "llama-ngram", "hf-assisted")
LABELS = {"ours": "specdec default pair", "ours-ar": "specdec AR", "ours-suffix": "specdec suffix (no draft model)",
          "llama-ar": "llama.cpp AR", "llama-ngram": "llama.cpp ngram-mod", "hf-assisted": "transformers assisted"}
LLAMA_AR, OUR_AR = "llama-ar", "ours-ar"
QUICK = dict(categories="coding,math_reasoning,qa,writing,code", code_prompts=3, batch_sizes="1,4",
             max_tokens="64", cell_prompts=4, draft_n_max="3,8", hf_prompts=2)


def label(engine: str) -> str:
    if engine.startswith("llama-draft:"):
        return f"llama.cpp draft-simple n-max {engine.split(':')[1]}"
    return LABELS.get(engine, engine)


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m bench.qwen_pair", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--target", default=str(cache_dir() / TARGET_FILE.file),
                   help=f"the target GGUF (fetched by `{FETCH_COMMAND}`)")
    p.add_argument("--draft", default=str(cache_dir() / DRAFT_FILE.file), help="the draft GGUF")
    p.add_argument("--specbench", default=SPECBENCH, help="SpecBench's question.jsonl (fields category, turns: the "
                   "first turn is asked)")
    p.add_argument("--categories", type=comma_list(), default=None, help="comma-separated categories to ask: "
                   f"SpecBench's and '{CODE}' (this script's prompts); default: every one")
    p.add_argument("--per-category", type=int, default=1, help="SpecBench questions per category, evenly spaced "
                   "through the category in file order")
    p.add_argument("--code-prompts", type=int, default=len(CODE_PROMPTS),
                   help=f"this script's code prompts to ask (0..{len(CODE_PROMPTS)}), in order")
    p.add_argument("--batch-sizes", type=comma_ints, default="1,4,8", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=comma_ints, default="64,256", help="comma-separated new tokens per request "
                   "(exactly that many: EOS ignored)")
    p.add_argument("--long-batch-sizes", default="1", help="batch sizes that also run the lengths above the "
                   "shortest: comma-separated, or 'all'")
    p.add_argument("--cell-prompts", type=int, default=8, help="prompts at a batch size above 1 (the shortest "
                   "length), rounded up to a multiple of it; batch 1 at the shortest length asks every prompt (the "
                   "per-category table)")
    p.add_argument("--long-prompts", type=int, default=3, help="prompts at the longer lengths (code prompts first), "
                   "rounded up to a multiple of the batch size")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds of every cell (the engine order rotates "
                   "with every batch of prompts)")
    p.add_argument("--engines", type=comma_list(FAMILIES), default=",".join(FAMILIES),
                   help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--draft-n-max", type=comma_ints, default="3,8,16",
                   help="llama-draft: one llama-server per --spec-draft-n-max")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads of every engine (torch threads; llama-server -t/-tb)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="build our engines without --profile (default: with it, for the draft/verify phase times)")
    p.add_argument("--llama-server", default=LLAMA_SERVER, metavar="PATH",
                   help="llama.cpp's llama-server (built from the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp); "
                        "default $SPECDEC_LLAMA_SERVER or the build under /work/llamacpp")
    p.add_argument("--llama-args", default="",
                   help="extra arguments for every llama-server, one string (default: none)")
    p.add_argument("--llama-default-spin", action="store_true", help="run llama-server with libgomp's default "
                   "wait policy instead of the benchmarks' GOMP_SPINCOUNT=10000 (default: the same environment as our "
                   "engines)")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds a llama-server may take to answer "
                   "/health before its mode is given up")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds one batch of requests may take")
    p.add_argument("--hf-prompts", type=int, default=14, help="hf-assisted: the first N prompts of batch 1 at the "
                   "shortest length (default 14: one per category at the default --per-category)")
    p.add_argument("--output", default=None, metavar="FILE.json", help="every measurement, the machine, the command "
                   "and the revision (rewritten after every cell)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="tokens/s by category at batch 1 (grouped bars)")
    p.add_argument("--server-logs", default=None, metavar="DIR", help="keep the llama-server logs here (default: a "
                   "temporary folder, removed at the end unless a server failed)")
    p.add_argument("--dry-run", action="store_true", help="print the prompts and cells this run would measure, and "
                   "stop (loads the tokenizer only)")
    p.add_argument("--quick", action="store_true", help=quick_help(QUICK, "about 20 minutes"))
    return parse_with_quick(p, QUICK, argv, check=check_args)


def check_args(args) -> None:
    """Refuses bad values, one line naming the flag (ValueError); fills args.engine_names and args.long_sizes."""
    for flag, value, least in (("--per-category", args.per_category, 0), ("--code-prompts", args.code_prompts, 0),
                               ("--cell-prompts", args.cell_prompts, 1), ("--long-prompts", args.long_prompts, 1),
                               ("--rounds", args.rounds, 1), ("--threads", args.threads, 1),
                               ("--hf-prompts", args.hf_prompts, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.code_prompts > len(CODE_PROMPTS):
        raise ValueError(f"--code-prompts must be at most {len(CODE_PROMPTS)}, got {args.code_prompts}")
    for flag, value in (("--server-timeout", args.server_timeout), ("--request-timeout", args.request_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    text = str(args.long_batch_sizes).strip().lower()
    if text == "all":
        args.long_sizes = list(args.batch_sizes)
    else:
        try:
            args.long_sizes = comma_ints(text)
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"--long-batch-sizes {err} or 'all'") from None
    for flag, path in (("--target", args.target), ("--draft", args.draft), ("--specbench", args.specbench)):
        if not os.path.isfile(path):
            hint = f" (fetch the pair with `{FETCH_COMMAND}`)" if flag != "--specbench" else ""
            raise ValueError(f"{flag} {path}: no such file{hint}")
    args.target, args.draft = os.path.abspath(args.target), os.path.abspath(args.draft)  # servers run elsewhere
    read_specbench(args.specbench, args.categories, args.per_category)  # unknown --categories: one line
    if args.categories is not None and args.per_category == 0 and CODE not in args.categories:
        raise ValueError("--per-category 0 with --categories lacking 'code': no prompt to ask")
    args.engine_names = engine_names(args.engines, args.draft_n_max)
    if any(e.startswith("llama-") for e in args.engine_names):
        if not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
            raise ValueError(f"--llama-server {args.llama_server}: not an executable file (or leave the llama-* "
                             f"engines out of --engines)")
        try:
            args.llama_extra = shlex.split(args.llama_args)
        except ValueError as err:
            raise ValueError(f"--llama-args {args.llama_args!r}: {err}") from None
    else:
        args.llama_extra = []


def engine_names(families: list[str], draft_n_max: list[int]) -> list[str]:
    """The engines of the `--engines` families, `llama-draft` one per n-max, in FAMILIES order."""
    names = []
    for family in FAMILIES:
        if family in families:
            names += [f"llama-draft:{n}" for n in draft_n_max] if family == "llama-draft" else [family]
    return names


# ---------------------------------------------------------------------------------------------- prompts
@dataclass
class Prompt:
    category: str
    text: str
    source: str  # "specbench:QUESTION_ID" or "code:I"
    ids: list[int] = field(default_factory=list)  # the chat-rendered token ids, every engine's input


def read_specbench(path: str, categories: list[str] | None, per_category: int) -> list[Prompt]:
    """`per_category` first-turn questions of every category (in file order of first appearance; only those in
    `categories` when given), evenly spaced through the category's questions in file order."""
    by_category: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_category.setdefault(row["category"], []).append(row)
    if categories is not None:
        unknown = [c for c in categories if c != CODE and c not in by_category]
        if unknown:
            raise ValueError(f"--categories: {', '.join(unknown)} not in {path} (it has {', '.join(by_category)}, "
                             f"and '{CODE}' is this script's)")
    out = []
    for category, rows in by_category.items():
        if categories is not None and category not in categories:
            continue
        for row in evenly_spaced(rows, min(per_category, len(rows))) if per_category else []:
            out.append(Prompt(category, row["turns"][0], f"specbench:{row.get('question_id')}"))
    return out


def code_prompts(n: int) -> list[Prompt]:
    return [Prompt(CODE, text, f"code:{i}") for i, text in enumerate(CODE_PROMPTS[:n])]


def build_pool(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts in round-robin order over their categories (each category's first, then each one's second, ...),
    so that any first few cover the categories evenly."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    pool, i = [], 0
    while len(pool) < len(prompts):
        pool += [group[i] for group in by_category.values() if i < len(group)]
        i += 1
    return pool


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a user turn in the target's chat template: `LLM.encode(texts, chat=True)`, the function
    `python -m specdec.run --chat` applies, called on the tokenizer alone (nothing else of an LLM is needed)."""
    from types import SimpleNamespace

    from specdec import LLM

    return LLM.encode(SimpleNamespace(tokenizer=tokenizer), texts, chat=True)


@dataclass
class Cell:
    batch_size: int
    max_tokens: int
    prompts: list[int]  # pool indexes, len a multiple of batch_size; batch j is prompts[j*B:(j+1)*B]

    @property
    def batches(self) -> list[list[int]]:
        B = self.batch_size
        return [self.prompts[i:i + B] for i in range(0, len(self.prompts), B)]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_cells(pool: list[Prompt], batch_sizes, lengths, long_sizes, cell_prompts: int,
               long_prompts: int) -> list[Cell]:
    """The (batch size, length) cells and their prompts (pool indexes). Batch 1 at the shortest length asks every
    prompt; a batch size above 1 at the shortest length the first `cell_prompts` of the pool (rounded up to a
    multiple of B, cycling if the pool is shorter); a longer length (only at `long_sizes`) the first `long_prompts`
    with the code prompts first."""
    shortest = min(lengths)
    code_first = sorted(range(len(pool)), key=lambda i: pool[i].category != CODE)  # stable: pool order otherwise
    cells = []
    for B in batch_sizes:
        for N in lengths:
            if N != shortest and B not in long_sizes:
                continue
            if N == shortest and B == 1:
                chosen = list(range(len(pool)))
            elif N == shortest:
                chosen = evenly_cycled(list(range(len(pool))), round_up(cell_prompts, B))
            else:
                chosen = evenly_cycled(code_first, round_up(long_prompts, B))
            cells.append(Cell(B, N, chosen))
    return cells


def evenly_cycled(order: list[int], n: int) -> list[int]:
    """The first n of `order`, cycling when it is shorter."""
    return [order[i % len(order)] for i in range(n)]


# ---------------------------------------------------------------------------------------------- llama.cpp
def server_command(binary: str, engine: str, target: str, draft: str, threads: int, batch_size: int,
                   context: int, port: int, extra: list[str]) -> list[str]:
    """llama-server for one engine at one batch size: `-np B` slots of `context / B` positions each, on
    127.0.0.1:port; draft-simple at its n-max, or ngram-mod."""
    cmd = [binary, "-m", target, "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", str(batch_size),
           "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if engine.startswith("llama-draft:"):
        cmd += ["--spec-type", "draft-simple", "-md", draft, "--spec-draft-n-max", engine.split(":")[1]]
    elif engine == "llama-ngram":
        cmd += ["--spec-type", "ngram-mod"]
    elif engine != LLAMA_AR:
        raise ValueError(f"not a llama.cpp engine: {engine}")
    return cmd + list(extra)


def completion_body(ids: list[int], max_tokens: int) -> dict:
    """The /completion request: the token ids as the prompt, exactly max_tokens greedy tokens, no prompt cache."""
    return {"prompt": [int(t) for t in ids], "n_predict": int(max_tokens), "ignore_eos": True, "cache_prompt": False,
            "temperature": 0.0, "top_k": 1, "samplers": ["top_k", "temperature"], "return_tokens": True,
            "stream": False}


def parse_completion(data: dict) -> dict:
    """What one /completion answer says: its `timings` (prompt_n, prompt_ms, predicted_n, predicted_ms,
    predicted_per_second; draft_n and draft_n_accepted only where it drafted: 0 otherwise) and the token ids."""
    t = data.get("timings") or {}
    out = {key: t.get(key) for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                       "predicted_per_second")}
    out["draft_n"] = int(t.get("draft_n") or 0)
    out["draft_n_accepted"] = int(t.get("draft_n_accepted") or 0)
    tokens = data.get("tokens")
    out["tokens"] = [int(x) for x in tokens] if isinstance(tokens, list) else []
    if out["predicted_n"] is None:
        out["predicted_n"] = len(out["tokens"]) or int(data.get("tokens_predicted") or 0)
    return out


def llama_counts(answers: list[dict]) -> dict:
    """The counters every engine reports (see `Counts`) from a batch's parsed /completion answers. A decode step
    gains 1 + its accepted drafts, the first token comes from the prefill: steps = predicted - 1 - accepted."""
    decode = sum(max(a["predicted_n"] - 1, 0) for a in answers)
    accepted = sum(a["draft_n_accepted"] for a in answers)
    return dict(proposed=sum(a["draft_n"] for a in answers), accepted=accepted, decode_tokens=decode,
                row_steps=max(decode - accepted, 0), steps=None, draft_s=None)


def die_with_parent() -> None:
    """In a server's child process before exec: SIGTERM it when this process dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class EngineFailed(RuntimeError):
    """An engine that cannot go on (a server that did not start or died, an exception in a run): one line."""


def last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f.read()[-20000:].splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


def server_env(threads: int, default_spin: bool = False) -> dict:
    """llama-server's environment: this process's (llama.cpp here is built with OpenMP, so it shares our engines'
    wait policy, GOMP_SPINCOUNT=10000 from bench/__init__.py unless the caller set one, as the project's earlier
    llama.cpp figures did); `default_spin` drops that spin count (libgomp's defaults) unless the caller set it."""
    from specdec.openmp import SPIN_COUNT

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if default_spin and env.get("GOMP_SPINCOUNT") == SPIN_COUNT and "OMP_WAIT_POLICY" not in env:
        env.pop("GOMP_SPINCOUNT")
    return env


def healthy(base: str) -> bool:
    """GET base/health answers 200."""
    import httpx

    try:
        return httpx.get(f"{base}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def start_server(command: list[str], port: int, log_path: str, env: dict, timeout_s: float,
                 what: str) -> subprocess.Popen:
    """Starts a server on 127.0.0.1:port (output to `log_path`, run from the repository root, SIGTERM should this
    process die) and returns it once GET /health answers 200. The process is ours from the moment it exists: if it
    exits, does not answer within `timeout_s`, or anything (an interrupt too) stops the wait, it is stopped
    (bench/serve.py's `stop`: SIGTERM, wait, SIGKILL) and EngineFailed says why, naming `what`, with the log's last
    line."""
    from bench.serve import stop

    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                why = f"exited {proc.returncode}: {last_line(log_path)}"
                break
            if healthy(f"http://127.0.0.1:{port}"):
                return proc
            if time.monotonic() > deadline:
                why = f"no answer from /health in {timeout_s:g}s: {last_line(log_path)}"
                break
            time.sleep(0.25)
    except BaseException:
        stop(proc, timeout_s=30)
        raise
    stop(proc, timeout_s=30)
    raise EngineFailed(f"{what} did not start: {why}")


class LlamaEngine:
    """One llama-server (one mode, `-np B`), its requests sent from B threads at once."""

    def __init__(self, name: str, batch_size: int, context: int, args, log_dir: str):
        self.name, self.batch_size, self.context, self.args, self.log_dir = name, batch_size, context, args, log_dir
        self.proc = None
        self.starts = 0
        self.command = None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=batch_size, thread_name_prefix=name)
        self.client = None

    @property
    def stateful(self) -> bool:
        return self.name == "llama-ngram"  # its n-gram pool is shared by every request for the server's life

    def start(self) -> None:
        """A fresh server (the previous one stopped), up once /health answers 200 within --server-timeout
        (`start_server`: an interrupt while it loads stops it too, and it gets SIGTERM should this process die)."""
        import httpx

        from bench.serve import free_port

        self.close_server()
        port = free_port()
        a = self.args
        self.command = server_command(a.llama_server, self.name, a.target, a.draft, a.threads, self.batch_size,
                                      self.context, port, a.llama_extra)
        self.starts += 1
        self.log_path = os.path.join(self.log_dir, f"{self.name.replace(':', '-')}-B{self.batch_size}-"
                                                   f"{self.starts}.log")
        self.base = f"http://127.0.0.1:{port}"
        self.proc = start_server(self.command, port, self.log_path, server_env(a.threads, a.llama_default_spin),
                                 a.server_timeout, f"{self.name} (B={self.batch_size})")
        self.client = httpx.Client(timeout=httpx.Timeout(a.request_timeout, connect=10.0),
                                   limits=httpx.Limits(max_connections=self.batch_size + 2))

    def reset_round(self) -> None:
        if self.stateful or self.proc is None or self.proc.poll() is not None:
            self.start()

    def _post(self, body: dict) -> dict:
        r = self.client.post(f"{self.base}/completion", json=body)
        if r.status_code != 200:
            raise EngineFailed(f"{self.name}: HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def measure(self, batch_ids: list[list[int]], max_tokens: int) -> dict:
        import httpx

        bodies = [completion_body(ids, max_tokens) for ids in batch_ids]
        t0 = time.perf_counter()
        futures = [self.pool.submit(self._post, body) for body in bodies]
        try:
            answers = [f.result(timeout=self.args.request_timeout + 5) for f in futures]
        except (httpx.HTTPError, concurrent.futures.TimeoutError, EngineFailed) as err:
            dead = self.proc is not None and self.proc.poll() is not None
            why = (f"exited {self.proc.returncode}: {last_line(self.log_path)}" if dead
                   else f"{type(err).__name__}: {err}")
            raise EngineFailed(f"{self.name} (B={self.batch_size}): {why}") from None
        seconds = time.perf_counter() - t0
        parsed = [parse_completion(a) for a in answers]
        return {"seconds": seconds, "tokens": [p.pop("tokens") for p in parsed],
                "new_tokens": sum(p["predicted_n"] for p in parsed), "counts": llama_counts(parsed),
                "stats": {"requests": parsed}}

    def warm_up(self, batch_ids, max_tokens) -> None:
        self.measure(batch_ids, max_tokens)

    def close_server(self) -> None:
        from bench.serve import stop

        if self.proc is not None:  # the server first: requests still in flight then end at once
            stop(self.proc, timeout_s=30)
            self.proc = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def close(self) -> None:
        self.close_server()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        return {"command": shlex.join(self.command or []), "starts": self.starts}


# ---------------------------------------------------------------------------------------------- specdec
def ours_flags(name: str, args, batch_size: int) -> list[str]:
    """The `python -m specdec.run` flags of one of our engines."""
    flags = ["--target", args.target]
    flags += {"ours": ["--draft", args.draft], "ours-ar": ["--method", "ar"],
              "ours-suffix": ["--draft", "suffix"]}[name]
    flags += ["--batch-size", str(batch_size), "--threads", str(args.threads)]
    return flags + (["--profile"] if args.profile else [])


def ours_counts(m) -> dict:
    """The counters every engine reports from a run's RunMetrics (specdec/metrics.py)."""
    phases = m.phase_time_s if m.profiled else None
    return dict(proposed=m.proposed_drafts, accepted=m.accepted_drafts,
                decode_tokens=m.generated_tokens - m.first_tokens, row_steps=m.row_steps, steps=m.steps,
                draft_s=None if phases is None else phases.get("draft", 0.0))


class OursEngine:
    """One of our engines: the LLM `python -m specdec.run FLAGS` builds, loaded once per batch size."""

    stateful = False

    def __init__(self, name: str, batch_size: int, args):
        from specdec.flags import build_llm
        from specdec.openmp import apply_threads
        from specdec.run import build_parser

        self.name, self.batch_size = name, batch_size
        self.flags = ours_flags(name, args, batch_size)
        cli = build_parser().parse_args(self.flags)
        t0 = time.perf_counter()
        self.llm = build_llm(cli)
        self.threads = apply_threads(cli.threads, self.llm.target, self.llm.startup, self.llm.specs[0])
        self.load_s = time.perf_counter() - t0
        spec = self.llm.options.speculation
        self.k_option = spec.num_speculative_tokens if spec.speculative else None

    def reset_round(self) -> None:
        from specdec.run import forget_answers

        forget_answers(self.llm)

    def measure(self, batch_ids: list[list[int]], max_tokens: int) -> dict:
        from specdec import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompt_token_ids=batch_ids, sampling_params=params)
        m = outs.metrics
        # auto k's start-up measurement of a context it has not met yet (once per batch size and context bucket in
        # a process, kept in the cost cache: a server pays it once) is left out, as specdec.run leaves it out of
        # tokens/s; its seconds are kept in the record (startup_s) and summed in the report
        seconds = time.perf_counter() - t0 - m.calibration_s
        metrics = {k: v for k, v in dataclasses.asdict(m).items() if k not in ("latencies_s", "ttfts_s")}
        metrics["k_histogram"] = {str(k): n for k, n in sorted(m.k_histogram.items())}
        tokens = [list(map(int, o.token_ids)) for o in outs]
        eos = self.llm.eos_token_ids
        stats = {"metrics": metrics, "k_option": self.k_option,
                 "eos_at": [next((i for i, t in enumerate(ts) if t in eos), None) for ts in tokens]}
        return {"seconds": seconds, "startup_s": m.calibration_s, "tokens": tokens, "new_tokens": sum(map(len, tokens)),
                "counts": ours_counts(m),
                "stats": stats}

    def warm_up(self, batch_ids, max_tokens) -> None:
        self.measure(batch_ids, max_tokens)

    def close(self) -> None:
        self.llm = None

    def describe(self) -> dict:
        return {"command": "python -m specdec.run " + shlex.join(self.flags), "load_s": self.load_s,
                "threads": self.threads, "startup": list(self.llm.startup.summary_lines()) if self.llm else []}


# ---------------------------------------------------------------------------------------------- transformers
class HFEngine:
    """transformers' assisted generation (batch 1): the target's generate with the draft as its assistant model,
    transformers' default assistant settings; forwards counted and the draft's forwards timed by hooks."""

    stateful = False
    name = "hf-assisted"

    def __init__(self, args):
        import torch
        import transformers

        from bench.peers import assistant_config, hf_load, no_eos_config

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        self.target = hf_load(args.target, torch.float32)
        self.draft = hf_load(args.draft, torch.float32)
        self.load_s = time.perf_counter() - t0
        pad = self.target.config.pad_token_id
        self.pad = 0 if pad is None else int(pad)
        self.draft.generation_config = assistant_config("default", self.pad)
        self.no_eos_config = no_eos_config
        self.version = transformers.__version__
        self.counts = {"target": 0, "draft": 0, "draft_s": 0.0, "t0": 0.0}
        self.target.register_forward_pre_hook(lambda *_: self._count("target"))
        self.draft.register_forward_pre_hook(lambda *_: self._draft_start())
        self.draft.register_forward_hook(lambda *_: self._draft_end())

    def _count(self, which):
        self.counts[which] += 1

    def _draft_start(self):
        self.counts["draft"] += 1
        self.counts["t0"] = time.perf_counter()

    def _draft_end(self):
        self.counts["draft_s"] += time.perf_counter() - self.counts["t0"]

    def reset_round(self) -> None:
        pass

    def measure(self, batch_ids: list[list[int]], max_tokens: int) -> dict:
        import torch

        (ids,) = batch_ids  # batch 1: assisted generation takes one sequence
        config = self.no_eos_config(self.pad, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        self.counts.update(target=0, draft=0, draft_s=0.0)
        input_ids = torch.tensor([ids], dtype=torch.long)  # [1, L]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                       generation_config=config, assistant_model=self.draft)  # [1, L + N]
        seconds = time.perf_counter() - t0
        tokens = out[0, input_ids.shape[1]:].tolist()
        c = self.counts
        # every target forward verifies one step's drafts and gains 1 + its accepted ones (the first one also
        # prefills); every draft forward proposes one token: approximate counts, from the forwards
        counts = dict(proposed=c["draft"], accepted=max(len(tokens) - c["target"], 0), decode_tokens=len(tokens),
                      row_steps=c["target"], steps=c["target"], draft_s=c["draft_s"])
        return {"seconds": seconds, "tokens": [tokens], "new_tokens": len(tokens), "counts": counts,
                "stats": {"target_forwards": c["target"], "draft_forwards": c["draft"], "draft_s": c["draft_s"]}}

    def warm_up(self, batch_ids, max_tokens) -> None:
        self.measure(batch_ids[:1], max_tokens)

    def close(self) -> None:
        self.target = self.draft = None

    def describe(self) -> dict:
        return {"command": f"transformers {self.version}: AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) "
                           "float32, generate(assistant_model=draft, do_sample=False), default assistant settings",
                "load_s": self.load_s}


# ---------------------------------------------------------------------------------------------- summary
def _sum(records, key):
    values = [r["counts"][key] for r in records if r["counts"].get(key) is not None]
    return sum(values) if values else None


def _tps(records) -> float:
    seconds = sum(r["seconds"] for r in records)
    return sum(r["new_tokens"] for r in records) / seconds if seconds else 0.0


def per_round_ratio(records, reference_records) -> list[float] | None:
    """Per round: (tokens/s of `records`) / (tokens/s of the reference on exactly the same batches); None where
    the reference did not run all of them."""
    ref = {(r["round"], r["batch"]): r for r in reference_records}
    ratios = []
    for rnd in sorted({r["round"] for r in records}):
        mine = [r for r in records if r["round"] == rnd]
        theirs = [ref.get((rnd, r["batch"])) for r in mine]
        if not mine or any(t is None for t in theirs):
            return None
        ratios.append(_tps(mine) / _tps(theirs))
    return ratios or None


def aggregate(records: list[dict], reference: dict[str, list[dict]]) -> dict:
    """One engine in one cell: tokens/s per round, speed-ups per round against each reference's records (same
    cell), acceptance, tokens per decode step, draft time per step, the k histogram, equality with our AR."""
    batches = {rnd: {r["batch"] for r in records if r["round"] == rnd} for rnd in {r["round"] for r in records}}
    most = max(map(len, batches.values()))
    records = [r for r in records if len(batches[r["round"]]) == most]  # a round cut short (a failure) is left out
    rounds = sorted({r["round"] for r in records})
    tps = [_tps([r for r in records if r["round"] == rnd]) for rnd in rounds]
    proposed, accepted = _sum(records, "proposed"), _sum(records, "accepted")
    decode, row_steps = _sum(records, "decode_tokens"), _sum(records, "row_steps")
    steps, draft_s = _sum(records, "steps"), _sum(records, "draft_s")
    row = {"tokens_per_s": spread(tps), "tokens_per_s_rounds": tps, "rounds": len(rounds),
           "prompts": len({p for r in records for p in r["prompts"]}),
           "new_tokens_per_round": sum(r["new_tokens"] for r in records) // max(len(rounds), 1),
           "proposed": proposed, "accepted": accepted,
           "acceptance": accepted / proposed if proposed else None,
           "tokens_per_step": decode / row_steps if decode and row_steps else None,
           "draft_ms_per_step": 1000 * draft_s / steps if draft_s is not None and steps else None,
           "draft_share": draft_s / sum(r["seconds"] for r in records) if draft_s is not None else None}
    for key, ref in reference.items():
        ratios = per_round_ratio(records, ref) if ref else None
        row[f"x_{key}"] = spread(ratios) if ratios else None
        row[f"x_{key}_rounds"] = ratios
    hist: dict[int, int] = {}
    for r in records:
        for k, n in ((r.get("stats") or {}).get("metrics") or {}).get("k_histogram", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + n
    row["k_histogram"] = {str(k): n for k, n in sorted(hist.items())} or None
    k_options = {(r.get("stats") or {}).get("k_option") for r in records} - {None}
    row["k_option"] = k_options.pop() if len(k_options) == 1 else None
    return row


def same_as(records: list[dict], reference_records: list[dict]) -> tuple[int, int] | None:
    """(requests whose token ids equal the reference's, requests compared), matched by round and batch."""
    ref = {(r["round"], r["batch"]): r["tokens"] for r in reference_records}
    same = total = 0
    for r in records:
        theirs = ref.get((r["round"], r["batch"]))
        if theirs is None:
            continue
        same += sum(a == b for a, b in zip(r["tokens"], theirs))
        total += len(r["tokens"])
    return (same, total) if total else None


def summarise(records: list[dict], engines: list[str]) -> list[dict]:
    """One row per engine, batch size and length that has measurements, in cell then engine order."""
    rows = []
    cells = sorted({(r["batch_size"], r["max_tokens"]) for r in records})
    for B, N in cells:
        at = [r for r in records if (r["batch_size"], r["max_tokens"]) == (B, N)]
        reference = {"llama_ar": [r for r in at if r["engine"] == LLAMA_AR],
                     "our_ar": [r for r in at if r["engine"] == OUR_AR]}
        for engine in engines:
            mine = [r for r in at if r["engine"] == engine]
            if not mine:
                continue
            row = {"engine": engine, "label": label(engine), "batch_size": B, "max_tokens": N,
                   **aggregate(mine, reference)}
            match = same_as(mine, reference["our_ar"])
            row["same_as_our_ar"] = None if match is None else {"same": match[0], "of": match[1]}
            rows.append(row)
    return rows


def category_rows(records: list[dict], pool: list[dict], engines: list[str]) -> list[dict]:
    """Batch 1 at the shortest length, per category: each engine's tokens/s per round over the category's prompts,
    and the default pair's per-round ratio to our AR and to llama.cpp's fastest speculative mode there."""
    at1 = [r for r in records if r["batch_size"] == 1]
    if not at1:
        return []
    shortest = min(r["max_tokens"] for r in at1)
    at1 = [r for r in at1 if r["max_tokens"] == shortest]
    categories = list(dict.fromkeys(p["category"] for p in pool))
    rows = []
    for category in categories:
        mine = [r for r in at1 if pool[r["prompts"][0]]["category"] == category]
        if not mine:
            continue
        row = {"category": category, "max_tokens": shortest, "prompts": len({r["prompts"][0] for r in mine}),
               "engines": {}}
        for engine in engines:
            sub = [r for r in mine if r["engine"] == engine]
            if sub:
                rounds = sorted({r["round"] for r in sub})
                row["engines"][engine] = spread([_tps([r for r in sub if r["round"] == rnd]) for rnd in rounds])
        ours = [r for r in mine if r["engine"] == "ours"]
        ar = [r for r in mine if r["engine"] == OUR_AR]
        ratios = per_round_ratio(ours, ar) if ours and ar else None
        row["ours_x_our_ar"] = spread(ratios) if ratios else None
        spec = [e for e in row["engines"] if e.startswith("llama-") and e != LLAMA_AR]
        best = max(spec, key=lambda e: row["engines"][e]["median"], default=None)
        ratios = per_round_ratio(ours, [r for r in mine if r["engine"] == best]) if ours and best else None
        row["best_llama_spec"] = best
        row["ours_x_best_llama_spec"] = spread(ratios) if ratios else None
        rows.append(row)
    return rows


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def k_cell(row) -> str:
    engine = row["engine"]
    if engine.startswith("llama-draft:"):
        return f"n-max {engine.split(':')[1]}"
    if engine == "llama-ngram":
        return "ngram-mod defaults"
    if engine == "hf-assisted":
        return "transformers defaults"
    if row.get("k_option") is None:
        return "–"
    return k_text(row["k_option"], row.get("k_histogram"))


def summary_table(rows: list[dict]) -> str:
    def cells(r):
        same = r.get("same_as_our_ar")
        return [r["batch_size"], r["max_tokens"], r["label"], r["prompts"], fmt_spread(r["tokens_per_s"]),
                fmt_spread(r.get("x_llama_ar"), "{:.2f}"), fmt_spread(r.get("x_our_ar"), "{:.2f}"),
                ("no drafts" if r["acceptance"] is None and r["engine"] not in (LLAMA_AR, OUR_AR)
                 else _pct(r["acceptance"])), "–" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}",
                "–" if r["draft_ms_per_step"] is None else f"{r['draft_ms_per_step']:.1f} ({_pct(r['draft_share'])})",
                k_cell(r), "–" if same is None else f"{same['same']}/{same['of']}"]

    return md_table(["B", "new tokens", "engine", "prompts", "tokens/s median (min–max)", "× llama.cpp AR",
                     "× our AR", "acceptance", "tokens/step", "draft ms/step (share of wall)", "k", "= our AR"],
                    map(cells, rows), right=(0, 1, 3, 4, 5, 6, 7, 8, 9))


def headlines(rows: list[dict]) -> list[str]:
    """Per cell: the default pair against llama.cpp's AR, its fastest speculative mode (draft-simple at its best
    n-max named) and our AR."""
    out = []
    for B, N in dict.fromkeys((r["batch_size"], r["max_tokens"]) for r in rows):
        at = {r["engine"]: r for r in rows if (r["batch_size"], r["max_tokens"]) == (B, N)}
        parts = []
        drafts = [r for e, r in at.items() if e.startswith("llama-draft:")]
        if drafts:
            best = max(drafts, key=lambda r: r["tokens_per_s"]["median"])
            parts.append(f"llama.cpp draft-simple best at n-max {best['engine'].split(':')[1]} "
                         f"({best['tokens_per_s']['median']:.1f} tok/s)")
        spec = [r for e, r in at.items() if e.startswith("llama-") and e != LLAMA_AR]
        ours = at.get("ours")
        if ours:
            text = f"specdec default pair {ours['tokens_per_s']['median']:.1f} tok/s"
            if ours.get("x_llama_ar"):
                text += f" = {ours['x_llama_ar']['median']:.2f}× llama.cpp AR"
            if spec:
                best = max(spec, key=lambda r: r["tokens_per_s"]["median"])
                text += (f", {ours['tokens_per_s']['median'] / best['tokens_per_s']['median']:.2f}× llama.cpp's "
                         f"fastest speculative mode ({best['label']})")
            if ours.get("x_our_ar"):
                text += f", {ours['x_our_ar']['median']:.2f}× our AR"
            parts.insert(0, text)
        if parts:
            out.append(f"B = {B}, {N} new tokens: " + "; ".join(parts))
    return out


def category_table(rows: list[dict], engines: list[str]) -> str:
    shown_engines = [e for e in engines if any(e in r["engines"] for r in rows)]
    header = ["category", "prompts"] + [label(e) for e in shown_engines] + ["default pair × our AR",
                                                                            "default pair × fastest llama.cpp spec"]
    body = [[r["category"], r["prompts"]] +
            ["–" if e not in r["engines"] else f"{r['engines'][e]['median']:.1f}" for e in shown_engines] +
            [fmt_spread(r["ours_x_our_ar"], "{:.2f}"),
             fmt_spread(r["ours_x_best_llama_spec"], "{:.2f}") +
             (f" ({label(r['best_llama_spec']).removeprefix('llama.cpp ')})" if r["ours_x_best_llama_spec"] else "")]
            for r in rows]
    return md_table(header, body, right=tuple(range(1, len(header))))


def render(result: dict) -> str:
    """The markdown report of a run (what main prints to stdout)."""
    meta = result["meta"]
    rows, cats = result["summary"], result["categories"]
    lines = [f"### Qwen2.5-Coder pair: {shown(meta['target'])} (target), {shown(meta['draft'])} (draft), end to end",
             "", f"`{meta['command']}`  ", machine_line(meta["machine"]) + "  ",
             f"{meta['threads']} thread(s) per engine, {meta['rounds']} round(s) per cell, greedy, EOS ignored, "
             f"chat template; llama-server {meta.get('llama_server_version') or '–'}", ""]
    startup = meta.get("startup_s")
    if startup:
        lines[-1:-1] = [f"Our engines' start-up measurement (auto k's costs at a context bucket met for the first "
                        f"time, or their spot check) is not in the timed seconds, as `specdec.run` leaves it out of "
                        f"tokens/s: {startup:.1f} s in all over the run.", ""]
    lines += [f"- {h}" for h in headlines(rows)]
    lines += ["", summary_table(rows), ""]
    eos = meta.get("eos_before_end")
    if eos:
        lines.append("Our AR's answers that reach an end-of-turn token before the last new token: " + ", ".join(
            f"B = {b}, {n} tokens: {v['early']}/{v['of']}" for (b, n), v in
            ((tuple(map(int, k.split("x"))), v) for k, v in eos.items())) +
            " (ours and transformers decode on past it; llama.cpp's ignore_eos bans it).")
    if cats:
        lines += ["", f"#### Batch 1, {cats[0]['max_tokens']} new tokens, by category: tokens/s (median over rounds)",
                  "", category_table(cats, meta["engines"])]
    if result.get("failures"):
        lines += ["", "Failures:"] + [f"- {f}" for f in result["failures"]]
    return "\n".join(lines) + "\n"


def plot(cats: list[dict], engines: list[str], path: str) -> str:
    plt = pyplot()
    shown_engines = [e for e in engines if any(e in r["engines"] for r in cats)]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(cats) * max(len(shown_engines), 1) / 3), 4.8))
    width = 0.8 / max(len(shown_engines), 1)
    for i, engine in enumerate(shown_engines):
        xs = [j + (i - (len(shown_engines) - 1) / 2) * width for j, r in enumerate(cats) if engine in r["engines"]]
        s = [r["engines"][engine] for r in cats if engine in r["engines"]]
        ax.bar(xs, [v["median"] for v in s], width, label=label(engine),
               yerr=[[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]], capsize=1.5,
               color=f"C{i}")
    ax.set_xticks(range(len(cats)), [r["category"] for r in cats], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s, end to end (median, min–max)")
    ax.set_title(f"Qwen2.5-Coder 1.5B / 0.5B (Q4_K_M), batch 1, {cats[0]['max_tokens']} new tokens, by category",
                 fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- running
def slot_context(prompts: list[Prompt], cells: list[Cell], batch_size: int, draft_n_max: list[int]) -> int:
    """Positions one llama-server slot needs at this batch size: the longest prompt, the most new tokens and the
    largest draft, rounded up to 256."""
    at = [c for c in cells if c.batch_size == batch_size]
    longest = max(len(prompts[i].ids) for c in at for i in c.prompts)
    need = longest + max(c.max_tokens for c in at) + max(draft_n_max + [64]) + 16  # ngram-mod drafts <= 64
    return round_up(need, 256)


class Runner:
    """Builds the engines of each batch size, runs the cells' rounds, keeps every measurement."""

    def __init__(self, args, pool: list[Prompt], cells: list[Cell], log_dir: str, result: dict):
        self.args, self.pool, self.cells, self.log_dir, self.result = args, pool, cells, log_dir, result
        self.records = result["measurements"]
        self.failures = result["failures"]
        self.started = time.perf_counter()
        self.work_total = sum(self.cell_work(c) for c in cells)
        self.work_done = 0

    def cell_work(self, cell: Cell) -> int:
        """Engine-tokens of a cell over all its rounds (for the time estimate)."""
        n = sum(1 for e in self.args.engine_names if e != "hf-assisted")
        hf = len(self.hf_batches(cell)) if "hf-assisted" in self.args.engine_names else 0
        return self.args.rounds * cell.max_tokens * (n * len(cell.prompts) + hf)

    def hf_batches(self, cell: Cell) -> set[int]:
        shortest = min(self.args.max_tokens)
        if cell.batch_size != 1 or cell.max_tokens != shortest:
            return set()
        return set(range(min(self.args.hf_prompts, len(cell.batches))))

    def fail(self, engine: str, message: str, engines: dict) -> None:
        self.failures.append(message)
        log("qwen_pair", f"FAILED {message}")
        e = engines.pop(engine, None)
        if e is not None:
            try:
                e.close()
            except Exception:  # noqa: BLE001 - closing a broken engine must not stop the run
                pass

    def build(self, B: int, engines: dict) -> None:
        """The engines at batch size B, into `engines` as each is made (so that an interrupt stops what is up); a
        failed one: one line, the others go on."""
        context = None
        for name in self.args.engine_names:
            if name == "hf-assisted" and not any(self.hf_batches(c) for c in self.cells if c.batch_size == B):
                continue
            t0 = time.perf_counter()
            try:
                if name.startswith("ours"):
                    engines[name] = OursEngine(name, B, self.args)
                elif name.startswith("llama-"):
                    if context is None:
                        context = B * slot_context(self.pool, self.cells, B, self.args.draft_n_max)
                    engine = LlamaEngine(name, B, context, self.args, self.log_dir)
                    engines[name] = engine
                    engine.start()
                else:
                    engines[name] = HFEngine(self.args)
            except EngineFailed as err:
                self.fail(name, str(err), engines)
                continue
            except Exception as err:  # noqa: BLE001 - the runtime or a peer: the traceback, then the others go on
                log("qwen_pair", f"{name} (B={B}) failed to load:\n{traceback.format_exc()}")
                self.fail(name, f"{name} (B={B}) failed to load: {type(err).__name__}: {err}", engines)
                continue
            log("qwen_pair", f"B={B}: {name} ready in {time.perf_counter() - t0:.1f}s")

    def run_cell(self, cell: Cell, engines: dict) -> None:
        B, N = cell.batch_size, cell.max_tokens
        hf = self.hf_batches(cell)

        def ids(batch: list[int]) -> list[list[int]]:
            return [self.pool[i].ids for i in batch]

        for name in list(engines):  # untimed: allocations, auto k's first costs, llama.cpp's first batch
            if name == "hf-assisted" and not hf:
                continue
            try:
                t0 = time.perf_counter()
                engines[name].warm_up(ids(cell.batches[0]), min(N, 32))
                log("qwen_pair", f"B={B} N={N}: warmed up {name} in {time.perf_counter() - t0:.1f}s")
            except Exception as err:  # noqa: BLE001
                self.engine_error(name, err, B, N, engines)
        names = list(engines)
        if not names:
            return
        for rnd in range(self.args.rounds):
            t_round = time.perf_counter()
            for name in list(engines):
                try:
                    engines[name].reset_round()
                except Exception as err:  # noqa: BLE001
                    self.engine_error(name, err, B, N, engines)
            for j, batch in enumerate(cell.batches):
                shift = (rnd + j) % len(names)  # every batch and every round: the next engine first
                for name in names[shift:] + names[:shift]:
                    if name not in engines or (name == "hf-assisted" and j not in hf):
                        continue
                    try:
                        m = engines[name].measure(ids(batch), N)
                    except Exception as err:  # noqa: BLE001
                        self.engine_error(name, err, B, N, engines)
                        continue
                    self.records.append({"engine": name, "batch_size": B, "max_tokens": N, "round": rnd,
                                         "batch": j, "prompts": batch,
                                         "categories": [self.pool[i].category for i in batch], **m})
                    short = [len(t) for t in m["tokens"] if len(t) != N]
                    if short:
                        log("qwen_pair", f"{name} B={B} N={N}: answers of {short} tokens, not {N}")
                    self.work_done += N * len(batch)
            elapsed = time.perf_counter() - self.started
            left = elapsed / max(self.work_done, 1) * (self.work_total - self.work_done)
            now = [r for r in self.records if (r["batch_size"], r["max_tokens"], r["round"]) == (B, N, rnd)]
            tps = {e: _tps([r for r in now if r["engine"] == e]) for e in names if any(r["engine"] == e for r in now)}
            log("qwen_pair", f"B={B} N={N} round {rnd + 1}/{self.args.rounds} in {time.perf_counter() - t_round:.0f}s: "
                + ", ".join(f"{e} {v:.1f}" for e, v in tps.items()) + f" tok/s; about {left / 60:.0f} min left")

    def engine_error(self, name: str, err: Exception, B: int, N: int, engines: dict) -> None:
        if isinstance(err, EngineFailed):
            self.fail(name, str(err), engines)
            return
        log("qwen_pair", f"{name} B={B} N={N} raised:\n{traceback.format_exc()}")
        self.fail(name, f"{name} (B={B}, N={N}): {type(err).__name__}: {err}", engines)

    def run(self, checkpoint) -> None:
        for B in sorted({c.batch_size for c in self.cells}):
            engines: dict = {}
            try:
                self.build(B, engines)
                self.result["engines"].update({f"{name}@B{B}": e.describe() for name, e in engines.items()})
                for cell in (c for c in self.cells if c.batch_size == B):
                    self.run_cell(cell, engines)
                    checkpoint()
                self.result["engines"].update({f"{name}@B{B}": e.describe() for name, e in engines.items()})
            finally:
                for e in engines.values():
                    e.close()
                engines.clear()
                gc.collect()


def llama_version(binary: str) -> str | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip().startswith("version")]
    return lines[0].removeprefix("version: ") if lines else None


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from specdec.models import load_tokenizer

    def terminate(signum, _frame):  # SIGTERM: unwind like Ctrl-C, so every server is stopped by the finally below
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    torch.set_num_threads(args.threads)
    specbench = read_specbench(args.specbench, args.categories, args.per_category)
    code = code_prompts(args.code_prompts) if args.categories is None or CODE in args.categories else []
    pool = build_pool(specbench + code)
    if not pool:
        raise SystemExit("bench.qwen_pair: no prompt to ask (see --categories, --per-category, --code-prompts)")
    tokenizer = load_tokenizer(args.target)
    for prompt, ids in zip(pool, chat_ids(tokenizer, [p.text for p in pool])):
        prompt.ids = ids
    cells = plan_cells(pool, args.batch_sizes, args.max_tokens, args.long_sizes, args.cell_prompts, args.long_prompts)
    lengths = sorted(len(p.ids) for p in pool)
    log("qwen_pair", f"{len(pool)} prompts ({len(code)} code), {lengths[0]}-{lengths[-1]} tokens (median "
        f"{lengths[len(lengths) // 2]}); engines {', '.join(args.engine_names)}; cells " +
        ", ".join(f"B={c.batch_size} N={c.max_tokens} ({len(c.prompts)} prompts)" for c in cells) +
        f"; {args.rounds} round(s)")
    if args.dry_run:
        for i, p in enumerate(pool):
            print(f"{i:3d} {p.category:15s} {len(p.ids):5d} tokens  {p.source:16s} {p.text[:70]!r}")
        for c in cells:
            print(f"B={c.batch_size} N={c.max_tokens}: prompts {c.prompts}" +
                  (f"; hf-assisted on the first {min(args.hf_prompts, len(c.prompts))}"
                   if "hf-assisted" in args.engine_names and c.batch_size == 1 and c.max_tokens == min(
                       args.max_tokens) else ""))
        return
    for path in (args.output, args.plot):  # before the run, not after it: a folder that cannot be made fails now
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"command": command_line("bench.qwen_pair", argv), "machine": machine(), "target": args.target,
            "draft": args.draft, "threads": args.threads, "rounds": args.rounds, "engines": args.engine_names,
            "batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens, "profile": args.profile,
            "llama_server": args.llama_server if any(e.startswith("llama-") for e in args.engine_names) else None,
            "llama_server_version": None, "specbench": args.specbench,
            "cells": [dataclasses.asdict(c) for c in cells], "loadavg_start": list(os.getloadavg())}
    if meta["llama_server"]:
        meta["llama_server_version"] = llama_version(args.llama_server)
        meta["llama_server_env"] = {k: v for k, v in server_env(args.threads, args.llama_default_spin).items()
                                    if k.startswith(("OMP_", "GOMP_", "KMP_"))}
    meta["target_bytes"], meta["draft_bytes"] = os.path.getsize(args.target), os.path.getsize(args.draft)
    result = {"meta": meta, "prompts": [{"index": i, "category": p.category, "source": p.source,
                                         "chars": len(p.text), "tokens": len(p.ids)} for i, p in enumerate(pool)],
              "engines": {}, "measurements": [], "failures": [], "summary": [], "categories": []}
    log_dir = args.server_logs or tempfile.mkdtemp(prefix="qwen-pair-logs-")
    os.makedirs(log_dir, exist_ok=True)

    def finish(complete: bool) -> None:
        pool_meta = result["prompts"]
        result["summary"] = summarise(result["measurements"], args.engine_names)
        result["categories"] = category_rows(result["measurements"], pool_meta, args.engine_names)
        early = {}
        for r in result["measurements"]:
            if r["engine"] == OUR_AR:
                key = f"{r['batch_size']}x{r['max_tokens']}"
                v = early.setdefault(key, {"early": 0, "of": 0})
                at = r["stats"]["eos_at"]
                v["early"] += sum(a is not None and a < r["max_tokens"] - 1 for a in at)
                v["of"] += len(at)
        meta["eos_before_end"] = early
        meta["startup_s"] = sum(r.get("startup_s", 0.0) for r in result["measurements"])
        meta["complete"] = complete
        meta["loadavg_end"] = list(os.getloadavg())
        meta["total_s"] = time.perf_counter() - t_start
        if args.output:
            write_json(args.output, result)

    t_start = time.perf_counter()
    runner = Runner(args, pool, cells, log_dir, result)
    try:
        runner.run(lambda: finish(False))
    finally:
        if result["measurements"]:
            finish(complete=sys.exc_info()[0] is None)
        if args.server_logs is None:
            if any(f.startswith("llama-") for f in result["failures"]):
                log("qwen_pair", f"llama-server logs kept in {log_dir}")
            else:
                shutil.rmtree(log_dir, ignore_errors=True)
    print(render(result))
    if args.plot and result["categories"]:
        log("qwen_pair", f"wrote {plot(result['categories'], args.engine_names, args.plot)}")
    if args.output:
        log("qwen_pair", f"wrote {args.output}")
    log("qwen_pair", f"done in {(time.perf_counter() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
