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


def check_cache_memory(models, rows: int, capacity: int, device, batch_size: int) -> None:
    """Refuse, in one line naming the batch size and the estimate, caches that cannot fit."""
    need = sum(cache_bytes(m, rows, capacity) for m in models if m is not None)
    free = available_bytes(device) if need else None
    if free is not None and need > HEADROOM * free:
        raise MemoryBudgetError(
            f"batch size {batch_size} (--batch-size): KV caches for {rows} rows of {capacity} positions need "
            f"{need / 2**30:.1f} GiB, more than the {HEADROOM * free / 2**30:.1f} GiB that can be used on {device} "
            f"({free / 2**30:.1f} GiB available); use a smaller --batch-size or --max-tokens")
