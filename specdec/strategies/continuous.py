"""Continuous batching over the ragged layout: a fixed number of rows; when a row finishes, its slot
takes the next prompt from the queue (prefilled on its own, then copied into the slot). Also the refill
loop of exspec's pool (`refill`)."""
from __future__ import annotations

import time
from collections import deque

from ..batch import RAGGED, Batch, DecodeContext, prefill, required_capacity
from ..invariants import check_invariants
from ..speculative import decode_step


def admit(ctx: DecodeContext, queue: deque, n: int, capacity: int, progress) -> Batch | None:
    """Prefill up to n live requests from the queue (a request may finish at its first token: it is
    reported and skipped). The caller times it (phase "prefill")."""
    while queue:
        chunk = [queue.popleft() for _ in range(min(n, len(queue)))]
        batch = prefill(ctx, chunk, RAGGED, capacity or max(len(r.prompt_ids) for r in chunk))
        done = batch.drop_finished()
        if done:
            progress(done)
        if len(batch):
            return batch
    return None


def refill(ctx: DecodeContext, queue: deque, free: list[int], load, progress) -> list[int]:
    """Fill free slots from the queue: `load(slots, fresh_batch)` places each prefilled chunk. Returns the
    slots left free (the queue ran dry)."""
    with ctx.timer.phase("prefill"):
        while free and queue:
            fresh = admit(ctx, queue, len(free), 0, progress)
            if fresh is None:
                break
            load(free[: len(fresh)], fresh)
            free = free[len(fresh):]
    return free


def run_continuous(ctx: DecodeContext, requests, batch_size: int, progress) -> None:
    """Step until every request has finished, refilling free rows from the queue."""
    queue = deque(requests)
    with ctx.timer.phase("prefill"):
        batch = admit(ctx, queue, batch_size, required_capacity(requests, ctx.k_max), progress)
    while batch is not None and len(batch):
        started, rows = time.perf_counter(), len(batch)
        decode_step(ctx, batch)
        ctx.step_done(rows, started)
        finished = [i for i, r in enumerate(batch.requests) if r.finished]
        progress([batch.requests[i] for i in finished])
        free = refill(ctx, queue, finished, batch.load, progress)
        with ctx.timer.phase("other"):
            if free:
                batch.drop_finished()
        if ctx.options.check_invariants and len(batch):
            check_invariants(ctx, batch)
