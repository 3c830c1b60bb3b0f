"""The draft-model proposer: up to k autoregressive forwards of a small model (or of a feature draft reading the
target's hidden states) on the batch's draft cache (its lag rule: `Batch.set_draft_lag`, specdec/batch.py), each
row stopping when unsure.

Drafts that stop when unsure: after each draft forward a row's chance that all its drafts so far will be accepted
is the product of the draft's top probabilities, each calibrated by the acceptance measured at that probability
(`KChooser.calibrated`); where it falls below the threshold (`KChooser.stop_threshold`: where one more draft no
longer pays, from the measured costs; or the `draft_confidence` option) the row's drafting ends, without the
unsure draft, and when every row has stopped no further draft forward runs. The verify then covers the longest
row's drafts. Exact: it only shortens what the target verifies. Reading the rows' stops needs the host, so it runs
where that costs nothing: on the CPU."""
from __future__ import annotations

import torch

from ..batch import finite_rows
from ..options import AUTO
from ..sampling import sample_race
from .base import Proposal


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """The softmax's largest value of each row of logits [B, V]: [B] (1 / sum exp(l - max))."""
    return torch.exp(logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1))


class ModelProposer:
    """Up to k drafts per row from `ctx.draft`; every row can offer k (`plan` is None)."""

    uses_draft_model = True

    def __init__(self, name: str = "model"):
        self.name = name
        self._confidence: list[list[float]] = []  # the step in flight: each row's drafts' top probabilities
        self._offered: list[int] = []  # ... and its drafts
        self._chooser = None
        self.forwards = 0  # draft forwards of the step in flight

    def plan(self, batch, k_max: int):
        return None

    def threshold(self, ctx, batch, k: int) -> float:
        """The chance of acceptance below which a row stops drafting (0: never), where stopping costs nothing."""
        setting = ctx.options.speculation.draft_confidence
        if ctx.device.type != "cpu" or k < 2:
            return 0.0
        if setting == AUTO:
            return ctx.chooser.stop_threshold(batch, k) if ctx.chooser is not None else 0.0
        return float(setting)

    def propose(self, ctx, batch, k: int, noise, plan=None) -> Proposal:
        """The first draft forward feeds each row's unseen tokens (T >= 2, or >= 1 for a feature draft: see
        `Batch.set_draft_lag` and `Batch.rewind_draft`), the next ones one each, until k drafts or until every row
        has stopped (the module docstring). `noise`: the step's `sampling.StepNoise` (None when all greedy);
        `noise.race[:, j]`, the Exp(1) noise of position seq_len + j, samples the j-th draft of sampling rows. A row
        whose draft logits were not all finite offers no draft (length 0)."""
        V, params, cache = ctx.vocab_size, batch.params, batch.draft_cache
        T, fed = batch.rewind_draft()
        positions = batch.last_positions(T, cache.layout)  # [B, T]
        x = batch.tokens.gather(1, positions)  # [B, T]
        num_new = None if all(f == T for f in fed) else fed
        # a feature draft reads the target's hidden state before each token, then its own output (models/feature_draft.py)
        extra = {"features": batch.features_before(positions), "hidden": "last"} if batch.features is not None else {}
        threshold = self.threshold(ctx, batch, k)
        subset = getattr(ctx.draft, "head_ids", None)  # [N] the draft head's tokens, where it is restricted
        calibrate = ctx.chooser.calibrated if ctx.chooser is not None else (lambda c: c)
        B = len(batch)
        lengths = [k] * B  # each row's drafts, as it stops
        chance = torch.ones(B, device=x.device)  # [B] each row's drafts so far all accepted, calibrated
        confidence = []  # [B] per draft: the draft's top probability
        drafts, probs = [], []
        ok = torch.ones(B, dtype=torch.bool, device=x.device)  # [B]
        for j in range(k):
            logits = ctx.draft.forward(x, cache, num_new=num_new, logits="last", **extra)
            if extra:
                logits, extra["features"] = logits  # [B, 1, V], [B, 1, E]
            logits = logits[:, -1, :V]  # [B, V]
            # a head restricted to a subset of the vocabulary (restrict_head) gives -inf outside it, by design
            ok &= finite_rows(logits if subset is None else logits.index_select(1, subset))
            token = logits.argmax(dim=-1)  # [B]
            if noise is not None:
                q = params.probs(logits, ctx.probs_dtype)  # [B, V]
                token = torch.where(params.greedy, token, sample_race(q, noise.race[:, j]))
                probs.append(q)
            drafts.append(token)
            x, num_new = token[:, None], None  # [B, 1]
            if threshold > 0:  # the host reads each row's chance: free on the CPU, the only place this runs
                top = top_probability(logits)  # [B]
                confidence.append(top)
                chance = chance * calibrate(top)  # [B]
                if j >= 1:  # every drafting row keeps its first draft
                    unsure = (chance < threshold).tolist()
                    lengths = [min(n, j) if u else n for n, u in zip(lengths, unsure)]
                    if all(n <= j for n in lengths):
                        break
        self.forwards = len(drafts)
        ctx.metrics.draft_forwards += self.forwards
        width = max(lengths)
        self._chooser = ctx.chooser
        self._confidence = torch.stack(confidence, dim=1).tolist() if confidence else []  # [B, forwards]
        self._offered = lengths
        length = torch.where(ok, torch.tensor(lengths, device=x.device), 0)  # [B] int64
        return Proposal(torch.stack(drafts[:width], dim=1), length, lengths,
                        torch.stack(probs[:width], dim=1) if probs else None, ok, forwards=self.forwards)

    def observe(self, batch, k: int, seq_before: list[int], counts: list[int], num_accepted, kept=None) -> None:
        """The draft cache keeps what the lag rule says (`Batch.set_draft_lag`); the step's first draft forward
        fed each row's sequence before the step. `kept` ([B] bool, host list): rows whose drafts were not this
        model's (a lookup's, `CombinedProposer`). The rows whose drafts were this model's calibrate the chooser's
        acceptance by confidence (`KChooser.record_confidence`)."""
        before = batch.target_cache.length - num_accepted  # [B] the sequence before the step
        batch.set_draft_lag(before, seq_before, replaced=kept)
        if self._chooser is not None and self._confidence:
            mine = [not r for r in kept] if kept else [True] * len(counts)
            rows = [(c, o, a) for c, o, a, m in zip(self._confidence, self._offered, counts, mine) if m]
            if rows:
                self._chooser.record_confidence(*map(list, zip(*rows)))
        self._confidence = []

    def release(self, request) -> None:
        pass
