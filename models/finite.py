"""NaN/inf scans of weights (`check_weights=True`), shared by the safetensors loader (models/loader.py) and the
GGUF loader (models/gguf.py)."""
from __future__ import annotations

import time

import torch

from .errors import CheckpointError

FINITE_SCAN_ELEMENTS = 1 << 24  # elements checked at a time by check_weights (bounded temporary)


def count_non_finite(tensor: torch.Tensor) -> int:
    """NaN and ±inf entries of `tensor`, scanned in bounded chunks (no full-size boolean temporary). A chunk
    whose sum is finite has no NaN/inf (either would make the sum NaN or inf), and a sum is ~30x faster than
    `isfinite` on the CPU; only a chunk with a non-finite sum (or one that overflowed) is counted exactly."""
    flat = tensor.reshape(-1)
    bad = 0
    for first in range(0, flat.numel(), FINITE_SCAN_ELEMENTS):
        chunk = flat[first: first + FINITE_SCAN_ELEMENTS]
        if not bool(torch.isfinite(chunk.sum())):
            bad += int((~torch.isfinite(chunk)).sum())
    return bad


def check_finite(tensor: torch.Tensor, what: str) -> float:
    """Raise CheckpointError naming `what` (file and weight) if `tensor` holds NaN/inf; returns the seconds
    the scan took (`check_weights=True` reports them)."""
    started = time.perf_counter()
    bad = count_non_finite(tensor)
    if bad:
        raise CheckpointError(f"{what} has {bad} non-finite value(s) (NaN/inf) as "
                              f"{str(tensor.dtype).removeprefix('torch.')}")
    return time.perf_counter() - started
