"""Continuous batching over one batch of at most `batch_size` rows: the scheduler of `ar` and `ragged`
(ragged layout) and of `eqspec` (left-padded layout).

- ragged (`ar`, `ragged`): each row at its own offsets (start = 0), nothing ever moves. A finished row's
  slot takes the next waiting request (prefilled on its own, then copied into the slot); rows left free
  when nobody waits are compacted away (the last rows move into them); newcomers beyond the free slots are
  appended as new rows.
- left-padded (`eqspec`, the paper's EQSPEC): every running row ends at one column. After every step the
  unfinished rows are realigned (shifted, in both caches, to end at the longest row's edge). Finished rows
  are handled as in the ragged layout: a newcomer is prefilled on its own and copied into a free row, right-
  aligned at that edge (if its prompt is longer than every running row, the realignment then moves the
  others right); rows left free are filled by moving the last rows into them.

Rows join and leave by copying that row alone (`Batch.load`, `Batch.drop_finished`); the batch's storage is
copied only when it grows (more rows: `Batch.reserve`, in powers of two; more columns: `Batch.grow`).

With a prefix cache (specdec/prefix_cache.py) a newcomer's prefill copies its prompt's cached prefix in
and feeds the rest (specdec/prefill.py), and a finished row's sequence is stored before its row is reused.
With chunked prefill (`prefill_chunk`) a prompt with more uncached tokens than a chunk is prefilled one
chunk per step (`ChunkedPrefill`, one at a time, its rows kept free for it) while the running rows decode,
and a step's other newcomers prefill at most a chunk's worth of tokens (one newcomer at least).
"""
from __future__ import annotations

from collections import deque

from ..batch import LEFT_PADDED, Batch, DecodeContext, required_capacity
from ..commit import commit
from ..prefill import Budget, ChunkedPrefill, advance_chunked, prefill, store_finished, take_waiting


class ContinuousScheduler:
    def __init__(self, ctx: DecodeContext, batch_size: int, layout: str):
        self.ctx = ctx
        self.batch_size = batch_size
        self.layout = layout
        self.waiting: deque = deque()  # requests not yet holding a row, in arrival order
        self.batch: Batch | None = None
        self.job: ChunkedPrefill | None = None  # a long prompt being prefilled a chunk per step

    # --------------------------------------------------------------------------------------- rows
    def running(self) -> list:
        return [r for r in self.batch.requests if not r.finished] if self.batch is not None else []

    def queued(self) -> list:
        """Requests without a row yet: waiting, or being prefilled in chunks."""
        return list(self.waiting) + (self.job.requests if self.job is not None else [])

    def _rows_free(self) -> int:
        """Rows newcomers may take now: the batch's free and unused rows, less those kept for the chunked
        prefill in progress."""
        live = len(self.running())
        return self.batch_size - live - (len(self.job.requests) if self.job is not None else 0)

    def rows_for(self, live: int) -> int:
        """Cache rows allocated while `live` requests are running or waiting."""
        return min(self.batch_size, live)

    def release(self, request) -> None:
        """An aborted request (already marked finished): leave the queue, or free its row at the next
        admission (a finished row is refilled or dropped there)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if self.job is not None and all(r.finished for r in self.job.requests):
            self.job = None  # every request of the chunked prefill was aborted: its caches go

    def _prefill(self, n: int, capacity: int | None = None, budget: Budget | None = None) -> tuple[Batch | None, list]:
        """Prefill up to n waiting requests, into caches of `capacity` columns (at least what they need), or
        None: of their prompts only (rows that are copied into the batch, which `_room_for` grows). Returns
        the batch of those still live (None if none) and the ones that finished at their first token."""
        done = []
        budget = budget or Budget(None)
        while self.waiting:
            chunk = take_waiting(self.ctx, self.waiting, n, budget)
            if not chunk:
                break
            need = (max(capacity, required_capacity(chunk, self.ctx.k_max)) if capacity is not None
                    else max(len(r.prompt_ids) for r in chunk) + 1)
            fresh, first = prefill(self.ctx, chunk, self.layout, need, joining=bool(self.running()))
            commit(self.ctx, fresh.requests, first)
            done += fresh.drop_finished()
            if len(fresh):
                return fresh, done
        return None, done

    def _place(self, fresh: Batch) -> None:
        """Put freshly prefilled rows into the batch's free rows, then new ones (or make them the first
        batch); each row is copied once, no other row moves."""
        if self.batch is None:
            fresh.grow(required_capacity(fresh.requests + list(self.waiting), self.ctx.k_max))
            self.batch = fresh
            return
        self._room_for(fresh)
        free = [i for i, r in enumerate(self.batch.requests) if r.finished][: len(fresh)]
        extra = len(fresh) - len(free)
        if extra:  # room for all that may join now
            wanted = len(self.batch) + extra + len(self.waiting)
            self.batch.reserve(min(self.batch_size, 1 << (wanted - 1).bit_length()))
        self.batch.load(free + list(range(len(self.batch), len(self.batch) + extra)), fresh, self._starts(fresh))

    def _room_for(self, fresh: Batch) -> None:
        """Grow the batch's columns to what the newcomers need (a copy of the batch, only when it grows)."""
        self.batch.grow(required_capacity(fresh.requests, self.ctx.k_max))

    # ------------------------------------------------------------------------------------ schedule
    def _starts(self, fresh: Batch) -> list[int] | None:
        """Left-padded: the column each newcomer's caches start at, so that it ends at the batch's edge (the
        longest unfinished row, or the newcomer if it is longer: then `Batch.right_align` moves the others)."""
        if self.layout != LEFT_PADDED:
            return None
        running = [n for n, r in zip(self.batch.target_cache.host_length, self.batch.requests) if not r.finished]
        edge = max(running + fresh.target_cache.host_length)
        return [edge - n for n in fresh.target_cache.host_length]

    def admit(self) -> list:
        """Give waiting requests the rows that are free (finished, aborted) or not yet used: each newcomer
        is prefilled and copied into its row, no other row is copied (left-padded: unless a newcomer is
        longer than every running row). Returns the requests that finished at their first token."""
        ctx, done = self.ctx, []
        with ctx.timer.phase("prefill"):
            store_finished(ctx, self.batch)  # prefix cache: finished (aborted) rows, before their rows are reused
            if self.batch is not None and self.job is None and not self.running():
                # no live row: the next batch is sized for the requests at hand (growing this one would zero and
                # copy every row slot it reserved, for rows long gone: ~1 s per turn of a 2,000-token chat)
                self.batch = None
            # chunked prefill: a long waiting prompt started if rows are free for it, one chunk fed
            self.job, chunked, done = advance_chunked(ctx, self.job, self.waiting, self._rows_free(), self.layout)
            admitted = chunked is not None
            if chunked is not None:
                self._place(chunked)
            budget = Budget(ctx.options.scheduler.prefill_chunk)
            if self.batch is None:
                if self.waiting and self._rows_free() > 0:  # the first batch is sized for every request known now
                    capacity = required_capacity(list(self.waiting), ctx.k_max)
                    self.batch, finished = self._prefill(self._rows_free(), capacity, budget)
                    done += finished
                return done
            while self.waiting and self._rows_free() > 0:  # newcomers take the free rows in place, then new rows
                fresh, finished = self._prefill(self._rows_free(), budget=budget)
                done += finished
                if fresh is None:
                    break
                self._place(fresh)
                admitted = True
            if any(r.finished for r in self.batch.requests):  # rows nobody took: the last rows move into them
                self.batch.drop_finished()
        if admitted and self.layout == LEFT_PADDED and len(self.batch):
            with ctx.timer.phase("realign"):
                self.batch.right_align()
        return done

    def select(self) -> Batch | None:
        """The rows to step: every live row of the batch."""
        return self.batch if self.batch is not None and len(self.batch) else None

    def postprocess(self, batch: Batch) -> None:
        """Left-padded: right-align the unfinished rows (invariant I6); finished rows stay, as in the ragged
        layout, until `admit` refills or removes them. Ragged: nothing moves."""
        if self.layout == LEFT_PADDED:
            with self.ctx.timer.phase("realign"):
                batch.right_align()
