"""Continuous batching over one batch of at most `batch_size` rows: the scheduler of `ar` and `ragged`
(ragged layout) and of `eqspec` (left-padded layout).

- ragged (`ar`, `ragged`): each row at its own offsets (start = 0), nothing ever moves. A finished row's
  slot takes the next waiting request (prefilled on its own, then copied into the slot); rows left free
  when nobody waits are compacted away; newcomers beyond the free slots are appended as new rows.
- left-padded (`eqspec`, the paper's EQSPEC): every row ends at one column. After every step the finished
  rows are dropped and the rest realigned (shifted, in both caches, to end at the longest row's edge);
  a newcomer is prefilled on its own and appended, then the same realignment right-aligns it with the
  others (or moves them right, if its prompt is longer than every running row).
"""
from __future__ import annotations

from collections import deque

from ..batch import LEFT_PADDED, Batch, DecodeContext, prefill, required_capacity
from ..speculative import realign_batch


class ContinuousScheduler:
    def __init__(self, ctx: DecodeContext, batch_size: int, layout: str):
        self.ctx = ctx
        self.batch_size = batch_size
        self.layout = layout
        self.waiting: deque = deque()  # requests not yet holding a row, in arrival order
        self.batch: Batch | None = None

    # --------------------------------------------------------------------------------------- rows
    def running(self) -> list:
        return [r for r in self.batch.requests if not r.finished] if self.batch is not None else []

    def rows_for(self, live: int) -> int:
        """Cache rows allocated while `live` requests are running or waiting."""
        return min(self.batch_size, live)

    def release(self, request) -> None:
        """An aborted request (already marked finished): leave the queue, or free its row at the next
        admission (a finished row is refilled or dropped there)."""
        if request in self.waiting:
            self.waiting.remove(request)

    def _prefill(self, n: int, capacity: int) -> tuple[Batch | None, list]:
        """Prefill up to n waiting requests. Returns the batch of those still live (None if none) and the
        ones that finished at their first token."""
        done = []
        while self.waiting:
            chunk = [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]
            fresh = prefill(self.ctx, chunk, self.layout, max(capacity, required_capacity(chunk, self.ctx.k_max)))
            done += fresh.drop_finished()
            if len(fresh):
                return fresh, done
        return None, done

    # ------------------------------------------------------------------------------------ schedule
    def admit(self) -> list:
        """Give waiting requests the rows that are free (finished, aborted) or not yet used. Returns the
        requests that finished at their first token."""
        ctx, done = self.ctx, []
        with ctx.timer.phase("prefill"):
            if self.batch is None:
                if self.waiting:  # the first batch is sized for every request known now (no growth later)
                    capacity = required_capacity(list(self.waiting), ctx.k_max)
                    self.batch, done = self._prefill(self.batch_size, capacity)
                return done
            free = [i for i, r in enumerate(self.batch.requests) if r.finished]
            if self.layout != LEFT_PADDED:  # ragged: newcomers take the free slots in place
                while free and self.waiting:
                    fresh, finished = self._prefill(len(free), self.batch.capacity)
                    done += finished
                    if fresh is None:
                        break
                    self.batch.grow(fresh.capacity)
                    self.batch.load(free[: len(fresh)], fresh)
                    free = free[len(fresh):]
            if free:
                self.batch.drop_finished()
            appended = False
            while self.waiting and len(self.batch) < self.batch_size:
                fresh, finished = self._prefill(self.batch_size - len(self.batch), self.batch.capacity)
                done += finished
                if fresh is None:
                    break
                if len(self.batch):
                    self.batch.extend(fresh)
                else:
                    self.batch = fresh
                appended = True
        if appended and self.layout == LEFT_PADDED and len(self.batch):
            with ctx.timer.phase("realign"):
                realign_batch(ctx, self.batch)
        return done

    def select(self) -> Batch | None:
        """The rows to step: every live row of the batch."""
        return self.batch if self.batch is not None and len(self.batch) else None

    def postprocess(self, batch: Batch) -> None:
        """Left-padded: drop the finished rows and right-align the rest (invariant I6). Ragged: nothing
        moves; finished rows wait for `admit` to refill or drop them."""
        if self.layout != LEFT_PADDED:
            return
        with self.ctx.timer.phase("other"):
            batch.drop_finished()
        if len(batch):
            with self.ctx.timer.phase("realign"):
                realign_batch(self.ctx, batch)
