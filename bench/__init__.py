"""specdec's benchmarks, run from the repository root as modules: `python -m bench.NAME --help`. Every one runs
with OMP_WAIT_POLICY=PASSIVE unless the environment sets it: small per-token forwards on a shared CPU are far
slower with OpenMP's spin-waiting."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
