"""The state shared by every strategy: the decoding context, and a batch of rows with their caches and
their device-resident row state.

Row i of a `Batch` runs `requests[i]`. Between steps, for every unfinished row with sequence s (prompt +
emitted tokens):
- `tokens[i, :len(s)]` holds s on the device and `seq_len[i] = len(s)` (what the next forward feeds is
  gathered from there: nothing is rebuilt from Python lists per step);
- the target cache holds s[:-1] (`length = len(s) - 1`): the last token, already emitted, is fed next;
- the draft cache holds a prefix s[:len(s) - lag] with lag >= 2 (`DRAFT_LAG` = 2 after a prefill or a
  speculative step, one more after each step that did not run the draft, k = 0; the whole sequence when the
  draft's prefill was deferred, see `DecodeContext.prefills_draft`). A feature draft (models/feature_draft.py)
  keeps only what it fed with the target's own features: lag >= 1 (a + 1 after a step that accepted a
  drafts), and `features[i, p]` holds the target's hidden state at position p for every p < len(s) - 1.
  The rule, in one place: `Batch.set_draft_lag`, called by every prefill and every draft model's step.
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
from .options import Options, positions_needed
from .request import Request
from .sampling import RowParams, probs_dtype


DRAFT_LAG = 2
"""Tokens a draft model's cache trails each row's sequence by after it drafted (`Batch.set_draft_lag`, the
rule's one home, says why)."""


class NonFiniteLogitsError(ValueError):
    """The target produced NaN/inf logits: its output would be garbage (docs/api.md, failure behaviour)."""


@dataclass
class DecodeContext:
    target: object  # model protocol: forward(input_ids, cache, num_new=None, logits=...), new_cache(...)
    draft: object | None
    options: Options
    vocab_size: int  # logits are cut to the shared vocabulary (embeddings may be padded)
    device: torch.device
    metrics: RunMetrics
    timer: PhaseTimer
    target_name: str = "target"
    chooser: object | None = None  # auto k: a `specdec.autok.KChooser`; None: fixed k
    proposer: object | None = None  # where drafts come from (specdec/proposers); None: AR, target only
    prefix_cache: object | None = None  # a `specdec.prefix_cache.PrefixCache` (shared by the LLM's engines), or None
    warned: set = field(default_factory=set)  # warnings already given in this run

    @property
    def k_max(self) -> int:
        """The most drafts a step may propose (0 without a proposer)."""
        return self.options.speculation.k_max if self.proposer is not None else 0

    @property
    def probs_dtype(self) -> torch.dtype:
        return probs_dtype(self.target.dtype) if hasattr(self.target, "dtype") else torch.float32

    @property
    def kernel_backend(self) -> str | None:
        return self.options.load.kernel_backend

    @property
    def feature_draft(self) -> bool:
        """Whether the draft reads the target's hidden states (docs/api.md, feature drafts)."""
        return getattr(self.draft, "reads_target_hidden", False)

    def prefills_draft(self, requests: list, joining: bool = True) -> bool:
        """Whether the prefill of `requests` fills their draft caches too. Always with a fixed k; with auto k
        only while the chooser is drafting, and, where the newcomers start a batch of their own (`joining`
        False: no row runs), only where drafting pays the draft's prefill back over their tokens
        (`KChooser.draft_prefill_pays`: a long prompt with a short answer does not). A row whose draft was not
        prefilled catches up on its whole sequence in its first draft forward (the lag mechanism above), which
        the chooser prices before it drafts; rows that join running ones get theirs at once, so that their lag
        never holds back the running rows' drafting."""
        if self.draft is None:
            return False
        if self.chooser is None:
            return True
        if not self.chooser.drafting:
            return False
        if joining:
            return True
        store = self.prefix_cache  # the draft's K/V it holds is copied in either way: the rest is the catch-up
        held = [store.peek(r.prompt_ids, self.feature_draft)[1] if store is not None else 0 for r in requests]
        catch_up = max(len(r.prompt_ids) - h for r, h in zip(requests, held)) + 1  # and the first token
        return self.chooser.draft_prefill_pays(requests, catch_up)

    def step_done(self, rows: int, started: float) -> None:
        """A step (of `rows` rows, begun at perf_counter() `started`) has ended, its postprocess included
        (`Engine.step` calls this after the commit and the scheduler's realignment or copy-back): its wall
        time feeds the auto-k cost model. The run's one device read waits for the forwards; a realignment
        after it is timed on the host (on a GPU its kernels may still be in flight)."""
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

    def __init__(self, requests: list[Request | None], target_cache, draft_cache, tokens, seq_len,
                 params: RowParams | None = None, features=None):
        self.requests = requests
        self.target_cache = target_cache
        self.draft_cache = draft_cache
        self.seq_len = seq_len  # [B] int64
        self.params = params  # [B] RowParams; None for a storage with empty rows (exspec's pool)
        self._tokens_all, self._features_all = tokens, features  # storage of `reserved_rows` rows
        # tokens [B, C] int64: row i's sequence at columns 0..seq_len[i]-1; features [B, C, E]: the target's
        # hidden state per position (feature drafts), or None
        self._use_rows(tokens.shape[0])

    def __len__(self) -> int:
        return len(self.requests)

    def _rows_changed(self) -> None:
        """The rows' sampling parameters on the device, rebuilt when rows come and go (None while a row is
        empty: a pool's free slot)."""
        full = all(r is not None for r in self.requests)
        self.params = row_params(self.requests, self.tokens.device) if full else None

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

    def set_draft_lag(self, fed, host_fed: list[int], replaced: list[bool] | None = None) -> None:
        """The draft's lag rule, in one place: what the draft cache keeps of each row after a forward that fed
        it, a prefill's (`fed`: the prompt) or a speculative step's (`fed`: the sequence before the step, which
        its first draft forward fed). `fed` [B] on the device, `host_fed` its host list; the target cache
        already holds each row's sequence but its last token.

        - A draft model keeps the sequence but its last `DRAFT_LAG` (2) tokens: one token less than the
          target. After a step, that is the accepted drafts it fed (all but the k-th, which it proposed but
          never fed) whatever the row accepted; after a prefill, the prompt but its last token. So every row
          lags the same, and the next step's first draft forward feeds 2 tokens per row (`rewind_draft`).
        - A feature draft keeps `fed`: only what it fed with the target's own hidden states (it drafts with its
          own), lag 1 after a prefill and a + 1 after a step that accepted a drafts; the accepted tokens are
          re-fed with the target's features next step. So does a row whose drafts came from elsewhere
          (`replaced`, host list of bools: a lookup's, proposers/combined.py): what the draft fed after
          `fed` is not what the row accepted."""
        if self.features is not None:
            self.draft_cache.set_rows(length=fed, host_length=list(host_fed))
            return
        target = self.target_cache
        length = target.length + 1 - DRAFT_LAG  # [B] the sequence (the target's length + 1) less the lag
        host = [n + 1 - DRAFT_LAG for n in target.host_length]
        if replaced is not None and any(replaced):
            length = torch.where(torch.tensor(replaced, device=length.device), fed, length)  # [B]
            host = [f if r else n for f, n, r in zip(host_fed, host, replaced)]
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

    def right_align(self) -> None:
        """Left-padded layout: right-align the unfinished rows at the longest one's edge, in both caches
        (invariant I6; `KVCache.right_align`). Finished rows stay until the scheduler refills or removes them."""
        live = [not r.finished for r in self.requests]
        self.target_cache.right_align(live, self.draft_cache)

    # ---------------------------------------------------------------------------------------- rows
    # Like the caches (models/cache.py), `tokens` and `features` are views of the first B rows of a storage
    # with `reserved_rows` slots: a row joins or leaves by copying that row alone.
    @property
    def reserved_rows(self) -> int:
        return self._tokens_all.shape[0]

    def _use_rows(self, rows: int) -> None:
        self.tokens = self._tokens_all[:rows]  # [B, C]
        self.features = None if self._features_all is None else self._features_all[:rows]  # [B, C, E]

    def _restore(self, rows: int, capacity: int) -> None:
        """New zero storage of `rows` slots and `capacity` columns holding the rows in use (one copy)."""
        B, C = self.tokens.shape
        self._tokens_all = self.tokens.new_zeros(rows, capacity)  # [R, C']
        self._tokens_all[:B, :C] = self.tokens
        if self.features is not None:
            features = self.features.new_zeros(rows, capacity, self.features.shape[2])  # [R, C', E]
            features[:B, :C] = self.features
            self._features_all = features
        self._use_rows(B)

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows, so that admitting up to that many copies no other row (copies the rows in
        use once, if the storage grows)."""
        if rows <= self.reserved_rows:
            return
        for cache in self.caches():
            cache.reserve_rows(rows)
        self._restore(rows, self.tokens.shape[1])

    def grow(self, capacity: int) -> None:
        """Room for `capacity` columns per row in the caches and the device sequences."""
        if capacity <= self.capacity:
            return
        for cache in self.caches():
            cache.grow(capacity)
        self._restore(self.reserved_rows, capacity)

    def _take(self, order: list[int]) -> None:
        """Row i takes row order[i] (i < len(order)), the rest are released; only rows that move are copied
        (`KVCache.take_rows`: a row moves only into a row that `order` drops)."""
        for cache in self.caches():
            cache.take_rows(order)
        for i, j in enumerate(order):
            if i != j:
                n = self.requests[j].sequence_length
                self.tokens[i, :n].copy_(self.tokens[j, :n])  # [n]
                if self.features is not None:
                    self.features[i, :n].copy_(self.features[j, :n])  # [n, E]
        index = torch.tensor(order, dtype=torch.int64, device=self.tokens.device)  # [b]
        self.seq_len = self.seq_len.index_select(0, index)  # [b]
        self.requests = [self.requests[j] for j in order]
        self._use_rows(len(order))
        self._rows_changed()

    def load(self, slots: list[int], other: "Batch", starts: list[int] | None = None) -> None:
        """Put the rows of a freshly prefilled batch into `slots` (rows of this batch, each overwritten; a
        slot may be `len(self)`.. up to `reserved_rows`, adding rows). `starts`: the column each row's
        caches start at (left-padded layout; default: as in `other`). Copies those rows only."""
        if not slots:
            return
        self.add_rows(max(max(slots) + 1, len(self)) - len(self))
        if self.features is None and other.features is not None:  # the first rows with features
            E = other.features.shape[2]
            self._features_all = other.features.new_zeros(self.reserved_rows, self.tokens.shape[1], E)  # [R, C, E]
            self._use_rows(len(self))
        self.target_cache.load_rows(slots, other.target_cache, starts)
        if self.draft_cache is not None:
            self.draft_cache.load_rows(slots, other.draft_cache, starts)
        index = torch.tensor(slots, dtype=torch.int64, device=self.tokens.device)  # [b]
        for i, (slot, request) in enumerate(zip(slots, other.requests)):
            n = request.sequence_length
            self.tokens[slot, :n].copy_(other.tokens[i, :n])  # [n]
            if self.features is not None:
                self.features[slot, :n].copy_(other.features[i, :n])  # [n, E]
            self.requests[slot] = request
        self.seq_len = self.seq_len.index_copy(0, index, other.seq_len)  # [B]
        self._rows_changed()

    def relayout(self, ctx: "DecodeContext", layout: str) -> None:
        """Move a freshly prefilled batch's rows into new caches of `layout` (same capacity): left-padded,
        every row ends at the longest row's edge, target and draft rows at one start. One copy of each row's
        cached columns; the sequences and features stay (they are logical)."""
        if self.target_cache.layout == layout:
            return
        edge = max(self.target_cache.host_length, default=0)
        starts = [edge - n for n in self.target_cache.host_length] if layout == LEFT_PADDED else [0] * len(self)
        if starts == self.target_cache.host_start:  # already there (one row, or rows of one length)
            for cache in self.caches():
                cache.layout = layout
            return
        rows = list(range(len(self)))
        for name, model in (("target_cache", ctx.target), ("draft_cache", ctx.draft)):
            old = getattr(self, name)
            if old is None:
                continue
            new = ctx.new_cache(model, len(self), old.capacity, layout)
            new.load_rows(rows, old, starts)
            setattr(self, name, new)

    def add_rows(self, count: int) -> None:
        """`count` empty rows (request None, empty caches) after the existing ones, for `load` to fill."""
        if count <= 0:
            return
        rows = len(self) + count
        self.reserve(rows)
        for cache in self.caches():
            cache.resize_rows(rows)
        self.seq_len = torch.cat([self.seq_len, self.seq_len.new_zeros(count)])  # [rows]
        self.requests = self.requests + [None] * count
        self._use_rows(rows)
        self._rows_changed()

    def extend(self, other: "Batch", starts: list[int] | None = None) -> None:
        """Append the rows of a freshly prefilled batch (same layout) after this batch's rows (`load`; the
        caller has grown the batch to the columns they need)."""
        self.load(list(range(len(self), len(self) + len(other))), other, starts)

    def drop_finished(self) -> list[Request]:
        """Remove the finished rows, moving the last unfinished rows into their places (each moved row is
        copied once; no other row moves). Returns the requests dropped."""
        done = [r for r in self.requests if r.finished]
        if done:
            live = [i for i, r in enumerate(self.requests) if not r.finished]
            n = len(live)
            order = list(range(n))
            holes = [i for i in range(n) if self.requests[i].finished]
            for hole, row in zip(holes, [i for i in live if i >= n]):
                order[hole] = row
            self._take(order)
        return done


def row_params(requests: list[Request], device) -> RowParams:
    return RowParams.of([r.params for r in requests], [r.seed for r in requests], device)


def required_capacity(requests: list[Request], k_max: int) -> int:
    """Columns a cache needs so that any of these requests runs to max_tokens with k_max drafts in flight."""
    return max(positions_needed(len(r.prompt_ids), r.params.max_tokens, k_max) for r in requests)


__all__ = ["Batch", "DecodeContext", "DRAFT_LAG", "NonFiniteLogitsError", "LEFT_PADDED", "RAGGED", "finite_rows",
           "required_capacity", "row_params"]
