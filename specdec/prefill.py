"""The prefill, one for every method (ar, eqspec, ragged, exspec), with or without the prefix cache, whole or
in chunks (docs/design.md, "Admitting a request"): newcomers' prompts through the target (and the draft), and
each request's first token from the target. Like a decoding step (specdec/speculative.py) it ends with one
read of the device and returns what each row emitted (a `StepOutput`), uncommitted.

`PromptRows` holds the rows of the prompts being prefilled: the target's cache (and the draft's, and the
target's hidden states for a feature draft), each row's prompt and how much of it each model holds. It begins
with each prompt's cached prefix (`PrefixCache.fetch`: one slice copy per tree node and cache, never the
whole prompt), and `feed` runs the rest through the target and the draft, all of it at once or at most
`limit` tokens per row; the forward already takes a cache that holds a prefix (positions and columns come
from each row's start and length). `finish` sets the draft's lag (`Batch.set_draft_lag`), stores the prompts
in the prefix cache, copies each prompt's row into the rows of the requests that asked for it (the n choices
of one prompt share one prefill, with a prefix cache or in chunks) and emits every request's first token.

- `prefill`: the newcomers' prompts fed at once, one forward per model. With a prefix cache the rows are
  ragged (a row that holds a cached prefix is fed the rest) and `finish` moves them to the batch's layout;
  without one, each request has its own row, written in the batch's layout (left-padded: every row ends at
  the longest prompt's column).
- `ChunkedPrefill`: one prompt longer than the chunk (`LLM(prefill_chunk=...)`, `--prefill-chunk`), fed a chunk
  per engine step while the running rows keep decoding; its requests join the batch after the last chunk,
  which emits their first tokens.

The draft: with a fixed k (or while auto k drafts) the draft is fed along with the target, chunk by chunk
(a feature draft after the target, from the hidden states the target just produced), then keeps what the lag
rule says. With auto k not drafting, the draft gets only the prefix the cache holds for it, and catches up
later like any lagging draft. What the cache holds for the draft is only what the draft computed.
"""
from __future__ import annotations

import torch

from .batch import LEFT_PADDED, RAGGED, Batch, DecodeContext, finite_rows, row_params
from .commit import StepOutput, commit
from .logprobs import StepLogprobs, read_back
from .request import Request
from .sampling import choose_tokens


class PromptRows:
    """Rows of prompts in caches of `capacity` columns (at least what the feeding needs) in `layout`, each
    beginning with its cached prefix. Left-padded only for rows fed whole with nothing cached (a left-padded
    row that holds tokens cannot be fed fewer than the others)."""

    def __init__(self, ctx: DecodeContext, prompts: list[list[int]], capacity: int, layout: str = RAGGED,
                 run_draft: bool = True):
        self.ctx = ctx
        self.prompts = prompts
        self.lengths = [len(p) for p in prompts]
        self.run_draft = ctx.draft is not None and run_draft  # the draft's caches filled too (DecodeContext.prefills_draft)
        store, device = ctx.prefix_cache, ctx.device
        U = len(prompts)
        # columns: a row's prefix plus the longest feed of any row (ragged padding is written past a row's end)
        cached = [store.peek(p, ctx.feature_draft) if store is not None else (0, 0) for p in prompts]
        C = max(capacity, max(self.lengths) + 1)
        if U > 1:
            for which in (0, 1) if self.run_draft else (0,):
                starts = [c[which] for c in cached]
                C = max(C, max(starts) + max(n - s for n, s in zip(self.lengths, starts)) + 1)
        tokens = torch.zeros(U, C, dtype=torch.int64)  # [U, C]
        for u, p in enumerate(prompts):
            tokens[u, :len(p)] = torch.tensor(p)
        target = ctx.new_cache(ctx.target, U, C, layout)
        draft = ctx.new_cache(ctx.draft, U, C, layout) if ctx.draft is not None else None
        for cache in (target, draft):  # empty rows (left-padded: ending at the longest prompt's column)
            if cache is not None:
                cache.set_prefill(self.lengths, max(self.lengths))
        features = None
        if ctx.feature_draft:
            features = torch.zeros(U, C, ctx.target.cfg.hidden_size, dtype=ctx.target.dtype, device=device)  # [U, C, E]
        self.rows = Batch([None] * U, target, draft, tokens.to(device),
                          torch.tensor(self.lengths, dtype=torch.int64, device=device), None, features)
        self.done, self.draft_done = [0] * U, [0] * U  # tokens each model's row holds
        if store is not None:
            for u, p in enumerate(prompts):
                self.done[u], self.draft_done[u] = store.fetch(p, target, u, draft, features)
            ctx.metrics.prefix_hit_tokens += sum(self.done)
            ctx.metrics.prefix_queried_tokens += sum(self.lengths)
            for cache, held in ((target, self.done), (draft, self.draft_done)):
                if cache is not None:
                    cache.set_rows(length=torch.tensor(held, dtype=torch.int64, device=device), host_length=list(held))

    @property
    def remaining(self) -> int:
        """Prompt tokens the target has yet to be fed (the most of any row)."""
        return max(n - d for n, d in zip(self.lengths, self.done))

    def _ids(self, starts: list[int], ends: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """Each row's prompt tokens starts[u]..ends[u], padded on the layout's side: [U, T] on the device, the
        counts, and each row's padding before its tokens (left-padded rows only)."""
        new = [e - s for s, e in zip(starts, ends)]
        T = max(new)
        pads = [T - n if self.rows.target_cache.left_padded else 0 for n in new]
        ids = torch.zeros(len(new), T, dtype=torch.int64)  # [U, T], 0 = padding (never attended)
        for u, (p, s, e, pad) in enumerate(zip(self.prompts, starts, ends, pads)):
            ids[u, pad:pad + e - s] = torch.tensor(p[s:e])
        return ids.to(self.ctx.device), new, pads

    def feed(self, limit: int | None = None) -> torch.Tensor:
        """Feed every row's next tokens (all the rest, or at most `limit`) through the target, and the draft
        (when it runs) up to the same token. Returns the target's logits at each row's last fed token [U, V]."""
        ctx, rows = self.ctx, self.rows
        ends = [n if limit is None else min(n, d + limit) for n, d in zip(self.lengths, self.done)]
        ids, new, pads = self._ids(self.done, ends)  # [U, T]
        if min(new) < 1:
            raise AssertionError(f"prefill: a row has nothing to feed ({new})")
        if rows.features is not None:  # the target's hidden state at every fed position, kept per position
            logits, hidden = ctx.target.forward(ids, rows.target_cache, num_new=new, logits="last", hidden="all")
            for u, (d, n, pad) in enumerate(zip(self.done, new, pads)):
                rows.features[u, d:d + n] = hidden[u, pad:pad + n]  # [n, E]
        else:
            logits = ctx.target.forward(ids, rows.target_cache, num_new=new, logits="last")
        ctx.metrics.target_forwards += 1
        self.done = ends
        if self.run_draft and any(e > d for e, d in zip(ends, self.draft_done)):
            starts = list(self.draft_done)  # a draft behind the target (less of it cached) catches up here
            ids_d, new_d, pads_d = self._ids(starts, ends)  # [U, T]
            draft_input = {}
            if rows.features is not None:  # each token with the target's hidden state before it
                j = torch.arange(ids_d.shape[1], device=ctx.device)  # [T]
                first = [s - pad for s, pad in zip(starts, pads_d)]  # each row's position at column 0
                positions = torch.tensor(first, device=ctx.device)[:, None] + j  # [U, T]
                draft_input["features"] = rows.features_before(positions)  # [U, T, E]
            ctx.draft.forward(ids_d, rows.draft_cache, num_new=new_d, logits="last", **draft_input)
            ctx.metrics.draft_forwards += 1
            self.draft_done = list(ends)
        return logits[:, -1, : ctx.vocab_size]  # [U, V]

    def finish(self, logits, requests: list[Request], index: list[int], layout: str) -> tuple[Batch, StepOutput]:
        """After the last feed (`logits` [U, V]): set the draft's lag, store the prompts in the prefix cache,
        give request i the row of prompt index[i], emit every request's first token. Returns the batch (in
        `layout`) and its first tokens, uncommitted."""
        ctx, rows = self.ctx, self.rows
        if self.run_draft:
            draft = rows.draft_cache
            rows.set_draft_lag(draft.length, draft.host_length)  # it fed every prompt
        store = ctx.prefix_cache
        if store is not None:
            for u, p in enumerate(self.prompts):
                store.store_row(p, rows.target_cache, u, rows.draft_cache, rows.features)
        device = ctx.device
        target, draft, tokens, features = rows.target_cache, rows.draft_cache, rows.tokens, rows.features
        if index != list(range(len(self.prompts))):  # a prompt asked by several requests: copy its row
            which = torch.tensor(index, dtype=torch.int64, device=device)  # [B]
            target = target.select_rows(index)
            draft = draft.select_rows(index) if draft is not None else None
            tokens = tokens.index_select(0, which)
            features = features.index_select(0, which) if features is not None else None
            logits = logits.index_select(0, which)
        lengths = [len(r.prompt_ids) for r in requests]
        batch = Batch(list(requests), target, draft, tokens,
                      torch.tensor(lengths, dtype=torch.int64, device=device), row_params(requests, device), features)
        if layout == LEFT_PADDED:
            batch.relayout(ctx, LEFT_PADDED)
        return batch, first_tokens(ctx, batch, logits, lengths)


def first_tokens(ctx: DecodeContext, batch: Batch, logits, lengths: list[int]) -> StepOutput:
    """Each row's first token from the prefill's last logits [B, V] (appended to the batch's sequences),
    read back with the one sync of a prefill; uncommitted."""
    first = choose_tokens(logits, batch.params, ctx.probs_dtype, batch.seq_len, lengths, ctx.kernel_backend)  # [B]
    batch.append(first[:, None], torch.ones_like(first))
    logprobs = StepLogprobs.of(logits, batch.params, ctx.probs_dtype)  # None unless some row asks
    readback, values = read_back(torch.stack([first, finite_rows(logits).to(torch.int64)], dim=1), logprobs,
                                 first)  # the one sync
    tokens = [[token] for token, _ in readback]
    return StepOutput(tokens, [bool(f) for _, f in readback], "prefill",
                      logprobs=logprobs.parse(values, tokens, batch.params.host_logprobs) if logprobs else None)


def distinct_prompts(requests: list[Request]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts of `requests`, in order, and each request's index into them."""
    seen: dict[tuple, int] = {}
    index = [seen.setdefault(tuple(r.prompt_ids), len(seen)) for r in requests]
    return [list(p) for p in seen], index


def prefill(ctx: DecodeContext, requests: list[Request], layout: str, capacity: int,
            joining: bool = True) -> tuple[Batch, StepOutput]:
    """Prefill the newcomers' prompts at once into caches of `capacity` columns (at least what they need) and
    emit each request's first token from the target; their drafts' too where `ctx.prefills_draft` says
    (`joining`: they join running rows). Returns the batch (in `layout`) and its first tokens,
    uncommitted (the caller commits them: specdec/commit.py). With a prefix cache, each distinct prompt's
    cached prefix is copied in, the rest fed, and the prompt's row copied to every request that asked for it.
    Without one, each request is fed in its own row: sharing a row would change the forward's shape (and,
    unless the models are batch-invariant, the last bits of its results)."""
    run_draft = ctx.prefills_draft(requests, joining)
    if ctx.prefix_cache is None:
        rows = PromptRows(ctx, [r.prompt_ids for r in requests], capacity, layout, run_draft)
        index = list(range(len(requests)))
    else:
        prompts, index = distinct_prompts(requests)
        rows = PromptRows(ctx, prompts, capacity, run_draft=run_draft)
    return rows.finish(rows.feed(), requests, index, layout)


def store_finished(ctx: DecodeContext, batch: Batch, rows=None) -> None:
    """Prefix cache: store the K/V of each finished row's sequence (prompt and output) that was not stored
    yet, before its row is reused (`rows`: the row indices to look at, default every row)."""
    store = ctx.prefix_cache
    if store is None or batch is None:
        return
    for i in range(len(batch.requests)) if rows is None else rows:
        r = batch.requests[i]
        if r is not None and r.finished and not r.prefix_stored:
            r.prefix_stored = True
            store.store_row(r.prompt_ids + r.output_ids, batch.target_cache, i, batch.draft_cache, batch.features)


def uncached_tokens(ctx: DecodeContext, request: Request) -> int:
    """The prompt tokens a prefill of `request` would feed (those the prefix cache does not hold)."""
    store = ctx.prefix_cache
    n = len(request.prompt_ids)
    return n if store is None else n - store.peek(request.prompt_ids, ctx.feature_draft)[0]


class Budget:
    """The prompt tokens a step's admissions may still prefill (chunked prefill); None: no bound."""

    def __init__(self, tokens: int | None):
        self.left, self.spent = tokens, False

    def take(self, tokens: int) -> bool:
        """Whether `tokens` more fit (the first admission of a step always does); counts them if so."""
        if self.left is None:
            return True
        if tokens > self.left and self.spent:
            return False
        self.left, self.spent = self.left - tokens, True
        return True


def take_waiting(ctx: DecodeContext, waiting, n: int, budget: Budget) -> list[Request]:
    """Up to n waiting requests to prefill now, in arrival order, removed from `waiting` (a deque). With
    chunked prefill: only those whose uncached prompt fits in a chunk (longer ones stay: a `ChunkedPrefill`
    takes them), within the step's budget (a prompt shared with one already taken costs nothing)."""
    chunk = ctx.options.scheduler.prefill_chunk
    if chunk is None:
        return [waiting.popleft() for _ in range(min(n, len(waiting)))]
    chosen, seen = [], set()
    for r in list(waiting):
        if len(chosen) >= n:
            break
        key = tuple(r.prompt_ids)
        new = 0 if key in seen else uncached_tokens(ctx, r)
        if new > chunk:
            continue
        if not budget.take(new):
            break
        chosen.append(r)
        seen.add(key)
    for r in chosen:
        waiting.remove(r)
    return chosen


def take_long(ctx: DecodeContext, waiting, rows: int) -> list[Request]:
    """The first waiting request whose uncached prompt is longer than a chunk, with the other choices of
    its request (one prefill serves them), removed from `waiting` -- if they fit in `rows` free rows."""
    chunk = ctx.options.scheduler.prefill_chunk
    if chunk is None:
        return []
    for r in waiting:
        if uncached_tokens(ctx, r) > chunk:
            group = [q for q in waiting if q.request_id == r.request_id and q.prompt_ids == r.prompt_ids]
            if len(group) > rows:
                return []
            for q in group:
                waiting.remove(q)
            return group
    return []


def advance_chunked(ctx: DecodeContext, job: "ChunkedPrefill | None", waiting, rows: int,
                    layout: str) -> tuple["ChunkedPrefill | None", Batch | None, list]:
    """One engine step of chunked prefill: start `job` for a long waiting prompt if none runs and `rows`
    rows are free for its requests, and feed one chunk. Returns (the job still running, or None; its batch
    after its last chunk, its first tokens committed -- None before, or if all finished at their first
    token; the requests that did)."""
    if job is None:
        group = take_long(ctx, waiting, rows)
        if group:
            job = ChunkedPrefill(ctx, group, ctx.options.scheduler.prefill_chunk, layout)
    if job is None:
        return None, None, []
    out = job.advance()
    if out is None:
        return job, None, []
    fresh, first = out
    commit(ctx, fresh.requests, first)
    done = fresh.drop_finished()
    return None, (fresh if len(fresh) else None), done


class ChunkedPrefill:
    """One prompt's prefill (for its requests: the n choices of one request share it), `chunk` tokens per
    `advance`, so that the running rows decode between the chunks."""

    def __init__(self, ctx: DecodeContext, requests: list[Request], chunk: int, layout: str, capacity: int = 0):
        self.ctx, self.requests, self.chunk, self.layout = ctx, list(requests), chunk, layout
        self.rows = PromptRows(ctx, [list(requests[0].prompt_ids)], capacity, run_draft=ctx.prefills_draft(requests))
        self.chunks = 0

    @property
    def remaining(self) -> int:
        return self.rows.remaining

    def advance(self) -> tuple[Batch, StepOutput] | None:
        """Feed the next chunk; after the last one, the batch of the requests still live (possibly none)
        and their first tokens (uncommitted). None while chunks remain."""
        last = self.rows.remaining <= self.chunk
        logits = self.rows.feed(self.chunk)
        self.chunks += 1
        self.ctx.metrics.prefill_chunks += 1
        if not last:
            return None
        return self.rows.finish(logits, self.requests, [0] * len(self.requests), self.layout)


__all__ = ["Budget", "ChunkedPrefill", "PromptRows", "advance_chunked", "distinct_prompts", "first_tokens", "prefill",
           "store_finished", "take_long", "take_waiting", "uncached_tokens"]
