"""`GET /metrics`: the server's Prometheus metrics (prometheus-client, its text exposition format).

The engine's cumulative counters (tokens, drafts, the k histogram) are read from the snapshot the engine
thread takes after every step (`EngineWorker.stats`), so a scrape never reads state that a step is
changing; latencies are observed by the event loop as each request's tokens arrive."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    """Collects the engine's state at scrape time: rows running, requests waiting, the counters of its
    `RunMetrics`, and the histogram of k (drafts proposed per step) as a Prometheus histogram."""

    def __init__(self, worker, k_max: int):
        self.worker, self.k_max = worker, k_max

    def collect(self):
        stats = self.worker.stats()
        yield GaugeMetricFamily("specdec_num_requests_running", "Requests holding a batch row",
                                value=stats["running"])
        yield GaugeMetricFamily("specdec_num_requests_waiting", "Requests accepted and waiting for a batch row",
                                value=stats["waiting"])
        for name, key, text in (
                ("specdec_generation_tokens", "generated_tokens", "Tokens generated (all requests, aborted ones too)"),
                ("specdec_spec_decode_proposed_drafts", "proposed_drafts", "Draft tokens proposed for verification"),
                ("specdec_spec_decode_accepted_drafts", "accepted_drafts", "Draft tokens the target accepted"),
                ("specdec_engine_steps", "steps", "Engine decoding steps")):
            yield CounterMetricFamily(name, text, value=stats[key])
        yield GaugeMetricFamily("specdec_spec_decode_acceptance_rate", "Accepted / proposed drafts over the "
                                "server's life (0 before any draft)", value=stats["acceptance_rate"])
        by_drafter = stats.get("drafts_by_drafter", {})  # name -> (proposed, accepted)
        proposed = CounterMetricFamily("specdec_spec_decode_drafter_proposed_drafts", "Draft tokens proposed, by "
                                       "drafter (model, feature, ngram, suffix)", labels=["drafter"])
        accepted = CounterMetricFamily("specdec_spec_decode_drafter_accepted_drafts", "Draft tokens the target "
                                       "accepted, by drafter", labels=["drafter"])
        rate = GaugeMetricFamily("specdec_spec_decode_drafter_acceptance_rate", "Accepted / proposed drafts, by "
                                 "drafter", labels=["drafter"])
        for name, (n_proposed, n_accepted) in sorted(by_drafter.items()):
            proposed.add_metric([name], n_proposed)
            accepted.add_metric([name], n_accepted)
            rate.add_metric([name], n_accepted / n_proposed if n_proposed else 0.0)
        yield proposed
        yield accepted
        yield rate
        yield CounterMetricFamily("specdec_prefill_chunks", "Prompt chunks prefilled while other rows decoded "
                                  "(--prefill-chunk)", value=stats.get("prefill_chunks", 0))
        cache = stats.get("prefix_cache")  # None without --prefix-cache-gb
        if cache is not None:
            for name, key, text in (
                    ("specdec_prefix_cache_queried_tokens", "queried_tokens", "Prompt tokens looked up in the prefix "
                     "cache (a prompt shared by n choices once)"),
                    ("specdec_prefix_cache_hit_tokens", "hit_tokens", "Prompt tokens found in the prefix cache: "
                     "copied in, not prefilled"),
                    ("specdec_prefix_cache_evictions", "evictions", "Prefix cache entries (tree nodes) evicted to "
                     "stay within the budget"),
                    ("specdec_prefix_cache_evicted_tokens", "evicted_tokens", "Tokens of the evicted entries")):
                yield CounterMetricFamily(name, text, value=cache[key])
            yield GaugeMetricFamily("specdec_prefix_cache_bytes", "Bytes the prefix cache holds (K/V and features)",
                                    value=cache["bytes"])
            yield GaugeMetricFamily("specdec_prefix_cache_budget_bytes", "The prefix cache's budget "
                                    "(--prefix-cache-gb)", value=cache["budget_bytes"])
        counts = stats["k_histogram"]  # k -> steps
        buckets, running = [], 0
        for k in range(max([self.k_max, *counts]) + 1):
            running += counts.get(k, 0)
            buckets.append((str(float(k)), running))
        buckets.append(("+Inf", running))
        yield HistogramMetricFamily("specdec_speculative_k", "Drafts proposed per engine step (k; 0 = a step "
                                    "without the draft)", buckets=buckets,
                                    sum_value=sum(k * n for k, n in counts.items()))
        off = CounterMetricFamily("specdec_drafting_off_steps", "Engine steps auto k chose without drafts, by why "
                                  "(specdec/autok.py K0_REASONS)", labels=["reason"])
        for reason, steps in sorted(stats.get("k0_reasons", {}).items()):
            off.add_metric([reason], steps)
        yield off


class ServerMetrics:
    """Every metric of one server, in its own registry. `forward`: what runs the target's steps, as labels
    (specdec/summary.py `forward_info`: forward, isa, reason), exposed as `specdec_forward_info`."""

    def __init__(self, worker, k_max: int, forward: dict[str, str] | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(worker, k_max))
        if forward is not None:
            Info("specdec_forward", "What runs the target's steps: forward (native: one C++ call a step; torch), the "
                 "CPU quantized kernel's instruction set (isa: scalar, avx2, avx512-vnni; none where it is not used) "
                 "and why not native (reason)", registry=self.registry).info(forward)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From a request's arrival to its first "
                              "token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("specdec_inter_token_latency_seconds", "Time between a request's tokens: "
                                     "each token of a step that emits n tokens, dt after the previous ones, "
                                     "counts dt / n", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("specdec_requests_finished", "Requests finished, by finish reason (stop, length, "
                                "abort: the client went away or the server shut down)", ["finish_reason"],
                                registry=self.registry)
        self.rejected = Counter("specdec_requests_rejected", "Requests refused with an error, by HTTP status",
                                ["status"], registry=self.registry)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
