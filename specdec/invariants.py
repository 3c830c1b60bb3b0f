"""Invariant checks after every step (debug mode: `LLM(check_invariants=True)`, `--check-invariants`; on for
every LLM of the test suite). Each failure names the invariant, the row and the column.

- lengths: the target caches all tokens but the last, the draft a shorter prefix (see batch.py), and
  the host mirrors of start/length equal the device values;
- I2 positions and I4 KV correspondence: layer-0 K/V depend only on (token, position), so recomputing
  them for every cached token of every row and comparing with the cache columns `start + t` catches
  positions that count padding, rejected drafts left in the cache and rows shifted wrongly;
- I3 attention: the mask of a one-token step lets row i see exactly its columns start..start+length;
- I6 rectangular (left-padded layout): start + length is the same for every row; ragged: start = 0.
"""
from __future__ import annotations

import torch

from specdec.models.cache import LEFT_PADDED, RAGGED

from .batch import DRAFT_LAG


class InvariantError(AssertionError):
    pass


def _tolerance(dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)


def check_cache(name: str, model, cache, sequences: list[list[int]], lag: int, exact: bool = True,
                features=None) -> None:
    """`cache` must hold the first len(seq) - lag tokens of every row's sequence (`exact=False`: at most
    that many: the draft, whose lag varies). `features(i, n)` [1, n, E]: a feature draft's input for row i's
    first n tokens (its K/V depend on them too)."""
    B = cache.batch_size
    start, length = cache.start.tolist(), cache.length.tolist()
    if (start, length) != (cache.host_start, cache.host_length):
        raise InvariantError(f"lengths: {name}: host mirror (start {cache.host_start}, length {cache.host_length}) "
                             f"differs from the device (start {start}, length {length})")
    for i in range(B):
        expected = len(sequences[i]) - lag
        if length[i] != expected if exact else not 0 <= length[i] <= expected:
            raise InvariantError(f"lengths: {name} row {i}: cache length {length[i]}, expected "
                                 f"{'' if exact else 'at most '}{expected}")
        if start[i] < 0 or start[i] + length[i] > cache.capacity:
            raise InvariantError(f"bounds: {name} row {i}: columns {start[i]}..{start[i] + length[i]} outside the cache")
    ends = {s + n for s, n in zip(start, length)}
    if cache.layout == LEFT_PADDED and exact and len(ends) > 1:
        raise InvariantError(f"I6 rectangular: {name} rows end at different columns {sorted(ends)}")
    if cache.layout == RAGGED and any(start):
        raise InvariantError(f"ragged layout: {name} row {start.index(next(s for s in start if s))} has start != 0")

    plan = cache.plan(1)
    for i in range(B):
        want = torch.zeros(plan.width, dtype=torch.bool)
        want[start[i]: start[i] + length[i] + 1] = True
        got = plan.mask[i, 0].cpu()
        if not torch.equal(got, want):
            col = int((got != want).nonzero()[0])
            raise InvariantError(f"I3 attention: {name} row {i} column {col}: mask is {bool(got[col])}, expected {bool(want[col])}")

    if not hasattr(model, "layer0_kv"):
        return  # a foreign model without the cheap recomputation hook: lengths, layout and mask only
    tol = _tolerance(cache.k.dtype)
    if getattr(model, "compiled_forward", None) is not None:  # inductor's float32 rsqrt differs in the last bit
        tol = max(tol, 1e-5)
    for i in range(B):
        n = length[i]
        if n == 0:
            continue
        tokens = torch.tensor(sequences[i][:n], device=cache.k.device)[None]  # [1, n]
        positions = torch.arange(n, device=cache.k.device)[None]  # [1, n]
        extra = () if features is None else (features(i, n),)
        k_ref, v_ref = model.layer0_kv(tokens, positions, *extra)  # [1, H_kv, n, D]
        cols = slice(start[i], start[i] + n)
        for what, ref, got in (("K", k_ref[0], cache.k[0, i, :, cols]), ("V", v_ref[0], cache.v[0, i, :, cols])):
            err = (ref.double() - got.double()).abs().amax(dim=(0, 2))  # [n]
            scale = ref.double().abs().amax().clamp(min=1.0)
            bad = (err > tol * scale).nonzero()
            if len(bad):
                t = int(bad[0])
                which = "I2 positions / I4 KV correspondence"
                raise InvariantError(
                    f"{which}: {name} row {i} column {start[i] + t} (token {sequences[i][t]} at index {t}): "
                    f"cached {what} differs from recomputation by {float(err[t]):.3g}")


def check_invariants(ctx, batch) -> None:
    sequences = [r.prompt_ids + r.output_ids for r in batch.requests]
    seq_len = batch.seq_len.tolist()
    for i, seq in enumerate(sequences):
        if seq_len[i] != len(seq) or batch.tokens[i, : len(seq)].tolist() != seq:
            raise InvariantError(f"row state: row {i}: device sequence differs from request {batch.requests[i].index}")
    check_cache("target", ctx.target, batch.target_cache, sequences, lag=1)
    if batch.draft_cache is not None:
        features = None
        if batch.features is not None:  # a feature draft fed token p with the target's hidden state at p - 1

            def features(i, n):
                zero = batch.features.new_zeros(1, 1, batch.features.shape[2])  # [1, 1, E]: before position 0
                return torch.cat([zero, batch.features[i: i + 1, : n - 1]], dim=1)  # [1, n, E]
        # lag 1: a feature draft, or a row that took a lookup's drafts (proposers/combined.py)
        lag = 1 if batch.features is not None or getattr(ctx.proposer, "lookup", None) is not None else DRAFT_LAG
        check_cache("draft", ctx.draft, batch.draft_cache, sequences, lag=lag,
                    exact=False, features=features)
        if batch.target_cache.layout == LEFT_PADDED and not torch.equal(batch.target_cache.start, batch.draft_cache.start):
            raise InvariantError("I6 rectangular: target and draft rows start at different columns")
