"""A request's state during generation and what `LLM.generate` returns for it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .sampling import SamplingParams, request_seed


@dataclass
class Request:
    index: int  # position in the caller's prompt list: outputs come back in this order
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # EOS ids (unless ignore_eos) plus the request's stop_token_ids
    output_ids: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each of its verification steps
    step_ks: list[int] = field(default_factory=list)  # k of every decoding step it took part in (0: target only)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    longest_wait_steps: int = 0  # EXSPEC: the longest run of steps it sat in the pool unscheduled
    seed: int | None = None  # key of its random numbers (sampling.request_seed), set at creation; None: greedy
    request_id: str = ""  # the Engine's name for it
    reported: int = 0  # output tokens already returned in a RequestDelta
    acceptance: list[float] = field(default_factory=lambda: [0.0, 0.0])  # auto k's decayed [accepted, offered]
    choice: int = 0  # which of its request's n completions this is (SamplingParams.n): (request_id, choice) is unique
    logprobs: list | None = None  # a TokenLogprob per output token (specdec/logprobs.py), if params.logprobs is set
    prefix_stored: bool = False  # its sequence's K/V went to the prefix cache when it finished (specdec/prefill.py)

    def __post_init__(self):
        if self.seed is None and not self.params.greedy:
            self.seed = request_seed(self.params.seed)
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    @property
    def key(self) -> tuple[str, int]:
        """What names this row of work: its request's id and its choice (the n choices of one request share
        the id)."""
        return self.request_id, self.choice

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sequence_length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def commit(self, tokens: list[int], logprobs: list | None = None) -> int:
        """Append emitted tokens (with their log-probabilities, when the request asks: `logprobs`, one per
        token), stopping exactly where AR decoding would. Returns how many were kept."""
        kept = 0
        for j, token in enumerate(tokens):
            if self.finished:
                break
            self.output_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[j])
            kept += 1
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        now = time.perf_counter()
        if self.first_token_at is None and kept:
            self.first_token_at = now
        if self.finished and self.finished_at is None:
            self.finished_at = now
        return kept

    def finish(self, now: float, reason: str) -> None:
        """End the request early (`reason` "abort"): it emits nothing more."""
        self.finish_reason = reason
        self.finished_at = now


@dataclass
class RequestOutput:
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    accepted_counts: list[int]  # drafts accepted per verification step (empty for AR)
    speculative_tokens: list[int]  # k of every decoding step the request took part in (0: a target-only step)
    latency_s: float
    time_to_first_token_s: float
    longest_wait_steps: int  # EXSPEC: the longest run of steps it sat in the pool unscheduled
    choice: int = 0  # which of the prompt's n completions (SamplingParams.n) this is
    logprobs: list | None = None  # with SamplingParams.logprobs: a TokenLogprob per token of token_ids

    @classmethod
    def from_request(cls, r: Request, prompt: str | None, text: str | None) -> "RequestOutput":
        return cls(r.index, prompt, list(r.prompt_ids), list(r.output_ids), text, r.finish_reason,
                   list(r.accepted), list(r.step_ks), (r.finished_at or r.submitted_at) - r.submitted_at,
                   (r.first_token_at or r.submitted_at) - r.submitted_at, r.longest_wait_steps, r.choice,
                   None if r.logprobs is None else list(r.logprobs))

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' log-probabilities (None unless they were asked for)."""
        return None if self.logprobs is None else sum(e.logprob for e in self.logprobs)
