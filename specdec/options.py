"""`EngineOptions`: every setting a strategy reads, in one validated object passed from `LLM` to the
strategies (no module-level switches, no swallowed keyword arguments)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.kernels.dispatch import BACKENDS

AUTO = "auto"


def positions_needed(prompt_tokens: int, max_tokens: int, k_max: int) -> int:
    """Cache columns (and positions) a request needs: its prompt, max_tokens generated, and a verify pass of
    k_max drafts in flight after its last token. The capacity rule, in one place."""
    return prompt_tokens + max_tokens + k_max + 1


@dataclass(frozen=True)
class EngineOptions:
    # k: drafts per step, or "auto" (chosen every step from measured costs and per-request acceptance)
    num_speculative_tokens: int | str = AUTO
    max_speculative_tokens: int = 8  # the largest k "auto" may choose; fixed k uses its own value
    window_size: int = 48  # exspec: live sequences in the pool
    max_wait_steps: int = 8  # exspec: no row waits more steps than this
    # exspec: one row's realignment time over a step's fixed cost (docs/exspec.md); sets which same-length
    # groups are worth a step. 0: only groups as large as a mixed batch; inf: any group
    realign_cost_ratio: float = 0.175
    # exspec: write a mixed batch's rows at their left-padded columns while gathering them, instead of
    # realigning the batch buffer afterwards (faster; then the gather is timed as "realign")
    fold_shift: bool = False
    kernel_backend: str | None = None  # "triton" / "torch" / "auto" for every kernel; None: $SPECDEC_KERNELS
    compile: bool = False  # torch.compile the target and draft forwards
    profile: bool = False  # time phases (draft / verify / accept / realign ...), synchronising at each boundary
    check_invariants: bool = False  # check I2-I6 after every step (slow, debugging and tests)
    cost_cache: str | None = None  # auto k: JSON file of calibrated costs (None: the user's cache directory)
    # a prompt with more uncached tokens than this is prefilled this many tokens per engine step, while the
    # running rows decode (and a step's other admissions prefill this many tokens at most); None: at once
    prefill_chunk: int | None = None

    def __post_init__(self):
        k = self.num_speculative_tokens
        if k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"num_speculative_tokens must be an int >= 0 or 'auto', got {k!r}")
        if not isinstance(self.max_speculative_tokens, int) or self.max_speculative_tokens < 1:
            raise ValueError(f"max_speculative_tokens must be an int >= 1, got {self.max_speculative_tokens!r}")
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {self.max_wait_steps}")
        if math.isnan(self.realign_cost_ratio) or self.realign_cost_ratio < 0:
            raise ValueError(f"realign_cost_ratio must be >= 0, got {self.realign_cost_ratio}")
        chunk = self.prefill_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill_chunk (--prefill-chunk) must be an int >= 1 (tokens; leave it unset to prefill "
                             f"prompts at once), got {chunk!r}")
        if self.kernel_backend is not None and self.kernel_backend not in BACKENDS:
            raise ValueError(f"kernel_backend must be one of {BACKENDS} or None, got {self.kernel_backend!r}")

    @property
    def auto_k(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def k_max(self) -> int:
        """The most drafts any step may propose (sizes the caches)."""
        return self.max_speculative_tokens if self.auto_k else int(self.num_speculative_tokens)
