"""EQSPEC (Zhang et al., 2025): static batches in the left-padded (rectangular) layout; after every
verification, unpad-append-repad, i.e. shift each row of both caches so all rows end at one column."""
from __future__ import annotations

import time

from ..batch import LEFT_PADDED, DecodeContext, prefill, required_capacity
from ..invariants import check_invariants
from ..speculative import decode_step, realign_batch


def run(ctx: DecodeContext, requests, batch_size: int, progress) -> None:
    for first in range(0, len(requests), batch_size):
        chunk = requests[first: first + batch_size]
        with ctx.timer.phase("prefill"):
            batch = prefill(ctx, chunk, LEFT_PADDED, required_capacity(chunk, ctx.k_max))
            done = batch.drop_finished()
        progress(done)
        while len(batch):
            started, rows = time.perf_counter(), len(batch)
            decode_step(ctx, batch)
            with ctx.timer.phase("other"):
                done = batch.drop_finished()
            if len(batch):
                with ctx.timer.phase("realign"):
                    realign_batch(ctx, batch)
            ctx.step_done(rows, started)
            progress(done)
            if len(batch):
                if ctx.options.check_invariants:
                    check_invariants(ctx, batch)
