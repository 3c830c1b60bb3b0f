"""A draft model with a lookup beside it (`--draft DIR --lookup ngram|suffix`; the default pair's `lookup=auto`):
free drafts first. A row whose lookup has at least `min_match` drafts (or k, if smaller) takes them, unless its
lookup drafts have been accepted markedly less often than the model's (each row's record of both, decayed);
the model drafts the other rows, and where no row needs it, the model does not run at all (no draft forward: a
lookup's drafts cost nothing). A row that took the lookup's drafts keeps only the sequence before the step in its
draft cache (the model's drafts after it were not what the row accepted: `ModelProposer.observe`); where the model
did not run, the draft cache is left as it was and catches up in the model's next forward (its lag,
`Batch.set_draft_lag`), as after a step of the target alone."""
from __future__ import annotations

import torch

from .base import Proposal, host_proposal, one_hot_probs, padded_drafts

DECAY = 0.8  # per step a row drafts from a source: its recent acceptance weighs more
PRIOR = (0.6, 1.0)  # a row's unmeasured record of each source: [accepted, offered] pseudo-counts
WORSE = 0.5  # a row's lookup is passed over while its acceptance is below this fraction of the model's


class CombinedProposer:
    uses_draft_model = True

    def __init__(self, model, lookup, min_match: int = 2):
        self.model, self.lookup, self.min_match = model, lookup, min_match
        self.name = f"{model.name}+{lookup.name}"
        self._replaced: list[bool] = []  # rows that took the lookup's drafts in the step in flight
        self._offered: list[int] = []  # each row's drafts in the step in flight
        self._model_ran = False
        self.records: dict = {}  # request key -> {"lookup": [accepted, offered], "model": [...]}

    def plan(self, batch, k_max: int) -> list[list[int]]:
        return self.lookup.plan(batch, k_max)

    def _record(self, request) -> dict:
        return self.records.setdefault(request.key, {"lookup": list(PRIOR), "model": list(PRIOR)})

    def takes_lookup(self, request, drafts: list[int], need: int) -> bool:
        """Whether a row takes its lookup's drafts: enough of them, and its lookup not measured markedly worse
        than its model."""
        if len(drafts) < need:
            return False
        record = self._record(request)
        rate = {source: accepted / offered for source, (accepted, offered) in record.items()}
        return rate["lookup"] >= WORSE * rate["model"]

    def propose(self, ctx, batch, k: int, noise, plan) -> Proposal:
        need = min(self.min_match, k)
        self._replaced = [self.takes_lookup(r, d, need) for r, d in zip(batch.requests, plan)]
        self._model_ran = not all(self._replaced)
        sources = [self.lookup.name if r else self.model.name for r in self._replaced]
        if not self._model_ran:  # every row has free drafts: no draft forward
            ctx.metrics.lookup_rows += len(plan)
            width = max(len(d) for d in plan)  # the step verifies the longest offer only
            proposal = host_proposal(plan, min(k, width), batch.params, ctx.vocab_size, ctx.probs_dtype, ctx.device)
            proposal.sources, proposal.forwards = sources, 0
            self._offered = list(proposal.lengths)
            return proposal
        proposal = self.model.propose(ctx, batch, k, noise)
        if not any(self._replaced):
            proposal.sources = sources
            self._offered = list(proposal.lengths)
            return proposal
        width = proposal.tokens.shape[1]  # the model's rows may have stopped early: the lookup's fit within k
        width = max(width, max(min(len(d), k) for d, r in zip(plan, self._replaced) if r))
        replaced = torch.tensor(self._replaced, device=proposal.tokens.device)  # [B] bool
        looked_up, found = padded_drafts(plan, width, proposal.tokens.device)  # [B, width]
        model_tokens = torch.nn.functional.pad(proposal.tokens, (0, width - proposal.tokens.shape[1]))  # [B, width]
        lengths = [n if r else m for n, m, r in zip(found, proposal.lengths, self._replaced)]
        tokens = torch.where(replaced[:, None], looked_up, model_tokens)  # [B, width]
        length = torch.where(replaced, torch.tensor(lengths, device=tokens.device), proposal.length)  # [B]
        probs = proposal.probs
        if probs is not None:  # a looked-up draft is deterministic: one-hot; the model's rows padded with theirs
            probs = torch.nn.functional.pad(probs, (0, 0, 0, width - probs.shape[1]), value=0.0)  # [B, width, V]
            probs = torch.where(replaced[:, None, None], one_hot_probs(looked_up, probs.shape[-1], probs.dtype), probs)
        ctx.metrics.lookup_rows += sum(self._replaced)
        self._offered = lengths
        return Proposal(tokens, length, lengths, probs, proposal.finite | replaced, sources, proposal.forwards)

    def observe(self, batch, k, seq_before, counts, num_accepted, kept=None) -> None:
        if self._model_ran:
            self.model.observe(batch, k, seq_before, counts, num_accepted, kept=self._replaced or None)
        self.lookup.observe(batch, k, seq_before, counts, num_accepted)
        for request, replaced, offered, accepted in zip(batch.requests, self._replaced, self._offered, counts):
            if offered:  # a draft after the first rejection was never tested (autok.KChooser.record_acceptance)
                record = self._record(request)["lookup" if replaced else "model"]
                record[0] = DECAY * record[0] + accepted
                record[1] = DECAY * record[1] + accepted + (accepted < offered)
        self._replaced, self._offered = [], []

    def release(self, request) -> None:
        self.model.release(request)
        self.lookup.release(request)
        self.records.pop(request.key, None)
