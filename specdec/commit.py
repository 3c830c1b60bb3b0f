"""What a forward gave each row, and the one place it is committed to the requests.

A prefill and a decoding step (specdec/speculative.py) end with one read of the device and return a
`StepOutput`: each row's emitted tokens (on the host) with its finiteness flags (and, for rows that ask,
each token's log-probabilities). `commit` alone writes a request's output: non-finite checks, the tokens
(`Request.commit` stops exactly where AR decoding would; a token's log-probabilities go with it),
the request's and the run's statistics, auto k's acceptance record. The engine commits a decoding step in
its postprocess; a scheduler commits a prefill as soon as it ran (a request can finish at its first token,
before it takes a row).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass
class StepOutput:
    tokens: list[list[int]]  # per row: the tokens it emitted (accepted drafts, then the target's own token)
    finite: list[bool]  # per row: the target's logits were finite
    where: str  # "prefill" or "decoding step N", for the error message
    offered: list[int] | None = None  # decoding steps: drafts each row had on offer (0: a target-only step)
    speculative: bool = False  # a verification (drafts were proposed), not a target-only step
    draft_finite: list[bool] | None = None  # per row: the draft's logits were finite (speculative steps)
    sources: list[str] | None = None  # per row: the drafter of its drafts (None: the proposer's name)
    logprobs: list | None = None  # per row: a TokenLogprob per emitted token, or None (the row did not ask);
    # None when no row asked (specdec/logprobs.py)

    @property
    def accepted(self) -> list[int]:
        """Drafts accepted per row."""
        return [len(t) - 1 for t in self.tokens]


def commit(ctx, requests: list, out: StepOutput) -> None:
    """Commit `out` (row i to requests[i]) and count it in `ctx.metrics` (and auto k's `ctx.chooser`)."""
    m = ctx.metrics
    for i, (request, tokens) in enumerate(zip(requests, out.tokens)):
        if not out.finite[i]:
            ctx.raise_non_finite(request, out.where)
        if out.draft_finite is not None and not out.draft_finite[i]:
            warn_once(ctx, "draft-non-finite",
                      "the draft model produced non-finite logits; its drafts were rejected for those rows "
                      "(the output is the target's own, at the cost of speed)")
        if out.offered is not None:
            if out.speculative:
                request.accepted.append(len(tokens) - 1)
            request.step_ks.append(out.offered[i])
        m.generated_tokens += request.commit(tokens, out.logprobs[i] if out.logprobs is not None else None)
    if out.offered is None:  # a prefill: every row's first token
        m.first_tokens += len(requests)
        return
    m.row_steps += len(requests)
    if not out.speculative:
        return
    counts = out.accepted
    if ctx.chooser is not None:
        ctx.chooser.record_acceptance(requests, out.offered, counts)
    m.proposed_drafts += sum(out.offered)
    m.accepted_drafts += sum(counts)
    for source, offered, a in zip(out.sources or [ctx.proposer.name] * len(counts), out.offered, counts):
        tally = m.drafts_by_drafter.setdefault(source, [0, 0])  # [proposed, accepted]
        tally[0] += offered
        tally[1] += a


def warn_once(ctx, key: str, message: str) -> None:
    if key not in ctx.warned:
        ctx.warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
