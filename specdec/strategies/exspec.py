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

from specdec.kernels.realign import realign

from ..batch import Batch, DecodeContext, required_capacity
from ..invariants import check_invariants
from ..speculative import speculative_step
from .continuous import admit

USES_DRAFT = True

# One row's realignment time over a step's fixed cost (measured: docs/exspec.md); sets which groups are
# worth a step (`min_group_size`). 0: only groups as large as a mixed batch; inf: any group.
REALIGN_COST_PER_ROW = 0.175
# Write a mixed batch's rows at their left-padded columns while gathering them, instead of realigning
# the batch buffer afterwards (faster: the copy happens anyway; see docs/exspec.md). Off by default:
# the fallback is the EQSPEC path, whose realignment the metrics report in phase "realign".
FOLD_SHIFT = False


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
    """`size` slots of target and draft KV state (ragged: start = 0), the requests in them and their
    waits, and a `batch_size`-row buffer per model that a step runs on.

    Between steps, slot s holds `rows[s]`'s target cache (len(sequence) - 1 tokens at columns 0..) and
    draft cache (one token fewer), exactly as a ragged Batch row would (see batch.py). Rows are moved with
    one slice copy per row: on the CPU, index_select / index_put on these strided views take a slow path
    (30x slower, docs/exspec.md). The buffers are zero-initialised and reused: a mixed batch's attention
    reads (masked) padding columns, which must hold finite values, never torch.empty garbage.
    """

    def __init__(self, ctx: DecodeContext, size: int, capacity: int, batch_size: int, fold_shift: bool):
        self.ctx = ctx
        self.k = ctx.num_speculative_tokens
        self.fold_shift = fold_shift
        self.target = ctx.target.new_cache(size, capacity, "ragged")
        self.draft = ctx.draft.new_cache(size, capacity, "ragged")
        rows = min(batch_size, size)
        self.buffers = (ctx.target.new_cache(rows, capacity, "left"), ctx.draft.new_cache(rows, capacity, "left"))
        self.rows: list = [None] * size
        self.waits: list[int] = [0] * size

    @property
    def device(self):
        return self.target.length.device

    def free_slots(self) -> list[int]:
        return [s for s, r in enumerate(self.rows) if r is None]

    def live_slots(self) -> list[int]:
        return [s for s, r in enumerate(self.rows) if r is not None]

    def target_lengths(self, slots: list[int]) -> list[int]:
        return [self.rows[s].sequence_length - 1 for s in slots]

    def load(self, slots: list[int], fresh: Batch) -> None:
        """Copy a freshly prefilled (ragged) batch into free slots."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.target.load_rows(index, fresh.target_cache)
        self.draft.load_rows(index, fresh.draft_cache)
        for slot, request in zip(slots, fresh.requests):
            self.rows[slot] = request
            self.waits[slot] = 0

    def gather(self, slots: list[int], grouped: bool) -> Batch:
        """The rows of `slots` as a left-padded Batch in the buffers. Equal lengths: start = 0, nothing to
        realign. Mixed: realigned to the longest row's edge (the EQSPEC path), or, with fold_shift, copied
        straight to their left-padded columns."""
        g, ctx = len(slots), self.ctx
        lengths = self.target_lengths(slots)
        longest = max(lengths)
        width = longest + self.k + 1  # room for the verify pass's k + 1 columns
        fold = self.fold_shift and not grouped
        offsets = [longest - n for n in lengths] if fold else [0] * g
        with ctx.timer.phase("realign" if fold else "other"):
            kv = []
            for pool, buf in zip((self.target, self.draft), self.buffers):
                k, v = buf.k[:, :g, :, :width], buf.v[:, :g, :, :width]  # [L, g, H_kv, width, D] views
                for i, (slot, n, o) in enumerate(zip(slots, lengths, offsets)):
                    k[:, i, :, o:o + n].copy_(pool.k[:, slot, :, :n])
                    v[:, i, :, o:o + n].copy_(pool.v[:, slot, :, :n])
                kv.append((k, v))
        length = torch.tensor(lengths, dtype=torch.int64, device=self.device)  # [g]
        start = torch.tensor(offsets, dtype=torch.int64, device=self.device)  # [g]
        make = type(self.target)
        batch = Batch([self.rows[s] for s in slots], make(*kv[0], start, length, "left"),
                      make(*kv[1], start.clone(), length - 1, "left"))
        if not grouped and not fold:
            with ctx.timer.phase("realign"):
                shift = length.max() - length  # [g]
                realign(kv, start, length, shift, backend=ctx.kernel_backend)
                batch.target_cache.start = shift
                batch.draft_cache.start = shift.clone()
        self.stepped, self.before = slots, lengths
        return batch

    def scatter(self, batch: Batch) -> None:
        """Copy back the k + 2 columns per row the step may have written (the draft's from its old length
        on, the target's from one further), undoing the left padding."""
        n = self.k + 2
        start = batch.target_cache.start.tolist()
        with self.ctx.timer.phase("other"):
            for pool, step in ((self.target, batch.target_cache), (self.draft, batch.draft_cache)):
                for i, (slot, length) in enumerate(zip(self.stepped, self.before)):
                    src, dst = start[i] + length - 1, length - 1
                    pool.k[:, slot, :, dst:dst + n].copy_(step.k[:, i, :, src:src + n])
                    pool.v[:, slot, :, dst:dst + n].copy_(step.v[:, i, :, src:src + n])

    def view(self, slots: list[int]) -> Batch:
        """A copy of the rows of `slots` as a ragged Batch, for the invariant checks."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        length = torch.tensor(self.target_lengths(slots), dtype=torch.int64, device=self.device)
        zeros = torch.zeros_like(length)
        make = type(self.target)
        target, draft = ((c.k.index_select(1, index), c.v.index_select(1, index)) for c in (self.target, self.draft))
        return Batch([self.rows[s] for s in slots], make(*target, zeros, length, "ragged"),
                     make(*draft, zeros.clone(), length - 1, "ragged"))


# -------------------------------------------------------------------------------------------------- run
def run(ctx: DecodeContext, requests, batch_size: int, progress, window_size: int = 48, max_wait_steps: int = 8,
        realign_cost: float | None = None, fold_shift: bool | None = None, **_) -> None:
    if max_wait_steps < 0:
        raise ValueError(f"max_wait_steps must be >= 0, got {max_wait_steps}")
    if not requests:
        return
    fold_shift = FOLD_SHIFT if fold_shift is None else fold_shift
    if realign_cost is None:  # folded into the gather, a mixed batch's realignment costs nothing extra
        realign_cost = 0.0 if fold_shift else REALIGN_COST_PER_ROW
    size = min(pool_limit(window_size, batch_size, max_wait_steps), len(requests))
    pool = Pool(ctx, size, required_capacity(requests, ctx.num_speculative_tokens), batch_size, fold_shift)
    queue = deque(requests)
    while True:
        free = pool.free_slots()
        with ctx.timer.phase("prefill"):
            while free and queue:  # refill (a request may finish at its first token: admit skips it)
                fresh = admit(ctx, queue, len(free), 0, progress)
                if fresh is None:
                    break
                pool.load(free[: len(fresh)], fresh)
                free = free[len(fresh):]
        live = pool.live_slots()
        if not live:
            return
        with ctx.timer.phase("other"):
            lengths = pool.target_lengths(live)
            waits = [pool.waits[s] for s in live]
            chosen, grouped = schedule(lengths, waits, batch_size, max_wait_steps,
                                       min_group_size(batch_size, len(live), realign_cost))
            slots = [live[i] for i in chosen]
        batch = pool.gather(slots, grouped)
        speculative_step(ctx, batch)
        pool.scatter(batch)
        ctx.metrics.grouped_steps += grouped
        with ctx.timer.phase("other"):
            unfinished = [s for s in slots if not pool.rows[s].finished]
            if ctx.check_invariants and unfinished:
                check_invariants(ctx, pool.view(unfinished))
            stepped, done = set(slots), 0
            for s in pool.live_slots():
                request = pool.rows[s]
                if s in stepped:
                    pool.waits[s] = 0
                else:
                    pool.waits[s] += 1
                    request.max_wait_steps = max(request.max_wait_steps, pool.waits[s])
                if request.finished:
                    pool.rows[s] = None
                    done += 1
        progress(done)
