"""Continuous batching over the ragged layout: a fixed number of rows; when a row finishes, its slot
takes the next prompt from the queue (prefilled on its own, then copied into the slot)."""
from __future__ import annotations

from collections import deque

from ..batch import Batch, DecodeContext, prefill, required_capacity
from ..invariants import check_invariants


def admit(ctx: DecodeContext, queue: deque, n: int, capacity: int, progress) -> Batch | None:
    """Prefill up to n live requests from the queue (a request may finish at its first token). The caller
    times it (phase "prefill")."""
    while queue:
        chunk = [queue.popleft() for _ in range(min(n, len(queue)))]
        cap = capacity or max(len(r.prompt_ids) for r in chunk)
        batch = prefill(ctx, chunk, "ragged", cap)
        done = sum(r.finished for r in chunk)
        if done:
            progress(done)
            batch.drop_finished()
        if len(batch):
            return batch
    return None


def run_continuous(ctx: DecodeContext, requests, batch_size: int, step, progress) -> None:
    """Run `step(ctx, batch)` until every request has finished, refilling free rows from the queue."""
    queue = deque(requests)
    with ctx.timer.phase("prefill"):
        batch = admit(ctx, queue, batch_size, required_capacity(requests, ctx.num_speculative_tokens), progress)
    while batch is not None and len(batch):
        step(ctx, batch)
        free = [i for i, r in enumerate(batch.requests) if r.finished]
        progress(len(free))
        with ctx.timer.phase("prefill"):
            while free and queue:
                fresh = admit(ctx, queue, len(free), 0, progress)
                if fresh is None:
                    break
                batch.load(free[: len(fresh)], fresh)
                free = free[len(fresh):]
        with ctx.timer.phase("other"):
            if free:
                batch.drop_finished()
        if ctx.check_invariants and len(batch):
            check_invariants(ctx, batch)
