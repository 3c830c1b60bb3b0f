"""One model forward on a prefilled cache, timed: what auto k's calibration and the benchmarks measure.

`PrefilledCache` prefills a model's KV cache with a prompt; `time(x)` runs one forward of `x` on top of that
prefix and rewinds the cache (O(1): only the row lengths move), so every call sees the same prefix.
`time_forward` is the whole measurement on random token ids: one untimed warm-up forward (where a compiled
model compiles; with CUDA graphs, until the step is a replay of its captured graph), then the median of
`repeats` timed ones: what a step costs as it will run. The start-up measurement (specdec/startup.py) asks
for the warm-up forward only the first time it times a model a given way.
"""
from __future__ import annotations

import statistics
import time

import torch

from specdec.models.cache import RAGGED


def synchronize(device) -> None:
    """Wait for a CUDA device's queued work (nothing to wait for elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def random_tokens(rows: int, length: int, vocab: int, generator: torch.Generator, device) -> torch.Tensor:
    """[rows, length] token ids in 3..vocab-1 (above the usual special ids)."""
    return torch.randint(3, vocab, (rows, length), generator=generator).to(device)


class PrefilledCache:
    """`model`'s cache after `prompt` [rows, P] (every row P tokens); forwards on top of it rewind it."""

    def __init__(self, model, prompt: torch.Tensor, capacity: int, layout: str = RAGGED):
        rows, P = prompt.shape
        self.model, self.device = model, prompt.device
        self.cache = model.new_cache(rows, capacity, layout)
        self.cache.set_prefill([P] * rows, P)
        model.forward(prompt, self.cache, num_new=[P] * rows, logits="last")
        self.length, self.host_length = self.cache.length, list(self.cache.host_length)

    def step(self, x: torch.Tensor, logits: str = "all") -> torch.Tensor:
        """One forward of `x` [rows, T] on top of what the cache holds (not rewound)."""
        return self.model.forward(x, self.cache, logits=logits)

    def rewind(self) -> None:
        """Back to the prefix."""
        self.cache.set_rows(length=self.length, host_length=self.host_length)

    def forward(self, x: torch.Tensor, logits: str = "all") -> torch.Tensor:
        """The logits of one forward of `x` [rows, T] on top of the prefix; the cache is rewound after it."""
        try:
            return self.step(x, logits)
        finally:
            self.rewind()

    def time(self, x: torch.Tensor, logits: str = "all") -> float:
        """Wall seconds of one forward of `x` on top of the prefix (the rewind after it is not timed)."""
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            self.step(x, logits)
            synchronize(self.device)
            return time.perf_counter() - t0
        finally:
            self.rewind()


def time_forward(model, rows: int, new_tokens: int, context: int, repeats: int, logits: str = "all",
                 vocab: int | None = None, seed: int = 0, warm_up: bool = True) -> tuple[float, float]:
    """(median wall time of a forward of `new_tokens` random tokens per row on top of a `context`-token random
    prefix, seconds before the timed forwards: the prefill, the untimed warm-up forward (where a compiled
    model compiles) unless `warm_up` is False, and with CUDA graphs the shape's capture forwards)."""
    start = time.perf_counter()
    device = getattr(model, "device", torch.device("cpu"))
    vocab = vocab or model.vocab_size
    g = torch.Generator().manual_seed(seed)
    prefilled = PrefilledCache(model, random_tokens(rows, context, vocab, g, device), context + new_tokens + 1)
    x = random_tokens(rows, new_tokens, vocab, g, device)  # [rows, T]
    runner = getattr(model, "graph_runner", None)  # CUDA graphs: warm up until the step replays its graph
    for _ in range(int(warm_up) + (runner.forwards_before_replay() if runner is not None else 0)):
        prefilled.forward(x, logits)  # untimed
    before = time.perf_counter() - start
    return statistics.median(prefilled.time(x, logits) for _ in range(repeats)), before
