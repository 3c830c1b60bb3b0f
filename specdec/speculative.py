"""One speculative step on a batch: draft k tokens, verify k+1 positions in one target pass, accept
per row (greedy or rejection sampling), commit, and fix the caches' lengths (and, in the left-padded
layout, realign). Shared by the eqspec, ragged and exspec strategies."""
from __future__ import annotations

import torch

from specdec.kernels.realign import realign
from specdec.kernels.rejection import rejection_sample

from .batch import Batch, DecodeContext, RowParams, draw_noise, draw_uniforms
from .sampling import sample_race


def propose(ctx: DecodeContext, batch: Batch, params: RowParams, noise):
    """k draft tokens per row: ([B, k] int64, [B, k, V] draft distributions or None when all greedy).

    The first draft forward feeds the row's last two tokens (T = 2), the next k - 1 feed one each.
    `noise`: [B, k+1, V] Exp(1) draws; column j samples the j-th draft of sampling rows.
    """
    k, V = ctx.num_speculative_tokens, ctx.vocab_size
    x = batch.last_tokens(2, ctx.device)  # [B, 2]
    drafts, probs = [], []
    for j in range(k):
        logits = ctx.draft.forward(x, batch.draft_cache, logits="last")[:, -1, :V]  # [B, V]
        token = logits.argmax(dim=-1)  # [B]
        if noise is not None:
            q = params.probs(logits, ctx.probs_dtype)  # [B, V]
            token = torch.where(params.greedy, token, sample_race(q, noise[:, j]))
            probs.append(q)
        drafts.append(token)
        x = token[:, None]  # [B, 1]
    ctx.metrics.draft_forwards += k
    return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if probs else None)


def verify(ctx: DecodeContext, batch: Batch, draft_ids, params: RowParams):
    """Target logits at the k+1 positions [B, k+1, V]: argmax [B, k+1] and probabilities (or None)."""
    pending = batch.last_tokens(1, ctx.device)  # [B, 1]
    logits = ctx.target.forward(torch.cat([pending, draft_ids], dim=1), batch.target_cache)[..., : ctx.vocab_size]
    ctx.metrics.target_forwards += 1
    target_argmax = logits.argmax(dim=-1) if bool(params.greedy.any()) else None  # [B, k+1]
    target_probs = None if params.all_greedy else params.probs(logits, ctx.probs_dtype)  # [B, k+1, V]
    return target_argmax, target_probs


def accept(ctx: DecodeContext, batch: Batch, draft_ids, draft_probs, target_argmax, target_probs,
           params: RowParams, uniforms, noise):
    """Choose each row's emitted tokens, commit them, and set both caches' lengths."""
    k = ctx.num_speculative_tokens
    output, num_accepted = rejection_sample(
        draft_ids, target_argmax, target_probs, draft_probs, params.greedy, uniforms,
        None if noise is None else noise[:, k], backend=ctx.kernel_backend)  # [B, k+1], [B]
    rows, counts = output.tolist(), num_accepted.tolist()
    for request, row, a in zip(batch.requests, rows, counts):
        request.accepted.append(a)
        request.scheduled_steps += 1
        ctx.metrics.generated_tokens += request.commit(row[: a + 1])
    m = ctx.metrics
    m.proposed_drafts += k * len(counts)
    m.accepted_drafts += sum(counts)
    m.row_steps += len(counts)
    # the verify pass cached the pending token and all k drafts: keep the pending one and the accepted
    batch.target_cache.length = batch.target_cache.length - (k - num_accepted)
    batch.draft_cache.length = batch.target_cache.length - 1


def realign_batch(ctx: DecodeContext, batch: Batch) -> None:
    """Left-padded layout: right-align every row at the longest row's edge (invariant I6), moving the
    target's and the draft's caches together (their rows share `start`)."""
    target, draft = batch.target_cache, batch.draft_cache
    length = target.length  # [B]
    new_start = length.max() - length  # [B]
    delta = new_start - target.start  # [B], may be negative
    if bool((delta != 0).any()):
        realign([(target.k, target.v), (draft.k, draft.v)], target.start, length, delta, backend=ctx.kernel_backend)
    target.start = new_start
    draft.start = new_start.clone()


def speculative_step(ctx: DecodeContext, batch: Batch) -> None:
    """Draft, verify and accept one step for every row of `batch` (finished rows stay in place: the
    strategy drops, refills or realigns them)."""
    params = RowParams.of(batch.requests, ctx.device)
    k = ctx.num_speculative_tokens
    noise = uniforms = None
    with ctx.timer.phase("other"):
        if not params.all_greedy:  # each sampling request draws from its own stream, in a fixed order
            uniforms = draw_uniforms(batch.requests, k, ctx.device)  # [B, k]
            noise = draw_noise(batch.requests, (k + 1, ctx.vocab_size), ctx.device, ctx.probs_dtype)  # [B, k+1, V]
    with ctx.timer.phase("draft"):
        draft_ids, draft_probs = propose(ctx, batch, params, noise)
    with ctx.timer.phase("verify"):
        target_argmax, target_probs = verify(ctx, batch, draft_ids, params)
    with ctx.timer.phase("accept"):
        accept(ctx, batch, draft_ids, draft_probs, target_argmax, target_probs, params, uniforms, noise)
    ctx.metrics.steps += 1
