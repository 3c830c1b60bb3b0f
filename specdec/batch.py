"""The state shared by every strategy: the decoding context, and a batch of rows with their caches.

Row i of a `Batch` runs `requests[i]`. Between steps, for every row:
- the target cache holds all of the row's tokens but the last one (`length = len(sequence) - 1`): the
  last token, already emitted, is fed at the next step;
- the draft cache holds one token fewer (`length = target length - 1`): each draft step re-feeds the
  last two tokens, which keeps the draft in step even when all k drafts were accepted (the k-th draft
  was proposed but never fed through the draft) at the price of one extra column in one draft forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .metrics import PhaseTimer, RunMetrics
from .request import Request
from .sampling import probs_dtype, process_logits, sample_race


@dataclass
class DecodeContext:
    target: object  # model protocol: forward(input_ids, cache, num_new=None, logits=...), new_cache(...)
    draft: object | None
    num_speculative_tokens: int  # k (0 for AR)
    vocab_size: int  # logits are cut to the shared vocabulary (embeddings may be padded)
    device: torch.device
    metrics: RunMetrics
    timer: PhaseTimer
    check_invariants: bool = False
    kernel_backend: str | None = None

    @property
    def probs_dtype(self) -> torch.dtype:
        return probs_dtype(self.target.dtype) if hasattr(self.target, "dtype") else torch.float32


@dataclass
class RowParams:
    """Per-row sampling parameters of a batch, as tensors [B]."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B]

    @classmethod
    def of(cls, requests: list[Request], device) -> "RowParams":
        ps = [r.params for r in requests]
        return cls(torch.tensor([p.greedy for p in ps], device=device),
                   torch.tensor([p.temperature for p in ps], dtype=torch.float64, device=device),
                   torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=device))

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    def probs(self, logits, dtype):
        """Processed distributions of logits [B, V] (or [B, T, V], same params for every T)."""
        if logits.dim() == 3:
            B, T, V = logits.shape
            rep = lambda t: t.repeat_interleave(T)  # noqa: E731
            return process_logits(logits.reshape(B * T, V), rep(self.temperature), rep(self.top_k),
                                  rep(self.top_p), dtype).view(B, T, V)
        return process_logits(logits, self.temperature, self.top_k, self.top_p, dtype)


def draw_noise(requests: list[Request], shape, device, dtype) -> torch.Tensor:
    """Exp(1) noise [B, *shape] from each sampling request's own generator (ones for greedy rows)."""
    rows = []
    for r in requests:
        if r.generator is None:
            rows.append(torch.ones(shape, dtype=dtype, device=device))
        else:
            rows.append(torch.empty(shape, dtype=dtype, device=device).exponential_(generator=r.generator))
    # an exact 0 (possible on CPU) would make p / e = 0/0 = NaN and let a zero-probability token win
    return torch.stack(rows).clamp_(min=torch.finfo(dtype).tiny)


def draw_uniforms(requests: list[Request], k: int, device) -> torch.Tensor:
    """Acceptance uniforms [B, k] float64 from each sampling request's own generator."""
    rows = [torch.zeros(k, dtype=torch.float64, device=device) if r.generator is None
            else torch.rand(k, dtype=torch.float64, device=device, generator=r.generator) for r in requests]
    return torch.stack(rows)


def choose_tokens(ctx: DecodeContext, requests: list[Request], logits) -> torch.Tensor:
    """Next token per row from the target's logits [B, V]: argmax for greedy rows, a sample otherwise."""
    tokens = logits.argmax(dim=-1)  # [B]
    params = RowParams.of(requests, logits.device)
    if not params.all_greedy:
        probs = params.probs(logits, ctx.probs_dtype)  # [B, V]
        noise = draw_noise(requests, (logits.shape[-1],), logits.device, probs.dtype)  # [B, V]
        tokens = torch.where(params.greedy, tokens, sample_race(probs, noise))
    return tokens


class Batch:
    """Rows decoded together, with the target's (and the draft's) KV cache of the same row order."""

    def __init__(self, requests: list[Request], target_cache, draft_cache=None):
        self.requests = requests
        self.target_cache = target_cache
        self.draft_cache = draft_cache

    def __len__(self) -> int:
        return len(self.requests)

    def last_tokens(self, n: int, device) -> torch.Tensor:
        """The last n tokens of every row's sequence: [B, n] int64."""
        return torch.tensor([r.last_tokens(n) for r in self.requests], dtype=torch.int64, device=device)

    def caches(self):
        return [c for c in (self.target_cache, self.draft_cache) if c is not None]

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.int64, device=self.target_cache.length.device)
        for cache in self.caches():
            cache.keep_rows(index)
        self.requests = [self.requests[i] for i in rows]

    def load(self, slots: list[int], other: "Batch") -> None:
        """Put the rows of a freshly prefilled batch into `slots` (continuous batching)."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.target_cache.length.device)
        self.target_cache.load_rows(index, other.target_cache)
        if self.draft_cache is not None:
            self.draft_cache.load_rows(index, other.draft_cache)
        for slot, request in zip(slots, other.requests):
            self.requests[slot] = request

    def drop_finished(self) -> list[int]:
        """Compact away finished rows; returns the kept row indices."""
        keep = [i for i, r in enumerate(self.requests) if not r.finished]
        if len(keep) < len(self.requests):
            self.keep(keep)
        return keep


def prefill(ctx: DecodeContext, requests: list[Request], layout: str, capacity: int) -> Batch:
    """Prefill prompts (padded on the layout's side), emit each row's first token from the target."""
    device = ctx.device
    lengths = [len(r.prompt_ids) for r in requests]
    width = max(lengths)
    ids = torch.zeros(len(requests), width, dtype=torch.int64)  # [B, W], 0 = padding (never attended)
    for i, r in enumerate(requests):
        if layout == "left":
            ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids)
        else:
            ids[i, : lengths[i]] = torch.tensor(r.prompt_ids)
    ids = ids.to(device)
    num_new = torch.tensor(lengths, dtype=torch.int64, device=device)  # [B]

    def run(model):
        cache = model.new_cache(len(requests), capacity, layout)
        cache.set_prefill(num_new, width)
        logits = model.forward(ids, cache, num_new=num_new, logits="last")[:, -1, : ctx.vocab_size]  # [B, V]
        return cache, logits

    target_cache, logits = run(ctx.target)
    ctx.metrics.target_forwards += 1
    draft_cache = None
    if ctx.draft is not None:
        draft_cache, _ = run(ctx.draft)
        draft_cache.length = draft_cache.length - 1  # the draft lags one token (see module docstring)
        ctx.metrics.draft_forwards += 1
    tokens = choose_tokens(ctx, requests, logits).tolist()
    for r, token in zip(requests, tokens):
        kept = r.commit([token])
        ctx.metrics.generated_tokens += kept
        ctx.metrics.prefill_tokens += kept
    return Batch(list(requests), target_cache, draft_cache)


def required_capacity(requests: list[Request], k: int) -> int:
    """Columns a cache needs so that any of these requests runs to max_tokens with k drafts in flight."""
    return max(len(r.prompt_ids) + r.params.max_tokens for r in requests) + k + 1
