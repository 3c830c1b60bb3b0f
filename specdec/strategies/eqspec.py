"""EQSPEC (Zhang et al., 2025): static batches in the left-padded (rectangular) layout; after every
verification, unpad-append-repad, i.e. shift each row of both caches so all rows end at one column."""
from __future__ import annotations

from ..batch import DecodeContext, prefill, required_capacity
from ..invariants import check_invariants
from ..speculative import realign_batch, speculative_step

USES_DRAFT = True


def run(ctx: DecodeContext, requests, batch_size: int, progress, **_) -> None:
    for first in range(0, len(requests), batch_size):
        chunk = requests[first: first + batch_size]
        with ctx.timer.phase("prefill"):
            batch = prefill(ctx, chunk, "left", required_capacity(chunk, ctx.num_speculative_tokens))
            kept = len(batch.drop_finished())
        progress(len(chunk) - kept)
        while len(batch):
            speculative_step(ctx, batch)
            with ctx.timer.phase("other"):
                before = len(batch)
                batch.drop_finished()
            progress(before - len(batch))
            if len(batch):
                with ctx.timer.phase("realign"):
                    realign_batch(ctx, batch)
                if ctx.check_invariants:
                    check_invariants(ctx, batch)
