"""CPU threads for the command-line programs: OpenMP's wait policy, set before torch loads OpenMP (this module
imports nothing that does), and `--threads auto`, the thread count that measures fastest on this machine.

OpenMP's idle threads either sleep at once (`OMP_WAIT_POLICY=PASSIVE`) or spin before they sleep. A decode
step is hundreds of short parallel regions, so each wake-up counts. Measured on a 2-core EPYC
(`python -m bench.decode_threads`, docs/benchmarks/quantized.md), a SmolLM2-135M decode step at two threads
against one: quiet machine, PASSIVE 0.78x (int4) and 1.05x (float32); a bounded spin (`GOMP_SPINCOUNT=10000`,
libgomp spins that many times, then sleeps) 1.26x and 1.28x; ACTIVE 1.34x and 1.27x. With one core busy
elsewhere, every policy's second thread loses (PASSIVE 0.91x, the spins 0.4-0.5x): then one thread is right.
So the programs spin briefly (`default_wait_policy`) and measure what a second thread does before they
serve (`apply_threads`: timed by the start-up measurement, specdec/startup.py, and cached with its other
timings; a cached choice is timed again at its count and measured anew if that is off by more than
startup.SPOT_CHECK_FACTOR, as when a core has got busy since); an environment that sets `OMP_WAIT_POLICY` or
`GOMP_SPINCOUNT` keeps its own, and a library user decides for their own process.
"""
from __future__ import annotations

import os

SPIN_COUNT = "10000"  # GOMP_SPINCOUNT: ~10-50 us of spinning, then sleep (libgomp's default is 300,000)
THREADS_CONTEXT = 128  # the decode step timed: batch 1, one token after this many
THREADS_REPEATS = 5  # forwards per count and round
THREADS_ROUNDS = 3  # rounds, the counts interleaved
MARGIN = 0.03


def default_wait_policy() -> None:
    """GOMP_SPINCOUNT=SPIN_COUNT unless the environment sets a wait policy or a spin count. Has an effect only
    before torch is imported."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def thread_counts(available: int) -> list[int]:
    """The counts `--threads auto` times: one, half and all of torch's default."""
    return sorted({1, max(1, available // 2), max(1, available)})


def decode_step_seconds(model, count: int, measurement) -> float:
    """The median seconds of a batch-1 decode step of `model` (one token after THREADS_CONTEXT) at `count`
    threads, timed by `measurement` (a `startup.StartupMeasurement`); torch is left at `count` threads."""
    import torch

    torch.set_num_threads(count)
    seconds, _ = measurement.time_forward(model, 1, 1, THREADS_CONTEXT, THREADS_REPEATS, logits="last")
    return seconds


def time_threads(model, counts: list[int], measurement) -> dict[int, float]:
    """{count: the median seconds of a batch-1 decode step of `model`}, the counts timed in THREADS_ROUNDS
    interleaved rounds (a machine that gets busier slows every count alike)."""
    import statistics

    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(THREADS_ROUNDS):
        for n in counts:
            times[n].append(decode_step_seconds(model, n, measurement))
    return {n: statistics.median(t) for n, t in times.items()}


def fastest_count(medians: dict[int, float]) -> int:
    """The count to run at: more threads win only if at least MARGIN faster than fewer (noise and a shared
    machine favour fewer)."""
    best = min(medians)
    for n in sorted(medians):
        if medians[n] < (1 - MARGIN) * medians[best]:
            best = n
    return best


def apply_threads(value: str, model, measurement=None, spec=None) -> str:
    """Set torch's thread count from a `--threads` value (`auto`, or a count already checked positive);
    returns what was done, for the program's start-up line. `auto` times `model` through `measurement` (a
    `startup.StartupMeasurement`; None: one of its own) and caches the times when `spec`, what the model was
    loaded from, identifies it (`startup.model_identity`)."""
    import torch

    from specdec import startup

    if value != "auto":
        torch.set_num_threads(int(value))
        return f"torch threads {value}"
    counts = thread_counts(torch.get_num_threads())
    if len(counts) == 1 or model.device.type != "cpu":
        return f"torch threads {torch.get_num_threads()}"
    measurement = measurement if measurement is not None else startup.StartupMeasurement()
    model_id = startup.model_identity(model, spec)
    key = startup.cache_key("threads", [model_id], model.dtype, model.device, startup.forward_variant(model),
                            f"counts={','.join(map(str, counts))}", f"ctx={THREADS_CONTEXT}") if model_id else None

    def still_holds(medians: dict[int, float]) -> bool:  # the cached winner's step, timed again
        best = fastest_count(medians)
        return startup.within_factor(decode_step_seconds(model, best, measurement), medians[best])

    def timed(medians: dict[int, float]) -> str:
        return ", ".join(f"{n}: {medians[n] * 1e3:.1f} ms" for n in counts)

    medians, cached = measurement.measure(
        key, lambda: time_threads(model, counts, measurement),
        decode=lambda entry: {n: float(entry[str(n)]) for n in counts},
        describe=lambda medians: f"threads {fastest_count(medians)} ({timed(medians)})", check=still_holds)
    best = fastest_count(medians)
    torch.set_num_threads(best)
    return f"torch threads {best} (--threads auto{', cached' if cached else ''}: a decode step at {timed(medians)})"
