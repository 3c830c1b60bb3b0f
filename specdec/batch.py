"""The state shared by every strategy: the decoding context, and a batch of rows with their caches and
their device-resident row state.

Row i of a `Batch` runs `requests[i]`. Between steps, for every unfinished row with sequence s (prompt +
emitted tokens):
- `tokens[i, :len(s)]` holds s on the device and `seq_len[i] = len(s)` (what the next forward feeds is
  gathered from there: nothing is rebuilt from Python lists per step);
- the target cache holds s[:-1] (`length = len(s) - 1`): the last token, already emitted, is fed next;
- the draft cache holds a prefix s[:len(s) - lag] with lag >= 2 (2 after a speculative step, one more
  after each step that did not run the draft, k = 0; the whole sequence when the draft's prefill was
  deferred, see `DecodeContext.prefill_draft`). A feature draft (models/feature_draft.py) keeps only what it
  fed with the target's own features: lag >= 1 (a + 1 after a step that accepted a drafts), and
  `features[i, p]` holds the target's hidden state at position p for every p < len(s) - 1.
  A speculative step's first draft forward feeds the last T = max(lag) tokens of every row, re-writing the
  columns of tokens it already holds (identical K/V), so one uniform forward covers every row whatever its
  lag, and the draft is always in step even when all k drafts were accepted (the k-th draft is proposed but
  never fed through the draft).

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
from .options import EngineOptions, positions_needed
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
    proposer: object | None = None  # where drafts come from (specdec/proposers); None: AR, target only
    warned: set = field(default_factory=set)  # warnings already given in this run

    @property
    def k_max(self) -> int:
        """The most drafts a step may propose (0 without a proposer)."""
        return self.options.k_max if self.proposer is not None else 0

    @property
    def probs_dtype(self) -> torch.dtype:
        return probs_dtype(self.target.dtype) if hasattr(self.target, "dtype") else torch.float32

    @property
    def kernel_backend(self) -> str | None:
        return self.options.kernel_backend

    @property
    def feature_draft(self) -> bool:
        """Whether the draft reads the target's hidden states (docs/api.md, feature drafts)."""
        return getattr(self.draft, "reads_target_hidden", False)

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

    def __init__(self, requests: list[Request], target_cache, draft_cache, tokens, seq_len, params: RowParams,
                 features=None):
        self.requests = requests
        self.target_cache = target_cache
        self.draft_cache = draft_cache
        self.tokens = tokens  # [B, C] int64: row i's sequence at columns 0..seq_len[i]-1
        self.seq_len = seq_len  # [B] int64
        self.params = params
        self.features = features  # [B, C, E] the target's hidden state per position (feature drafts), or None

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

    def draft_accepted(self, seq_before: list[int], counts: list[int], num_accepted, replaced=None) -> None:
        """After a verification that accepted counts[i] drafts (num_accepted [B] on the device): the draft
        keeps the accepted drafts it has fed (all but the k-th), a lag of 2 behind the sequence. A feature
        draft fed its drafts with its own features, not the target's: it keeps only the sequence before the
        step (lag a + 1), and re-feeds the accepted tokens with the target's features next step. So does a
        row whose drafts came from elsewhere (`replaced`, host list of bools: a lookup's drafts): what the
        draft fed after the sequence was not what the row accepted."""
        before = self.target_cache.length - num_accepted  # [B] the sequence before the step, fed by the first forward
        if self.features is not None:
            self.draft_cache.set_rows(length=before, host_length=list(seq_before))
            return
        host = [s if r else s + a - 1 for s, a, r in zip(seq_before, counts, replaced or [False] * len(counts))]
        length = self.target_cache.length - 1  # [B]
        if replaced is not None and any(replaced):
            length = torch.where(torch.tensor(replaced, device=length.device), before, length)  # [B]
        self.draft_cache.set_rows(length=length, host_length=host)

    def last_positions(self, T: int, layout: str) -> torch.Tensor:
        """The positions of every row's last T tokens [B, T]; a row shorter than T is padded on the layout's
        side (left-padded: at the front, with position 0; ragged: at the back)."""
        j = torch.arange(T, device=self.tokens.device)  # [T]
        if layout == LEFT_PADDED:
            return (self.seq_len[:, None] - T + j).clamp(min=0)  # [B, T]
        return (self.seq_len - T).clamp(min=0)[:, None] + j  # [B, T]

    def last_tokens(self, T: int, layout: str) -> torch.Tensor:
        """The last T tokens of every row, gathered on the device: [B, T] int64 (padded as `last_positions`)."""
        return self.tokens.gather(1, self.last_positions(T, layout))

    def features_before(self, positions) -> torch.Tensor:
        """A feature draft's input for tokens at `positions` [B, T]: the target's hidden state at the
        position before each ([B, T, E]; zeros before position 0, and for left padding)."""
        E = self.features.shape[-1]
        before = positions - 1  # [B, T]
        gathered = self.features.gather(1, before.clamp(min=0)[..., None].expand(-1, -1, E))  # [B, T, E]
        return gathered.masked_fill((before < 0)[..., None], 0)

    def record_features(self, hidden) -> None:
        """Store the target's hidden states [B, T, E] of a step that fed positions seq_len - 1 .. seq_len + T - 2
        (before `append`); positions past what the step accepts are rewritten by a later step."""
        T, E = hidden.shape[1], hidden.shape[2]
        columns = self.seq_len[:, None] - 1 + torch.arange(T, device=hidden.device)  # [B, T]
        self.features.scatter_(1, columns[..., None].expand(-1, -1, E), hidden.to(self.features.dtype))

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
        if self.features is not None:
            self.features = self.features.index_select(0, index)  # [b, C, E]
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
        if self.features is not None:
            features = self.features.new_zeros(len(self), capacity, self.features.shape[2])  # [B, C', E]
            features[:, : self.features.shape[1]] = self.features
            self.features = features

    def extend(self, other: "Batch") -> None:
        """Append the rows of a freshly prefilled batch (same layout; its capacity is raised to ours)."""
        other.grow(self.capacity)
        self.grow(other.capacity)
        self.target_cache.append_rows(other.target_cache)
        if self.draft_cache is not None:
            self.draft_cache.append_rows(other.draft_cache)
        self.tokens = torch.cat([self.tokens, other.tokens])  # [B + b, C]
        self.seq_len = torch.cat([self.seq_len, other.seq_len])  # [B + b]
        if self.features is not None:
            self.features = torch.cat([self.features, other.features])  # [B + b, C, E]
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
        if self.features is not None:
            self.features[index, :width] = other.features
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

    target_cache = empty_cache(ctx.target)
    features = None
    if ctx.feature_draft:  # the target's hidden state at every prompt position, kept per position
        logits, hidden = ctx.target.forward(ids, target_cache, num_new=lengths, logits="last", hidden="all")
        features = hidden.new_zeros(len(requests), tokens.shape[1], hidden.shape[2])  # [B, C, E]
        for i, n in enumerate(lengths):
            features[i, :n] = hidden[i, width - n:] if layout == LEFT_PADDED else hidden[i, :n]
    else:
        logits = ctx.target.forward(ids, target_cache, num_new=lengths, logits="last")
    logits = logits[:, -1, : ctx.vocab_size]  # [B, V]
    ctx.metrics.target_forwards += 1
    batch = Batch(list(requests), target_cache, None, tokens.to(device),
                  torch.tensor(lengths, dtype=torch.int64, device=device), row_params(requests, device), features)
    if ctx.draft is not None:
        batch.draft_cache = empty_cache(ctx.draft)
    if ctx.draft is not None and ctx.prefill_draft:
        draft_input = {}
        if features is not None:  # each prompt token with the target's hidden state before it
            j = torch.arange(width, device=device)  # [W]
            shift = torch.tensor([width - n if layout == LEFT_PADDED else 0 for n in lengths], device=device)  # [B]
            draft_input["features"] = batch.features_before(j[None] - shift[:, None])  # [B, W, E]
        ctx.draft.forward(ids, batch.draft_cache, num_new=lengths, logits="last", **draft_input)
        ctx.metrics.draft_forwards += 1
        if features is None:
            # the draft lags by two tokens (see module docstring): the last prompt token is fed again next step
            batch.draft_cache.set_rows(length=batch.draft_cache.length - 1, host_length=[n - 1 for n in lengths])
    # else deferred: an empty draft cache, the whole sequence is its lag
    first = choose_tokens(logits, batch.params, ctx.probs_dtype, batch.seq_len, lengths, ctx.kernel_backend)  # [B]
    batch.append(first[:, None], torch.ones_like(first))
    readback = torch.stack([first, finite_rows(logits).to(torch.int64)], dim=1).tolist()  # the one sync
    commit_first_tokens(ctx, requests, readback, "prefill")
    ctx.metrics.first_tokens += len(requests)
    return batch


def required_capacity(requests: list[Request], k_max: int) -> int:
    """Columns a cache needs so that any of these requests runs to max_tokens with k_max drafts in flight."""
    return max(positions_needed(len(r.prompt_ids), r.params.max_tokens, k_max) for r in requests)


__all__ = ["Batch", "DecodeContext", "NonFiniteLogitsError", "LEFT_PADDED", "RAGGED", "finite_rows", "prefill",
           "required_capacity", "row_params"]
