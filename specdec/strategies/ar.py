"""AR: autoregressive decoding with the target alone, continuous batching, one token per row per step.
The reference every speculative strategy must reproduce, and the speed baseline."""
from __future__ import annotations

from ..batch import Batch, DecodeContext, choose_tokens
from .continuous import run_continuous

USES_DRAFT = False


def ar_step(ctx: DecodeContext, batch: Batch) -> None:
    with ctx.timer.phase("verify"):
        logits = ctx.target.forward(batch.last_tokens(1, ctx.device), batch.target_cache)[:, -1, : ctx.vocab_size]
        ctx.metrics.target_forwards += 1
    with ctx.timer.phase("accept"):
        tokens = choose_tokens(ctx, batch.requests, logits).tolist()
        for request, token in zip(batch.requests, tokens):
            request.scheduled_steps += 1
            ctx.metrics.generated_tokens += request.commit([token])
        ctx.metrics.row_steps += len(tokens)
    ctx.metrics.steps += 1


def run(ctx: DecodeContext, requests, batch_size: int, progress, **_) -> None:
    run_continuous(ctx, requests, batch_size, ar_step, progress)
