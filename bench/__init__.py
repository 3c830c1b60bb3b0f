"""specdec's benchmarks, run from the repository root as modules: `python -m bench.NAME --help`.

Shared pieces are in bench/common.py (timing, spreads, machine metadata, pairs) and specdec/timing.py (one
forward on a prefilled cache). Every benchmark runs with OMP_WAIT_POLICY=PASSIVE unless the environment sets
it: small per-token forwards on a shared, oversubscribed CPU are far slower with OpenMP's spin-waiting.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
