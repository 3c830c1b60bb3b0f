"""specdec.kernels: one module per op, each with a Triton kernel, a pure-torch reference and a validating
wrapper that dispatches between them (`dispatch.py`: Triton on CUDA, the reference elsewhere, or what
`backend=` asks for: an engine's `kernel_backend`).

- `realign`: shift rows of the target's and draft's caches by per-row deltas (left-padded layout);
- `positions`: positions, write columns and attention mask of a step from (start, length);
- `rejection`: greedy and random acceptance of drafts, residual and bonus sampling;
- `kv_append`: scatter K/V at per-row columns (ragged layout);
- `bi_matmul`: batch-invariant matmul (a fixed summation order per row) for `batch_invariant=True` linears;
- `bi_attention`: batch-invariant attention over the cache (each query's keys summed in one fixed order);
- `quant_matmul`: weight-only int4 / int8 matmul, the weight dequantized in registers (batch-invariant);
- `rmsnorm`: batch-invariant RMSNorm (HF's order), optionally fused with the residual add;
- `noise`: uniforms keyed by (seed, position, stream, index) (Philox4x32-10, `tl.randint4x`), the
  randomness of sampling.

This top-level `kernels/` folder installs as `specdec.kernels` (setup.py's package_dir): import it as
`from specdec.kernels.realign import realign`. Importing never imports triton (see `dispatch.lazy_jit`).
"""
import importlib.machinery
import importlib.util
import os
import sys


def _hand_over_to_installed_kernels() -> None:
    """Run from a source checkout, the repository root is on sys.path (`python -m ...` puts the working
    directory first), and `import kernels` finds this folder instead of the PyPI package `kernels` that
    transformers (>= 5.x) imports. Imported under that top-level name, this module puts the installed package
    in its place (the import statement then returns it); with none installed it stays this folder."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return  # none installed: stay this folder (older transformers probe `import kernels` and move on)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_to_installed_kernels()
