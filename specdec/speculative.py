"""One decoding step on a batch, shared by every strategy.

A speculative step: the proposer (specdec/proposers) plans what each row has on offer, k is chosen (fixed,
or auto k from the offers), the proposer drafts up to k tokens per row, the target verifies k+1 positions
in one pass, each row accepts up to its own draft length (greedy, coupled or rejection sampling:
sampling.py), commit, fix the caches' lengths; the left-padded layout then realigns (the scheduler's
postprocess). A target-only step (k = 0, and every AR step) feeds each row's last token once and emits one
token; a draft model skips it and catches up in its next forward (batch.py).

A step reads the device once: one small tensor holding each row's emitted tokens, accepted count and
finiteness flags, needed on the host for stop detection and request bookkeeping. Everything else the
host needs to plan the next forward (lengths, widths, which rows sample) it already knows.
"""
from __future__ import annotations

import warnings

import torch

from specdec.kernels.realign import realign
from specdec.kernels.rejection import random_slot, rejection_sample

from .batch import Batch, DecodeContext, finite_rows
from .proposers import Proposal
from .sampling import choose_tokens, draw_step_noise, sample_race


def verify(ctx: DecodeContext, batch: Batch, draft_ids):
    """Target logits at the k+1 positions [B, k+1, V] -> argmax [B, k+1] (None when no row is greedy),
    probabilities [B, k+1, V] (None when all rows are greedy), and [B] bool: the row's logits are finite."""
    params = batch.params
    pending = batch.last_tokens(1, batch.target_cache.layout)  # [B, 1]
    logits = target_forward(ctx, batch, torch.cat([pending, draft_ids], dim=1))[..., : ctx.vocab_size]  # [B, k+1, V]
    target_argmax = logits.argmax(dim=-1) if params.any_greedy else None  # [B, k+1]
    target_probs = None if params.all_greedy else params.probs(logits, ctx.probs_dtype)  # [B, k+1, V]
    return target_argmax, target_probs, finite_rows(logits)


def accept(ctx: DecodeContext, batch: Batch, k: int, proposal: Proposal, target_argmax, target_probs, target_ok,
           noise):
    """Choose each row's emitted tokens, read them back (the step's one synchronisation), commit them to
    the requests, and set the target cache's lengths (the proposer's own state: `observe`).

    A row accepts at most its own draft length (`proposal.length`). Greedy rows accept drafts while they
    equal the target's argmax; coupled rows while they equal the target's race sample argmax(p / E) with
    the step's RACE noise (the E a draft model proposed with), and emit the target's sample at the first
    mismatch: every token is the target's own; rejection rows by rejection sampling (`noise.uniforms`, and
    the residual noise of the slot each row emits at)."""
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
    output, num_accepted = rejection_sample(
        draft_ids, target_argmax, target_probs if rejection else None, proposal.probs if rejection else None,
        params.exact_match, noise.uniforms if rejection else None, residual,
        backend=ctx.kernel_backend, draft_len=proposal.length, any_greedy=params.any_greedy or params.any_coupled,
        all_greedy=not rejection)  # [B, k+1], [B]
    batch.append(output, num_accepted + 1)
    draft_finite = proposal.finite if proposal.finite is not None else torch.ones_like(target_ok)  # [B]
    flags = torch.stack([num_accepted, target_ok.to(torch.int64), draft_finite.to(torch.int64)], dim=1)  # [B, 3]
    readback = torch.cat([output, flags], dim=1).tolist()  # [B, k+4]: the step's one read of the device
    seq_before = batch.host_seq_len
    counts = []
    for request, row, offered in zip(batch.requests, readback, proposal.lengths):
        a, finite, draft_finite = row[k + 1:]
        if not finite:
            ctx.raise_non_finite(request, f"decoding step {ctx.metrics.steps}")
        if not draft_finite:
            warn_once(ctx, "draft-non-finite",
                      "the draft model produced non-finite logits; its drafts were rejected for those rows "
                      "(the output is the target's own, at the cost of speed)")
        request.accepted.append(a)
        request.step_ks.append(offered)
        ctx.metrics.generated_tokens += request.commit(row[: a + 1])
        counts.append(a)
    if ctx.chooser is not None:
        ctx.chooser.record_acceptance(batch.requests, proposal.lengths, counts)
    m = ctx.metrics
    m.proposed_drafts += sum(proposal.lengths)
    m.accepted_drafts += sum(counts)
    m.row_steps += len(counts)
    for source, offered, a in zip(proposal.sources or [ctx.proposer.name] * len(counts), proposal.lengths, counts):
        tally = m.drafts_by_drafter.setdefault(source, [0, 0])  # [proposed, accepted]
        tally[0] += offered
        tally[1] += a
    # the verify pass cached the pending token and all k drafts: keep the pending one and the accepted
    target = batch.target_cache
    target.set_rows(length=target.length - (k - num_accepted),
                    host_length=[s + a for s, a in zip(seq_before, counts)])
    ctx.proposer.observe(batch, k, seq_before, counts, num_accepted)
    return counts


def target_forward(ctx: DecodeContext, batch: Batch, x):
    """The target's logits [B, T, V] for x [B, T] fed after each row's cache; with a feature draft, the
    target's hidden states at those positions are stored for the draft (`Batch.record_features`)."""
    ctx.metrics.target_forwards += 1
    if batch.features is None:
        return ctx.target.forward(x, batch.target_cache)
    logits, hidden = ctx.target.forward(x, batch.target_cache, hidden="all")  # [B, T, V], [B, T, E]
    batch.record_features(hidden)
    return logits


def warn_once(ctx: DecodeContext, key: str, message: str) -> None:
    if key not in ctx.warned:
        ctx.warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def realign_batch(ctx: DecodeContext, batch: Batch) -> None:
    """Left-padded layout: right-align every row at the longest row's edge (invariant I6), moving the
    target's and the draft's caches together (their rows share `start`)."""
    target, draft = batch.target_cache, batch.draft_cache
    longest = max(target.host_length)
    new_host = [longest - n for n in target.host_length]
    delta_host = [new - old for new, old in zip(new_host, target.host_start)]
    if not any(delta_host):
        return
    new_start = longest - target.length  # [B]
    delta = new_start - target.start  # [B], may be negative
    caches = [(target.k, target.v)] + ([(draft.k, draft.v)] if draft is not None else [])
    realign(caches, target.start, target.length, delta, backend=ctx.kernel_backend,
            host=(target.host_start, target.host_length, delta_host))
    target.set_rows(start=new_start, host_start=new_host)
    if draft is not None:
        draft.set_rows(start=new_start.clone(), host_start=list(new_host))


def speculative_step(ctx: DecodeContext, batch: Batch, k: int, plan) -> None:
    """Propose, verify and accept one step of up to k drafts per row of `batch` (`plan`: the proposer's
    offers, see specdec/proposers; finished rows stay in place: the scheduler drops, refills or realigns
    them)."""
    params = batch.params
    with ctx.timer.phase("other"):  # keyed by (seed, position): column j is position seq_len + j, whatever k
        noise = draw_step_noise(params, batch.seq_len, batch.host_seq_len, k, ctx.vocab_size, ctx.probs_dtype,
                                ctx.kernel_backend)
    with ctx.timer.phase("draft"):
        proposal = ctx.proposer.propose(ctx, batch, k, noise, plan)
    with ctx.timer.phase("verify"):
        target_argmax, target_probs, target_ok = verify(ctx, batch, proposal.tokens)
    with ctx.timer.phase("accept"):
        accept(ctx, batch, k, proposal, target_argmax, target_probs, target_ok, noise)
    ctx.metrics.record_step(k)


def target_step(ctx: DecodeContext, batch: Batch) -> None:
    """One token per row from the target alone (AR decoding, and k = 0 steps of speculative strategies)."""
    with ctx.timer.phase("verify"):
        pending = batch.last_tokens(1, batch.target_cache.layout)  # [B, 1]
        logits = target_forward(ctx, batch, pending)[:, -1, : ctx.vocab_size]  # [B, V]
    with ctx.timer.phase("accept"):
        tokens = choose_tokens(logits, batch.params, ctx.probs_dtype, batch.seq_len, batch.host_seq_len,
                               ctx.kernel_backend)  # [B]
        batch.append(tokens[:, None], torch.ones_like(tokens))
        readback = torch.stack([tokens, finite_rows(logits).to(torch.int64)], dim=1).tolist()  # the one sync
        for request, (token, finite) in zip(batch.requests, readback):
            if not finite:
                ctx.raise_non_finite(request, f"decoding step {ctx.metrics.steps}")
            request.step_ks.append(0)
            ctx.metrics.generated_tokens += request.commit([token])
        ctx.metrics.row_steps += len(readback)
    ctx.metrics.record_step(0)


def decode_step(ctx: DecodeContext, batch: Batch) -> int:
    """One step of the batch: the proposer's plan (what each row has on offer, on the host), k chosen by
    the context (fixed, or auto from the offers), at most the longest offer; returns k. The scheduler's
    postprocess (realignment) follows, and only then `ctx.step_done` times the step."""
    proposer = ctx.proposer
    plan = proposer.plan(batch, ctx.k_max) if proposer is not None else None
    # what bounds each row's drafts: a lookup's offers (a draft model, even beside a lookup, offers k everywhere)
    offers = None if plan is None or proposer.uses_draft_model else [len(d) for d in plan]
    if proposer is None:
        k = 0
    elif ctx.chooser is None:
        k = ctx.k_max
    else:
        k = ctx.chooser.choose(batch, offers)
    if offers is not None:
        k = min(k, max(offers, default=0))
    if k == 0:
        target_step(ctx, batch)
    else:
        speculative_step(ctx, batch, k, plan)
    return k
