"""Rejection sampling for speculative decoding: which drafts each row keeps, and the token after them.

Per row i with drafts d_1..d_k:

- greedy rows: accept d_j while d_j equals the target's argmax at j-1; the next token is the target's
  argmax at the first mismatch (correction) or at position k (bonus) when all k are accepted;
- random rows (Leviathan et al. / Chen et al.): accept d_j when u_j * q_j(d_j) <= p_j(d_j), i.e. with
  probability min(1, p/q); at the first rejection emit a sample of max(p_j - q_j, 0) (renormalising is
  unnecessary: the sample is the argmax of residual / Exp(1) noise, an exponential race); when all k are
  accepted emit the bonus, a sample of the target's p_k by the same race.

A row offers `draft_len[i]` <= k drafts (a proposer may have fewer than k for it; 0 when its draft
distribution is unusable, e.g. non-finite draft logits): drafts past its length are never accepted, and a
row that accepts all of its own emits the bonus there, a sample of the target's p (q taken as 0). So a
row of length L emits exactly what it would in a step of k = L, and the output distribution is the
target's whatever the draft produced.

Outputs `[B, k+1]` token ids with -1 placeholders after the emitted token, and `[B]` accepted counts.
Masked lanes in every argmax are -inf, never 0, so no id >= vocab size can win.
"""
from __future__ import annotations

import torch

from .dispatch import check, choose_backend, lazy_jit, next_power_of_2

tl = None  # triton.language, bound when this module's first kernel is launched (see dispatch.lazy_jit)

BLOCK_V = 2048  # vocabulary tile of the residual/bonus race


def random_accepts(draft_ids, target_probs, draft_probs, uniforms):
    """[B, k] bool: u_j * q_j(d_j) <= p_j(d_j) in float64, the acceptance test of random rows (both backends)."""
    k = draft_ids.shape[1]
    p_draft = target_probs[:, :k].gather(2, draft_ids[:, :, None]).squeeze(2).double()  # [B, k] p_j(d_j)
    q_draft = draft_probs.gather(2, draft_ids[:, :, None]).squeeze(2).double()  # [B, k] q_j(d_j)
    return uniforms * q_draft <= p_draft


def leading_run(accepted) -> torch.Tensor:
    """[B] int64: the accepted drafts of each row, the leading run of True in accepted [B, k]."""
    return torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)


def within(draft_len, k: int) -> torch.Tensor:
    """[B, k] bool: the drafts each row offers (the first draft_len[i] of its k)."""
    return torch.arange(k, device=draft_len.device)[None, :] < draft_len[:, None]


def random_slot(draft_ids, target_probs, draft_probs, uniforms, draft_len) -> torch.Tensor:
    """[B] int64: the slot a random row emits at (its accepted drafts), as `rejection_sample` will find it:
    for a caller whose residual noise depends on that slot (noise keyed by position, specdec/sampling.py)."""
    k = draft_ids.shape[1]
    return leading_run(random_accepts(draft_ids, target_probs, draft_probs, uniforms) & within(draft_len, k))


def rejection_sample_reference(draft_ids, target_argmax, target_probs, draft_probs, is_greedy, uniforms, noise,
                               draft_len=None):
    """Torch reference; see `rejection_sample` for shapes. Returns (output [B, k+1], num_accepted [B])."""
    B, k = draft_ids.shape
    device = draft_ids.device
    j = torch.arange(k + 1, device=device)  # [k+1]
    if draft_len is None:
        draft_len = torch.full((B,), k, dtype=torch.int64, device=device)
    accepted = torch.zeros(B, k, dtype=torch.bool, device=device)  # [B, k]
    if target_argmax is not None:
        accepted = torch.where(is_greedy[:, None], draft_ids == target_argmax[:, :k], accepted)
    if target_probs is not None:
        accepted_random = random_accepts(draft_ids, target_probs, draft_probs, uniforms)  # [B, k]
        accepted = torch.where(is_greedy[:, None], accepted, accepted_random)
    accepted &= within(draft_len, k)
    num_accepted = leading_run(accepted)  # [B]

    next_token = torch.zeros(B, dtype=torch.int64, device=device)  # [B]
    rows = torch.arange(B, device=device)
    if target_argmax is not None:
        next_token = torch.where(is_greedy, target_argmax[rows, num_accepted], next_token)
    if target_probs is not None:
        p_at = target_probs[rows, num_accepted].double()  # [B, V] target at the emitted slot
        clipped = num_accepted.clamp(max=k - 1)
        use_q = num_accepted < draft_len  # [B] a rejection; the row's bonus (all its drafts accepted): q = 0
        q_at = torch.where(use_q[:, None], draft_probs[rows, clipped].double(), torch.zeros_like(p_at))
        residual = (p_at - q_at).clamp(min=0)  # [B, V]; bonus rows: q = 0, so residual = p
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p_at, residual)
        race = residual / noise.double()  # [B, V] exponential race
        next_token = torch.where(is_greedy, next_token, race.argmax(dim=1))

    output = torch.where(j[None, :] < num_accepted[:, None], torch.cat([draft_ids, draft_ids[:, :1]], 1), -1)  # [B, k+1]
    output[rows, num_accepted] = next_token
    return output, num_accepted


def rejection_sample(draft_ids, target_argmax=None, target_probs=None, draft_probs=None, is_greedy=None,
                     uniforms=None, noise=None, backend: str | None = None, draft_len=None,
                     any_greedy: bool | None = None, all_greedy: bool | None = None):
    """Validate and dispatch.

    draft_ids:     [B, k] int64, proposed tokens
    target_argmax: [B, k+1] int64, argmax of the target's logits (needed when any row is greedy)
    target_probs:  [B, k+1, V] float, processed target distributions (needed when any row samples)
    draft_probs:   [B, k, V] float, processed draft distributions the drafts were sampled from
    is_greedy:     [B] bool, rows that accept by exact match with target_argmax (greedy rows, and rows whose
                   caller put another token of the target's own there, e.g. a coupled row's race sample)
    uniforms:      [B, k] float64 in [0, 1), acceptance draws of sampling rows
    noise:         [B, V] float32/64 Exp(1) draws for the residual/bonus race of sampling rows
    draft_len:     [B] int64 in 0..k, the drafts each row offers (None: all k; 0: none usable)
    any_greedy, all_greedy: what the caller knows of is_greedy on the host (None: read from the device)
    """
    B, k = draft_ids.shape
    check(k >= 1 and draft_ids.dtype == torch.int64, "rejection_sample: draft_ids must be [B, k>=1] int64")
    if is_greedy is None:
        is_greedy = torch.full((B,), target_probs is None, dtype=torch.bool, device=draft_ids.device)
    check(is_greedy.shape == (B,) and is_greedy.dtype == torch.bool, "rejection_sample: is_greedy must be [B] bool")
    check(draft_len is None or (draft_len.shape == (B,) and draft_len.dtype == torch.int64),
          "rejection_sample: draft_len must be [B] int64")
    if any_greedy is None:
        any_greedy = bool(is_greedy.any())
    if all_greedy is None:
        all_greedy = bool(is_greedy.all())
    check(target_argmax is not None or target_probs is not None, "rejection_sample: need target_argmax or target_probs")
    if target_argmax is not None:
        check(target_argmax.shape == (B, k + 1) and target_argmax.dtype == torch.int64,
              f"rejection_sample: target_argmax must be [{B}, {k + 1}] int64")
    else:
        check(not any_greedy, "rejection_sample: greedy rows need target_argmax")
    if target_probs is not None:
        V = target_probs.shape[-1]
        check(target_probs.shape == (B, k + 1, V), f"rejection_sample: target_probs must be [{B}, {k + 1}, V]")
        check(draft_probs is not None and draft_probs.shape == (B, k, V), f"rejection_sample: draft_probs must be [{B}, {k}, {V}]")
        check(uniforms is not None and uniforms.shape == (B, k) and uniforms.dtype == torch.float64,
              f"rejection_sample: uniforms must be [{B}, {k}] float64")
        check(noise is not None and noise.shape == (B, V) and noise.is_floating_point(),
              f"rejection_sample: noise must be [{B}, {V}] float")
        check(target_probs.is_floating_point() and draft_probs.is_floating_point(),
              "rejection_sample: target_probs/draft_probs must be floating point")
    else:
        check(all_greedy, "rejection_sample: sampling rows need target_probs")
    if choose_backend(draft_ids, backend) == "triton":
        return rejection_sample_triton(draft_ids, target_argmax, target_probs, draft_probs, is_greedy, uniforms, noise,
                                       draft_len)
    return rejection_sample_reference(draft_ids, target_argmax, target_probs, draft_probs, is_greedy, uniforms, noise,
                                      draft_len)


@lazy_jit
def _race(
    p_row,  # [V] pointer to target_probs[i, n, :]
    q_row,  # [V] pointer to draft_probs[i, min(n, k-1), :]
    z_row,  # [V] pointer to noise[i, :]
    stride_pv, stride_qv, stride_zv,
    q_len,  # V after a rejection (subtract q), 0 for the bonus (q = 0)
    V,
    RESIDUAL: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """argmax over V of race = r / noise (float64), r = max(p - q, 0) if RESIDUAL else p.

    Same tie and NaN rules as torch.argmax: the first maximal index wins, a NaN beats every number
    (the first NaN wins). Masked lanes are -inf. Returns (index, any r > 0 or NaN).
    """
    offs0 = tl.arange(0, BLOCK_V)
    best = tl.full([], -float("inf"), tl.float64)  # loop-carried types are fixed: float64 / int32
    best_idx = tl.full([], 0, tl.int32)
    first_nan = tl.full([], V, tl.int32)
    nonempty = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0  # [BLOCK_V]
        m = offs < V
        r = tl.load(p_row + offs * stride_pv, mask=m, other=0.0).to(tl.float64)
        if RESIDUAL:
            q = tl.load(q_row + offs * stride_qv, mask=offs < q_len, other=0.0).to(tl.float64)
            diff = r - q
            r = tl.where(diff < 0, 0.0, diff)  # clamp(min=0) that keeps NaN, like torch
            nonempty = nonempty | tl.max(((r > 0) | (r != r)).to(tl.int32), axis=0)
        z = tl.load(z_row + offs * stride_zv, mask=m, other=1.0).to(tl.float64)
        race = r / z  # float64: PTX has only div.rn.f64 (IEEE), so this is exact like torch
        is_nan = m & (race != race)
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, offs, V), axis=0))
        race = tl.where(m & (race == race), race, -float("inf"))
        tile_best = tl.max(race, axis=0)
        tile_idx = v0 + tl.argmax(race, axis=0)  # first maximal lane of the tile
        take = tile_best > best  # strict: an earlier tile keeps ties
        best_idx = tl.where(take, tile_idx, best_idx)
        best = tl.where(take, tile_best, best)
    return tl.where(first_nan < V, first_nan, best_idx).to(tl.int64), nonempty


@lazy_jit
def _rejection_kernel(
    out_ptr,  # [B, k+1] int64, out
    num_acc_ptr,  # [B] int64, out
    draft_ids_ptr,  # [B, k] int64
    target_argmax_ptr,  # [B, k+1] int64 (unused unless HAS_ARGMAX)
    target_probs_ptr,  # [B, k+1, V] float (unused unless HAS_PROBS)
    draft_probs_ptr,  # [B, k, V] float (unused unless HAS_PROBS)
    is_greedy_ptr,  # [B] uint8 (a view of the bool tensor)
    draft_len_ptr,  # [B] int64: the drafts the row offers (past them: never accepted, q = 0)
    uniforms_ptr,  # [B, k] float64
    noise_ptr,  # [B, V] float32/float64
    s_out_b, s_out_j,
    s_d_b, s_d_j,
    s_a_b, s_a_j,
    s_p_b, s_p_j, s_p_v,
    s_q_b, s_q_j, s_q_v,
    s_g, s_len,
    s_u_b, s_u_j,
    s_z_b, s_z_v,
    K, V,
    HAS_ARGMAX: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per request (row): acceptance over the k drafts, then the emitted token."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)  # [BLOCK_K], BLOCK_K >= k+1
    jm = j < K
    drafts = tl.load(draft_ids_ptr + row * s_d_b + j * s_d_j, mask=jm, other=0)  # [BLOCK_K]
    g = tl.load(is_greedy_ptr + row * s_g)
    greedy = g != 0
    if HAS_ARGMAX:
        argmax = tl.load(target_argmax_ptr + row * s_a_b + j * s_a_j, mask=jm, other=-1)
        acc_greedy = drafts == argmax
    else:
        acc_greedy = j < 0
    if HAS_PROBS:
        valid = jm & (drafts >= 0) & (drafts < V)  # an id outside the vocabulary is never read, never accepted
        p = tl.load(target_probs_ptr + row * s_p_b + j * s_p_j + drafts * s_p_v, mask=valid, other=0.0)
        q = tl.load(draft_probs_ptr + row * s_q_b + j * s_q_j + drafts * s_q_v, mask=valid, other=0.0)
        u = tl.load(uniforms_ptr + row * s_u_b + j * s_u_j, mask=jm, other=1.0)
        acc_random = (u * q.to(tl.float64) <= p.to(tl.float64)) & valid  # float64, as the reference
    else:
        acc_random = j < 0
    length = tl.load(draft_len_ptr + row * s_len)
    accepted = tl.where(greedy, acc_greedy, acc_random) & jm & (j < length)
    n = tl.min(tl.where(accepted | (j >= K), K, j), axis=0)  # first rejection, or K: the leading run

    token = tl.full([], 0, tl.int64)
    if HAS_ARGMAX:
        token = tl.load(target_argmax_ptr + row * s_a_b + n * s_a_j).to(tl.int64)
    if HAS_PROBS:
        if g == 0:
            p_row = target_probs_ptr + row * s_p_b + n * s_p_j
            q_row = draft_probs_ptr + row * s_q_b + tl.minimum(n, K - 1) * s_q_j
            z_row = noise_ptr + row * s_z_b
            q_len = tl.where(n < length, V, 0)
            token, nonempty = _race(p_row, q_row, z_row, s_p_v, s_q_v, s_z_v, q_len, V, True, BLOCK_V)
            if nonempty == 0:  # max(p - q, 0) is all zero: sample p itself (the reference's fallback)
                token, nonempty = _race(p_row, q_row, z_row, s_p_v, s_q_v, s_z_v, q_len, V, False, BLOCK_V)
    jo = tl.arange(0, BLOCK_K)
    out = tl.where(jo < n, drafts, tl.where(jo == n, token, -1))
    tl.store(out_ptr + row * s_out_b + jo * s_out_j, out, mask=jo < K + 1)
    tl.store(num_acc_ptr + row, n.to(tl.int64))


def rejection_sample_triton(draft_ids, target_argmax, target_probs, draft_probs, is_greedy, uniforms, noise,
                            draft_len=None):
    """Launch `_rejection_kernel` with grid (B,); same outputs as `rejection_sample_reference`."""
    B, k = draft_ids.shape
    device = draft_ids.device
    output = torch.empty((B, k + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=device)
    if B == 0:
        return output, num_accepted
    has_argmax, has_probs = target_argmax is not None, target_probs is not None
    greedy_u8 = is_greedy.view(torch.uint8)
    if draft_len is None:
        draft_len = torch.full((B,), k, dtype=torch.int64, device=device)
    a = target_argmax if has_argmax else draft_ids
    p = target_probs if has_probs else draft_ids[:, :, None]
    q = draft_probs if has_probs else draft_ids[:, :, None]
    u = uniforms if has_probs else draft_ids
    z = noise if has_probs else draft_ids
    V = target_probs.shape[-1] if has_probs else 1
    _rejection_kernel[(B,)](
        output, num_accepted, draft_ids, a, p, q, greedy_u8, draft_len, u, z,
        output.stride(0), output.stride(1),
        draft_ids.stride(0), draft_ids.stride(1),
        a.stride(0), a.stride(1),
        p.stride(0), p.stride(1), p.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        greedy_u8.stride(0), draft_len.stride(0),
        u.stride(0), u.stride(1),
        z.stride(0), z.stride(1),
        k, V,
        HAS_ARGMAX=has_argmax, HAS_PROBS=has_probs,
        BLOCK_K=next_power_of_2(k + 1), BLOCK_V=min(BLOCK_V, next_power_of_2(V)),
    )
    return output, num_accepted
