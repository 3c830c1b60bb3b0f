"""`Engine`: the incremental core. Requests join at any time (`add_request`), leave early (`abort`), and
every `step()` returns what each request gained in it (`RequestDelta`). `LLM.generate` is "add all, step
until done"; the server steps one engine in a background thread.

A step is three calls, owned here:

1. **schedule**: abort what was aborted, admit waiting requests into free rows (prefill, by the method's
   scheduler: ragged / left-padded continuous batching, or exspec's pool), choose the rows to run;
2. **run**: one decoding step of those rows, k fixed or chosen by auto k (`speculative.decode_step`:
   draft, verify, accept); it returns each row's emitted tokens (`commit.StepOutput`), read from the
   device once, and writes no request;
3. **postprocess**: commit those tokens to the requests (`commit.commit`: stops, non-finite checks,
   statistics -- the one place a request's output grows; a prefill's first tokens go through it too),
   then what the layout needs (left-padded: realign the unfinished rows; exspec: copy the rows back into
   the pool, count waits, free finished rows), auto k's timing, the deltas.

Thread safety: `add_request`, `abort`, `has_unfinished`, `num_waiting` and `num_running` may be called
from any thread, also while `step()` runs (they only touch a lock-guarded inbox and counters the step
publishes). `step()` itself must be called from one thread at a time (a second concurrent call raises).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from .autok import prepare_chooser
from .batch import DecodeContext
from .commit import commit
from .detokenizer import IncrementalDetokenizer
from .invariants import check_invariants
from .memory import check_cache_memory
from .metrics import PhaseTimer, RunMetrics
from .options import Options, positions_needed
from .request import Request, RequestOutput
from .sampling import SamplingParams
from .speculative import decode_step
from .schedulers import SCHEDULERS



@dataclass
class RequestDelta:
    """What one request gained in one step."""

    request_id: str
    token_ids: list[int]  # tokens emitted in this step
    text: str  # their text, incrementally detokenized ("" until a printable piece is complete; with
    # stream_text=False "" until the request finishes, then all of it)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int  # emitted so far, this step's included
    output: RequestOutput | None = None  # the whole request, once finished
    choice: int = 0  # which of the request's n completions (SamplingParams.n) gained the tokens
    logprobs: list | None = None  # with SamplingParams.logprobs: a TokenLogprob per token of token_ids


class Engine:
    """Decodes the requests added to it, a step at a time, on an `LLM`'s models and options."""

    def __init__(self, llm, batch_size: int | None = None, stream_text: bool = True):
        """`stream_text`: detokenize every step's new tokens (streaming, the server); False: only when a
        request finishes, once (`LLM.generate`, which reads only the final text)."""
        if batch_size is not None:  # this engine's batch size, checked by the option's rule
            Options.build(llm.options, batch_size=batch_size)
        batch_size = llm.batch_size if batch_size is None else batch_size
        self.llm = llm
        self.batch_size = int(batch_size)
        self.metrics = RunMetrics(llm.method, self.batch_size)
        self.proposer = llm.new_proposer()  # this engine's drafter, with its per-row state
        # auto k: this engine's own chooser (the LLM's holds the settings and the calibrated costs it shares)
        self.chooser = llm.chooser.for_engine() if llm.chooser is not None else None
        self.ctx = DecodeContext(llm.target, llm.draft, llm.options, llm.vocab_size, llm.device, self.metrics,
                                 PhaseTimer(self.metrics, llm.device, llm.options.scheduler.profile), llm.target_name,
                                 self.chooser, self.proposer, llm.prefix_cache)
        self.metrics.drafter = None if self.proposer is None else self.proposer.name
        self.scheduler = SCHEDULERS[llm.method](self.ctx, self.batch_size)
        self._tables: dict[int, tuple] = {}  # auto k: rows -> (cost table, its cache key), each measured once
        self._lock = threading.Lock()
        self._stepping = threading.Lock()
        self._inbox: deque[Request] = deque()  # added since the last step
        self._aborts: list[tuple[str, int | None]] = []  # (request id, choice or None: every choice)
        self._live: dict[tuple[str, int], Request] = {}  # (id, choice) -> every request added, not yet reported finished
        self._ids: dict[str, int] = {}  # request id -> its choices in `_live` (an id is in use while any is)
        self._next_index = 0
        self._running = 0  # published by each step, for other threads
        self._checked = (0, 0)  # (rows, columns) whose caches were found to fit in memory
        self.stream_text = stream_text
        # called inside `step()` with the deltas of its admissions (first tokens), right after they are made and
        # before the step's decoding run, which then reports only what it adds: a server streams a newcomer's
        # first token without waiting for that run (specdec/serve/worker.py); None: everything at the step's end
        self.on_first_tokens = None
        self._detokenizers: dict[tuple, IncrementalDetokenizer] = {}  # (id, choice) -> its text so far (streaming)

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request: `prompt` is text (encoded with the tokenizer) or a list of token ids. Raises
        ValueError/TypeError, naming the request, if it cannot run. Returns its id.

        With `params.n` > 1 the request is n requests of the same prompt, choices 0..n-1 under the one id
        (each delta names its `choice`), choice j sampled with `params.for_choice(j)`. They are queued
        together, so they are admitted together while rows are free. (Where a prefix cache would let them
        share the prompt's prefill: they hold one `prompt_ids` list.)"""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        with self._lock:
            index = self._next_index
            self._next_index += 1
        name = f"prompt {index}" if request_id is None else f"request {request_id!r}"
        ids = self.llm.prompt_ids(prompt, name)
        self.llm.check_request(ids, params, index, name)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.llm.eos_token_ids))
        self._check_memory(positions_needed(len(ids), params.max_tokens, self.ctx.k_max), params.n)
        rid = str(index) if request_id is None else str(request_id)
        requests = [Request(index, ids, params.for_choice(j) if params.n > 1 else params, frozenset(stop),
                            request_id=rid, choice=j) for j in range(params.n)]
        with self._lock:
            if rid in self._ids:
                raise ValueError(f"request id {rid!r} is already in use")
            self._ids[rid] = len(requests)
            for request in requests:
                self._live[request.key] = request
            self._inbox.extend(requests)
        return rid

    def _check_memory(self, capacity: int, count: int = 1) -> None:
        """Refuse a request (of `count` choices) whose admission could make the caches outgrow the memory
        available: checked for the rows that can run with it (rounded up to a power of two, at most the
        batch's or pool's rows) and the most columns any request needs, each time either grows."""
        with self._lock:
            live = len(self._live) + count
            capacity = max(capacity, self._checked[1])
        bound = self.scheduler.rows_for(1 << 62)
        rows = min(bound, self.scheduler.rows_for(1 << (live - 1).bit_length()))
        if rows > self._checked[0] or capacity > self._checked[1]:
            prefix = self.llm.prefix_cache  # its budget not yet filled is promised too (what it holds is not free)
            reserved = 0 if prefix is None else max(prefix.budget - prefix.bytes, 0)
            check_cache_memory((self.llm.target, self.llm.draft), rows, capacity, self.llm.device, self.batch_size,
                               self.ctx.k_max + 1, reserved)
            with self._lock:
                self._checked = (max(rows, self._checked[0]), capacity)

    def abort(self, request_id: str, choice: int | None = None) -> bool:
        """Stop a request (every choice of it, or only `choice`): its rows are freed at the next step, which
        reports them finished ("abort"). False if no unfinished request (choice) has this id."""
        rid = str(request_id)
        with self._lock:
            live = [r for key, r in self._live.items() if key[0] == rid and choice in (None, key[1])] \
                if rid in self._ids else []
            if all(r.finished for r in live):
                return False
            self._aborts.append((rid, choice))
            return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet holding a row."""
        with self._lock:
            return len(self._live) - self._running

    @property
    def num_running(self) -> int:
        """Requests holding a row (as of the last step)."""
        return self._running

    # ---------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """One step: schedule, run, postprocess. Returns a delta per request that gained tokens or finished."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("Engine.step() is already running in another thread; step from one thread")
        try:
            started, calibrated = time.perf_counter(), self.metrics.calibration_s
            first_tokens = self.metrics.first_tokens
            batch = self._schedule()
            if self.on_first_tokens is not None and self.metrics.first_tokens > first_tokens:
                self.on_first_tokens(self._deltas())  # the newcomers' first tokens, before the decoding run
            if batch is not None:
                run_started, rows = time.perf_counter(), len(batch)
                out = decode_step(self.ctx, batch)  # run: every row's tokens, read from the device once
                commit(self.ctx, batch.requests, out)  # postprocess: the one place requests gain tokens
                self.scheduler.postprocess(batch)  # the layout's part: realign, copy back, free rows
                self.ctx.step_done(rows, run_started)
            deltas = self._deltas()
            self.metrics.wall_time_s += time.perf_counter() - started - (self.metrics.calibration_s - calibrated)
            return deltas
        finally:
            self._stepping.release()

    def _schedule(self):
        with self._lock:
            arrivals, aborts = list(self._inbox), self._aborts
            self._inbox.clear()
            self._aborts = []
        self.scheduler.waiting.extend(arrivals)
        self.metrics.num_requests += len(arrivals)
        for rid, choice in aborts:
            # a choice no longer live finished (and was reported) before the abort arrived
            with self._lock:
                aborted = [r for key, r in self._live.items() if key[0] == rid and choice in (None, key[1])]
            for request in aborted:
                if not request.finished:
                    request.finish(now=time.perf_counter(), reason="abort")
                    self.scheduler.release(request)
        self._prepare_chooser()
        self.scheduler.admit()
        batch = self.scheduler.select()
        if batch is not None and self.ctx.options.scheduler.check_invariants:
            check_invariants(self.ctx, batch)  # every row, before each step it takes part in
        return batch

    def _prepare_chooser(self) -> None:
        """Auto k: measure (or load) the forward costs for the rows that can run now -- min(batch size,
        requests), in powers of two -- the first time that many can."""
        chooser = self.llm.chooser  # calibrated there: the costs are the models', shared by the LLM's engines
        if chooser is None:
            return
        queued = self.scheduler.queued()  # waiting, or being prefilled in chunks
        live = len(self.scheduler.running()) + len(queued)
        if not live:
            return
        rows = min(self.batch_size, 1 << (live - 1).bit_length())
        if rows not in self._tables:  # the batch that runs now: its own table (a server's one client is batch 1)
            requests = self.scheduler.running() + queued
            started = time.perf_counter()
            prepare_chooser(self.llm, chooser, requests, *self.llm.specs, rows)
            self._tables[rows] = (chooser.costs, chooser.key)
            ended = time.perf_counter()
            self.metrics.calibration_s += ended - started  # start-up work, not decoding time
            self._exclude_from_request_times(started, ended)
        self.chooser.costs, self.chooser.key = self._tables[rows]

    def _exclude_from_request_times(self, started: float, ended: float) -> None:
        """Keep start-up work (auto k's calibration, from `started` to `ended`) out of every unfinished request's
        time to first token and latency, as it is kept out of the wall time: the request's times before it move
        later by the part of it the request was there for (all of it for a request submitted before it)."""
        with self._lock:
            unfinished = [r for r in self._live.values() if not r.finished]
        for r in unfinished:
            overlap = ended - max(started, r.submitted_at)
            if overlap > 0:
                r.submitted_at += overlap
                if r.first_token_at is not None:  # a running request's first token came before: its TTFT stays
                    r.first_token_at += overlap

    def _deltas(self) -> list[RequestDelta]:
        deltas, tokenizer = [], self.llm.tokenizer
        finished = []
        with self._lock:
            live = list(self._live.items())
        for key, r in live:
            start = r.reported
            new = r.output_ids[start:]
            if not new and not r.finished:
                continue
            r.reported = len(r.output_ids)
            text, full = "", None
            if tokenizer is not None:  # a few tokens per step (specdec/detokenizer.py), the whole output once
                if r.finished:
                    detokenizer = self._detokenizers.pop(key, None) or IncrementalDetokenizer(tokenizer)
                    text, full = detokenizer.finish(r.output_ids)
                elif self.stream_text:
                    detokenizer = self._detokenizers.get(key)
                    if detokenizer is None:
                        detokenizer = self._detokenizers[key] = IncrementalDetokenizer(tokenizer)
                    text = detokenizer.step(r.output_ids)
            output = None
            if r.finished:
                output = RequestOutput.from_request(r, None, full)
                finished.append(key)
                self.metrics.latencies_s.append(output.latency_s)
                self.metrics.ttfts_s.append(output.time_to_first_token_s)
                if self.proposer is not None:
                    self.proposer.release(r)
            deltas.append(RequestDelta(r.request_id, new, text, r.finished, r.finish_reason, len(r.prompt_ids),
                                       len(r.output_ids), output, r.choice,
                                       None if r.logprobs is None else r.logprobs[start:]))
        running = len(self.scheduler.running())
        with self._lock:
            for key in finished:
                del self._live[key]
                self._ids[key[0]] -= 1
                if not self._ids[key[0]]:
                    del self._ids[key[0]]
            self._running = running
        return deltas

