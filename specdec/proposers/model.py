"""The draft-model proposer: k autoregressive forwards of a small model (or of a feature draft reading the
target's hidden states) on the batch's draft cache (its lag rule: `Batch.set_draft_lag`, specdec/batch.py)."""
from __future__ import annotations

import torch

from ..batch import finite_rows
from ..sampling import sample_race
from .base import Proposal


class ModelProposer:
    """k drafts per row from `ctx.draft`; every row always offers k (`plan` is None)."""

    uses_draft_model = True

    def __init__(self, name: str = "model"):
        self.name = name

    def plan(self, batch, k_max: int):
        return None

    def propose(self, ctx, batch, k: int, noise, plan=None) -> Proposal:
        """The first draft forward feeds each row's unseen tokens (T >= 2, or >= 1 for a feature draft: see
        `Batch.set_draft_lag` and `Batch.rewind_draft`), the next k - 1 one each. `noise`: the step's
        `sampling.StepNoise` (None when all greedy); `noise.race[:, j]`, the Exp(1) noise of position seq_len + j,
        samples the j-th draft of sampling rows. A row whose draft logits were not all finite offers no draft
        (length 0)."""
        V, params, cache = ctx.vocab_size, batch.params, batch.draft_cache
        T, fed = batch.rewind_draft()
        positions = batch.last_positions(T, cache.layout)  # [B, T]
        x = batch.tokens.gather(1, positions)  # [B, T]
        num_new = None if all(f == T for f in fed) else fed
        # a feature draft reads the target's hidden state before each token, then its own output (models/feature_draft.py)
        extra = {"features": batch.features_before(positions), "hidden": "last"} if batch.features is not None else {}
        drafts, probs = [], []
        ok = torch.ones(len(batch), dtype=torch.bool, device=x.device)  # [B]
        for j in range(k):
            logits = ctx.draft.forward(x, cache, num_new=num_new, logits="last", **extra)
            if extra:
                logits, extra["features"] = logits  # [B, 1, V], [B, 1, E]
            logits = logits[:, -1, :V]  # [B, V]
            ok &= finite_rows(logits)
            token = logits.argmax(dim=-1)  # [B]
            if noise is not None:
                q = params.probs(logits, ctx.probs_dtype)  # [B, V]
                token = torch.where(params.greedy, token, sample_race(q, noise.race[:, j]))
                probs.append(q)
            drafts.append(token)
            x, num_new = token[:, None], None  # [B, 1]
        ctx.metrics.draft_forwards += k
        length = torch.where(ok, k, 0)  # [B] int64
        return Proposal(torch.stack(drafts, dim=1), length, [k] * len(batch),
                        torch.stack(probs, dim=1) if probs else None, ok)

    def observe(self, batch, k: int, seq_before: list[int], counts: list[int], num_accepted, kept=None) -> None:
        """The draft cache keeps what the lag rule says (`Batch.set_draft_lag`); the step's first draft forward
        fed each row's sequence before the step. `kept` ([B] bool, host list): rows whose drafts were not this
        model's (a lookup's, `CombinedProposer`)."""
        before = batch.target_cache.length - num_accepted  # [B] the sequence before the step
        batch.set_draft_lag(before, seq_before, replaced=kept)

    def release(self, request) -> None:
        pass
