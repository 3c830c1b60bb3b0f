"""The serving half of issue 56 on the Qwen2.5-Coder pair (1.5B-Instruct target, 0.5B-Instruct draft, Q4_K_M GGUF
as stored): `python -m specdec.serve --target T --draft D` over HTTP against the same server with `--method ar` (one
client) and against llama.cpp's `llama-server -np C` (C concurrent clients), end to end, the same chat-templated
token ids for every server, greedy, a fixed number of new tokens (EOS ignored).

Two phases a round, every server started fresh in every round (so no request drafts from its own answer of an
earlier round: our suffix store and llama.cpp's ngram-mod pool live as long as the server), the order rotating
with the round:
- one client: `--prompts` requests one after another, not streamed (SpecBench first turns, one per category, then
  bench/qwen_pair.py's code prompts), `--max-tokens` new tokens each; our pair server with its defaults (`--batch-size
  8`: one client runs at batch 1 in a server sized for 8) and our AR server (`--target T --method ar`: the flags are
  bench/qwen_pair.py's `ours_flags`, as `specdec.run` gets them there, plus --host/--port). /metrics is read before
  and after every request: acceptance, the k histogram (`specdec_speculative_k`) and the steps without drafts (its
  k = 0 bucket) of the timed requests alone (the start-up warm-up's counts left out);
- C clients (`--clients`, default 8): `--concurrent-prompts` requests, C in flight at a time, `--concurrent-max-tokens`
  new tokens each; our pair server and our AR server with `--batch-size C`, llama-server `-np C` AR and draft-simple
  (`-md D --spec-draft-n-max N`, N from `--draft-n-max` or the best of a bench/qwen_pair.py run's JSON); tokens/s =
  all new tokens / the wall time from the first request sent to the last answer.
Each server gets an untimed warm-up first (C requests of 16 tokens on a prompt outside the timed ones). Medians over
rounds with min-max; speed-ups are per round, the same prompts. Every server process is stopped on exit, on an error
and on SIGTERM (terminate, wait, kill).

The full run (about 35 minutes on a quiet 2-core box, as estimated from issue 56's speeds and 25-55 s to start one of
our servers: 3 rounds; 16 prompts x 64 tokens with one client, 16 prompts x 128 tokens with 8 clients; the plan and
its estimate are logged at the start, the time left after every server):

    python -m bench.qwen_serve --output bench/results/qwen-serve.json > bench/results/qwen-serve.md

The quick variant (about 10 minutes: 2 rounds, 5 prompts with one client, 8 with 8 clients, 64 tokens):

    python -m bench.qwen_serve --quick --output bench/results/qwen-serve-quick.json > bench/results/qwen-serve-quick.md

`--dry-run` prints the prompts, the servers' commands and the estimate, and stops.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

from bench import qwen_pair as qp
from bench.common import (HelpFormatter, comma_list, command_line, fmt_spread, log, machine, machine_line, md_table,
                          parse_with_quick, quick_help, shown, write_json)
from specdec.flags import Parser

TAG = "qwen_serve"
FAMILIES = ("ours", "ours-ar", "ours-suffix", "llama-ar", "llama-draft", "llama-ngram")
OURS_DEFAULT_BATCH = 8  # specdec.serve's --batch-size default: the one-client servers are started with it
WARM_UP_TEXT = "Write a haiku about the sea."  # asked once per server, untimed, before the timed prompts
WARM_UP_TOKENS = 16
DRAFT_N_MAX = 3  # issue 56: llama.cpp's draft-simple was fastest at n-max 3 (0.62x its AR; 8: 0.58x, 16: 0.60x)
QUICK = dict(rounds=2, categories="coding,math_reasoning,qa,writing,code", code_prompts=3, prompts=5,
             concurrent_prompts=8, concurrent_max_tokens=64)
# rough speeds for the plan's estimate (tokens/s on the 2-core EPYC, issue 56) and seconds to start a server
GUESS_TPS = {1: {"ours": 16.0, "ours-ar": 16.0, "ours-suffix": 20.0, "llama-ar": 16.6, "llama-draft": 10.0,
                 "llama-ngram": 19.0},
             8: {"ours": 27.0, "ours-ar": 33.0, "ours-suffix": 30.0, "llama-ar": 25.0, "llama-draft": 20.0,
                 "llama-ngram": 25.0}}
GUESS_START_S = {"ours": 40.0, "llama": 8.0}
ONE = "one client"


def family(name: str) -> str:
    return name.split(":")[0]


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Parser(prog="python -m bench.qwen_serve", description=__doc__.split("\n\n")[0],
               formatter_class=HelpFormatter)
    p.add_argument("--target", default=str(qp.cache_dir() / qp.TARGET_FILE.file),
                   help=f"the target GGUF (fetched by `{qp.FETCH_COMMAND}`)")
    p.add_argument("--draft", default=str(qp.cache_dir() / qp.DRAFT_FILE.file), help="the draft GGUF")
    p.add_argument("--specbench", default=qp.SPECBENCH, help="SpecBench's question.jsonl (the first turn is asked)")
    p.add_argument("--categories", type=comma_list(), default=None, help="comma-separated categories to ask: "
                   f"SpecBench's and '{qp.CODE}' (bench/qwen_pair.py's code prompts); default: every one")
    p.add_argument("--per-category", type=int, default=1, help="SpecBench questions per category")
    p.add_argument("--code-prompts", type=int, default=len(qp.CODE_PROMPTS),
                   help=f"bench/qwen_pair.py's code prompts in the pool (0..{len(qp.CODE_PROMPTS)})")
    p.add_argument("--prompts", type=int, default=16, help="one client: the first N prompts of the pool (round robin "
                   "over the categories: every category once, then the code prompts)")
    p.add_argument("--max-tokens", type=int, default=64, help="one client: new tokens per request (exactly: EOS "
                   "ignored)")
    p.add_argument("--one-client-servers", type=comma_list(FAMILIES), default="ours,ours-ar",
                   help=f"one client: comma-separated, of {', '.join(FAMILIES)}; ours: `specdec.serve --target T "
                        f"--draft D`, ours-ar: `--target T --method ar`, ours-suffix: `--target T --draft suffix` "
                        f"(bench/qwen_pair.py's engines, as servers); llama-*: llama-server -np 1")
    p.add_argument("--one-client-batch-size", type=int, default=OURS_DEFAULT_BATCH,
                   help="one client: our servers' --batch-size (the server's default)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients: requests in flight at a time; our "
                   "servers' --batch-size and llama-server's -np")
    p.add_argument("--concurrent-prompts", type=int, default=16, help="concurrent clients: requests in all (the "
                   "first of the pool, cycling if it is shorter)")
    p.add_argument("--concurrent-max-tokens", type=int, default=128, help="concurrent clients: new tokens per "
                   "request")
    p.add_argument("--concurrent-servers", type=comma_list(FAMILIES), default="ours,ours-ar,llama-ar,llama-draft",
                   help=f"concurrent clients: comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds: every server of both phases, started fresh, the "
                   "order rotating")
    p.add_argument("--draft-n-max", type=int, default=None, help="llama-draft's --spec-draft-n-max (default: the "
                   f"best of --draft-n-max-from, else {DRAFT_N_MAX}, issue 56's best at batch 1)")
    p.add_argument("--draft-n-max-from", default=None, metavar="FILE.json", help="a `python -m bench.qwen_pair "
                   "--output` file: llama-draft runs at the n-max whose draft-simple was fastest there, at the "
                   "batch size nearest --clients")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads of every server (our --threads; llama-server -t/-tb)")
    p.add_argument("--llama-server", default=qp.LLAMA_SERVER, metavar="PATH",
                   help="llama.cpp's llama-server; default $SPECDEC_LLAMA_SERVER or the build under /work/llamacpp")
    p.add_argument("--llama-args", default="", help="extra arguments for every llama-server, one string")
    p.add_argument("--llama-default-spin", action="store_true", help="run llama-server with libgomp's default "
                   "wait policy instead of our servers' GOMP_SPINCOUNT=10000")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds a server may take to answer /health")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--output", default=None, metavar="FILE.json", help="every measurement, /metrics text, the "
                   "servers' commands, the machine and the revision (rewritten after every server)")
    p.add_argument("--server-logs", default=None, metavar="DIR", help="keep every server's log here (default: a "
                   "temporary folder, removed at the end unless a server failed)")
    p.add_argument("--dry-run", action="store_true", help="print the prompts, the servers' commands and the "
                   "estimate, and stop (loads the tokenizer only)")
    p.add_argument("--quick", action="store_true", help=quick_help(QUICK, "about 10 minutes"))
    return parse_with_quick(p, QUICK, argv, check=check_args)


def check_args(args) -> None:
    """Refuses bad values, one line naming the flag (ValueError); fills args.n_max, args.one_names,
    args.many_names and args.llama_extra."""
    for flag, value, least in (("--per-category", args.per_category, 0), ("--code-prompts", args.code_prompts, 0),
                               ("--prompts", args.prompts, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--one-client-batch-size", args.one_client_batch_size, 1),
                               ("--clients", args.clients, 2), ("--concurrent-prompts", args.concurrent_prompts, 1),
                               ("--concurrent-max-tokens", args.concurrent_max_tokens, 1),
                               ("--rounds", args.rounds, 1), ("--threads", args.threads, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.code_prompts > len(qp.CODE_PROMPTS):
        raise ValueError(f"--code-prompts must be at most {len(qp.CODE_PROMPTS)}, got {args.code_prompts}")
    if args.draft_n_max is not None and args.draft_n_max < 1:
        raise ValueError(f"--draft-n-max must be >= 1, got {args.draft_n_max}")
    for flag, value in (("--server-timeout", args.server_timeout), ("--request-timeout", args.request_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    for flag, path in (("--target", args.target), ("--draft", args.draft), ("--specbench", args.specbench)):
        if not os.path.isfile(path):
            hint = f" (fetch the pair with `{qp.FETCH_COMMAND}`)" if flag != "--specbench" else ""
            raise ValueError(f"{flag} {path}: no such file{hint}")
    args.target, args.draft = os.path.abspath(args.target), os.path.abspath(args.draft)
    qp.read_specbench(args.specbench, args.categories, args.per_category)  # unknown --categories: one line
    args.n_max = args.draft_n_max
    if args.n_max is None and args.draft_n_max_from:
        try:
            import json

            with open(args.draft_n_max_from, encoding="utf-8") as f:
                args.n_max = best_n_max(json.load(f), args.clients)
        except (OSError, ValueError) as err:
            raise ValueError(f"--draft-n-max-from {args.draft_n_max_from}: {err}") from None
        if args.n_max is None:
            raise ValueError(f"--draft-n-max-from {args.draft_n_max_from}: no llama.cpp draft-simple row in its "
                             f"summary")
    args.n_max = args.n_max or DRAFT_N_MAX
    args.one_names = qp.engine_names(args.one_client_servers, [args.n_max])
    args.many_names = qp.engine_names(args.concurrent_servers, [args.n_max])
    args.llama_extra = []
    if any(n.startswith("llama-") for n in args.one_names + args.many_names):
        if not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
            raise ValueError(f"--llama-server {args.llama_server}: not an executable file (or leave the llama-* "
                             f"servers out)")
        try:
            args.llama_extra = shlex.split(args.llama_args)
        except ValueError as err:
            raise ValueError(f"--llama-args {args.llama_args!r}: {err}") from None


def best_n_max(pair_result: dict, clients: int) -> int | None:
    """The --spec-draft-n-max of llama.cpp's fastest draft-simple in a bench/qwen_pair.py result, at the batch size
    nearest `clients` (the larger on a tie) and its shortest length; None where it has no draft-simple row."""
    rows = [r for r in pair_result.get("summary", []) if str(r.get("engine", "")).startswith("llama-draft:")]
    if not rows:
        return None
    size = min({r["batch_size"] for r in rows}, key=lambda b: (abs(b - clients), -b))
    at = [r for r in rows if r["batch_size"] == size]
    shortest = min(r["max_tokens"] for r in at)
    best = max((r for r in at if r["max_tokens"] == shortest), key=lambda r: r["tokens_per_s"]["median"])
    return int(best["engine"].split(":")[1])


# ---------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Phase:
    clients: int  # requests in flight at a time (1: one after another)
    max_tokens: int
    prompts: list[int]  # pool indexes, in the order sent
    servers: list[str]  # engine names (qwen_pair's: ours, ours-ar, llama-ar, llama-draft:N, ...)
    batch_size: int  # our servers' --batch-size (llama-server's -np is `clients`)

    @property
    def title(self) -> str:
        return ONE if self.clients == 1 else f"{self.clients} clients"


def plan_phases(args, pool_size: int) -> list[Phase]:
    phases = []
    if args.one_names:
        phases.append(Phase(1, args.max_tokens, list(range(min(args.prompts, pool_size))), args.one_names,
                            args.one_client_batch_size))
    if args.many_names:
        phases.append(Phase(args.clients, args.concurrent_max_tokens,
                            qp.evenly_cycled(list(range(pool_size)), args.concurrent_prompts), args.many_names,
                            args.clients))
    return phases


def estimate_s(phases: list[Phase], rounds: int) -> float:
    """Seconds the run should take at issue 56's speeds (GUESS_TPS) plus the servers' starts and warm-ups."""
    total = 0.0
    for ph in phases:
        for name in ph.servers:
            tps = GUESS_TPS[1 if ph.clients == 1 else 8][family(name)]
            start = GUESS_START_S["ours" if name.startswith("ours") else "llama"]
            warm = ph.clients * WARM_UP_TOKENS / tps
            total += rounds * (start + warm + 1.1 * len(ph.prompts) * ph.max_tokens / tps)
    return total


def llama_context(pool: list, ph: Phase, n_max: int) -> int:
    """llama-server's -c for a phase: -np slots of what its longest prompt, its new tokens and the largest draft
    need (bench/qwen_pair.py's `slot_context`)."""
    return ph.clients * qp.slot_context(pool, [qp.Cell(ph.clients, ph.max_tokens, ph.prompts)], ph.clients, [n_max])


def rotated(names: list[str], shift: int) -> list[str]:
    shift %= max(len(names), 1)
    return names[shift:] + names[:shift]


# ---------------------------------------------------------------------------------------------- commands, requests
def our_command(name: str, port: int, args, batch_size: int) -> list[str]:
    """`python -m specdec.serve` on 127.0.0.1:port with the flags `python -m specdec.run` gets for the same engine
    in bench/qwen_pair.py (`ours_flags`: --target, --draft or --method ar or --draft suffix, --batch-size,
    --threads; no --profile)."""
    from bench.serve import specdec_command

    return specdec_command(port, *qp.ours_flags(name, SimpleNamespace(target=args.target, draft=args.draft,
                                                                       threads=args.threads, profile=False),
                                                batch_size))


def completion_request(model: str, ids: list[int], max_tokens: int) -> dict:
    """Our server's /v1/completions body: the token ids as the prompt, exactly max_tokens greedy tokens, the
    answer's token ids returned."""
    return {"model": model, "prompt": [int(t) for t in ids], "max_tokens": int(max_tokens), "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": False}


def parse_our_answer(data: dict) -> dict:
    """Token ids, finish reason and completion tokens of one /v1/completions answer."""
    choice = data["choices"][0]
    tokens = [int(t) for t in choice.get("token_ids") or []]
    usage = data.get("usage") or {}
    return {"tokens": tokens, "finish_reason": choice.get("finish_reason"),
            "completion_tokens": int(usage.get("completion_tokens", len(tokens)))}


def parse_metrics(text: str) -> dict:
    """What our server's /metrics says about drafting: generated tokens, drafts proposed and accepted (and per
    drafter), engine steps, the k histogram (`specdec_speculative_k`: steps that proposed k drafts, from its
    cumulative buckets; k = 0: a step without drafts), the life-long acceptance gauge and `specdec_forward_info`."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"generated": 0.0, "proposed": 0.0, "accepted": 0.0, "steps": 0.0, "acceptance_rate": None,
           "k_histogram": {}, "drafters": {}, "forward": None}
    scalars = {"specdec_generation_tokens_total": "generated", "specdec_spec_decode_proposed_drafts_total": "proposed",
               "specdec_spec_decode_accepted_drafts_total": "accepted", "specdec_engine_steps_total": "steps",
               "specdec_spec_decode_acceptance_rate": "acceptance_rate"}
    buckets = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in scalars:
                out[scalars[s.name]] = s.value
            elif s.name == "specdec_speculative_k_bucket" and s.labels.get("le") != "+Inf":
                buckets[int(float(s.labels["le"]))] = s.value
            elif s.name.startswith("specdec_spec_decode_drafter_") and s.name.endswith("_drafts_total"):
                which = "proposed" if "_proposed_" in s.name else "accepted"
                out["drafters"].setdefault(s.labels["drafter"], {"proposed": 0.0, "accepted": 0.0})[which] = s.value
            elif s.name == "specdec_forward_info":
                out["forward"] = dict(s.labels)
    below = 0.0
    for k in sorted(buckets):
        if buckets[k] - below:
            out["k_histogram"][k] = buckets[k] - below
        below = buckets[k]
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    """`after - before` of parse_metrics' counters (whole numbers): what a span of requests did (the acceptance over
    it)."""
    d = {key: round(after[key] - before[key]) for key in ("generated", "proposed", "accepted", "steps")}
    d["acceptance"] = d["accepted"] / d["proposed"] if d["proposed"] else None
    ks = set(before["k_histogram"]) | set(after["k_histogram"])
    d["k_histogram"] = {k: n for k in sorted(ks)
                        if (n := round(after["k_histogram"].get(k, 0) - before["k_histogram"].get(k, 0)))}
    d["drafters"] = {}
    for name, a in after["drafters"].items():
        b = before["drafters"].get(name, {"proposed": 0.0, "accepted": 0.0})
        if a["proposed"] - b["proposed"]:
            d["drafters"][name] = {key: round(a[key] - b[key]) for key in ("proposed", "accepted")}
    return d


def our_counts(delta: dict, answers: list[dict], clients: int) -> dict:
    """bench/qwen_pair.py's counters (`Counts`) from a /metrics delta over `answers`: decode tokens are the
    answers' tokens past their first (the prefill's); row steps are the engine's steps with one client (one row a
    step) and unknown with more."""
    decode = sum(max(len(a["tokens"]) - 1, 0) for a in answers)
    return dict(proposed=int(delta["proposed"]), accepted=int(delta["accepted"]), decode_tokens=decode,
                row_steps=int(delta["steps"]) if clients == 1 else None, steps=int(delta["steps"]), draft_s=None)


def our_stats(name: str, delta: dict) -> dict:
    """A record's stats as qwen_pair's `aggregate` reads them (the k histogram, the k option), with the drafters."""
    return {"metrics": {"k_histogram": {str(k): int(n) for k, n in delta["k_histogram"].items()}},
            "k_option": None if name == "ours-ar" else "auto",
            "drafters": {d: {k: int(v) for k, v in c.items()} for d, c in delta["drafters"].items()}}


def send_all(ask, prompts: list, clients: int) -> tuple[list, float]:
    """ask(p) for every prompt, `clients` at a time (each next one sent as one finishes), in threads; returns the
    answers in prompt order and the wall seconds from the first sent to the last answered. An exception of any
    ask is raised once every ask sent has ended; an interrupt (SIGTERM, Ctrl-C) leaves at once, the asks not yet
    sent cancelled (those in flight end when the caller stops the server)."""
    t0 = time.perf_counter()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=clients, thread_name_prefix="client")
    try:
        futures = [pool.submit(ask, p) for p in prompts]
        concurrent.futures.wait(futures)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    seconds = time.perf_counter() - t0
    return [f.result() for f in futures], seconds


# ---------------------------------------------------------------------------------------------- a server
class Server:
    """One server for one phase of one round: ours (`python -m specdec.serve`) or llama-server (`-np clients`),
    started fresh, asked over HTTP, not streamed (ours: /v1/completions; llama.cpp: /completion, as
    bench/qwen_pair.py asks it), stopped by `close` (terminate, wait, kill)."""

    def __init__(self, name: str, phase: Phase, args, context: int, log_path: str):
        self.name, self.phase, self.args, self.context, self.log_path = name, phase, args, context, log_path
        self.ours = name.startswith("ours")
        self.proc = self.client = None
        self.command: list[str] = []
        self.model = None
        self.start_s = None

    def make_command(self, port: int) -> list[str]:
        a = self.args
        if self.ours:
            return our_command(self.name, port, a, self.phase.batch_size)
        return qp.server_command(a.llama_server, self.name, a.target, a.draft, a.threads, self.phase.clients,
                                 self.context, port, a.llama_extra)

    def start(self) -> None:
        import httpx

        from bench.serve import free_port

        port = free_port()
        self.command = self.make_command(port)
        self.base = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        env = qp.server_env(self.args.threads, self.args.llama_default_spin and not self.ours)
        self.proc = qp.start_server(self.command, port, self.log_path, env, self.args.server_timeout,
                                    f"{self.name} ({self.phase.title})")
        self.start_s = time.perf_counter() - t0
        self.client = httpx.Client(timeout=httpx.Timeout(self.args.request_timeout, connect=10.0),
                                   limits=httpx.Limits(max_connections=self.phase.clients + 2))
        if self.ours:
            self.model = self.get("/v1/models").json()["data"][0]["id"]

    def get(self, path: str):
        r = self.client.get(self.base + path)
        if r.status_code != 200:
            raise qp.EngineFailed(f"{self.name}: GET {path}: HTTP {r.status_code}: {r.text[:200]}")
        return r

    def ask(self, ids: list[int], max_tokens: int) -> dict:
        """One request: {tokens, seconds, and what the answer says}."""
        import httpx

        if self.ours:
            path, body = "/v1/completions", completion_request(self.model, ids, max_tokens)
        else:
            path, body = "/completion", qp.completion_body(ids, max_tokens)
        t0 = time.perf_counter()
        try:
            r = self.client.post(self.base + path, json=body)
        except httpx.HTTPError as err:
            proc = self.proc  # None once closed (a client thread still in flight then)
            dead = proc is not None and proc.poll() is not None
            why = (f"exited {proc.returncode}: {qp.last_line(self.log_path)}" if dead
                   else f"{type(err).__name__}: {err}")
            raise qp.EngineFailed(f"{self.name} ({self.phase.title}): {why}") from None
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            raise qp.EngineFailed(f"{self.name} ({self.phase.title}): HTTP {r.status_code}: {r.text[:300]}")
        answer = parse_our_answer(r.json()) if self.ours else qp.parse_completion(r.json())
        answer["seconds"] = seconds
        return answer

    def metrics(self) -> dict | None:
        """Our server's /metrics, parsed (and its text); None for llama-server."""
        if not self.ours:
            return None
        text = self.get("/metrics").text
        return {**parse_metrics(text), "text": text}

    def close(self) -> None:
        from bench.serve import stop

        if self.proc is not None:
            stop(self.proc, timeout_s=30)
            self.proc = None
        if self.client is not None:
            self.client.close()
            self.client = None


def measure(server: Server, phase: Phase, pool: list, rnd: int) -> tuple[list[dict], dict]:
    """The phase's timed requests on a started server: records in bench/qwen_pair.py's shape (one client: one a
    request, batch j = request j; C clients: one for the whole run, batch 0) and what /metrics says."""
    N, name = phase.max_tokens, server.name
    base = {"engine": name, "batch_size": phase.clients, "max_tokens": N, "round": rnd}
    extra = {}
    if phase.clients == 1:
        records = []
        before = first = server.metrics()
        for j, i in enumerate(phase.prompts):
            answer = server.ask(pool[i].ids, N)
            after = server.metrics()
            records.append({**base, "batch": j, "prompts": [i], "categories": [pool[i].category],
                            **record_body(name, [answer], answer["seconds"], before, after, 1)})
            before = after
        if first is not None:
            extra.update(metrics_text=after["text"], forward=after["forward"], delta=metrics_delta(first, after))
        return records, extra
    before = server.metrics()
    answers, seconds = send_all(lambda i: server.ask(pool[i].ids, N), phase.prompts, phase.clients)
    after = server.metrics()
    record = {**base, "batch": 0, "prompts": list(phase.prompts), "categories": [pool[i].category
                                                                                for i in phase.prompts],
              **record_body(name, answers, seconds, before, after, phase.clients)}
    if before is not None:
        extra.update(metrics_text=after["text"], forward=after["forward"], delta=metrics_delta(before, after))
    return [record], extra


def record_body(name: str, answers: list[dict], seconds: float, before, after, clients: int) -> dict:
    tokens = [a.pop("tokens") for a in answers]
    body = {"seconds": seconds, "tokens": tokens, "new_tokens": sum(map(len, tokens)),
            "request_seconds": [a["seconds"] for a in answers]}
    if name.startswith("ours"):
        delta = metrics_delta(before, after)
        body["counts"], body["stats"] = our_counts(delta, [{"tokens": t} for t in tokens], clients), our_stats(
            name, delta)
        body["stats"]["finish_reasons"] = [a["finish_reason"] for a in answers]
    else:
        body["counts"], body["stats"] = qp.llama_counts(answers), {"requests": answers}
    return body


def warm_up(server: Server, ids: list[int], clients: int) -> None:
    send_all(lambda _: server.ask(ids, WARM_UP_TOKENS), list(range(clients)), clients)


# ---------------------------------------------------------------------------------------------- summary
def phase_rows(records: list[dict], phases: list[Phase]) -> list[dict]:
    """bench/qwen_pair.py's summary rows (tokens/s per round, x llama.cpp AR and x our AR per round, acceptance,
    tokens a step, k, = our AR), one per server and phase, with the serving extras: steps without drafts, the
    drafters' counts and, with one client, the requests' own tokens/s."""
    rows = []
    for ph in phases:
        at = [r for r in records if (r["batch_size"], r["max_tokens"]) == (ph.clients, ph.max_tokens)]
        for row in qp.summarise(at, ph.servers):
            mine = [r for r in at if r["engine"] == row["engine"]]
            hist = {int(k): n for k, n in (row.get("k_histogram") or {}).items()}
            row["steps"] = sum(hist.values()) if hist else None
            row["steps_without_drafts"] = hist.get(0, 0) if hist else None
            drafters: dict = {}
            for r in mine:
                for d, c in (r.get("stats") or {}).get("drafters", {}).items():
                    t = drafters.setdefault(d, {"proposed": 0, "accepted": 0})
                    t["proposed"] += c["proposed"]
                    t["accepted"] += c["accepted"]
            row["drafters"] = drafters or None
            per_request = [n / s for r in mine for n, s in zip(map(len, r["tokens"]), r["request_seconds"]) if s]
            row["request_tokens_per_s"] = qp.spread(per_request) if ph.clients == 1 and per_request else None
            row["clients"] = ph.clients
            rows.append(row)
    return rows


def steps_cell(row: dict) -> str:
    if row.get("steps") is None:
        return "–"
    return f"{row['steps_without_drafts']}/{row['steps']} ({row['steps_without_drafts'] / row['steps']:.0%})" \
        if row["steps"] else "0/0"


def serve_table(rows: list[dict]) -> str:
    def cells(r):
        same = r.get("same_as_our_ar")
        return [r["clients"], r["max_tokens"], r["label"], r["prompts"], fmt_spread(r["tokens_per_s"]),
                fmt_spread(r.get("request_tokens_per_s")), fmt_spread(r.get("x_our_ar"), "{:.2f}"),
                fmt_spread(r.get("x_llama_ar"), "{:.2f}"),
                ("no drafts" if r["acceptance"] is None and r["engine"] not in (qp.LLAMA_AR, qp.OUR_AR)
                 else qp._pct(r["acceptance"])),
                "–" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}", qp.k_cell(r), steps_cell(r),
                "–" if same is None else f"{same['same']}/{same['of']}"]

    return md_table(["clients", "new tokens", "server", "prompts", "tokens/s median (min–max)",
                     "a request's tokens/s (min–max over requests)", "× our AR server", "× llama.cpp AR",
                     "acceptance", "tokens/step", "k", "steps without drafts", "= our AR"],
                    map(cells, rows), right=(0, 1, 3, 4, 5, 6, 7, 8, 9, 11))


def verdict(ratio, bar: float) -> str:
    if not ratio:
        return "not measured"
    return f"bar ≥ {bar:g}×: {'met' if ratio['median'] >= bar else 'not met'}"


def headlines(rows: list[dict]) -> list[str]:
    """Issue 56's two bars: one client, the pair server over our AR server (>= 1.3x) and that it drafted; C clients,
    our servers over llama-server -np C AR (>= 1x) and its speculative mode."""
    out = []
    for clients in dict.fromkeys(r["clients"] for r in rows):
        at = {r["engine"]: r for r in rows if r["clients"] == clients}
        ours = at.get("ours")
        if ours is None:
            continue
        text = f"{ONE if clients == 1 else f'{clients} clients'}, {ours['max_tokens']} new tokens: the pair server " \
               f"{ours['tokens_per_s']['median']:.1f} tok/s"
        if clients == 1:
            text += (f" = {fmt_spread(ours.get('x_our_ar'), '{:.2f}')}× the same server with --method ar "
                     f"({verdict(ours.get('x_our_ar'), 1.3)})")
            text += f"; drafted: acceptance {qp._pct(ours['acceptance'])} of {ours['proposed']} drafts, " \
                    f"{qp.k_cell(ours)}, steps without drafts {steps_cell(ours)}"
        else:
            text += (f" = {fmt_spread(ours.get('x_llama_ar'), '{:.2f}')}× llama-server -np {clients} AR "
                     f"({verdict(ours.get('x_llama_ar'), 1.0)})")
            if ours.get("x_our_ar"):
                text += f", {fmt_spread(ours['x_our_ar'], '{:.2f}')}× our AR server"
            ar = at.get(qp.OUR_AR)
            if ar and ar.get("x_llama_ar"):
                text += f"; our AR server {fmt_spread(ar['x_llama_ar'], '{:.2f}')}× llama.cpp AR"
            spec = [r for e, r in at.items() if e.startswith("llama-") and e != qp.LLAMA_AR]
            for r in spec:
                text += f"; {r['label']} {r['tokens_per_s']['median']:.1f} tok/s"
                if r.get("x_llama_ar"):
                    text += f" ({r['x_llama_ar']['median']:.2f}× its AR, acceptance {qp._pct(r['acceptance'])})"
        out.append(text)
    return out


def drafting_lines(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if not r["engine"].startswith("ours") or r.get("steps") is None:
            continue
        hist = ", ".join(f"{k}: {n}" for k, n in sorted((int(k), n) for k, n in r["k_histogram"].items()))
        by = "; ".join(f"{d} {c['accepted']}/{c['proposed']}" for d, c in (r.get("drafters") or {}).items())
        out.append(f"{r['label']}, {ONE if r['clients'] == 1 else str(r['clients']) + ' clients'}: "
                   f"{r['accepted']}/{r['proposed']} drafts accepted"
                   + (f" (by drafter, accepted/proposed: {by})" if by else "")
                   + f"; k histogram (k: steps) {{{hist}}}; steps without drafts {steps_cell(r)}")
    return out


def render(result: dict) -> str:
    meta = result["meta"]
    rows = result["summary"]
    lines = [f"### specdec.serve with the Qwen2.5-Coder pair: {shown(meta['target'])} (target), "
             f"{shown(meta['draft'])} (draft), over HTTP, end to end", "",
             f"`{meta['command']}`  ", machine_line(meta["machine"]) + "  ",
             f"{meta['threads']} thread(s) per server; {meta['rounds']} round(s), each starting every server fresh "
             f"(the order rotating); greedy, EOS ignored, chat-templated token ids; llama-server "
             f"{meta.get('llama_server_version') or '–'}", ""]
    lines += [f"- {h}" for h in headlines(rows)]
    for title, clients in ((ph["title"], ph["clients"]) for ph in meta["phases"]):
        at = [r for r in rows if r["clients"] == clients]
        if not at:
            continue
        ph = next(p for p in meta["phases"] if p["clients"] == clients)
        how = ("requests one after another" if clients == 1 else
               f"{clients} requests in flight at a time, tokens/s = all new tokens / the wall time")
        lines += ["", f"#### {title}: {len(ph['prompts'])} prompts, {ph['max_tokens']} new tokens each, {how}", "",
                  serve_table(at)]
        if clients == 1 and result.get("categories"):
            lines += ["", "By category (tokens/s, median over rounds):", "",
                      qp.category_table(result["categories"], ph["servers"])]
    drafting = drafting_lines(rows)
    if drafting:
        lines += ["", "Drafting on our servers' /metrics (the timed requests alone, all rounds):", ""]
        lines += [f"- {d}" for d in drafting]
    lines += ["", "Servers (seconds from start to /health, per round):", ""]
    for key, s in result["servers"].items():
        forward = s.get("forward")
        fw = f"; forward {forward.get('forward')} ({forward.get('isa')})" if forward else ""
        lines.append(f"- {key}: `{s['command']}` — " + ", ".join(f"{x:.1f}" for x in s["start_s"]) + " s" + fw)
    if result.get("failures"):
        lines += ["", "Failures:"] + [f"- {f}" for f in result["failures"]]
    return "\n".join(lines) + "\n"


def shown_command(command: list[str]) -> str:
    """A server's command as reports show it: paths relative to the repository, the port as PORT."""
    out = list(command)
    if "--port" in out:
        out[out.index("--port") + 1] = "PORT"
    out = [shown(x) if os.path.isabs(x) and os.path.exists(x) else x for x in out]
    if out and out[0] == sys.executable:
        out[0] = "python"
    return shlex.join(out)


# ---------------------------------------------------------------------------------------------- the run
class Runner:
    def __init__(self, args, pool, phases: list[Phase], log_dir: str, result: dict, warm_ids: list[int]):
        self.args, self.pool, self.phases, self.log_dir, self.result = args, pool, phases, log_dir, result
        self.warm_ids = warm_ids
        self.started = time.perf_counter()
        self.guess_total = estimate_s(phases, args.rounds)
        self.guess_done = 0.0
        self.failed: set[tuple[str, int]] = set()  # (server, clients) given up after a failure

    def run(self, checkpoint) -> None:
        for rnd in range(self.args.rounds):
            for ph in self.phases:
                for name in rotated(ph.servers, rnd):
                    skipped = (name, ph.clients) in self.failed  # it failed in an earlier round: not again
                    if not skipped:
                        self.run_server(name, ph, rnd)
                        checkpoint()
                    self.guess_done += estimate_s([dataclasses.replace(ph, servers=[name])], 1)
                    elapsed = time.perf_counter() - self.started
                    left = elapsed / max(self.guess_done, 1e-9) * (self.guess_total - self.guess_done)
                    log(TAG, f"round {rnd + 1}/{self.args.rounds}, {ph.title}: {name} "
                             f"{'skipped (failed earlier)' if skipped else 'done'}; {elapsed / 60:.1f} min so far, "
                             f"about {left / 60:.0f} min left")

    def run_server(self, name: str, ph: Phase, rnd: int) -> None:
        key = f"{name}@{ph.clients}"
        log_path = os.path.join(self.log_dir, f"{name.replace(':', '-')}-c{ph.clients}-r{rnd}.log")
        server = Server(name, ph, self.args, llama_context(self.pool, ph, self.args.n_max), log_path)
        try:
            server.start()
            info = self.result["servers"].setdefault(key, {"command": shown_command(server.command), "start_s": [],
                                                            "log": log_path})
            info["start_s"].append(server.start_s)
            log(TAG, f"round {rnd + 1}, {ph.title}: {name} up in {server.start_s:.1f}s")
            warm_up(server, self.warm_ids, ph.clients)
            records, extra = measure(server, ph, self.pool, rnd)
            if extra.get("delta"):
                info["forward"] = extra["forward"]
                info.setdefault("metrics_text", []).append(extra["metrics_text"])
            self.result["measurements"] += records
            short = [len(t) for r in records for t in r["tokens"] if len(t) != ph.max_tokens]
            if short:
                log(TAG, f"{name} ({ph.title}): answers of {short} tokens, not {ph.max_tokens}")
            tps = sum(r["new_tokens"] for r in records) / sum(r["seconds"] for r in records)
            d = extra.get("delta")
            drafted = (f"; acceptance {qp._pct(d['acceptance'])}, k histogram {d['k_histogram']}" if d else "")
            log(TAG, f"round {rnd + 1}, {ph.title}: {name} {tps:.1f} tok/s{drafted}")
        except Exception as err:  # noqa: BLE001 - one server's failure: said, the others go on
            if not isinstance(err, qp.EngineFailed):
                log(TAG, f"{name} ({ph.title}) raised:\n{traceback.format_exc()}")
            message = f"{name} ({ph.title}, round {rnd + 1}): {type(err).__name__}: {err}"
            self.result["failures"].append(message)
            self.failed.add((name, ph.clients))
            log(TAG, f"FAILED {message} (log: {log_path})")
        finally:
            server.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from specdec.models import load_tokenizer

    def terminate(signum, _frame):  # SIGTERM: unwind like Ctrl-C, so that the running server is stopped
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    torch.set_num_threads(args.threads)
    specbench = qp.read_specbench(args.specbench, args.categories, args.per_category)
    code = qp.code_prompts(args.code_prompts) if args.categories is None or qp.CODE in args.categories else []
    pool = qp.build_pool(specbench + code)
    if not pool:
        raise SystemExit("bench.qwen_serve: no prompt to ask (see --categories, --per-category, --code-prompts)")
    tokenizer = load_tokenizer(args.target)
    *ids, warm_ids = qp.chat_ids(tokenizer, [p.text for p in pool] + [WARM_UP_TEXT])
    for prompt, x in zip(pool, ids):
        prompt.ids = x
    phases = plan_phases(args, len(pool))
    used = sorted({i for ph in phases for i in ph.prompts})
    lengths = sorted(len(pool[i].ids) for i in used)
    guess = estimate_s(phases, args.rounds)
    log(TAG, f"{len(used)} prompts, {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}); " +
        "; ".join(f"{ph.title}: {len(ph.prompts)} requests x {ph.max_tokens} tokens on {', '.join(ph.servers)}"
                  for ph in phases) + f"; {args.rounds} round(s); about {guess / 60:.0f} min")
    if args.dry_run:
        for i in used:
            p = pool[i]
            print(f"{i:3d} {p.category:15s} {len(p.ids):5d} tokens  {p.source:16s} {p.text[:70]!r}")
        for ph in phases:
            for name in ph.servers:
                server = Server(name, ph, args, llama_context(pool, ph, args.n_max), "")
                print(f"{ph.title}: {name}: {shown_command(server.make_command(0))}")
        print(f"estimate: about {guess / 60:.0f} min")
        return
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    meta = {"command": command_line("bench.qwen_serve", argv), "machine": machine(), "target": args.target,
            "draft": args.draft, "threads": args.threads, "rounds": args.rounds, "draft_n_max": args.n_max,
            "phases": [{**dataclasses.asdict(ph), "title": ph.title} for ph in phases],
            "estimate_s": guess, "llama_server": None, "llama_server_version": None, "specbench": args.specbench,
            "warm_up": {"text": WARM_UP_TEXT, "tokens": WARM_UP_TOKENS}, "loadavg_start": list(os.getloadavg())}
    if any(n.startswith("llama-") for ph in phases for n in ph.servers):
        meta["llama_server"] = args.llama_server
        meta["llama_server_version"] = qp.llama_version(args.llama_server)
    meta["server_env"] = {k: v for k, v in qp.server_env(args.threads, args.llama_default_spin).items()
                          if k.startswith(("OMP_", "GOMP_", "KMP_"))}
    result = {"meta": meta, "prompts": [{"index": i, "category": p.category, "source": p.source,
                                         "chars": len(p.text), "tokens": len(p.ids)} for i, p in enumerate(pool)],
              "servers": {}, "measurements": [], "failures": [], "summary": [], "categories": []}
    log_dir = args.server_logs or tempfile.mkdtemp(prefix="qwen-serve-logs-")
    os.makedirs(log_dir, exist_ok=True)
    t_start = time.perf_counter()

    def finish(complete: bool) -> None:
        result["summary"] = phase_rows(result["measurements"], phases)
        one = [r for r in result["measurements"] if r["batch_size"] == 1]
        result["categories"] = qp.category_rows(one, result["prompts"], args.one_names) if one else []
        meta.update(complete=complete, loadavg_end=list(os.getloadavg()), total_s=time.perf_counter() - t_start)
        if args.output:
            write_json(args.output, result)

    runner = Runner(args, pool, phases, log_dir, result, warm_ids)
    try:
        runner.run(lambda: finish(False))
    finally:
        finish(complete=sys.exc_info()[0] is None)
        if args.server_logs is None:
            if result["failures"]:
                log(TAG, f"server logs kept in {log_dir}")
            else:
                shutil.rmtree(log_dir, ignore_errors=True)
    print(render(result))
    if args.output:
        log(TAG, f"wrote {args.output}")
    log(TAG, f"done in {(time.perf_counter() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
