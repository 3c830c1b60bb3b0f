"""specdec.kernels: one module per op, each with a Triton kernel, a pure-torch reference and a validating
wrapper that dispatches between them (`dispatch.py`: Triton on CUDA, the reference elsewhere, or what
`backend=` / `$SPECDEC_KERNELS` asks for).

- `realign`: shift rows of the target's and draft's caches by per-row deltas (left-padded layout);
- `positions`: positions, write columns and attention mask of a step from (start, length);
- `rejection`: greedy and random acceptance of drafts, residual and bonus sampling;
- `kv_append`: scatter K/V at per-row columns (ragged layout);
- `bi_matmul`: batch-invariant matmul (a fixed summation order per row) for `batch_invariant=True` linears;
- `bi_attention`: batch-invariant attention over the cache (each query's keys summed in one fixed order);
- `quant_matmul`: weight-only int4 / int8 matmul, the weight dequantized in registers (batch-invariant);
- `noise`: uniforms keyed by (seed, position, stream, index) (Philox4x32-10, `tl.randint4x`), the
  randomness of sampling.

This top-level `kernels/` folder installs as `specdec.kernels` (setup.py's package_dir): import it as
`from specdec.kernels.realign import realign`. Importing never imports triton (see `dispatch.lazy_jit`).
"""
