"""Decoding strategies, one module each, one interface: `run(ctx, requests, batch_size, progress)`.

- `ar`: target only, continuous batching; the reference for equivalence and the speed baseline.
- `eqspec`: left-padded (rectangular) layout, realign after every verification (the paper's EQSPEC).
- `ragged`: per-row offsets, nothing ever moves; free rows take the next prompt.
- `exspec`: a pool of sequences, batched in same-length groups (the paper's EXSPEC).
"""
from . import ar, eqspec, exspec, ragged

STRATEGIES = {"ar": ar, "eqspec": eqspec, "ragged": ragged, "exspec": exspec}
SPECULATIVE = ("eqspec", "ragged", "exspec")
