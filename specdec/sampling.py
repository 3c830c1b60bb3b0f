"""Sampling: per-request parameters, their per-row tensors, logits processing (temperature / top-k /
top-p), each request's random numbers keyed by (seed, absolute position) (`specdec.kernels.noise`), and
token choice.

Two samplers decide a sampling row's tokens in a speculative step (docs/design.md, "Randomness"):
- coupled (requests with a seed): every emitted token is the target's own race sample argmax(p / E_p),
  E_p ~ Exp(1) keyed by (seed, p); the draft proposes with the same E_p and a draft is accepted while it
  equals the target's sample. The output is the target-only AR sample of that seed, token for token,
  whatever k, the draft, the batch, the method or the replica;
- rejection (requests without a seed): Leviathan et al.'s rejection sampling (kernels/rejection.py),
  with its uniforms and residual noise keyed by position too. More drafts accepted, but which tokens come
  out depends on where the steps' boundaries fall.

Everything here takes plain tensors and lists; nothing reads the device back."""
from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass, field, replace

import torch

from specdec.kernels.noise import ACCEPT, RACE, RESIDUAL, exponential_noise, uniform_noise


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters of one request.

    temperature 0 is greedy (any positive temperature works: below ~1e-38 the distribution is the
    greedy one-hot, up to exact ties); top_k 0 and top_p 1 switch those filters off.

    `seed` makes the request reproducible: its random numbers are keyed by (seed, absolute position) and
    it is sampled by the coupled sampler, so its tokens are the target-only AR sample of that seed, the
    same whatever k (fixed or "auto"), the draft, the batch size and neighbours, the method and the
    replica. Bitwise in float64 always, and with `batch_invariant=True` in float32/bfloat16; otherwise a
    near-tie between two tokens' race scores can flip with the batch's rounding, as greedy argmaxes can.
    Without a seed a random one is drawn when the request is created (fixed for its life) and rejection
    sampling is used: exact in distribution, more drafts accepted, not reproducible across runs.

    `n` asks for n completions of the prompt (1..MAX_N): they are n requests of one prompt, choice j
    sampled with the key `choice_seed(seed, j)` (choice 0 with the seed itself; without a seed each
    choice draws its own random key).

    `logprobs` (None: off; 0..MAX_LOGPROBS) asks for the log-probability of every generated token and the
    `logprobs` most likely tokens at its position: the target's raw distribution, log_softmax of its
    logits before temperature / top-k / top-p (vLLM's default, "raw_logprobs"), in float32 (float64 for a
    float64 model), the same whatever the method or k (specdec/logprobs.py).

    Every field is validated here: a bad value raises ValueError naming the field (non-finite
    temperature/top_p, negative top_k, non-integer counts or ids, a seed outside [-2**63, 2**64), n or
    logprobs out of range).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

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
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            refuse("n", f"an integer in 1..{MAX_N}", self.n)
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            refuse("logprobs", f"None or an integer in 0..{MAX_LOGPROBS}", self.logprobs)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, choice: int) -> "SamplingParams":
        """The parameters of choice `choice` (0..n-1) of this request: one completion (n = 1), seeded with
        `choice_seed(seed, choice)` (choice 0 keeps the seed: it is the n = 1 request's sample)."""
        seed = None if self.seed is None else choice_seed(self.seed, choice)
        return replace(self, n=1, seed=seed)


MAX_N = 16  # the most completions one request may ask for (n); each is a request of its own
MAX_LOGPROBS = 20  # the most top log-probabilities per token (OpenAI's chat limit)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded with `seed`: the seed itself for choice 0, else
    splitmix64((seed mod 2**64) + choice) -- deterministic, and distinct choices of one seed get unrelated
    keys (choice j of seed s is not choice 0 of seed s + j)."""
    if choice == 0:
        return seed
    z = (int(seed) + choice) % (1 << 64)
    z = (z + 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)


def probs_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Distributions are computed in float64 for float64 models, float32 otherwise."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def process_logits(logits, temperature, top_k, top_p, dtype=torch.float32, filtered: bool = True):
    """Logits [N, V] -> probabilities [N, V] after per-row temperature [N], top-k [N] (int64) and top-p [N].

    Applied identically to target and draft distributions. Rows with temperature 0 are treated as
    temperature 1 (their probabilities are unused: greedy rows take the argmax of the raw logits).
    `filtered=False` (known on the host: no row uses top-k or top-p) skips the sort.

    Safe at any temperature: the row's maximum is subtracted before dividing, so every scaled logit is
    <= 0 and the maximum is exactly 0 (nothing overflows; a tiny temperature sends the others to -inf),
    and a temperature below `dtype`'s smallest normal is taken as that (the limit is the same one-hot).
    """
    x = logits.to(dtype)  # [N, V]
    x = x - x.max(dim=-1, keepdim=True).values
    scale = torch.where(temperature > 0, temperature, 1.0).to(dtype).clamp(min=torch.finfo(dtype).tiny)  # [N]
    x = x / scale[:, None]  # [N, V]
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


def request_seed(seed: int | None) -> int:
    """The 64-bit key of a request's random numbers, as a signed int64: `SamplingParams.seed` modulo
    2**64, or a fresh random one when none is given (drawn once, when the request is created)."""
    value = secrets.randbits(64) if seed is None else int(seed) % (1 << 64)
    return value - (1 << 64) if value >= 1 << 63 else value


def coupled(params: SamplingParams) -> bool:
    """Whether a sampling request is decided by the coupled sampler (module docstring): seeded ones."""
    return not params.greedy and params.seed is not None


@dataclass
class RowParams:
    """The sampling parameters of a batch's rows as device tensors [B] (built when the rows change, not
    per step), with what the host needs to plan a step without reading them back."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float64
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float64
    host_greedy: list[bool]
    seed: torch.Tensor  # [B] int64: each row's key (request_seed; 0 for greedy rows)
    coupled: torch.Tensor  # [B] bool: sampled by the coupled sampler
    host_coupled: list[bool]
    filtered: bool  # some row uses top-k or top-p
    host_logprobs: list[int | None] = field(default_factory=list)  # per row: top log-probabilities asked (None: off)
    logprob_rows: torch.Tensor | None = None  # [R] int64: the rows that ask for log-probabilities (None: none)

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list, device) -> "RowParams":
        """`seeds`: each request's key (`request_seed`), None for greedy rows."""
        host_coupled = [coupled(p) for p in params]
        host_logprobs = [p.logprobs for p in params]
        asking = [i for i, n in enumerate(host_logprobs) if n is not None]
        return cls(torch.tensor([p.greedy for p in params], device=device),
                   torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
                   [p.greedy for p in params],
                   torch.tensor([0 if s is None else s for s in seeds], dtype=torch.int64, device=device),
                   torch.tensor(host_coupled, dtype=torch.bool, device=device), host_coupled,
                   any(p.top_k > 0 or p.top_p < 1.0 for p in params), host_logprobs,
                   torch.tensor(asking, dtype=torch.int64, device=device) if asking else None)

    @property
    def all_greedy(self) -> bool:
        return all(self.host_greedy)

    @property
    def any_greedy(self) -> bool:
        return any(self.host_greedy)

    @property
    def any_coupled(self) -> bool:
        return any(self.host_coupled)

    @property
    def any_rejection(self) -> bool:
        """Some row samples by rejection (neither greedy nor coupled)."""
        return any(not g and not c for g, c in zip(self.host_greedy, self.host_coupled))

    @property
    def exact_match(self) -> torch.Tensor:
        """[B] bool: rows whose drafts are accepted while they equal the target's token (greedy: its
        argmax, coupled: its race sample)."""
        return self.greedy | self.coupled

    def probs(self, logits, dtype):
        """Processed distributions of logits [B, V] (or [B, T, V], same params for every T)."""
        if logits.dim() == 3:
            B, T, V = logits.shape
            rep = lambda t: t.repeat_interleave(T)  # noqa: E731
            return process_logits(logits.reshape(B * T, V), rep(self.temperature), rep(self.top_k),
                                  rep(self.top_p), dtype, self.filtered).view(B, T, V)
        return process_logits(logits, self.temperature, self.top_k, self.top_p, dtype, self.filtered)


@dataclass
class StepNoise:
    """A speculative step's random numbers; column j is each row's position positions + j (its pending
    token's successor is column 0). Greedy rows get numbers too (their own key 0), never used."""

    race: torch.Tensor  # [B, k+1, V] Exp(1), stream RACE: draft j's sample; coupled rows' target samples
    uniforms: torch.Tensor | None  # [B, k] float64 in (0, 1], stream ACCEPT: rejection rows' acceptance draws
    seed: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    host_top: int  # the largest position of a column, known on the host
    dtype: torch.dtype
    backend: str | None

    def narrowed(self, k: int) -> "StepNoise":
        """The numbers of the step's first k drafts, for a proposal shorter than the step was drawn for (rows that
        stopped drafting when unsure): the same numbers, keyed by position."""
        return replace(self, race=self.race[:, :k + 1],
                                   uniforms=None if self.uniforms is None else self.uniforms[:, :k])

    def residual(self, slot) -> torch.Tensor:
        """[B, V] Exp(1), stream RESIDUAL, at each row's position positions + slot ([B] int64, the slot a
        rejection row emits at): the noise of its residual or bonus sample. Drawn for that slot only."""
        return exponential_noise(self.seed, self.positions + slot, 1, self.race.shape[-1], RESIDUAL, self.dtype,
                                 self.backend, self.host_top)[:, 0]


def draw_step_noise(params: RowParams, positions, host_positions: list[int], k: int, vocab_size: int, dtype,
                    backend: str | None = None) -> StepNoise | None:
    """The numbers of a step of k drafts (None when every row is greedy). positions: [B] int64 on the
    device, the absolute position of each row's next token; host_positions: the same on the host (only
    their maximum is used, to check the counter's range without reading the device)."""
    if params.all_greedy:
        return None
    top = max(host_positions) + k
    race = exponential_noise(params.seed, positions, k + 1, vocab_size, RACE, dtype, backend, top)  # [B, k+1, V]
    uniforms = None
    if params.any_rejection:
        uniforms = uniform_noise(params.seed, positions, k, 1, ACCEPT, backend, top)[:, :, 0]  # [B, k]
    return StepNoise(race, uniforms, params.seed, positions, top, dtype, backend)


def choose_tokens(logits, params: RowParams, dtype, positions, host_positions: list[int],
                  backend: str | None = None) -> torch.Tensor:
    """Next token per row from logits [B, V] (target only: prefill, k = 0 steps, AR): the argmax for
    greedy rows, the race sample with the row's RACE noise at its position otherwise ([B] int64).
    positions / host_positions: as in `draw_step_noise`."""
    tokens = logits.argmax(dim=-1)  # [B]
    if not params.all_greedy:
        probs = params.probs(logits, dtype)  # [B, V]
        noise = exponential_noise(params.seed, positions, 1, logits.shape[-1], RACE, probs.dtype, backend,
                                  max(host_positions))[:, 0]  # [B, V]
        tokens = torch.where(params.greedy, tokens, sample_race(probs, noise))
    return tokens
