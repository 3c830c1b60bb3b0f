"""EXSPEC (Zhang et al., 2025): a pool (window) of live sequences; each step verifies a batch of sequences
of EQUAL length, so the left-padded batch is rectangular with zero padding and nothing is realigned.
When no same-length group is large enough to be worth a step, a mixed batch runs the EQSPEC way
(left-padded, realigned by the realign kernel). The pool is refilled from the queue as sequences finish.
Measurements behind the choices below: docs/exspec.md.

KV state: a preallocated pool of slots per model (target and draft), in the ragged layout (`start = 0`:
a slot's logical token t at column t), so equal-length rows are rectangular as they lie. A step copies
the selected rows' valid columns into a preallocated batch buffer, steps it, and copies back only the
k + 2 columns per row the step wrote. (Measured against stepping the rows in place after swapping them
into the first slots: the gather is faster, as few rows stay selected from one step to the next.)

Bounded waiting: a row's wait counts the steps since it was last scheduled (or admitted); none exceeds
`max_wait_steps` (m). The pool holds at most B(m+1) live rows (B = batch_size), and a selection is taken
only if afterwards, for every e in 0..m, the unscheduled rows of slack (m - wait) <= e number at most
B*e; earliest-deadline-first (the mixed batch) always passes when the state before it did, so the
bound can never be broken.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from ..batch import LEFT_PADDED, RAGGED, Batch, DecodeContext, required_capacity, row_params
from ..commit import commit
from ..options import positions_needed
from ..prefill import Budget, ChunkedPrefill, advance_chunked, prefill, store_finished, take_waiting

# Settings (EngineOptions): `realign_cost_ratio`, one row's realignment time over a step's fixed cost
# (measured: docs/exspec.md), sets which groups are worth a step (`min_group_size`); `fold_shift` writes
# a mixed batch's rows at their left-padded columns while gathering them instead of realigning the batch
# buffer afterwards (faster: the copy happens anyway). Off by default: the fallback is then the EQSPEC
# path, whose realignment the metrics report in phase "realign".


# ---------------------------------------------------------------------------------------------- schedule
def pool_limit(window_size: int, batch_size: int, max_wait_steps: int) -> int:
    """Live rows the pool may hold so that no row ever waits more than max_wait_steps steps: each step
    serves batch_size rows, so at most batch_size * (max_wait_steps + 1) rows can each be served once
    every max_wait_steps + 1 steps."""
    return min(window_size, batch_size * (max_wait_steps + 1))


def schedule(lengths: list[int], waits: list[int], batch_size: int, max_wait_steps: int,
             min_group: int) -> tuple[list[int], bool]:
    """Choose the rows (indices into lengths/waits) to step, and whether they all have one length.

    Same-length groups: for each length, its rows most-waited first, at most batch_size of them; the
    largest feasible group wins, ties going to the group whose member has waited longest (then the most
    total wait, then the shorter length). A group smaller than `min_group` is not worth a step: the
    mixed batch (EDF: the batch_size most-waited rows) runs instead.
    """
    n, B, m = len(lengths), batch_size, max_wait_steps
    slack = [m - w for w in waits]
    if min(slack, default=0) < 0:
        raise AssertionError(f"exspec: a row waited {max(waits)} > max_wait_steps={m} steps")
    order = sorted(range(n), key=lambda i: (slack[i], i))  # most urgent first, then slot order
    top = min(m, n // B + 1)  # for e > n / B the test below holds whatever the choice
    histogram = [0] * (top + 1)  # rows by slack (clamped at top)
    for s in slack:
        histogram[min(s, top)] += 1

    def feasible(chosen: list[int]) -> bool:
        left = histogram.copy()
        for i in chosen:
            left[min(slack[i], top)] -= 1
        waiting = 0
        for e in range(top + 1):  # after this step, the rows of slack <= e must fit in the next e steps
            waiting += left[e]
            if waiting > B * e:
                return False
        return True

    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(lengths[i], []).append(i)
    best, best_key = None, None
    for length, members in groups.items():
        chosen = members[:B]
        if len(chosen) < min_group:
            continue
        key = (len(chosen), max(waits[i] for i in chosen), sum(waits[i] for i in chosen), -length)
        if (best_key is None or key > best_key) and feasible(chosen):
            best, best_key = chosen, key
    if best is not None:
        return best, True
    mixed = order[:B]
    if not feasible(mixed):  # cannot happen while the pool respects pool_limit (EDF is optimal)
        raise AssertionError("exspec: earliest-deadline-first selection is infeasible")
    return mixed, len({lengths[i] for i in mixed}) == 1


def min_group_size(batch_size: int, live: int, realign_cost: float) -> int:
    """The smallest same-length group worth a step instead of a mixed batch of b = min(batch_size, live)
    rows. A step costs a + c*rows, a mixed one R = r*b more (realignment); rows advance alike, so a group
    of g wins when g / (a + c*g) >= b / (a + c*b + r*b), i.e. g >= b / (1 + (r/a) * b).
    `realign_cost` is r/a: one row's realignment over a step's fixed cost (docs/exspec.md)."""
    b = min(batch_size, live)
    return max(1, math.ceil(b / (1.0 + realign_cost * b) - 1e-9))


# ------------------------------------------------------------------------------------------------- pool
class Pool:
    """Slots of target and draft KV state (ragged: start = 0) with the sequences of the requests in them,
    and their waits, and a `batch_size`-row buffer per model that a step runs on. The slots are a ragged
    `Batch` (`store`: the one row storage, shared with continuous batching: `load`, `grow`, `add_rows`),
    whose rows hold None while free. It grows (more slots, more columns) as requests arrive, up to the pool
    limit; rows move only through `KVCache.gather_rows` / `scatter_rows` and `Batch.load`.

    Between steps, slot s holds `rows[s]`'s target cache (len(sequence) - 1 tokens at columns 0..) and its
    draft cache (a shorter prefix, see batch.py), exactly as a ragged Batch row would. The buffers are
    zero-initialised and reused: a mixed batch's attention reads (masked) padding columns, which must
    hold finite values, never torch.empty garbage.
    """

    def __init__(self, ctx: DecodeContext, size: int, capacity: int, batch_size: int):
        self.ctx = ctx
        self.batch_size = batch_size
        # no draft cache for a proposer without a model (ngram, suffix)
        self.store = Batch([None] * size, ctx.new_cache(ctx.target, size, capacity, RAGGED),
                           ctx.new_cache(ctx.draft, size, capacity, RAGGED) if ctx.draft is not None else None,
                           torch.zeros(size, capacity, dtype=torch.int64, device=ctx.device),  # [size, C]
                           torch.zeros(size, dtype=torch.int64, device=ctx.device))  # [size]
        self.buffers = self._buffers(size, capacity)
        self.waits: list[int] = [0] * size  # steps since each slot's row was last scheduled
        self.stepped: list[int] = []  # the slots of the batch in flight (set by gather, read by scatter)
        self.firsts: tuple[list[int], list[int]] = ([], [])  # per stepped row: the first column the step may write

    def _buffers(self, size: int, capacity: int):
        rows = min(self.batch_size, size)
        draft = self.ctx.draft
        return (self.ctx.new_cache(self.ctx.target, rows, capacity, LEFT_PADDED),
                self.ctx.new_cache(draft, rows, capacity, LEFT_PADDED) if draft is not None else None)

    # the slots' state, in the store
    @property
    def rows(self) -> list:
        return self.store.requests  # the request in each slot (None: free)

    @property
    def target(self):
        return self.store.target_cache

    @property
    def draft(self):
        return self.store.draft_cache

    @property
    def tokens(self) -> torch.Tensor:
        return self.store.tokens  # [size, C]

    @property
    def seq_len(self) -> torch.Tensor:
        return self.store.seq_len  # [size]

    @property
    def features(self):
        return self.store.features  # [size, C, E] the target's hidden states (feature drafts: batch.py), or None

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def capacity(self) -> int:
        return self.target.capacity

    def ensure(self, size: int, capacity: int) -> None:
        """At least `size` slots of at least `capacity` columns (existing rows keep their places)."""
        if size <= self.size and capacity <= self.capacity:
            return
        self.store.grow(capacity)
        if size > self.size:
            self.waits += [0] * (size - self.size)
            self.store.add_rows(size - self.size)
        self.buffers = self._buffers(self.size, self.capacity)

    def caches(self) -> list:
        return self.store.caches()

    def free_slots(self) -> list[int]:
        return [s for s, r in enumerate(self.rows) if r is None]

    def live_slots(self) -> list[int]:
        return [s for s, r in enumerate(self.rows) if r is not None]

    def target_lengths(self, slots: list[int]) -> list[int]:
        return [self.target.host_length[s] for s in slots]

    def index(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64, device=self.ctx.device)  # [g]

    def load(self, slots: list[int], fresh: Batch) -> None:
        """Copy a freshly prefilled (ragged) batch into free slots."""
        self.store.load(slots, fresh)
        for slot in slots:
            self.waits[slot] = 0

    def gather(self, slots: list[int], grouped: bool, fold_shift: bool) -> Batch:
        """The rows of `slots` as a left-padded Batch in the buffers. Equal lengths: start = 0, nothing to
        realign. Mixed: realigned to the longest row's edge (the EQSPEC path), or, with fold_shift, copied
        straight to their left-padded columns."""
        ctx = self.ctx
        lengths = self.target_lengths(slots)
        longest = max(lengths)
        width = positions_needed(longest, 0, ctx.k_max)  # room for the verify pass's k + 1 columns
        fold = fold_shift and not grouped
        offsets = [longest - n for n in lengths] if fold else [0] * len(slots)
        with ctx.timer.phase("realign" if fold else "other"):
            target = self.target.gather_rows(slots, self.buffers[0], offsets, width)
            draft = self.draft.gather_rows(slots, self.buffers[1], offsets, width) if self.draft is not None else None
        index = self.index(slots)
        requests = [self.rows[s] for s in slots]
        features = None if self.features is None else self.features.index_select(0, index)  # [g, C, E]
        batch = Batch(requests, target, draft, self.tokens.index_select(0, index), self.seq_len.index_select(0, index),
                      row_params(requests, ctx.device), features)
        if not grouped and not fold:
            with ctx.timer.phase("realign"):
                batch.right_align()
        # a step writes the target from its cached length on, the draft from where it is rewound to
        drafted = []
        if draft is not None:
            seq, (_, fed) = batch.host_seq_len, batch.draft_lag()
            drafted = [min(n, s - f) for n, s, f in zip(draft.host_length, seq, fed)]
        self.firsts = (list(target.host_length), drafted)
        self.stepped = slots
        return batch

    def scatter(self, batch: Batch) -> None:
        """Copy back what the step wrote (the columns from `firsts` on, per row and cache), undoing the
        left padding, and the rows' sequences."""
        index = self.index(self.stepped)
        with self.ctx.timer.phase("other"):
            self.target.scatter_rows(self.stepped, batch.target_cache, self.firsts[0])
            if self.draft is not None:
                self.draft.scatter_rows(self.stepped, batch.draft_cache, self.firsts[1])
            self.tokens.index_copy_(0, index, batch.tokens)
            self.seq_len.index_copy_(0, index, batch.seq_len)
            if batch.features is not None:
                self.features.index_copy_(0, index, batch.features)


# -------------------------------------------------------------------------------------------- scheduler
class PoolScheduler:
    """EXSPEC: refill the pool from the waiting queue, step the best same-length group (or a mixed batch),
    copy its rows back, count waits."""

    def __init__(self, ctx: DecodeContext, batch_size: int):
        self.ctx = ctx
        self.batch_size = batch_size
        self.waiting: deque = deque()
        self.pool: Pool | None = None
        options = ctx.options.scheduler
        self.limit = pool_limit(options.window_size, batch_size, options.max_wait_steps)
        # folded into the gather, a mixed batch's realignment costs nothing extra
        self.realign_ratio = 0.0 if options.fold_shift else options.realign_cost_ratio
        self.grouped = False
        self.job: ChunkedPrefill | None = None  # a long prompt being prefilled a chunk per step

    def running(self) -> list:
        return [r for r in self.pool.rows if r is not None and not r.finished] if self.pool is not None else []

    def queued(self) -> list:
        """Requests without a slot yet: waiting, or being prefilled in chunks."""
        return list(self.waiting) + (self.job.requests if self.job is not None else [])

    def _reserved(self) -> int:
        return len(self.job.requests) if self.job is not None else 0

    def rows_for(self, live: int) -> int:
        """Cache rows allocated while `live` requests are running or waiting: pool slots and the step buffer."""
        size = min(self.limit, live)
        return size + min(self.batch_size, size)

    def release(self, request) -> None:
        """An aborted request (already marked finished): leave the queue, or its slot is freed at `admit`."""
        if request in self.waiting:
            self.waiting.remove(request)
        if self.job is not None and all(r.finished for r in self.job.requests):
            self.job = None  # every request of the chunked prefill was aborted: its caches go

    def admit(self) -> list:
        """Free the slots of finished (aborted) rows, grow the pool for the requests known (up to its
        limit), and prefill waiting requests into free slots. Returns those finished at their first token."""
        ctx, done = self.ctx, []
        if self.pool is not None:
            finished = [s for s, r in enumerate(self.pool.rows) if r is not None and r.finished]
            store_finished(ctx, self.pool.store, finished)  # prefix cache: before the slots are reused
            for s in finished:
                self.pool.rows[s] = None
            if not self.pool.live_slots() and self.job is None:
                self.pool = None  # no live row: the next pool is sized for the requests at hand (not grown)
        if not self.waiting and self.job is None:
            return done
        with ctx.timer.phase("prefill"):
            live = len(self.pool.live_slots()) if self.pool is not None else 0
            # chunked prefill: a long waiting prompt started if the pool has room for it, one chunk fed
            self.job, chunked, done = advance_chunked(ctx, self.job, self.waiting, self.limit - live, RAGGED)
            arriving = (chunked.requests if chunked is not None else []) + self.queued()
            if not arriving:
                return done
            size = min(self.limit, live + len(arriving))
            capacity = required_capacity(arriving, ctx.k_max)
            if self.pool is None:
                self.pool = Pool(ctx, size, capacity, self.batch_size)
            self.pool.ensure(size, capacity)
            free = self.pool.free_slots()
            if chunked is not None:
                self.pool.load(free[: len(chunked)], chunked)
                free = free[len(chunked):]
            free = free[: max(0, len(free) - self._reserved())]  # the chunked prefill's slots stay free for it
            budget = Budget(ctx.options.scheduler.prefill_chunk)
            while free and self.waiting:
                chunk = take_waiting(ctx, self.waiting, len(free), budget)
                if not chunk:
                    break
                fresh, first = prefill(ctx, chunk, RAGGED, self.pool.capacity, joining=bool(self.pool.live_slots()))
                commit(ctx, fresh.requests, first)
                done += fresh.drop_finished()
                if len(fresh):
                    self.pool.load(free[: len(fresh)], fresh)
                    free = free[len(fresh):]
        return done

    def select(self) -> Batch | None:
        pool = self.pool
        live = pool.live_slots() if pool is not None else []
        if not live:
            return None
        with self.ctx.timer.phase("other"):
            chosen, self.grouped = schedule(pool.target_lengths(live), [pool.waits[s] for s in live],
                                            self.batch_size, self.ctx.options.scheduler.max_wait_steps,
                                            min_group_size(self.batch_size, len(live), self.realign_ratio))
        return pool.gather([live[i] for i in chosen], self.grouped, self.ctx.options.scheduler.fold_shift)

    def postprocess(self, batch: Batch) -> None:
        pool = self.pool
        pool.scatter(batch)
        store_finished(self.ctx, pool.store, [s for s in pool.stepped if pool.rows[s].finished])
        self.ctx.metrics.grouped_steps += self.grouped
        stepped = set(pool.stepped)
        for s in pool.live_slots():
            request = pool.rows[s]
            if s in stepped:
                pool.waits[s] = 0
            else:
                pool.waits[s] += 1
                request.longest_wait_steps = max(request.longest_wait_steps, pool.waits[s])
            if request.finished:
                pool.rows[s] = None
