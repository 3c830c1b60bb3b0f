"""The proposer protocol's data: a step's drafts (`Proposal`) and how host-side draft lists become one."""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOOKUPS = ("ngram", "suffix")  # drafters that need no model: `draft=` takes these names


@dataclass
class Proposal:
    """A step's drafts."""

    tokens: torch.Tensor  # [B, k] int64: row i's drafts in columns 0..lengths[i]-1, padding (a valid id) after
    length: torch.Tensor  # [B] int64: drafts each row offers (0 where the draft is unusable)
    lengths: list[int]  # the same on the host, as planned (before the device's finiteness check)
    probs: torch.Tensor | None  # [B, k, V] the distributions the drafts were drawn from; None when no row needs them
    finite: torch.Tensor | None = None  # [B] bool: the draft model's logits were finite (None: no model ran)
    sources: list[str] | None = None  # which drafter each row's drafts came from (None: all the proposer's)
    forwards: int | None = None  # draft forwards the proposal ran (None: k, one per draft; 0: none)


def one_hot_probs(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, k, V] the distribution of a deterministic proposal: all mass on the proposed token. Rejection
    sampling against it accepts token x with probability p(x), else samples p with x removed: exact."""
    probs = torch.zeros(*tokens.shape, vocab_size, dtype=dtype, device=tokens.device)  # [B, k, V]
    return probs.scatter_(2, tokens[..., None], 1.0)


def padded_drafts(drafts: list[list[int]], k: int, device) -> tuple[torch.Tensor, list[int]]:
    """Host draft lists as [B, k] int64 on the device, padded with token 0 past each row's length, and the
    lengths (at most k)."""
    lengths = [min(len(d), k) for d in drafts]
    rows = [d[:k] + [0] * (k - n) for d, n in zip(drafts, lengths)]
    return torch.tensor(rows, dtype=torch.int64).to(device), lengths  # [B, k]


def host_proposal(drafts: list[list[int]], k: int, params, vocab_size: int, probs_dtype, device) -> Proposal:
    """A Proposal of host-side draft lists (lookup proposers): padded with token 0, one-hot distributions
    when some row samples by rejection."""
    tokens, lengths = padded_drafts(drafts, k, device)  # [B, k]
    probs = one_hot_probs(tokens, vocab_size, probs_dtype) if params.any_rejection else None  # [B, k, V]
    return Proposal(tokens, torch.tensor(lengths, dtype=torch.int64).to(device), lengths, probs)


def tokens_since(request, seen: int) -> list[int]:
    """The tokens of a request's sequence (prompt + output) from index `seen` on, without copying the rest:
    what a per-row index must add to catch up."""
    prompt = request.prompt_ids
    if seen < len(prompt):
        return prompt[seen:] + request.output_ids
    return request.output_ids[seen - len(prompt):]


class LookupProposer:
    """The part every proposer without a model shares: drafts planned per row on the host (`drafts`, the
    subclass's), handed over as a one-hot Proposal, per-row state in `rows` (request id -> state) freed on
    release. The accepted tokens need no `observe`: the state reads them from the request at the next step."""

    uses_draft_model = False
    name = "lookup"

    def __init__(self):
        self.rows: dict = {}  # request key (id, choice) -> the row's index (created at its first step)

    def drafts(self, request, k_max: int) -> list[int]:
        raise NotImplementedError

    def plan(self, batch, k_max: int) -> list[list[int]]:
        return [self.drafts(r, k_max) for r in batch.requests]

    def propose(self, ctx, batch, k: int, noise, plan) -> Proposal:
        return host_proposal(plan, k, batch.params, ctx.vocab_size, ctx.probs_dtype, ctx.device)

    def observe(self, batch, k, seq_before, counts, num_accepted, kept=None) -> None:
        pass

    def release(self, request) -> None:
        self.rows.pop(request.key, None)
