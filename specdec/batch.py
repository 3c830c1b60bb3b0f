"""The state shared by every strategy: the decoding context, and a batch of rows with their caches and
their device-resident row state.

Row i of a `Batch` runs `requests[i]`. Between steps, for every unfinished row with sequence s (prompt +
emitted tokens):
- `tokens[i, :len(s)]` holds s on the device and `seq_len[i] = len(s)` (what the next forward feeds is
  gathered from there: nothing is rebuilt from Python lists per step);
- the target cache holds s[:-1] (`length = len(s) - 1`): the last token, already emitted, is fed next;
- the draft cache holds a prefix s[:len(s) - lag] with lag >= 2 (2 after a speculative step, one more
  after each step that did not run the draft, k = 0; the whole sequence when the draft's prefill was
  deferred, see `DecodeContext.prefill_draft`). A speculative step's first draft forward feeds the last
  T = max(lag) tokens of every row, re-writing the columns of tokens it already holds (identical K/V),
  so one uniform forward covers every row whatever its lag, and the draft is always in step even when
  all k drafts were accepted (the k-th draft is proposed but never fed through the draft).

The host mirrors what it needs to plan a step -- the rows' sequence lengths (from the requests), cache
lengths and starts (`KVCache.host_*`), which rows are greedy -- so a step never reads the device to plan
the next forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.models.cache import LEFT_PADDED, RAGGED

from .metrics import PhaseTimer, RunMetrics
from .options import EngineOptions
from .request import Request
from .sampling import RowParams, choose_tokens, probs_dtype


class NonFiniteLogitsError(ValueError):
    """The target produced NaN/inf logits: its output would be garbage (docs/api.md, failure behaviour)."""


@dataclass
class DecodeContext:
    target: object  # model protocol: forward(input_ids, cache, num_new=None, logits=...), new_cache(...)
    draft: object | None
    options: EngineOptions
    vocab_size: int  # logits are cut to the shared vocabulary (embeddings may be padded)
    device: torch.device
    metrics: RunMetrics
    timer: PhaseTimer
    target_name: str = "target"
    chooser: object | None = None  # auto k: a `specdec.autok.KChooser`; None: fixed k
    warned: set = field(default_factory=set)  # warnings already given in this run

    @property
    def k_max(self) -> int:
        """The most drafts a step may propose (0 without a draft)."""
        return self.options.k_max if self.draft is not None else 0

    @property
    def probs_dtype(self) -> torch.dtype:
        return probs_dtype(self.target.dtype) if hasattr(self.target, "dtype") else torch.float32

    @property
    def kernel_backend(self) -> str | None:
        return self.options.kernel_backend

    @property
    def prefill_draft(self) -> bool:
        """Whether a prefill fills the new rows' draft caches too. Always with a fixed k; with auto k only
        while the chooser is drafting: a run that stays at k = 0 never runs the draft, and one that starts
        drafting later has the draft catch up on each row's whole sequence in its first draft forward
        (the lag mechanism above), which the chooser prices before it decides."""
        return self.chooser is None or self.chooser.drafting

    def step_done(self, rows: int, started: float) -> None:
        """A strategy's step (of `rows` rows, begun at perf_counter() `started`) has ended: its wall time
        feeds the auto-k cost model. Every step ends with a read of the device, so the time is complete."""
        if self.chooser is not None:
            seconds = time.perf_counter() - started
            self.metrics.predicted_step_s += self.chooser.observe(seconds)
            self.metrics.measured_step_s += seconds

    def new_cache(self, model, batch_size: int, capacity: int, layout: str):
        cache = model.new_cache(batch_size, capacity, layout)
        cache.backend = self.kernel_backend
        return cache

    def raise_non_finite(self, request: Request, where: str) -> None:
        raise NonFiniteLogitsError(
            f"{self.target_name} produced non-finite logits (NaN or inf) for request {request.index} at "
            f"{where} (after {len(request.output_ids)} generated tokens); check the checkpoint's weights "
            f"(--check-weights) and the dtype")


def finite_rows(logits) -> torch.Tensor:
    """[B] bool: every logit of the row ([B, V] or [B, T, V]) is finite."""
    return torch.isfinite(logits).flatten(1).all(dim=1)


class Batch:
    """Rows decoded together: requests, the target's (and the draft's) KV cache of the same row order,
    and the device row state (`tokens`, `seq_len`, `params`)."""

    def __init__(self, requests: list[Request], target_cache, draft_cache, tokens, seq_len, params: RowParams):
        self.requests = requests
        self.target_cache = target_cache
        self.draft_cache = draft_cache
        self.tokens = tokens  # [B, C] int64: row i's sequence at columns 0..seq_len[i]-1
        self.seq_len = seq_len  # [B] int64
        self.params = params

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def host_seq_len(self) -> list[int]:
        return [r.sequence_length for r in self.requests]

    def caches(self):
        return [c for c in (self.target_cache, self.draft_cache) if c is not None]

    @property
    def capacity(self) -> int:
        return self.target_cache.capacity

    # ------------------------------------------------------------------------------ the draft's lag
    def draft_lag(self) -> tuple[int, list[int]]:
        """T, the tokens every row feeds in the next draft forward (the largest lag: sequence length minus
        draft cache length), and the real tokens per row, min(T, len(sequence)) (a row shorter than T feeds
        its whole sequence, padded)."""
        seq = self.host_seq_len
        T = max(s - n for s, n in zip(seq, self.draft_cache.host_length))
        return T, [min(T, s) for s in seq]

    def rewind_draft(self) -> tuple[int, list[int]]:
        """Rewind each row's draft cache so that the next draft forward re-feeds the last T tokens (the
        ones it holds rewrite identical K/V): one uniform forward whatever the rows' lags. Returns
        `draft_lag()`."""
        T, fed = self.draft_lag()
        seq = self.host_seq_len
        self.draft_cache.set_rows(length=(self.seq_len - T).clamp(min=0), host_length=[s - f for s, f in zip(seq, fed)])
        return T, fed

    def draft_accepted(self, seq_before: list[int], counts: list[int]) -> None:
        """After a verification that accepted counts[i] drafts: the draft keeps the accepted drafts it has
        fed (all but the k-th), a lag of 2 behind the sequence."""
        self.draft_cache.set_rows(length=self.target_cache.length - 1,
                                  host_length=[s + a - 1 for s, a in zip(seq_before, counts)])

    def last_tokens(self, T: int, layout: str) -> torch.Tensor:
        """The last T tokens of every row, gathered on the device: [B, T] int64. A row shorter than T is
        padded on the layout's side (left-padded: at the front; ragged: at the back)."""
        j = torch.arange(T, device=self.tokens.device)  # [T]
        if layout == LEFT_PADDED:
            index = (self.seq_len[:, None] - T + j).clamp(min=0)  # [B, T]
        else:
            index = (self.seq_len - T).clamp(min=0)[:, None] + j  # [B, T]
        return self.tokens.gather(1, index)

    def append(self, emitted, count) -> None:
        """Append emitted tokens [B, n] (only the first `count` [B] of each row are real; -1 placeholders
        after them) to the device sequences."""
        n = emitted.shape[1]
        columns = self.seq_len[:, None] + torch.arange(n, device=self.tokens.device)  # [B, n]
        self.tokens.scatter_(1, columns, emitted.clamp(min=0))  # placeholders land past the end: unread
        self.seq_len = self.seq_len + count

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.int64, device=self.tokens.device)  # [b]
        for cache in self.caches():
            cache.keep_rows(rows)
        self.tokens = self.tokens.index_select(0, index)
        self.seq_len = self.seq_len.index_select(0, index)
        self.requests = [self.requests[i] for i in rows]
        self.params = row_params(self.requests, self.tokens.device)

    def grow(self, capacity: int) -> None:
        """Room for `capacity` columns per row in the caches and the device sequences."""
        if capacity <= self.capacity:
            return
        for cache in self.caches():
            cache.grow(capacity)
        tokens = torch.zeros(len(self), capacity, dtype=self.tokens.dtype, device=self.tokens.device)  # [B, C']
        tokens[:, : self.tokens.shape[1]] = self.tokens
        self.tokens = tokens

    def extend(self, other: "Batch") -> None:
        """Append the rows of a freshly prefilled batch (same layout; its capacity is raised to ours)."""
        other.grow(self.capacity)
        self.grow(other.capacity)
        self.target_cache.append_rows(other.target_cache)
        if self.draft_cache is not None:
            self.draft_cache.append_rows(other.draft_cache)
        self.tokens = torch.cat([self.tokens, other.tokens])  # [B + b, C]
        self.seq_len = torch.cat([self.seq_len, other.seq_len])  # [B + b]
        self.requests = self.requests + other.requests
        self.params = row_params(self.requests, self.tokens.device)

    def load(self, slots: list[int], other: "Batch") -> None:
        """Put the rows of a freshly prefilled batch into `slots` (continuous batching)."""
        self.target_cache.load_rows(slots, other.target_cache)
        if self.draft_cache is not None:
            self.draft_cache.load_rows(slots, other.draft_cache)
        index = torch.tensor(slots, dtype=torch.int64, device=self.tokens.device)  # [b]
        width = other.tokens.shape[1]
        self.tokens[index, :width] = other.tokens
        self.seq_len[index] = other.seq_len
        for slot, request in zip(slots, other.requests):
            self.requests[slot] = request
        self.params = row_params(self.requests, self.tokens.device)

    def drop_finished(self) -> list[Request]:
        """Compact away finished rows; returns the requests dropped."""
        done = [r for r in self.requests if r.finished]
        if done:
            self.keep([i for i, r in enumerate(self.requests) if not r.finished])
        return done


def row_params(requests: list[Request], device) -> RowParams:
    return RowParams.of([r.params for r in requests], [r.seed for r in requests], device)


def commit_first_tokens(ctx: DecodeContext, requests: list[Request], readback: list[list[int]], where: str) -> None:
    """Commit each row's token from a readback of [token, finite] rows."""
    for r, (token, finite) in zip(requests, readback):
        if not finite:
            ctx.raise_non_finite(r, where)
        kept = r.commit([token])
        ctx.metrics.generated_tokens += kept


def prefill(ctx: DecodeContext, requests: list[Request], layout: str, capacity: int) -> Batch:
    """Prefill prompts (padded on the layout's side), emit each row's first token from the target."""
    device = ctx.device
    lengths = [len(r.prompt_ids) for r in requests]
    width = max(lengths)
    ids = torch.zeros(len(requests), width, dtype=torch.int64)  # [B, W], 0 = padding (never attended)
    tokens = torch.zeros(len(requests), max(capacity, width + 1), dtype=torch.int64)  # [B, C] the rows' sequences
    for i, r in enumerate(requests):
        prompt = torch.tensor(r.prompt_ids)
        tokens[i, : lengths[i]] = prompt
        if layout == LEFT_PADDED:
            ids[i, width - lengths[i]:] = prompt
        else:
            ids[i, : lengths[i]] = prompt
    ids = ids.to(device)

    def empty_cache(model):
        cache = ctx.new_cache(model, len(requests), capacity, layout)
        cache.set_prefill(lengths, width)
        return cache

    def run(model):
        cache = empty_cache(model)
        logits = model.forward(ids, cache, num_new=lengths, logits="last")[:, -1, : ctx.vocab_size]  # [B, V]
        return cache, logits

    target_cache, logits = run(ctx.target)
    ctx.metrics.target_forwards += 1
    draft_cache = None
    if ctx.draft is not None and ctx.prefill_draft:
        draft_cache, _ = run(ctx.draft)
        # the draft lags by two tokens (see module docstring): the last prompt token is fed again next step
        draft_cache.set_rows(length=draft_cache.length - 1, host_length=[n - 1 for n in lengths])
        ctx.metrics.draft_forwards += 1
    elif ctx.draft is not None:  # deferred: an empty draft cache, the whole sequence is its lag
        draft_cache = empty_cache(ctx.draft)
    batch = Batch(list(requests), target_cache, draft_cache, tokens.to(device),
                  torch.tensor(lengths, dtype=torch.int64, device=device), row_params(requests, device))
    first = choose_tokens(logits, batch.params, ctx.probs_dtype, batch.seq_len, lengths, ctx.kernel_backend)  # [B]
    batch.append(first[:, None], torch.ones_like(first))
    readback = torch.stack([first, finite_rows(logits).to(torch.int64)], dim=1).tolist()  # the one sync
    commit_first_tokens(ctx, requests, readback, "prefill")
    ctx.metrics.first_tokens += len(requests)
    return batch


def required_capacity(requests: list[Request], k_max: int) -> int:
    """Columns a cache needs so that any of these requests runs to max_tokens with k_max drafts in flight."""
    return max(len(r.prompt_ids) + r.params.max_tokens for r in requests) + k_max + 1


__all__ = ["Batch", "DecodeContext", "NonFiniteLogitsError", "LEFT_PADDED", "RAGGED", "finite_rows", "prefill",
           "required_capacity", "row_params"]
