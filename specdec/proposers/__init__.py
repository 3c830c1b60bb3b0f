"""Proposers: where a speculative step's drafts come from, behind one small protocol (docs/api.md).

A proposer offers each row of a batch up to k draft tokens; the target verifies them all in one pass and
each row keeps what *it* accepted. Shipped proposers:

- `ModelProposer`: a draft model (a small LM, or a feature draft reading the target's hidden states);
- `NgramProposer` ("ngram", prompt lookup): the continuation of the longest earlier match of the row's
  last n tokens in its prompt + output;
- `SuffixProposer` ("suffix", suffix decoding): the most frequent continuation in suffix tries over the
  row's prompt + output and over a bounded store of earlier requests' outputs;
- `CombinedProposer` (`lookup=`): a model proposer whose rows take a lookup's drafts where it has a long
  enough match.

The protocol (every method is called by `specdec.speculative.decode_step`, once per step, in this order):

- `plan(batch, k_max) -> list[list[int]] | None`: before k is chosen, the drafts each row has on offer (at
  most k_max each, possibly none), computed on the host; None when every row can always offer k (a draft
  model). Auto k reads the lengths; a step's k is at most the longest offer.
- `propose(ctx, batch, k, noise, plan) -> Proposal`: the step's drafts, [B, k] padded past each row's
  length, with the distributions they were drawn from where rejection sampling needs them (a deterministic
  draft is a one-hot distribution: `one_hot_probs`).
- `observe(batch, k, seq_before, counts, num_accepted)`: what each row accepted (host counts and [B] on
  the device), after the target's cache lengths are set.
- `release(request)`: a request finished; its per-row state goes.

`uses_draft_model` says whether the batch keeps a draft KV cache for the proposer (`DecodeContext.draft`),
`name` is what metrics and the server call it. Per-row state is the proposer's own, keyed by the Engine's
request id and freed in `release`; one proposer belongs to one Engine (`LLM.new_proposer`).
"""
from .base import LOOKUPS, LookupProposer, Proposal, host_proposal, one_hot_probs
from .combined import CombinedProposer
from .model import ModelProposer
from .ngram import NgramProposer
from .suffix import SuffixProposer, SuffixStore

__all__ = ["LOOKUPS", "CombinedProposer", "LookupProposer", "ModelProposer", "NgramProposer", "Proposal", "SuffixProposer",
           "SuffixStore", "host_proposal", "one_hot_probs"]
