"""OpenMP's wait policy for the command-line programs, set before torch loads OpenMP (this module imports
nothing that does).

With OpenMP's default spin-waiting, every parallel region of a small decode forward waits for the other
threads to be scheduled: on a shared 2-core CPU a 2-thread int4 decode step measured 585 ms against 56 ms
with `OMP_WAIT_POLICY=PASSIVE`, and a float32 one 284 against 104 ms (docs/benchmarks/prefill-and-step.md).
`python -m specdec.run`, `specdec.serve` and `specdec.train` therefore default to PASSIVE; an environment
that sets the variable keeps its own (ACTIVE can win on a dedicated machine), and a library user decides for
their own process.
"""
import os


def default_to_passive_waits() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment sets it. Has an effect only before torch is imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
