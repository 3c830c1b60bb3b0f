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
import time
from collections import deque

import torch

from specdec.models.cache import KVCache

from ..batch import LEFT_PADDED, RAGGED, Batch, DecodeContext, required_capacity, row_params
from ..invariants import check_invariants
from ..speculative import decode_step, realign_batch
from .continuous import refill

# Settings (EngineOptions): `realign_cost_per_row`, one row's realignment time over a step's fixed cost
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
    """`size` slots of target and draft KV state (ragged: start = 0) with the sequences of the requests in
    them (`tokens` [size, C], `seq_len` [size], on the device) and their waits, and a `batch_size`-row
    buffer per model that a step runs on.

    Between steps, slot s holds `rows[s]`'s target cache (len(sequence) - 1 tokens at columns 0..) and its
    draft cache (a shorter prefix, see batch.py), exactly as a ragged Batch row would. Rows are moved
    with one slice copy per row: on the CPU, index_select / index_put on these strided views take a slow
    path (30x slower, docs/exspec.md). The buffers are zero-initialised and reused: a mixed batch's
    attention reads (masked) padding columns, which must hold finite values, never torch.empty garbage.
    """

    def __init__(self, ctx: DecodeContext, size: int, capacity: int, batch_size: int):
        self.ctx = ctx
        self.fold_shift = ctx.options.fold_shift
        self.target = ctx.new_cache(ctx.target, size, capacity, RAGGED)
        self.draft = ctx.new_cache(ctx.draft, size, capacity, RAGGED)
        rows = min(batch_size, size)
        self.buffers = (ctx.new_cache(ctx.target, rows, capacity, LEFT_PADDED),
                        ctx.new_cache(ctx.draft, rows, capacity, LEFT_PADDED))
        self.tokens = torch.zeros(size, capacity, dtype=torch.int64, device=ctx.device)  # [size, C]
        self.seq_len = torch.zeros(size, dtype=torch.int64, device=ctx.device)  # [size]
        self.rows: list = [None] * size  # the request in each slot
        self.waits: list[int] = [0] * size  # steps since each slot's row was last scheduled
        self.stepped: list[int] = []  # the slots of the batch in flight (set by gather, read by scatter)

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
        self.target.load_rows(slots, fresh.target_cache)
        self.draft.load_rows(slots, fresh.draft_cache)
        index = self.index(slots)
        self.tokens[index, : fresh.tokens.shape[1]] = fresh.tokens
        self.seq_len[index] = fresh.seq_len
        for slot, request in zip(slots, fresh.requests):
            self.rows[slot] = request
            self.waits[slot] = 0

    def _batch_cache(self, pool: KVCache, buf: KVCache, g: int, width: int, index, slots, offsets) -> KVCache:
        """Rows `slots` of a pool cache copied into the first g rows of a buffer, at column offsets."""
        k, v = buf.k[:, :g, :, :width], buf.v[:, :g, :, :width]  # [L, g, H_kv, width, D] views
        lengths = [pool.host_length[s] for s in slots]
        for i, (slot, n, o) in enumerate(zip(slots, lengths, offsets)):
            k[:, i, :, o:o + n].copy_(pool.k[:, slot, :, :n])
            v[:, i, :, o:o + n].copy_(pool.v[:, slot, :, :n])
        cache = KVCache(k, v, torch.tensor(offsets, dtype=torch.int64, device=self.ctx.device),
                        pool.length.index_select(0, index), LEFT_PADDED, offsets, lengths)
        cache.backend = pool.backend
        return cache

    def gather(self, slots: list[int], grouped: bool) -> Batch:
        """The rows of `slots` as a left-padded Batch in the buffers. Equal lengths: start = 0, nothing to
        realign. Mixed: realigned to the longest row's edge (the EQSPEC path), or, with fold_shift, copied
        straight to their left-padded columns."""
        g, ctx = len(slots), self.ctx
        lengths = self.target_lengths(slots)
        longest = max(lengths)
        width = longest + ctx.k_max + 1  # room for the verify pass's k + 1 columns
        fold = self.fold_shift and not grouped
        offsets = [longest - n for n in lengths] if fold else [0] * g
        index = self.index(slots)
        with ctx.timer.phase("realign" if fold else "other"):
            target = self._batch_cache(self.target, self.buffers[0], g, width, index, slots, offsets)
            draft = self._batch_cache(self.draft, self.buffers[1], g, width, index, slots, offsets)
        requests = [self.rows[s] for s in slots]
        batch = Batch(requests, target, draft, self.tokens.index_select(0, index), self.seq_len.index_select(0, index),
                      row_params(requests, ctx.device))
        if not grouped and not fold:
            with ctx.timer.phase("realign"):
                realign_batch(ctx, batch)
        self.stepped = slots
        return batch

    def scatter(self, batch: Batch) -> None:
        """Copy back what the step wrote (`batch.written`: the columns of each cache, per row), undoing
        the left padding, and the rows' sequences and lengths."""
        index = self.index(self.stepped)
        with self.ctx.timer.phase("other"):
            for pool, step, written in ((self.target, batch.target_cache, batch.written.target),
                                        (self.draft, batch.draft_cache, batch.written.draft)):
                for i, (slot, (first, n)) in enumerate(zip(self.stepped, written)):
                    src = step.host_start[i] + first
                    pool.k[:, slot, :, first:first + n].copy_(step.k[:, i, :, src:src + n])
                    pool.v[:, slot, :, first:first + n].copy_(step.v[:, i, :, src:src + n])
                pool.length.index_copy_(0, index, step.length)
                for slot, n in zip(self.stepped, step.host_length):
                    pool.host_length[slot] = n
            self.tokens.index_copy_(0, index, batch.tokens)
            self.seq_len.index_copy_(0, index, batch.seq_len)

    def view(self, slots: list[int]) -> Batch:
        """A copy of the rows of `slots` as a ragged Batch, for the invariant checks."""
        index = self.index(slots)
        caches = []
        for c in (self.target, self.draft):
            host = [c.host_length[s] for s in slots]
            caches.append(KVCache(c.k.index_select(1, index), c.v.index_select(1, index),
                                  torch.zeros_like(index), c.length.index_select(0, index), RAGGED, [0] * len(slots), host))
        requests = [self.rows[s] for s in slots]
        return Batch(requests, *caches, self.tokens.index_select(0, index), self.seq_len.index_select(0, index),
                     row_params(requests, self.ctx.device))


# -------------------------------------------------------------------------------------------------- run
def run(ctx: DecodeContext, requests, batch_size: int, progress) -> None:
    if not requests:
        return
    options = ctx.options
    # folded into the gather, a mixed batch's realignment costs nothing extra
    realign_cost = 0.0 if options.fold_shift else options.realign_cost_per_row
    size = min(pool_limit(options.window_size, batch_size, options.max_wait_steps), len(requests))
    pool = Pool(ctx, size, required_capacity(requests, ctx.k_max), batch_size)
    queue = deque(requests)
    while True:
        refill(ctx, queue, pool.free_slots(), pool.load, progress)
        live = pool.live_slots()
        if not live:
            return
        with ctx.timer.phase("other"):
            lengths = pool.target_lengths(live)
            waits = [pool.waits[s] for s in live]
            chosen, grouped = schedule(lengths, waits, batch_size, options.max_wait_steps,
                                       min_group_size(batch_size, len(live), realign_cost))
            slots = [live[i] for i in chosen]
        started = time.perf_counter()
        batch = pool.gather(slots, grouped)
        decode_step(ctx, batch)
        pool.scatter(batch)
        ctx.step_done(len(slots), started)
        ctx.metrics.grouped_steps += grouped
        with ctx.timer.phase("other"):
            unfinished = [s for s in slots if not pool.rows[s].finished]
            if options.check_invariants and unfinished:
                check_invariants(ctx, pool.view(unfinished))
            stepped, done = set(slots), []
            for s in pool.live_slots():
                request = pool.rows[s]
                if s in stepped:
                    pool.waits[s] = 0
                else:
                    pool.waits[s] += 1
                    request.max_wait_steps = max(request.max_wait_steps, pool.waits[s])
                if request.finished:
                    pool.rows[s] = None
                    done.append(request)
        progress(done)
