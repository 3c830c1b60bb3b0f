"""Sampling parameters, logits processing (temperature / top-k / top-p) and per-request random streams."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters of one request.

    temperature 0 is greedy; top_k <= 0 and top_p >= 1 switch those filters off; `seed` fixes the
    request's own random stream, so the same seed gives the same output whatever the batch.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Distributions are computed in float64 for float64 models, float32 otherwise."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def process_logits(logits, temperature, top_k, top_p, dtype=torch.float32):
    """Logits [N, V] -> probabilities [N, V] after per-row temperature [N], top-k [N] (int64) and top-p [N].

    Applied identically to target and draft distributions. Rows with temperature 0 are treated as
    temperature 1 (their probabilities are unused: greedy rows take the argmax of the raw logits).
    """
    x = logits.to(dtype) / torch.where(temperature > 0, temperature, 1.0).to(dtype)[:, None]  # [N, V]
    V = x.shape[-1]
    use_k = (top_k > 0) & (top_k < V)  # [N]
    use_p = top_p < 1.0  # [N]
    if bool(use_k.any()) or bool(use_p.any()):
        sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
        rank = torch.arange(V, device=x.device)[None, :]  # [1, V]
        drop = use_k[:, None] & (rank >= top_k[:, None])  # [N, V]
        sorted_p = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # [N, V] mass strictly before each token
        drop |= use_p[:, None] & (before >= top_p.to(dtype)[:, None])  # keeps at least the top token
        x = torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))  # unsort
    return x.softmax(dim=-1)


def sample_race(probs, noise):
    """One sample per row of probs [N, V] from Exp(1) noise [N, V]: argmax(p / e) ~ Categorical(p)."""
    return (probs / noise.to(probs.dtype)).argmax(dim=-1)


def request_generator(seed: int | None, device) -> torch.Generator:
    """A request's own random stream; a fresh random seed when none is given."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g
