"""The lean torch path of `bi_attention` (issue #41) against a frozen copy of the path it replaced (commit
73b3370's `chunk_plan` and `bi_attention_reference`, kept here verbatim as the oracle): the same bits for every
query on random inputs over B, T, W, layouts and padding, dtypes, GQA groups and head sizes, with the
model's strided query view and layer caches (K and V views of one tensor, wider than W) or separate
tensors, and one plan shared by several layers' calls and by other plans' calls in between.

The oracle's own invariance is what tests/test_batch_invariant.py asserts; bit-identity with it carries
that over to the lean path (which those tests also run, as `bi_attention`)."""
import functools
import math
import random
from typing import NamedTuple

import torch

from specdec.kernels import bi_attention as ba
from specdec.kernels.bi_attention import CHUNK
from specdec.kernels.bi_matmul import padded_rows
from specdec.kernels.dispatch import cdiv
from specdec.kernels.positions import step_plan_reference


# ------------------------------------------------------------------------------------ the oracle (frozen)
class OracleChunkPlan(NamedTuple):
    """Which cache columns the torch reference reads, and what each padded query row may see; the same for
    every layer of a forward (`chunk_plan`)."""

    rows_index: torch.Tensor  # [B * H_kv * NC * chunk] row of the cache viewed as [B * H_kv * C, D] to read
    hidden: torch.Tensor  # [B, 1, NC, Rp, chunk] bool, query row g * T + t may NOT see the key (padding rows: all)
    chunks: int  # NC
    rows: int  # R = G * T real query rows per (row, KV head)
    workspace: ba.Workspace | None = None  # None: fresh temporaries


def oracle_chunk_plan(mask, first, group: int, kv_heads: int, capacity: int, chunk: int = CHUNK,
               workspace: ba.Workspace | None = None) -> OracleChunkPlan:
    """The reference's gather index and visibility for mask [B, T, W], first [B], `group` query heads per
    KV head and caches [B, kv_heads, capacity, D]."""
    B, T, W = mask.shape
    NC = max(1, cdiv(W, chunk))  # enough for any row (first >= 0); surplus chunks are no-ops
    R = group * T
    Rp = padded_rows(R)
    span = torch.arange(NC * chunk, device=mask.device)  # [NCW]
    index = first[:, None] + span[None, :]  # [B, NCW] cache column of the row's key c * chunk + j
    inside = index < W  # [B, NCW]
    index = index.clamp(max=max(W - 1, 0))
    visible = mask.gather(2, index[:, None, :].expand(B, T, NC * chunk)) & inside[:, None, :]  # [B, T, NCW]
    seen = torch.zeros(B, 1, NC, Rp, chunk, dtype=torch.bool, device=mask.device)
    seen[:, :, :, :R] = visible.view(B, 1, 1, T, NC, chunk).permute(0, 1, 4, 2, 3, 5).expand(
        B, 1, NC, group, T, chunk).reshape(B, 1, NC, R, chunk)  # row g * T + t sees what query t sees
    heads = torch.arange(B * kv_heads, device=mask.device).view(B, kv_heads, 1)  # [B, H_kv, 1] = b * H_kv + h
    rows_index = (heads * capacity + index[:, None, :]).reshape(-1)  # [B * H_kv * NCW]
    return OracleChunkPlan(rows_index, ~seen, NC, R, workspace)


def oracle_attention(q, k_cache, v_cache, mask, first, plan: OracleChunkPlan | None = None, chunk: int = CHUNK):
    """Torch reference; shapes as in `bi_attention`. Returns [B, H, T, D] in q's dtype."""
    B, H, T, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    G = H // Hkv  # query heads per KV head (head h reads KV head h // G)
    if plan is None:
        plan = oracle_chunk_plan(mask, first, G, Hkv, C, chunk)
    NC, R = plan.chunks, plan.rows
    Rp = plan.hidden.shape[3]
    Bt = B * Hkv * NC  # one [chunk]-key matmul per (row, KV head, chunk)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ws = plan.workspace
    bmm = ba.bounded_bmm
    # is_compiling first: torch.compile cannot trace get_num_threads (a compiled graph keeps the caller's threads)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        threads = torch.get_num_threads()
        how = ba.bmm_plan(acc, threads, D, chunk)
        if how.threads != threads or how.block is not None:  # this CPU's bmm changes rows with the call
            bmm = functools.partial(ba._bmm, how)

    def buffer(name, shape, dtype, layout=None):  # (view, new layout: padding not zeroed yet)
        if ws is None:
            return torch.zeros(shape, dtype=dtype, device=q.device), True
        return ws.get(name, shape, dtype, q.device, layout)

    Bm = max(Bt, 2)  # a batch of one matrix with a transposed operand takes another MKL path (measured): pad
    picked_k, new = buffer("picked_k", (Bm * chunk, D), k_cache.dtype, layout=Bt)  # rows' keys from their first
    if new and Bm > Bt:
        picked_k[Bt * chunk:] = 0
    torch.index_select(k_cache.reshape(B * Hkv * C, D), 0, plan.rows_index,
                       out=picked_k if Bm == Bt else picked_k[: Bt * chunk])
    picked_v, _ = buffer("picked_v", (Bt * chunk, D), v_cache.dtype)
    torch.index_select(v_cache.reshape(B * Hkv * C, D), 0, plan.rows_index, out=picked_v)
    keys, values = picked_k.view(Bm, chunk, D), picked_v.view(Bt, chunk, D)
    if keys.dtype != acc:
        keys = buffer("keys", (Bm, chunk, D), acc)[0].copy_(keys)  # [Bm, chunk, D]
        values = buffer("values", (Bt, chunk, D), acc)[0].copy_(values)  # [Bt, chunk, D]
    rows, new = buffer("rows", (Bm, Rp, D), acc, layout=(Bt, R))  # query rows, padded, once per chunk
    if new:  # rows R.. and matrices Bt.. stay zero for as long as this layout is reused
        rows.zero_()
    scaled = (q.to(acc) * (1.0 / math.sqrt(D))).reshape(B, Hkv, 1, R, D)  # row g*T+t: query head kv*G+g, query t
    rows[:Bt].view(B, Hkv, NC, Rp, D)[:, :, :, :R] = scaled
    scores, _ = buffer("scores", (Bm, Rp, chunk), acc)
    bmm(rows, keys.transpose(1, 2), scores)  # [Bm, Rp, chunk]: K^T as a view, never copied
    scores = scores[:Bt].view(B, Hkv, NC, Rp, chunk).masked_fill_(plan.hidden, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # [B, H_kv, 1, Rp, 1] exact in any order
    top.clamp_(min=torch.finfo(acc).min)  # finite for rows with no visible key (their scores stay -inf)
    probs = scores.sub_(top).exp_()  # [B, H_kv, NC, Rp, chunk], in place of the scores; 0 where hidden
    sums = probs.sum(dim=-1)  # [B, H_kv, NC, Rp], one fixed-length sum per chunk
    parts, _ = buffer("parts", (Bt, Rp, D), acc)
    bmm(probs.view(Bt, Rp, chunk), values, parts)  # [Bt, Rp, D]
    # chunks added in order (cumsum is a sequential scan: one fixed order for every row)
    total = sums.cumsum(dim=2)[:, :, -1]  # [B, H_kv, Rp]
    out = parts.view(B, Hkv, NC, Rp, D).cumsum(dim=2)[:, :, -1]  # [B, H_kv, Rp, D], fresh: not a buffer
    out = out / total[..., None].clamp_min(torch.finfo(acc).tiny)  # rows with no visible key: 0 / tiny = 0
    return out[:, :, :R].reshape(B, H, T, D).to(q.dtype)




# ------------------------------------------------------------------------------------------------ cases
def bits(x):
    """x's raw bits (so that -0.0 and 0.0, or two NaNs, are told apart)."""
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def random_step(g: random.Random, B: int, T: int, W: int, layout: str):
    """(mask [B, T, W], per-row start) of a step of T new tokens per row in a cache of W columns: "ragged"
    (every row from column 0, rows of other lengths, some with fewer new tokens: padding queries on the
    right), "shifted" (as ragged, but every row from column 1..20: padding before the first key), "left" (every
    row ends at W, left padding; some rows with fewer new tokens), "prefill" (left padded, nothing cached: the
    padding queries on the left see no key)."""
    num_new = torch.tensor([g.randint(1, T) if g.random() < 0.3 else T for _ in range(B)])
    if layout == "ragged":
        length = torch.tensor([g.randint(0, W - T) for _ in range(B)])
        length[g.randrange(B)] = W - T  # the widest row ends at W
        start = torch.zeros(B, dtype=torch.int64)
    elif layout == "shifted":
        start = torch.tensor([g.randint(1, max(1, min(20, W - T))) for _ in range(B)]).clamp(max=W - T)
        length = torch.tensor([g.randint(0, W - T - int(s)) for s in start])
        i = g.randrange(B)
        length[i] = W - T - start[i]  # the widest row ends at W
    elif layout == "left":
        length = torch.tensor([g.randint(0, W - int(n)) for n in num_new])
        length[g.randrange(B)] = W - int(num_new[0]) if B == 1 else length[0]
        start = W - length - num_new
    else:  # prefill: T = W
        length = torch.zeros(B, dtype=torch.int64)
        start = W - num_new
    _, _, mask = step_plan_reference(start, length, num_new, T, layout in ("left", "prefill"), W)
    return mask


def random_inputs(g: random.Random, gen, dtype, B, T, W, H, Hkv, D, spare: int, pair: bool):
    """q [B, H, T, D] as the model's strided view of its rotated projections, and k/v [B, H_kv, W, D]: views of
    one layer cache [2, B, H_kv, W + spare, D] (`pair`) or two tensors; random everywhere (junk outside the
    rows' keys)."""
    NH = H + 2 * Hkv
    rot = torch.randn(B, T, NH, D, generator=gen).to(dtype)
    q = rot.as_strided((B, H, T, D), (T * NH * D, D, NH * D, 1))
    if pair:
        kv = torch.randn(2, B, Hkv, W + spare, D, generator=gen).to(dtype)
        k, v = kv[0, :, :, :W], kv[1, :, :, :W]
    else:
        k, v = (torch.randn(B, Hkv, W + spare, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


GROUPS = ((9, 3, 64), (6, 2, 24), (4, 4, 16), (2, 1, 64), (8, 2, 128), (3, 1, 8))  # (H, H_kv, D)
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def check_case(g, gen, dtype, B, T, W, layout, group, pair, layers=2, workspace=None):
    """The lean path and the oracle on `layers` random layers sharing one mask (one plan each, as a forward):
    the same bits. Returns the plan."""
    H, Hkv, D = group
    mask = random_step(g, B, T, W, layout)
    first = ba.first_keys(mask)
    spare = g.choice((0, 1, 37, 64))
    plan = ba.chunk_plan(mask, first, H // Hkv, Hkv, W + spare, workspace=workspace)
    for _ in range(layers):
        q, k, v = random_inputs(g, gen, dtype, B, T, W, H, Hkv, D, spare, pair)
        out = ba.bi_attention_reference(q, k, v, mask, first, plan)
        ref = oracle_attention(q, k, v, mask, first)
        assert out.shape == ref.shape == q.shape and out.dtype == ref.dtype == dtype
        assert torch.equal(bits(out), bits(ref)), (dtype, B, T, W, layout, group, pair)
    return plan


def test_lean_path_has_the_frozen_references_bits():
    """~200 random steps (decode, verify and short prefills at batch 1-43, W 1-3000, four layouts, three
    dtypes, six GQA/head-size groups, pair and separate caches), two layers each, on one workspace: every
    output bit as the oracle's, on every staging path."""
    g, gen = random.Random(41), torch.Generator().manual_seed(41)
    workspace = ba.Workspace()  # the model's: reused by every plan, grown, taken over
    cases = 0
    for dtype in DTYPES:
        for _ in range(60):
            B = g.choice((1, 1, 2, 3, 8, 32))
            T = g.choice((1, 1, 2, 4, 6, 9))
            layouts = ("ragged", "shifted", "left", "left", "prefill") if T > 1 else ("ragged", "shifted", "left")
            layout = g.choice(layouts)
            W = T if layout == "prefill" else g.choice((T, 5, 63, 64, 65, 128, 200, 333, 1000))
            W = max(W, T)
            group = g.choice(GROUPS)
            if B * W > 8000:  # keep the test short: large batches at modest widths
                W = max(T, 8000 // B)
            check_case(g, gen, dtype, B, T, W, layout, group, pair=g.random() < 0.8, workspace=workspace)
            cases += 1
        for B, W in ((1, 3000), (2, 2047)):  # long contexts, decode
            check_case(g, gen, dtype, B, 1, W, g.choice(("ragged", "left")), GROUPS[0], True, workspace=workspace)
            cases += 1
        # every staging path: blocks of groups (from column 0, gathered from the caches, gathered from a copy
        # of them), 129 groups of one chunk (the last block takes a group), one matrix padded to two (gathered
        # from the caches, from a copy)
        for B, W, layout, group, pair in ((8, 1000, "ragged", GROUPS[0], True), (8, 1000, "left", GROUPS[0], True),
                                          (8, 1000, "left", GROUPS[0], False), (43, 60, "ragged", GROUPS[0], True),
                                          (43, 60, "left", GROUPS[0], True), (1, 40, "shifted", GROUPS[3], True),
                                          (1, 40, "shifted", GROUPS[3], False)):
            check_case(g, gen, dtype, B, 1, W, layout, group, pair, workspace=workspace)
            cases += 1
    assert cases == 3 * 69


def test_plans_taking_turns_on_one_workspace_keep_their_bits():
    """Forwards' plans taking turns on one workspace in a random order: decodes from column 0 (whose zeros
    past W live in the shared buffers) of one shape at three widths (a rollback shrinks W), a left-padded
    decode of the same shape (its gather writes those columns), a verify and a one-row decode; then another
    user leaves NaN in every buffer. Each call has the oracle's bits."""
    g, gen = random.Random(7), torch.Generator().manual_seed(7)
    workspace = ba.Workspace()
    H, Hkv, D = GROUPS[0]
    masks = [random_step(g, 2, 1, 150, "ragged"), random_step(g, 2, 1, 129, "ragged"),
             random_step(g, 2, 1, 190, "ragged"), random_step(g, 2, 1, 170, "left"), random_step(g, 3, 6, 300, "left"),
             random_step(g, 1, 1, 150, "ragged")]
    plans = [ba.chunk_plan(m, ba.first_keys(m), H // Hkv, Hkv, m.shape[2], workspace=workspace) for m in masks]
    assert [p.from_zero for p in plans] == [True, True, True, False, False, True] and not plans[0].blind
    assert plans[5].masked_from == plans[5].chunks - 1  # one row at its full width: only the last chunk masks
    turns = [i % len(plans) for i in range(2 * len(plans))] + [g.randrange(len(plans)) for _ in range(12)]
    for i in turns:
        mask, plan = masks[i], plans[i]
        B, T, W = mask.shape
        q, k, v = random_inputs(g, gen, torch.float32, B, T, W, H, Hkv, D, 10, True)
        ref = oracle_attention(q, k, v, mask, ba.first_keys(mask))
        assert torch.equal(bits(ba.bi_attention_reference(q, k, v, mask, ba.first_keys(mask), plan)), bits(ref)), i
        if i == 0:
            assert torch.equal(bits(ba.bi_attention(q, k, v, mask, backend="torch")), bits(ref))  # a plan of its own
    for i in (0, 3, 5):  # a layer, then another user leaves NaN in every buffer, then the plan's next layer
        for turn in range(2):
            q, k, v = random_inputs(g, gen, torch.float32, *masks[i].shape, H, Hkv, D, 10, True)
            ref = oracle_attention(q, k, v, masks[i], ba.first_keys(masks[i]))
            out = ba.bi_attention_reference(q, k, v, masks[i], ba.first_keys(masks[i]), plans[i])
            assert torch.equal(bits(out), bits(ref)), (i, turn)
            for buffer in workspace.buffers.values():
                buffer.fill_(float("nan"))
            workspace.owner = object()


def test_prefill_sized_calls_fold_the_chunks_in_the_oracles_bits():
    """Calls with many query rows (a prefill after a cached prefix, a chunk of a chunked prefill, a whole
    prompt) add the chunks' outputs by a left fold in double (`last_prefix_sum`) instead of a cumsum that
    writes every prefix: the same bits as the oracle's cumsum, every dtype, every layout."""
    g, gen = random.Random(43), torch.Generator().manual_seed(43)
    workspace = ba.Workspace()
    for dtype in DTYPES:
        for B, T, W, layout, group in ((1, 200, 2000, "ragged", GROUPS[0]), (1, 64, 64, "prefill", GROUPS[1]),
                                       (2, 40, 300, "left", GROUPS[4]), (3, 33, 500, "shifted", GROUPS[0])):
            H, Hkv, _ = group
            assert ba.folds("cpu", torch.float64 if dtype == torch.float64 else torch.float32,
                            padded_rows(T * H // Hkv))  # the call takes the fold
            check_case(g, gen, dtype, B, T, W, layout, group, pair=True, layers=1, workspace=workspace)
    parts = torch.randn(2, 3, 17, 70, 8, generator=gen) * 1e3  # [B, H_kv, NC, Rp, D]
    for dtype in (torch.float32, torch.float64):
        x = parts.to(dtype)
        out = torch.empty(2, 3, 70, 8, dtype=dtype)
        ba.last_prefix_sum(x, torch.empty(2, 3, 70, 8, dtype=torch.float64), out)
        assert torch.equal(bits(out), bits(x.cumsum(dim=2)[:, :, -1]))
