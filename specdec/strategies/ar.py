"""AR: autoregressive decoding with the target alone, continuous batching, one token per row per step.
The reference every speculative strategy must reproduce, and the speed baseline."""
from __future__ import annotations

from ..batch import DecodeContext
from .continuous import run_continuous


def run(ctx: DecodeContext, requests, batch_size: int, progress) -> None:
    run_continuous(ctx, requests, batch_size, progress)  # no draft: every step is a target-only step
