"""CPU threads for the command-line programs: OpenMP's wait policy, set before torch loads OpenMP (this module
imports nothing that does), and `--threads auto`, the thread count that measures fastest on this machine.

OpenMP's idle threads either sleep at once (`OMP_WAIT_POLICY=PASSIVE`) or spin before they sleep. A decode
step is hundreds of short parallel regions, so each wake-up counts. Measured on a 2-core EPYC
(`python -m bench.decode_threads`, docs/benchmarks/quantized.md), a SmolLM2-135M decode step at two threads
against one: quiet machine, PASSIVE 0.78x (int4) and 1.05x (float32); a bounded spin (`GOMP_SPINCOUNT=10000`,
libgomp spins that many times, then sleeps) 1.26x and 1.28x; ACTIVE 1.34x and 1.27x. With one core busy
elsewhere, every policy's second thread loses (PASSIVE 0.91x, the spins 0.4-0.5x): then one thread is right.
So the programs spin briefly (`default_wait_policy`) and measure what a second thread does before they
serve (`choose_threads`); an environment that sets `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` keeps its own, and
a library user decides for their own process.
"""
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


def choose_threads(model, counts: list[int]) -> tuple[int, dict[int, float]]:
    """(the count whose batch-1 decode step of `model` is fastest, the median seconds per count). The counts
    are timed in interleaved rounds; more threads win only if at least MARGIN faster than fewer (noise and
    a shared machine favour fewer). torch's thread count is left at the winner."""
    import statistics

    import torch

    from specdec import timing

    times: dict[int, list[float]] = {n: [] for n in counts}
    with torch.inference_mode():
        for _ in range(THREADS_ROUNDS):
            for n in counts:
                torch.set_num_threads(n)
                step, _ = timing.time_forward(model, 1, 1, THREADS_CONTEXT, THREADS_REPEATS, logits="last")
                times[n].append(step)
    medians = {n: statistics.median(t) for n, t in times.items()}
    best = min(counts)
    for n in sorted(counts):
        if medians[n] < (1 - MARGIN) * medians[best]:
            best = n
    torch.set_num_threads(best)
    return best, medians


def apply_threads(value: str, model) -> str:
    """Set torch's thread count from a `--threads` value (`auto`, or a count already checked positive);
    returns what was done, for the program's start-up line."""
    import torch

    if value != "auto":
        torch.set_num_threads(int(value))
        return f"torch threads {value}"
    counts = thread_counts(torch.get_num_threads())
    if len(counts) == 1 or model.device.type != "cpu":
        return f"torch threads {torch.get_num_threads()}"
    best, medians = choose_threads(model, counts)
    timed = ", ".join(f"{n}: {medians[n] * 1e3:.1f} ms" for n in counts)
    return f"torch threads {best} (--threads auto: a decode step at {timed})"
