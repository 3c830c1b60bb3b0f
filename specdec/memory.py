"""Memory is bounded by the work, not by a flag: the KV caches a run is about to allocate are estimated
from the rows that can actually run and checked against the memory available, so an oversized
`--batch-size` (or window) is one clear refusal, never the kernel's out-of-memory killer."""
from __future__ import annotations

import torch

HEADROOM = 0.9  # the share of available memory caches may take (activations and the rest need some)


class MemoryBudgetError(ValueError):
    """The KV caches a run needs do not fit in the memory available."""


def cache_bytes(model, rows: int, capacity: int) -> int:
    """Bytes of a KV cache of `rows` x `capacity` columns for one of our models (0 for a model object
    without a `cfg`: foreign models size their own caches)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(cfg, "num_layers"):
        return 0
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * rows * capacity
    if getattr(model, "reads_target_hidden", False):  # a feature draft: the target's hidden state per position
        kv += cfg.hidden_size * itemsize * rows * capacity
    return kv


def available_bytes(device) -> int | None:
    """Free memory where the caches will live: the GPU's free memory, or the host's MemAvailable (Linux);
    None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def graph_bytes(model, rows: int, capacity: int, tokens: int) -> int:
    """What a model's CUDA graphs (models/graphs.py) may hold for steps of `rows` rows and up to `tokens` new
    tokens over `capacity` columns (0 without graphs)."""
    runner = getattr(model, "graph_runner", None)
    if runner is None or getattr(model, "compiled_forward", None) is not None:
        return 0
    return runner.reserve_bytes(rows, capacity, tokens)


def held_rows(model, rows: int) -> int:
    """Storage rows a cache of `rows` rows holds: with CUDA graphs, its bucket's (the padding rows)."""
    runner = getattr(model, "graph_runner", None)
    return (runner.bucket(rows) or rows) if runner is not None else rows


def check_cache_memory(models, rows: int, capacity: int, device, batch_size: int, tokens: int = 1,
                       reserved: int = 0) -> None:
    """Refuse, in one line naming the batch size and the estimate, caches that cannot fit: one account of the
    device memory for the KV caches, the CUDA graphs that run on them (steps of up to `tokens` tokens per row)
    and `reserved` bytes promised to others (the prefix cache's budget not yet filled: what it holds is already
    out of the memory available)."""
    models = [m for m in models if m is not None]
    caches = sum(cache_bytes(m, held_rows(m, rows), capacity) for m in models)
    graphs = sum(graph_bytes(m, rows, capacity, tokens) for m in models)
    need = caches + graphs + reserved
    free = available_bytes(device) if caches else None
    if free is not None and need > HEADROOM * free:
        parts = "".join(f", {what} {n / 2**30:.2f} GiB" for what, n in (("their CUDA graphs", graphs),
                                                                           ("the prefix cache", reserved)) if n)
        raise MemoryBudgetError(
            f"batch size {batch_size} (--batch-size): KV caches for {rows} rows of {capacity} positions need "
            f"{need / 2**30:.1f} GiB (caches {caches / 2**30:.2f} GiB{parts}), more than the "
            f"{HEADROOM * free / 2**30:.1f} GiB that can be used on {device} ({free / 2**30:.1f} GiB available); "
            f"use a smaller --batch-size or --max-tokens")
