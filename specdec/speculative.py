"""What runs the models after the prefill (specdec/prefill.py): one decoding step on a batch, shared by every
method. Like the prefill it ends with one read of the device and returns what each row emitted (a
`StepOutput`), uncommitted.

A speculative step: the proposer (specdec/proposers) plans what each row has on offer, k is chosen (fixed,
or auto k from the offers), the proposer drafts up to k tokens per row, the target verifies k+1 positions
in one pass, each row accepts up to its own draft length (greedy, coupled or rejection sampling:
sampling.py), fix the caches' lengths, and return what each row emitted (a `StepOutput`): the engine commits
it to the requests (specdec/commit.py), then the left-padded layout realigns (the scheduler's postprocess,
`Batch.right_align`). A target-only step (k = 0, and every AR step) feeds each row's last token once and emits one
token; a draft model skips it and catches up in its next forward (its lag: `Batch.set_draft_lag`).

A step reads the device once: one small tensor holding each row's emitted tokens, accepted count and
finiteness flags, needed on the host for stop detection and request bookkeeping (in the commit), and, for
rows that ask, the target's log-probabilities at the emitted positions (specdec/logprobs.py). Everything else the
host needs to plan the next forward (lengths, widths, which rows sample) it already knows.
"""
from __future__ import annotations

import torch

from specdec.kernels.rejection import random_slot, rejection_sample

from .batch import Batch, DecodeContext, finite_rows
from .commit import StepOutput
from .logprobs import StepLogprobs, read_back
from .proposers import Proposal
from .sampling import choose_tokens, draw_step_noise, sample_race


def verify(ctx: DecodeContext, batch: Batch, draft_ids):
    """Target logits at the k+1 positions [B, k+1, V] -> argmax [B, k+1] (None when no row is greedy),
    probabilities [B, k+1, V] (None when all rows are greedy), [B] bool: the row's logits are finite, and
    the log-probabilities of the rows that ask for them (None when none does)."""
    params = batch.params
    pending = batch.last_tokens(1, batch.target_cache.layout)  # [B, 1]
    logits = target_forward(ctx, batch, torch.cat([pending, draft_ids], dim=1))[..., : ctx.vocab_size]  # [B, k+1, V]
    target_argmax = logits.argmax(dim=-1) if params.any_greedy else None  # [B, k+1]
    target_probs = None if params.all_greedy else params.probs(logits, ctx.probs_dtype)  # [B, k+1, V]
    return target_argmax, target_probs, finite_rows(logits), StepLogprobs.of(logits, params, ctx.probs_dtype)


def accept(ctx: DecodeContext, batch: Batch, k: int, proposal: Proposal, target_argmax, target_probs, target_ok,
           noise, logprobs: StepLogprobs | None = None) -> StepOutput:
    """Choose each row's emitted tokens, read them back (the step's one synchronisation), and set the
    target cache's lengths (the proposer's own state: `observe`). Returns what each row emitted, for the
    engine to commit (specdec/commit.py).

    A row accepts at most its own draft length (`proposal.length`). Greedy rows accept drafts while they
    equal the target's argmax; coupled rows while they equal the target's race sample argmax(p / E) with
    the step's RACE noise (the E a draft model proposed with), and emit the target's sample at the first
    mismatch: every token is the target's own; rejection rows by rejection sampling (`noise.uniforms`, and
    the residual noise of the slot each row emits at). `logprobs`: the verify pass's, for rows that ask:
    the emitted tokens' values ride in the same read."""
    params = batch.params
    draft_ids = proposal.tokens
    if params.any_coupled:
        race = sample_race(target_probs, noise.race)  # [B, k+1] the target's own samples
        target_argmax = race if target_argmax is None else torch.where(params.coupled[:, None], race, target_argmax)
    rejection = params.any_rejection
    residual = None
    if rejection:  # keyed by the position the row emits at: found first (the sampler's own test, on [B, k])
        residual = noise.residual(random_slot(draft_ids, target_probs, proposal.probs, noise.uniforms,
                                              proposal.length))  # [B, V]
    # the kernel's "greedy" rows are the rows that accept by exact match with `target_argmax`: greedy rows
    # (the argmax) and coupled rows (the race sample put in its place above); the others reject-sample
    any_exact = params.any_greedy or params.any_coupled
    output, num_accepted = rejection_sample(
        draft_ids, target_argmax, target_probs if rejection else None, proposal.probs if rejection else None,
        params.exact_match, noise.uniforms if rejection else None, residual,
        backend=ctx.kernel_backend, draft_len=proposal.length, any_greedy=any_exact,
        all_greedy=not rejection)  # [B, k+1], [B]
    batch.append(output, num_accepted + 1)
    draft_finite = proposal.finite if proposal.finite is not None else torch.ones_like(target_ok)  # [B]
    flags = torch.stack([num_accepted, target_ok.to(torch.int64), draft_finite.to(torch.int64)], dim=1)  # [B, 3]
    readback, values = read_back(torch.cat([output, flags], dim=1), logprobs, output)  # [B, k+4]: the one read
    seq_before = batch.host_seq_len
    counts = [row[k + 1] for row in readback]
    # the verify pass cached the pending token and all k drafts: keep the pending one and the accepted
    target = batch.target_cache
    target.set_rows(length=target.length - (k - num_accepted),
                    host_length=[s + a for s, a in zip(seq_before, counts)])
    ctx.proposer.observe(batch, k, seq_before, counts, num_accepted)
    tokens = [row[: a + 1] for row, a in zip(readback, counts)]
    return StepOutput(tokens, [bool(row[k + 2]) for row in readback],
                      f"decoding step {ctx.metrics.steps}", offered=list(proposal.lengths), speculative=True,
                      draft_finite=[bool(row[k + 3]) for row in readback], sources=proposal.sources,
                      logprobs=logprobs.parse(values, tokens, params.host_logprobs) if logprobs else None)


def target_forward(ctx: DecodeContext, batch: Batch, x):
    """The target's logits [B, T, V] for x [B, T] fed after each row's cache; with a feature draft, the
    target's hidden states at those positions are stored for the draft (`Batch.record_features`)."""
    ctx.metrics.target_forwards += 1
    if batch.features is None:
        return ctx.target.forward(x, batch.target_cache)
    logits, hidden = ctx.target.forward(x, batch.target_cache, hidden="all")  # [B, T, V], [B, T, E]
    batch.record_features(hidden)
    return logits


def speculative_step(ctx: DecodeContext, batch: Batch, k: int, plan) -> StepOutput:
    """Propose, verify and accept one step of up to k drafts per row of `batch` (`plan`: the proposer's
    offers, see specdec/proposers). Returns what each row emitted, uncommitted."""
    params = batch.params
    with ctx.timer.phase("other"):  # keyed by (seed, position): column j is position seq_len + j, whatever k
        noise = draw_step_noise(params, batch.seq_len, batch.host_seq_len, k, ctx.vocab_size, ctx.probs_dtype,
                                ctx.kernel_backend)
    with ctx.timer.phase("draft"):
        proposal = ctx.proposer.propose(ctx, batch, k, noise, plan)
    width = proposal.tokens.shape[1]  # fewer than k where every row stopped drafting early (unsure, or a lookup)
    if width < k:
        k, noise = width, None if noise is None else noise.narrowed(width)
    if ctx.chooser is not None:
        ctx.chooser.drafted(k, k if proposal.forwards is None else proposal.forwards)
    with ctx.timer.phase("verify"):
        target_argmax, target_probs, target_ok, logprobs = verify(ctx, batch, proposal.tokens)
    with ctx.timer.phase("accept"):
        out = accept(ctx, batch, k, proposal, target_argmax, target_probs, target_ok, noise, logprobs)
    ctx.metrics.record_step(k)
    return out


def target_step(ctx: DecodeContext, batch: Batch) -> StepOutput:
    """One token per row from the target alone (AR decoding, and k = 0 steps of speculative strategies)."""
    with ctx.timer.phase("verify"):
        pending = batch.last_tokens(1, batch.target_cache.layout)  # [B, 1]
        logits = target_forward(ctx, batch, pending)[:, -1, : ctx.vocab_size]  # [B, V]
    with ctx.timer.phase("accept"):
        tokens = choose_tokens(logits, batch.params, ctx.probs_dtype, batch.seq_len, batch.host_seq_len,
                               ctx.kernel_backend)  # [B]
        batch.append(tokens[:, None], torch.ones_like(tokens))
        logprobs = StepLogprobs.of(logits, batch.params, ctx.probs_dtype)  # None unless some row asks
        readback, values = read_back(torch.stack([tokens, finite_rows(logits).to(torch.int64)], dim=1), logprobs,
                                     tokens)  # the one sync
        emitted = [[token] for token, _ in readback]
    out = StepOutput(emitted, [bool(f) for _, f in readback], f"decoding step {ctx.metrics.steps}",
                     offered=[0] * len(readback),
                     logprobs=logprobs.parse(values, emitted, batch.params.host_logprobs) if logprobs else None)
    ctx.metrics.record_step(0)
    return out


def decode_step(ctx: DecodeContext, batch: Batch) -> StepOutput:
    """One step of the batch: the proposer's plan (what each row has on offer, on the host), k chosen by
    the context (fixed, or auto from the offers), at most the longest offer. Returns what each row emitted;
    the engine commits it (specdec/commit.py), then the scheduler's postprocess (realignment) follows, and
    only then `ctx.step_done` times the step."""
    proposer = ctx.proposer
    if proposer is not None and not proposer.uses_draft_model and ctx.chooser is not None and \
            ctx.chooser.settled_at_zero(batch):
        ctx.metrics.record_drafting_off(ctx.chooser.reason)
        return target_step(ctx, batch)  # k = 0 whatever the lookup offers: it plans at its next drafting step
    plan = proposer.plan(batch, ctx.k_max) if proposer is not None else None
    # what bounds each row's drafts: a lookup's offers (a draft model offers k everywhere; beside a lookup, the
    # lookup's where every row takes them: the model then does not run, proposers/combined.py)
    free = plan is not None and proposer.uses_draft_model and hasattr(proposer, "takes_lookup") and all(
        proposer.takes_lookup(r, d, min(proposer.min_match, ctx.k_max)) for r, d in zip(batch.requests, plan))
    offers = None if plan is None or (proposer.uses_draft_model and not free) else [len(d) for d in plan]
    if proposer is None:
        k = 0
    elif ctx.chooser is None:
        k = ctx.k_max
    else:
        k = ctx.chooser.choose(batch, offers, free)
    if offers is not None:
        k = min(k, max(offers, default=0))
    if k == 0:
        ctx.metrics.record_drafting_off(getattr(ctx.chooser, "reason", None))  # the summary and /metrics say why
        return target_step(ctx, batch)
    return speculative_step(ctx, batch, k, plan)
