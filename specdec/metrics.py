"""Run metrics every strategy reports: throughput, acceptance, tokens per step, forward counts, the k
chosen at each step and, when profiling, the time split into draft / verify / accept / realign / other."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PHASES = ("prefill", "draft", "verify", "accept", "realign", "other")


@dataclass
class RunMetrics:
    method: str
    batch_size: int
    drafter: str | None = None  # where drafts came from (the proposer's name): "model", "feature", "ngram", "suffix",
    # "model+suffix" ...
    num_requests: int = 0
    generated_tokens: int = 0
    first_tokens: int = 0  # first tokens, emitted by the prefill rather than by a decoding step
    wall_time_s: float = 0.0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    row_steps: int = 0  # sum over steps of the rows verified (or decoded, for AR)
    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    grouped_steps: int = 0  # EXSPEC: steps whose batch needed no realignment
    lookup_rows: int = 0  # a draft model with a lookup beside it: row-steps that took the lookup's drafts
    prefix_queried_tokens: int = 0  # prefix cache: prompt tokens looked up (each distinct prompt once) ...
    prefix_hit_tokens: int = 0  # ... and found there: copied in instead of prefilled
    prefill_chunks: int = 0  # chunked prefill: chunks fed (one per engine step at most)
    drafts_by_drafter: dict = field(default_factory=dict)  # drafter name -> [proposed, accepted] drafts
    k_histogram: dict = field(default_factory=dict)  # k -> steps that proposed k drafts (0: target-only)
    k0_reasons: dict = field(default_factory=dict)  # auto k: why steps were chosen without drafts -> steps
    predicted_step_s: float = 0.0  # auto k: the cost model's predicted time of the steps it chose ...
    measured_step_s: float = 0.0  # ... and their measured wall time
    calibration_s: float = 0.0  # auto k: measuring (or spot-checking) forward costs; not in wall_time_s
    profiled: bool = False  # phase_time_s is filled only with profile=True (timing synchronises)
    phase_time_s: dict = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    latencies_s: list = field(default_factory=list)
    ttfts_s: list = field(default_factory=list)

    def record_step(self, k: int) -> None:
        self.steps += 1
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1

    def record_drafting_off(self, reason: str | None) -> None:
        """A step auto k chose without drafts, and why (autok.K0_REASONS; None: not auto k's choice)."""
        if reason is not None:
            self.k0_reasons[reason] = self.k0_reasons.get(reason, 0) + 1

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens a row gains per decoding step: 1 for AR, 1 + accepted drafts for speculation."""
        return (self.generated_tokens - self.first_tokens) / self.row_steps if self.row_steps else 0.0

    @property
    def realign_share(self) -> float:
        """Realignment's share of decoding-step time (prefill excluded)."""
        total = sum(t for phase, t in self.phase_time_s.items() if phase != "prefill")
        return self.phase_time_s["realign"] / total if total else 0.0

    @property
    def grouping_rate(self) -> float:
        return self.grouped_steps / self.steps if self.steps else 0.0

    def latency_percentiles(self, which: str = "latency") -> dict:
        values = torch.tensor(self.latencies_s if which == "latency" else self.ttfts_s, dtype=torch.float64)
        if not len(values):
            return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
        q = torch.quantile(values, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64))
        return {"p50": float(q[0]), "p95": float(q[1]), "p99": float(q[2])}

    def as_dict(self) -> dict:
        return {
            "method": self.method, "batch_size": self.batch_size, "num_requests": self.num_requests,
            "generated_tokens": self.generated_tokens, "wall_time_s": self.wall_time_s,
            "tokens_per_s": self.tokens_per_s, "acceptance_rate": self.acceptance_rate,
            "proposed_drafts": self.proposed_drafts, "accepted_drafts": self.accepted_drafts,
            "mean_tokens_per_step": self.mean_tokens_per_step, "steps": self.steps,
            "target_forwards": self.target_forwards, "draft_forwards": self.draft_forwards,
            "realign_share": self.realign_share, "grouping_rate": self.grouping_rate,
            "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
            "k0_reasons": dict(self.k0_reasons),
            "predicted_step_s": self.predicted_step_s, "measured_step_s": self.measured_step_s,
            "calibration_s": self.calibration_s, "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_queried_tokens": self.prefix_queried_tokens, "prefill_chunks": self.prefill_chunks,
            "phase_time_s": dict(self.phase_time_s) if self.profiled else None,
            "latency_s": self.latency_percentiles("latency"), "ttft_s": self.latency_percentiles("ttft"),
        }


class PhaseTimer:
    """Accumulates wall time per phase into `metrics.phase_time_s` when enabled (profiling), synchronising
    CUDA at each boundary so the split is real; disabled, a phase costs nothing and never synchronises."""

    def __init__(self, metrics: RunMetrics, device, enabled: bool = False):
        self.metrics = metrics
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = enabled
        metrics.profiled = enabled

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.metrics.phase_time_s[name] += time.perf_counter() - t0
