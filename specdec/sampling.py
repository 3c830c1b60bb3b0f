"""Sampling: per-request parameters, their per-row tensors, logits processing (temperature / top-k /
top-p), per-request random streams and the draws taken from them, and token choice.

Everything here takes plain tensors, lists and generators; nothing reads the device back."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters of one request.

    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off; `seed` fixes the request's own
    random stream, so the same seed gives the same output whatever the batch. Every field is validated
    here: a bad value raises ValueError naming the field (non-finite temperature/top_p, negative top_k,
    non-integer counts or ids, a seed outside what torch.Generator accepts).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        def is_int(x) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        def is_real(x) -> bool:
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

        def refuse(name: str, rule: str, value):
            raise ValueError(f"SamplingParams.{name} must be {rule}, got {value!r}")

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            refuse("max_tokens", "an integer >= 1", self.max_tokens)
        if not is_real(self.temperature) or self.temperature < 0:
            refuse("temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        if not is_int(self.top_k) or self.top_k < 0:
            refuse("top_k", "an integer >= 0 (0 = off)", self.top_k)
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            refuse("top_p", "a number in (0, 1] (1 = off)", self.top_p)
        if self.seed is not None and not (is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 64)):
            refuse("seed", "None or an integer in [-2**63, 2**64)", self.seed)
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            refuse("stop_token_ids", "a sequence of token ids", self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in stop):
            refuse("stop_token_ids", "non-negative integer token ids", self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            refuse("ignore_eos", "True or False", self.ignore_eos)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Distributions are computed in float64 for float64 models, float32 otherwise."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def process_logits(logits, temperature, top_k, top_p, dtype=torch.float32, filtered: bool = True):
    """Logits [N, V] -> probabilities [N, V] after per-row temperature [N], top-k [N] (int64) and top-p [N].

    Applied identically to target and draft distributions. Rows with temperature 0 are treated as
    temperature 1 (their probabilities are unused: greedy rows take the argmax of the raw logits).
    `filtered=False` (known on the host: no row uses top-k or top-p) skips the sort.
    """
    x = logits.to(dtype) / torch.where(temperature > 0, temperature, 1.0).to(dtype)[:, None]  # [N, V]
    V = x.shape[-1]
    if filtered:
        use_k = (top_k > 0) & (top_k < V)  # [N]
        use_p = top_p < 1.0  # [N]
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


@dataclass
class RowParams:
    """The sampling parameters of a batch's rows as device tensors [B] (built when the rows change, not
    per step), with what the host needs to plan a step without reading them back."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float64
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float64
    host_greedy: list[bool]
    generators: list  # [B] torch.Generator, None for greedy rows
    filtered: bool  # some row uses top-k or top-p

    @classmethod
    def of(cls, params: list[SamplingParams], generators: list, device) -> "RowParams":
        return cls(torch.tensor([p.greedy for p in params], device=device),
                   torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
                   [p.greedy for p in params], list(generators),
                   any(p.top_k > 0 or p.top_p < 1.0 for p in params))

    @property
    def all_greedy(self) -> bool:
        return all(self.host_greedy)

    @property
    def any_greedy(self) -> bool:
        return any(self.host_greedy)

    def probs(self, logits, dtype):
        """Processed distributions of logits [B, V] (or [B, T, V], same params for every T)."""
        if logits.dim() == 3:
            B, T, V = logits.shape
            rep = lambda t: t.repeat_interleave(T)  # noqa: E731
            return process_logits(logits.reshape(B * T, V), rep(self.temperature), rep(self.top_k),
                                  rep(self.top_p), dtype, self.filtered).view(B, T, V)
        return process_logits(logits, self.temperature, self.top_k, self.top_p, dtype, self.filtered)


def draw_noise(generators: list, shape, device, dtype) -> torch.Tensor:
    """Exp(1) noise [B, *shape] from each sampling row's own generator (ones for greedy rows)."""
    rows = [torch.ones(shape, dtype=dtype, device=device) if g is None
            else torch.empty(shape, dtype=dtype, device=device).exponential_(generator=g) for g in generators]
    # an exact 0 (possible on CPU) would make p / e = 0/0 = NaN and let a zero-probability token win
    return torch.stack(rows).clamp_(min=torch.finfo(dtype).tiny)


def draw_uniforms(generators: list, k: int, device) -> torch.Tensor:
    """Acceptance uniforms [B, k] float64 from each sampling row's own generator (zeros for greedy rows)."""
    rows = [torch.zeros(k, dtype=torch.float64, device=device) if g is None
            else torch.rand(k, dtype=torch.float64, device=device, generator=g) for g in generators]
    return torch.stack(rows)


def choose_tokens(logits, params: RowParams, dtype) -> torch.Tensor:
    """Next token per row from logits [B, V]: the argmax for greedy rows, a sample otherwise ([B] int64).
    Sampling rows draw V exponentials from their own generator."""
    tokens = logits.argmax(dim=-1)  # [B]
    if not params.all_greedy:
        probs = params.probs(logits, dtype)  # [B, V]
        noise = draw_noise(params.generators, (logits.shape[-1],), logits.device, probs.dtype)  # [B, V]
        tokens = torch.where(params.greedy, tokens, sample_race(probs, noise))
    return tokens
