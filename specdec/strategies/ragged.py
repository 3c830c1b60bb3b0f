"""RAGGED: per-row offsets (start = 0), rows write their accepted tokens at their own columns and
nothing is ever shifted; a finished row's slot takes the next prompt (continuous batching). This goes
beyond the paper: realignment costs nothing."""
from __future__ import annotations

from ..batch import DecodeContext
from .continuous import run_continuous


def run(ctx: DecodeContext, requests, batch_size: int, progress) -> None:
    run_continuous(ctx, requests, batch_size, progress)
