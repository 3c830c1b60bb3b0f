"""A draft model with a lookup beside it (`--draft DIR --lookup ngram|suffix`): the model drafts every row
(its cache stays in step), and a row whose lookup has at least `min_match` drafts (or k, if smaller)
takes the lookup's instead. Such a row's draft cache keeps only the sequence before the step (the model's
own drafts after it were not what the row accepted): `ModelProposer.observe`."""
from __future__ import annotations

import torch

from .base import Proposal, one_hot_probs, padded_drafts


class CombinedProposer:
    uses_draft_model = True

    def __init__(self, model, lookup, min_match: int = 2):
        self.model, self.lookup, self.min_match = model, lookup, min_match
        self.name = f"{model.name}+{lookup.name}"
        self._replaced: list[bool] = []  # rows that took the lookup's drafts in the step in flight

    def plan(self, batch, k_max: int) -> list[list[int]]:
        return self.lookup.plan(batch, k_max)

    def propose(self, ctx, batch, k: int, noise, plan) -> Proposal:
        proposal = self.model.propose(ctx, batch, k, noise)
        need = min(self.min_match, k)
        self._replaced = [len(d) >= need for d in plan]
        if not any(self._replaced):
            proposal.sources = [self.model.name] * len(plan)
            return proposal
        replaced = torch.tensor(self._replaced, device=proposal.tokens.device)  # [B] bool
        looked_up, found = padded_drafts(plan, k, proposal.tokens.device)  # [B, k]
        lengths = [n if r else k for n, r in zip(found, self._replaced)]
        tokens = torch.where(replaced[:, None], looked_up, proposal.tokens)  # [B, k]
        length = torch.where(replaced, torch.tensor(lengths, device=tokens.device), proposal.length)  # [B]
        probs = proposal.probs
        if probs is not None:  # a looked-up draft is deterministic: one-hot
            probs = torch.where(replaced[:, None, None], one_hot_probs(looked_up, probs.shape[-1], probs.dtype), probs)
        ctx.metrics.lookup_rows += sum(self._replaced)
        sources = [self.lookup.name if r else self.model.name for r in self._replaced]
        return Proposal(tokens, length, lengths, probs, proposal.finite | replaced, sources)

    def observe(self, batch, k, seq_before, counts, num_accepted, kept=None) -> None:
        self.model.observe(batch, k, seq_before, counts, num_accepted, kept=self._replaced or None)
        self.lookup.observe(batch, k, seq_before, counts, num_accepted)
        self._replaced = []

    def release(self, request) -> None:
        self.model.release(request)
        self.lookup.release(request)
