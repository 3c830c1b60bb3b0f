"""Schedulers, one per layout policy, one interface (`waiting`, `admit`, `select`, `postprocess`, `release`,
`running`); the step itself (schedule -> run -> postprocess) is `specdec.engine.Engine.step`.

- `ar`: target only, continuous batching in the ragged layout; the reference and the speed baseline.
- `eqspec`: continuous batching in the left-padded layout, realigned after every step (the paper's EQSPEC).
- `ragged`: per-row offsets, nothing ever moves; free rows take the next request.
- `exspec`: a pool of sequences, stepped in same-length groups (the paper's EXSPEC).
"""
from specdec.models.cache import LEFT_PADDED, RAGGED

from .continuous import ContinuousScheduler
from .exspec import PoolScheduler

SCHEDULERS = {
    "ar": lambda ctx, batch_size: ContinuousScheduler(ctx, batch_size, RAGGED),
    "eqspec": lambda ctx, batch_size: ContinuousScheduler(ctx, batch_size, LEFT_PADDED),
    "ragged": lambda ctx, batch_size: ContinuousScheduler(ctx, batch_size, RAGGED),
    "exspec": PoolScheduler,
}
SPECULATIVE = ("eqspec", "ragged", "exspec")
