"""specdec's benchmarks, run from the repository root as modules: `python -m bench.NAME --help`. Every one runs
with the wait policy of the command-line programs (`specdec.openmp.default_wait_policy`: a bounded spin,
GOMP_SPINCOUNT=10000) unless the environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT, so that a benchmark
measures what `python -m specdec.run` gets (docs/api.md, "CPU threads")."""
from specdec.openmp import default_wait_policy

default_wait_policy()
