"""Triton kernels vs their torch references (exact), wrapper validation and backend dispatch.

On a CPU machine the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set below before
triton is imported). On a CUDA machine run with `TRITON_INTERPRET=0` to test the compiled kernels on the GPU
(`bench/gpu_check.sh` does). Shapes are small: the interpreter is slow.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specdec.kernels import dispatch  # noqa: E402
from specdec.kernels import kv_append as kva  # noqa: E402
from specdec.kernels import noise as nse  # noqa: E402
from specdec.kernels import positions as pos  # noqa: E402
from specdec.kernels import realign as rea  # noqa: E402
from specdec.kernels import rejection as rej  # noqa: E402

MODULES = (pos, kva, rea, rej, nse)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = dispatch.triton_available()
DEVICE = "cuda" if (not INTERPRET and torch.cuda.is_available()) else "cpu"

def _triton_runnable() -> str:
    """Why the Triton path cannot run here ("" when it can)."""
    if not HAS_TRITON:
        return "triton is not installed"
    if not INTERPRET:
        return "" if DEVICE == "cuda" else "no CUDA device and TRITON_INTERPRET is not 1"
    import triton.language as tl  # the kernels themselves are decorated at their first launch (lazy_jit)

    if type(tl.cdiv).__name__ == "JITFunction":  # triton's own library was built before TRITON_INTERPRET=1
        return "triton was imported before TRITON_INTERPRET=1 was set: export TRITON_INTERPRET=1 or run this file alone"
    return ""


SKIP_TRITON = _triton_runnable()
needs_triton = pytest.mark.skipif(bool(SKIP_TRITON), reason=SKIP_TRITON or "-")
FEW = settings(max_examples=6, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------------------- positions


def _check_plan(start, length, T, num_new, left_padded):
    a = pos.step_plan(start, length, T, num_new, left_padded, backend="triton")
    b = pos.step_plan(start, length, T, num_new, left_padded, backend="torch")
    assert a.width == b.width
    for x, y in ((a.positions, b.positions), (a.columns, b.columns), (a.mask, b.mask), (a.num_new, b.num_new)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)
    return a


@needs_triton
@pytest.mark.parametrize("left_padded", [False, True])
@pytest.mark.parametrize("case", ["decode", "ragged_pad", "b1", "prefill"])
def test_step_plan_matches_reference(left_padded, case):
    if case == "decode":  # k+1 = 4 verify tokens per row
        start, length, T, num_new = _t([0, 3, 5]), _t([7, 4, 2]), 4, None
    elif case == "ragged_pad":  # right-padded input: rows with fewer real tokens (and a finished row)
        start, length, T, num_new = _t([0, 0, 0, 0]), _t([5, 9, 1, 3]), 3, _t([3, 1, 0, 2])
    elif case == "b1":
        start, length, T, num_new = _t([2]), _t([6]), 1, None
    else:  # prefill of a left-padded batch: empty cache, start = W - prompt_len
        lens = _t([5, 2, 7])
        start, length, T, num_new = 7 - lens, torch.zeros_like(lens), 7, lens
    plan = _check_plan(start, length, T, num_new, left_padded)
    if case == "prefill" and left_padded:
        assert torch.equal(plan.columns, torch.arange(7, device=DEVICE).expand(3, 7))


@needs_triton
@FEW
@given(data=st.data())
def test_step_plan_random(data):
    B = data.draw(st.integers(1, 4))
    T = data.draw(st.integers(1, 6))
    start = _t(data.draw(st.lists(st.integers(0, 6), min_size=B, max_size=B)))
    length = _t(data.draw(st.lists(st.integers(0, 9), min_size=B, max_size=B)))
    num_new = _t(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    _check_plan(start, length, T, num_new, data.draw(st.booleans()))


# ----------------------------------------------------------------------------------------- KV append


def _check_kv_append(B, H, C, D, T, dtype, columns, strided=False):
    g = torch.Generator().manual_seed(B * 100 + H * 10 + D)
    if strided:  # a layer of a [L, 2, B, H, C, D] cache, and K/V as a strided view of a rotated [B, T, 3 H, D] qkv
        kv = torch.randn(2, 2, B, H, C, D, generator=g).to(dtype).to(DEVICE)[1]
        new = torch.randn(B, T, 3 * H, D, generator=g).to(dtype).to(DEVICE)[:, :, H:]
    else:
        kv = torch.randn(2, B, H, C, D, generator=g).to(dtype).to(DEVICE)
        new = torch.randn(B, T, 2 * H, D, generator=g).to(dtype).to(DEVICE)
    a, b = kv.clone(), kv.clone()
    kva.kv_append(a, new, columns, backend="triton")
    kva.kv_append(b, new, columns, backend="torch")
    assert torch.equal(a, b)
    assert not torch.equal(a, kv) or T == 0
    for i in range(B):  # row i's token t: K heads at slot 0, V heads at slot 1, column columns[i, t]
        for t in range(T):
            c = int(columns[i, t])
            assert torch.equal(b[0, i, :, c], new[i, t, :H]) and torch.equal(b[1, i, :, c], new[i, t, H:])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 6, 3, 1), (3, 2, 12, 24, 4), (2, 4, 9, 5, 3)])
def test_kv_append_matches_reference(dtype, shape):
    B, H, C, D, T = shape
    length = torch.arange(B, device=DEVICE) * 2  # ragged: every row writes at its own columns
    columns = length[:, None] + torch.arange(T, device=DEVICE)[None, :]
    _check_kv_append(B, H, C, D, T, dtype, columns)


@needs_triton
def test_kv_append_strided_left_padded():
    B, H, C, D, T = 3, 2, 10, 24, 4
    columns = (6 + torch.arange(T, device=DEVICE))[None, :].expand(B, T)  # left-padded: same columns every row
    _check_kv_append(B, H, C, D, T, torch.bfloat16, columns, strided=True)


@needs_triton
def test_kv_append_kernel_drops_out_of_range_columns():
    """The kernel never writes outside the cache (the reference would raise)."""
    kv = torch.zeros(2, 2, 1, 4, 3, device=DEVICE)  # [2, B, H_kv, C, D]
    new = torch.ones(2, 2, 2, 3, device=DEVICE)  # [B, T, 2 H_kv, D]
    kva.kv_append_triton(kv, new, _t([[-1, 0], [3, 4]]))
    assert kv[:, 0, 0, 0].eq(1).all() and kv[:, 1, 0, 3].eq(1).all()
    assert kv.sum() == 12


# ----------------------------------------------------------------------------------------- realign


def _caches(shapes, B, C, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(L, B, H, C, D, generator=g).to(dtype).to(DEVICE) for _ in range(2)) for L, H, D in shapes]


def _check_realign(caches, start, count, delta, block_c=None):
    a = [(k.clone(), v.clone()) for k, v in caches]
    b = [(k.clone(), v.clone()) for k, v in caches]
    if block_c is None:
        rea.realign(a, start, count, delta, backend="triton")
    else:
        rea.realign_triton(a, start, count, delta, block_c=block_c)
    rea.realign(b, start, count, delta, backend="torch")
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    return a


TARGET_DRAFT = [(2, 4, 24), (1, 1, 3)]  # (L, H_kv, D) of a target and a draft cache: different L/H/D


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_realign_target_and_draft(dtype):
    B, C = 4, 20
    start, count, delta = _t([2, 5, 0, 4]), _t([13, 10, 0, 12]), _t([3, -4, 2, 0])  # +, -, finished, zero
    _check_realign(_caches(TARGET_DRAFT, B, C, dtype), start, count, delta)


@needs_triton
@pytest.mark.parametrize("block_c", [1, 2, 4])
@pytest.mark.parametrize("shift", [1, 3, 5, -1, -3, -5])
def test_realign_overlapping_tiles(block_c, shift):
    """Many tiles per row and |delta| smaller/larger than a tile: the in-place order must be right."""
    B, C = 2, 24
    start = _t([6, 6])
    count = _t([13, 11])
    delta = _t([shift, -shift])
    _check_realign(_caches([(1, 2, 3)], B, C, torch.float32), start, count, delta, block_c=block_c)


@needs_triton
def test_realign_edges():
    B, C = 3, 12
    caches = _caches(TARGET_DRAFT, B, C, torch.float32)
    zeros = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    out = _check_realign(caches, _t([1, 2, 0]), _t([5, 6, 4]), zeros)  # delta = 0 everywhere: nothing moves
    assert all(torch.equal(x, y) for p, q in zip(out, caches) for x, y in zip(p, q))
    _check_realign(caches, _t([1, 2, 0]), zeros, _t([3, -2, 5]))  # every row finished (count 0)
    one = _caches([(3, 2, 5)], 1, 9, torch.bfloat16)  # B = 1, odd D
    _check_realign(one, _t([4]), _t([5]), _t([-4]))
    _check_realign(one, _t([0]), _t([5]), _t([4]))
    three = _caches([(1, 2, 4), (2, 1, 3), (1, 3, 8)], B, C, torch.float64)  # 6 tensors: two launches
    _check_realign(three, _t([1, 2, 0]), _t([5, 6, 4]), _t([2, -2, 0]))


@needs_triton
def test_realign_eqspec_step():
    """A left-padded batch after verification: rows accepted a_i of k drafts; re-pad to the longest row."""
    B, C = 4, 24
    length = _t([9, 5, 12, 7])  # cached lengths before the step, all ending at column W
    W = 14
    start = W - length
    a = _t([0, 3, 1, 2])
    count = length + a + 1  # kept tokens (the emitted token is not cached yet, but the shapes are the same)
    delta = (a.max() - a)  # EQSPEC: shift right by max_a - a_i
    _check_realign(_caches(TARGET_DRAFT, B, C, torch.bfloat16, seed=1), start, count, delta)
    _check_realign(_caches(TARGET_DRAFT, B, C, torch.bfloat16, seed=2), start + delta, count, -delta)  # back left
    assert int((start + delta + count).max()) <= C


@needs_triton
def test_realign_pingpong_variant():
    B, C = 3, 16
    caches = _caches(TARGET_DRAFT, B, C, torch.float32)
    start, count, delta = _t([2, 5, 1]), _t([9, 6, 3]), _t([-2, 3, 0])
    before = [(k.clone(), v.clone()) for k, v in caches]
    out = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    rea.realign_triton(caches, start, count, delta, out=out)
    ref = [(k.clone(), v.clone()) for k, v in caches]
    rea.realign_reference(ref, start, count, delta)
    for (k0, v0), (k1, v1) in zip(before, caches):  # sources untouched
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    for i in range(B):  # destination columns hold the shifted rows, delta = 0 rows included
        lo, hi = int(start[i] + delta[i]), int(start[i] + delta[i] + count[i])
        for (ko, vo), (kr, vr) in zip(out, ref):
            assert torch.equal(ko[:, i, :, lo:hi], kr[:, i, :, lo:hi])
            assert torch.equal(vo[:, i, :, lo:hi], vr[:, i, :, lo:hi])


@needs_triton
def test_realign_rejects_aliased_caches():
    caches = _caches([(1, 1, 3)], 1, 6, torch.float32)
    with pytest.raises(ValueError, match="twice"):
        rea.realign_triton(caches + caches, _t([0]), _t([2]), _t([1]))


@needs_triton
@FEW
@given(data=st.data())
def test_realign_random(data):
    B = data.draw(st.integers(1, 4))
    C = data.draw(st.integers(4, 20))
    start, count, delta = [], [], []
    for _ in range(B):
        n = data.draw(st.integers(0, C))
        lo, dst = data.draw(st.integers(0, C - n)), data.draw(st.integers(0, C - n))
        start.append(lo), count.append(n), delta.append(dst - lo)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    block_c = data.draw(st.sampled_from([None, 2, 4]))
    caches = _caches(TARGET_DRAFT, B, C, dtype, seed=data.draw(st.integers(0, 99)))
    _check_realign(caches, _t(start), _t(count), _t(delta), block_c=block_c)


def test_realign_rows_cpu_path_equals_reference():
    """The CPU path (one slice copy per moved row, given host lists) moves exactly what the reference moves,
    for right, left, zero, overlapping and empty shifts."""
    B, C = 6, 20
    start, count, delta = [0, 5, 3, 10, 2, 7], [8, 6, 0, 10, 5, 4], [4, -5, 3, -10, 1, 0]
    caches = _caches(TARGET_DRAFT, B, C, torch.float32, seed=3)
    a = [(k.clone(), v.clone()) for k, v in caches]
    b = [(k.clone(), v.clone()) for k, v in caches]
    rea.realign(a, _t(start), _t(count), _t(delta), backend="torch", host=(start, count, delta))
    rea.realign_reference(b, _t(start), _t(count), _t(delta))
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    with pytest.raises(ValueError, match="leaves the cache"):
        rea.realign(a, _t(start), _t(count), _t(delta), backend="torch", host=(start, count, [4, -6, 3, -10, 1, 0]))


# ----------------------------------------------------------------------------------------- rejection


def _probs(B, n, V, g, dtype=torch.float32, sparse=False):
    logits = torch.randn(B, n, V, generator=g, dtype=torch.float64) * 3
    if sparse:  # top-k processed distributions: exact zeros outside the top 3
        logits = logits.masked_fill(logits < logits.topk(min(3, V), dim=-1).values[..., -1:], -math.inf)
    return torch.softmax(logits, dim=-1).to(dtype).to(DEVICE)


def _sample_case(B, k, V, seed, greedy=None, probs_dtype=torch.float32, noise_dtype=torch.float32, sparse=False):
    g = torch.Generator().manual_seed(seed)
    target_probs = _probs(B, k + 1, V, g, probs_dtype, sparse)
    draft_probs = _probs(B, k, V, g, probs_dtype, sparse)
    draft_ids = torch.multinomial(draft_probs.float().reshape(-1, V).cpu(), 1, generator=g).reshape(B, k).to(DEVICE)
    target_argmax = target_probs.argmax(-1)
    take = torch.rand(B, k, generator=g).to(DEVICE) < 0.6  # greedy rows: make drafts match the target often
    draft_ids_g = torch.where(take, target_argmax[:, :k], draft_ids)
    if greedy is None:
        is_greedy = (torch.rand(B, generator=g) < 0.5).to(DEVICE)
    else:
        is_greedy = torch.full((B,), greedy, dtype=torch.bool, device=DEVICE)
    draft_ids = torch.where(is_greedy[:, None], draft_ids_g, draft_ids)
    uniforms = torch.rand(B, k, generator=g, dtype=torch.float64).to(DEVICE)
    noise = torch.empty(B, V, dtype=torch.float64).exponential_(generator=g).to(noise_dtype).to(DEVICE)
    return dict(draft_ids=draft_ids, target_argmax=target_argmax, target_probs=target_probs, draft_probs=draft_probs,
                is_greedy=is_greedy, uniforms=uniforms, noise=noise)


def _check_rejection(**kw):
    a = rej.rejection_sample(**kw, backend="triton")
    b = rej.rejection_sample(**kw, backend="torch")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (a, b)
    return a


@needs_triton
def test_rejection_greedy_by_hand():
    # row 0: all 3 accepted -> bonus argmax[3]; row 1: a = 0 -> correction argmax[0];
    # row 2: mismatch at j = 2; row 3: mismatch at j = 1 even though j = 2 matches again
    draft_ids = _t([[5, 6, 7], [1, 2, 3], [4, 4, 9], [8, 1, 2]])
    target_argmax = _t([[5, 6, 7, 11], [0, 2, 3, 4], [4, 4, 3, 5], [8, 7, 2, 1]])
    out, n = _check_rejection(draft_ids=draft_ids, target_argmax=target_argmax)
    assert n.tolist() == [3, 0, 2, 1]
    assert out.tolist() == [[5, 6, 7, 11], [0, -1, -1, -1], [4, 4, 3, -1], [8, 7, -1, -1]]


@needs_triton
def test_rejection_greedy_k1_b1():
    out, n = _check_rejection(draft_ids=_t([[3]]), target_argmax=_t([[3, 9]]))
    assert out.tolist() == [[3, 9]] and n.tolist() == [1]


@needs_triton
@pytest.mark.parametrize("V,B,k", [(100, 4, 3), (8193, 3, 2), (32000, 2, 2), (151936, 1, 2)])
def test_rejection_vocab_tile_boundaries(V, B, k):
    _check_rejection(**_sample_case(B, k, V, seed=V))


@needs_triton
@pytest.mark.parametrize("probs_dtype,noise_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.float32),
                                                     (torch.float32, torch.float64)])
def test_rejection_random_dtypes(probs_dtype, noise_dtype):
    _check_rejection(**_sample_case(4, 3, 300, seed=3, greedy=False, probs_dtype=probs_dtype,
                                    noise_dtype=noise_dtype, sparse=True))


@needs_triton
@pytest.mark.parametrize("greedy", [None, True, False])
def test_rejection_unusable_draft_accepts_nothing(greedy):
    """draft_len 0 (non-finite draft logits): no draft accepted, the next token is the target's own
    (argmax, or a sample of p with q taken as 0), whatever the draft distribution holds (NaN here)."""
    kw = _sample_case(4, 3, 300, seed=9, greedy=greedy)
    ok = torch.tensor([True, False, True, False], device=DEVICE)
    dp = kw["draft_probs"].clone()
    dp[~ok] = float("nan")
    out, n = _check_rejection(**{**kw, "draft_probs": dp}, draft_len=torch.where(ok, 3, 0))
    assert n[~ok].tolist() == [0, 0]
    rows = (~ok).nonzero().flatten()
    for i in rows.tolist():
        if kw["is_greedy"][i]:
            assert out[i, 0] == kw["target_argmax"][i, 0]
        else:  # the race over p alone
            assert out[i, 0] == (kw["target_probs"][i, 0].double() / kw["noise"][i].double()).argmax()
    assert (out[rows, 1:] == -1).all()


@needs_triton
@FEW
@given(data=st.data())
def test_rejection_row_of_length_L_emits_what_a_step_of_k_L_emits(data):
    """Per-row draft lengths (a proposer with fewer than k drafts for some rows): a row offering L of the
    k drafts emits exactly what the same row emits in a step of k = L (drafts past L never accepted; all
    L accepted: the bonus is the target's own sample at L, q = 0). Shapes and noise as in a real step."""
    B, k = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    V = data.draw(st.sampled_from([3, 17, 100]))
    kw = _sample_case(B, k, V, seed=data.draw(st.integers(0, 10_000)), sparse=data.draw(st.booleans()))
    if data.draw(st.booleans()):  # make acceptance likely, so that rows run to their length
        kw["target_probs"] = torch.cat([kw["draft_probs"], kw["target_probs"][:, -1:]], dim=1)
        kw["target_argmax"] = torch.cat([kw["draft_ids"], kw["target_argmax"][:, -1:]], dim=1)
    lengths = [data.draw(st.integers(0, k)) for _ in range(B)]
    out, n = _check_rejection(**kw, draft_len=_t(lengths))
    for i, L in enumerate(lengths):
        if L == 0:
            continue  # k = 0 has no rejection step; covered by the unusable-draft test
        row = {name: (None if t is None else t[i:i + 1]) for name, t in kw.items()}
        row["draft_ids"], row["uniforms"] = row["draft_ids"][:, :L], row["uniforms"][:, :L]
        row["draft_probs"] = row["draft_probs"][:, :L]
        row["target_probs"] = torch.cat([row["target_probs"][:, :L], row["target_probs"][:, L:L + 1]], dim=1)
        row["target_argmax"] = row["target_argmax"][:, :L + 1]
        alone, m = _check_rejection(**row)
        assert n[i] == m[0] and out[i, :L + 1].tolist() == alone[0].tolist(), (i, L)
        assert (out[i, L + 1:] == -1).all()
        slot = rej.random_slot(kw["draft_ids"], kw["target_probs"], kw["draft_probs"], kw["uniforms"], _t(lengths))
        if not kw["is_greedy"][i]:
            assert slot[i] == n[i]


@needs_triton
def test_rejection_all_rejected_and_all_accepted():
    kw = _sample_case(3, 3, 257, seed=5, greedy=False)
    rows = torch.arange(3, device=DEVICE)[:, None]
    j = torch.arange(3, device=DEVICE)[None, :]
    tp = kw["target_probs"].clone()
    tp[rows, j, kw["draft_ids"]] = 0.0  # p(d) = 0: every first draft rejected (u * q > 0)
    out, n = _check_rejection(**{**kw, "target_probs": tp})
    assert n.tolist() == [0, 0, 0]
    assert (out[:, 1:] == -1).all()
    tp = kw["target_probs"].clone()
    tp[:, :3] = kw["draft_probs"]  # p = q: everything accepted, the bonus comes from p_k
    out, n = _check_rejection(**{**kw, "target_probs": tp})
    assert n.tolist() == [3, 3, 3] and torch.equal(out[:, :3], kw["draft_ids"])


@needs_triton
def test_rejection_empty_residual_falls_back_to_p():
    """p = q/2 (unnormalised): a rejection leaves max(p - q, 0) = 0 everywhere; the reference samples p."""
    kw = _sample_case(3, 2, 50, seed=7, greedy=False)
    tp = kw["target_probs"].clone()
    tp[:, :2] = kw["draft_probs"] / 2
    uniforms = torch.full((3, 2), 0.9, dtype=torch.float64, device=DEVICE)
    out, n = _check_rejection(**{**kw, "target_probs": tp, "uniforms": uniforms})
    assert n.tolist() == [0, 0, 0]
    zero_bonus = {**kw, "target_probs": torch.zeros_like(tp), "uniforms": torch.zeros_like(uniforms)}
    out, n = _check_rejection(**zero_bonus)  # p = 0 everywhere: 0 * q <= 0 accepts; bonus race is all 0
    assert n.tolist() == [2, 2, 2] and out[:, 2].tolist() == [0, 0, 0]


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_rejection_ties_and_nan_like_torch_argmax():
    V = 5000  # three tiles of 2048
    kw = _sample_case(3, 1, V, seed=9, greedy=False)
    p = torch.zeros(3, 2, V, device=DEVICE)
    p[:, :, [7, 2048 + 7, 4095]] = 1 / 3  # exact ties in different tiles: the first index wins
    q = torch.zeros(3, 1, V, device=DEVICE)
    q[:, :, 1] = 1.0
    noise = torch.ones(3, V, device=DEVICE)
    noise[1, 2048 + 7] = 0.5  # row 1: the second tile wins strictly
    noise[2, [100, 3000]] = 0.0  # row 2: 0 / 0 = NaN at 100 and 3000 -> torch picks the first NaN
    ids = torch.ones(3, 1, dtype=torch.int64, device=DEVICE)
    out, n = _check_rejection(**{**kw, "draft_ids": ids, "target_probs": p, "draft_probs": q, "noise": noise})
    assert n.tolist() == [0, 0, 0] and out[:, 0].tolist() == [7, 2048 + 7, 100]


@needs_triton
def test_rejection_only_probs_or_only_argmax():
    kw = _sample_case(3, 2, 64, seed=11, greedy=False)
    _check_rejection(**{**kw, "target_argmax": None, "is_greedy": None})
    kg = _sample_case(3, 2, 64, seed=12, greedy=True)
    _check_rejection(draft_ids=kg["draft_ids"], target_argmax=kg["target_argmax"])


@needs_triton
@FEW
@given(data=st.data())
def test_rejection_random(data):
    B, k = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    V = data.draw(st.sampled_from([3, 17, 100, 2049]))
    kw = _sample_case(B, k, V, seed=data.draw(st.integers(0, 10_000)), sparse=data.draw(st.booleans()),
                      probs_dtype=data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])))
    _, accepted = _check_rejection(**kw)
    # random_slot (what the runtime keys a row's residual noise by) is the slot the sampler emits at
    full = torch.full((B,), k, dtype=torch.int64, device=DEVICE)
    slot = rej.random_slot(kw["draft_ids"], kw["target_probs"], kw["draft_probs"], kw["uniforms"], full)
    random_rows = ~kw["is_greedy"]
    assert torch.equal(slot[random_rows], accepted[random_rows])


def test_rejection_reference_converges_to_target():
    """Statistical check of the semantics (torch path, vectorised): the first emitted token ~ p_0."""
    g = torch.Generator().manual_seed(0)
    N, V = 200_000, 6
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.30], dtype=torch.float64)
    q = torch.tensor([0.30, 0.10, 0.20, 0.05, 0.25, 0.10], dtype=torch.float64)
    draft = torch.multinomial(q, N, replacement=True, generator=g)[:, None]  # [N, 1]
    out, _ = rej.rejection_sample(
        draft, target_probs=p.expand(N, 2, V), draft_probs=q.expand(N, 1, V),
        uniforms=torch.rand(N, 1, generator=g, dtype=torch.float64),
        noise=torch.empty(N, V, dtype=torch.float64).exponential_(generator=g), backend="torch")
    freq = torch.bincount(out[:, 0], minlength=V).double() / N
    assert (freq - p).abs().max() < 0.006, freq


# ----------------------------------------------------------------------------------------- noise


def test_philox_matches_the_random123_known_answer():
    """Philox4x32-10, counter 0 and key 0 (Random123's kat_vectors): the torch reference is Philox itself."""
    zero = torch.zeros((), dtype=torch.int64)
    assert [int(w) for w in nse.philox4x32(zero, zero, zero)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@needs_triton
@FEW
@given(data=st.data())
def test_noise_triton_bits_equal_the_reference(data):
    B, count = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    width = data.draw(st.sampled_from([1, 2, 7, 131, 1025, 2500]))
    seeds = _t([data.draw(st.integers(-(1 << 63), (1 << 63) - 1)) for _ in range(B)])
    top = nse.MAX_POSITION - count
    positions = _t([data.draw(st.sampled_from([0, 1, 517, top])) for _ in range(B)])
    stream = data.draw(st.sampled_from(nse.STREAMS))
    a = nse.uniform_noise(seeds, positions, count, width, stream, backend="triton")
    b = nse.uniform_noise(seeds, positions, count, width, stream, backend="torch")
    assert a.shape == (B, count, width) and a.dtype == torch.float64
    assert torch.equal(a, b)
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(nse.exponential_noise(seeds, positions, count, width, stream, dtype, backend="triton"),
                           nse.exponential_noise(seeds, positions, count, width, stream, dtype, backend="torch"))


def test_noise_is_keyed_by_seed_position_stream_and_index_only():
    seeds, positions = _t([3, -7, 3]), _t([10, 10, 40])
    u = nse.uniform_noise(seeds, positions, 5, 300, nse.RACE, backend="torch")  # [3, 5, 300]
    shifted = nse.uniform_noise(seeds, positions + 2, 3, 300, nse.RACE, backend="torch")
    assert torch.equal(u[:, 2:], shifted)  # column j of position p is column 0 of position p + j
    alone = nse.uniform_noise(seeds[1:2], positions[1:2], 5, 40, nse.RACE, backend="torch")
    assert torch.equal(u[1:2, :, :40], alone)  # neither the batch nor the width matters
    assert torch.equal(u[0, 0], nse.uniform_noise(_t([3]), _t([10]), 1, 300, nse.RACE, backend="torch")[0, 0])
    assert not torch.equal(u[0], u[1])  # another seed
    assert not torch.equal(u[0, 0], u[2, 0])  # another position, same seed
    other = nse.uniform_noise(seeds, positions, 5, 300, nse.RESIDUAL, backend="torch")
    assert (other != u).float().mean() > 0.99  # another stream


def test_noise_is_uniform_and_exponential():
    seeds = torch.arange(64, dtype=torch.int64) * 0x9E3779B97F4A7C15 % (1 << 62)
    u = nse.uniform_noise(seeds, torch.arange(64, dtype=torch.int64), 4, 1000, nse.RACE, backend="torch").flatten()
    assert 0 < float(u.min()) and float(u.max()) <= 1
    sorted_u = u.sort().values
    ks = float((sorted_u - torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u)).abs().max())
    assert ks < 1.63 / len(u) ** 0.5  # Kolmogorov-Smirnov at 1 %
    e = nse.exponential_noise(seeds, torch.zeros(64, dtype=torch.int64), 4, 1000, nse.ACCEPT, torch.float32,
                              backend="torch")
    assert e.dtype == torch.float32 and float(e.min()) > 0
    assert abs(float(e.double().mean()) - 1) < 0.01 and abs(float(e.double().var()) - 1) < 0.03


def test_noise_rejects_bad_arguments():
    s = torch.zeros(2, dtype=torch.int64)
    for args, kw, name in [((s.int(), s, 1, 4, 0), {}, "seeds"), ((s, s[:1], 1, 4, 0), {}, "positions"),
                           ((s, s, 0, 4, 0), {}, "count"), ((s, s, 1, 4, 3), {}, "stream"),
                           ((s, s, 2, 4, 0), {"host_max_position": 1 << 28}, "positions must be < 2\\*\\*28")]:
        with pytest.raises(ValueError, match=name):
            nse.uniform_noise(*args, **kw, backend="torch")


# ----------------------------------------------------------------------------------------- validation


def _valid_rejection_args():
    B, k, V = 2, 2, 5
    return dict(draft_ids=torch.zeros(B, k, dtype=torch.int64), target_argmax=torch.zeros(B, k + 1, dtype=torch.int64),
                target_probs=torch.full((B, k + 1, V), 0.2), draft_probs=torch.full((B, k, V), 0.2),
                is_greedy=torch.tensor([True, False]), uniforms=torch.rand(B, k, dtype=torch.float64),
                noise=torch.ones(B, V))


@pytest.mark.parametrize("arg,bad", [
    ("draft_ids", torch.zeros(2, 2, dtype=torch.int32)),
    ("target_argmax", torch.zeros(2, 2, dtype=torch.int64)),
    ("target_argmax", torch.zeros(2, 3, dtype=torch.int32)),
    ("target_probs", torch.full((2, 2, 5), 0.2)),
    ("draft_probs", torch.full((2, 2, 4), 0.2)),
    ("is_greedy", torch.tensor([1, 0])),
    ("uniforms", torch.rand(2, 2)),
    ("noise", torch.ones(2, 4)),
    ("noise", torch.ones(2, 5, dtype=torch.int64)),
])
def test_rejection_rejects_bad_arguments(arg, bad):
    kw = _valid_rejection_args()
    rej.rejection_sample(**kw, backend="torch")
    with pytest.raises(ValueError, match=arg):
        rej.rejection_sample(**{**kw, arg: bad}, backend="torch")


def test_rejection_rejects_missing_inputs():
    kw = _valid_rejection_args()
    with pytest.raises(ValueError, match="greedy rows need target_argmax"):
        rej.rejection_sample(**{**kw, "target_argmax": None})
    with pytest.raises(ValueError, match="sampling rows need target_probs"):
        rej.rejection_sample(kw["draft_ids"], kw["target_argmax"], is_greedy=kw["is_greedy"])


def test_kv_append_rejects_bad_arguments():
    kv = torch.zeros(2, 2, 1, 8, 3)  # [2, B, H_kv, C, D]
    new = torch.zeros(2, 2, 2, 3)  # [B, T, 2 H_kv, D]
    cols = torch.zeros(2, 2, dtype=torch.int64)
    for args, name in [((kv, new, cols.int()), "columns"),
                       ((kv, torch.zeros(2, 2, 2, 4), cols), "new must be"),
                       ((kv, new.double(), cols), "new dtype"),
                       ((kv[0], new, cols), "kv must be")]:
        with pytest.raises(ValueError, match=name):
            kva.kv_append(*args, backend="torch")


def test_step_plan_rejects_bad_arguments():
    s = torch.zeros(2, dtype=torch.int64)
    for args, kw, name in [((s.int(), s, 2), {}, "start"), ((s, s[:1], 2), {}, "length"), ((s, s, 0), {}, "T"),
                           ((s, s, 2), {"num_new": torch.zeros(2)}, "num_new")]:
        with pytest.raises(ValueError, match=name):
            pos.step_plan(*args, **kw, backend="torch")


def test_realign_rejects_bad_arguments():
    k = torch.zeros(1, 2, 1, 8, 3)
    s = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="delta"):
        rea.realign([(k, k)], s, s, s.int(), backend="torch")
    with pytest.raises(ValueError, match="cache"):
        rea.realign([(torch.zeros(1, 3, 1, 8, 3),) * 2], s, s, s, backend="torch")
    with pytest.raises(ValueError, match="leaves"):
        rea.realign([(k, k)], s, s + 5, s + 4, backend="torch")
    with pytest.raises(ValueError, match="leaves"):  # the source columns, too: the kernel must never read outside
        rea.realign([(k, k)], s + 6, s + 3, s - 6, backend="torch")
    with pytest.raises(ValueError, match="at least one"):
        rea.realign([], s, s, s, backend="torch")


# ----------------------------------------------------------------------------------------- dispatch


@pytest.fixture
def spies(monkeypatch):
    """Replace every wrapper's two implementations with recorders."""
    calls = []
    for mod, name in ((pos, "step_plan"), (kva, "kv_append"), (rea, "realign"), (rej, "rejection_sample"),
                      (nse, "uniform_noise")):
        ref = getattr(mod, f"{name}_reference")
        for path in ("triton", "reference"):
            def spy(*args, _ref=ref, _name=name, _path=path, **kwargs):
                calls.append((_name, "torch" if _path == "reference" else "triton"))
                return _ref(*args)

            monkeypatch.setattr(mod, f"{name}_{path}", spy)
    return calls


def _call_all(backend=None):
    s = torch.zeros(2, dtype=torch.int64)
    pos.step_plan(s, s, 2, backend=backend)
    kva.kv_append(torch.zeros(2, 2, 1, 4, 3), torch.zeros(2, 1, 2, 3), torch.zeros(2, 1, dtype=torch.int64),
                  backend=backend)
    rea.realign([(torch.zeros(1, 2, 1, 4, 3), torch.zeros(1, 2, 1, 4, 3))], s, s, s, backend=backend)
    rej.rejection_sample(torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), backend=backend)
    nse.uniform_noise(s, s, 2, 3, nse.RACE, backend=backend)


@pytest.mark.parametrize("backend,expected", [("torch", "torch"), ("triton", "triton"), ("auto", "torch"),
                                              (None, "torch")])
def test_backend_selection(monkeypatch, spies, backend, expected):
    """`backend=` alone chooses (None: auto, the torch reference for CPU tensors); no environment variable does
    (SPECDEC_KERNELS once did, duplicating the argument: set here, it must change nothing)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors may take the triton path only when interpreting
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("SPECDEC_KERNELS", "triton" if expected == "torch" else "torch")
    _call_all(backend)
    assert spies == [(n, expected) for n in ("step_plan", "kv_append", "realign", "rejection_sample", "uniform_noise")]


def test_backend_errors(monkeypatch):
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="kernel backend 'cuda' is not one of"):
        dispatch.choose_backend(x, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.choose_backend(x, "triton")
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        dispatch.choose_backend(x, "triton")


# ----------------------------------------------------------------------------------------- GPU compile


def _compile_recorded(patches, mod, kernel_name, launch, specialize: bool = False, metadata: list | None = None):
    """Run a launcher with the kernel replaced by a recorder, then compile each recorded launch for sm_90
    (no GPU needed): catches what the interpreter forgives (loop-carried/branch type changes, ...).
    `specialize`: as triton's launcher does on a GPU, integer arguments equal to 1 become constants and
    integers and pointers divisible by 16 are marked so (what lets the compiler vectorise and pipeline loads:
    without it a stride is unknown and no load is pipelined). `metadata`: a list to append each compiled
    kernel's metadata (shared memory, ...) to."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    kernel = getattr(mod, kernel_name)
    if isinstance(kernel, dispatch.LazyJit):
        kernel = kernel.materialize()
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((a, kw))

    patches.enter_context(mock.patch.object(mod, kernel_name, Recorder()))
    launch()
    compiled = []
    for args, kwargs in calls:
        args = list(args)
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(kernel.params):
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[(i,)] = kwargs[p.name]
                continue
            arg = args.pop(0)
            if specialize and isinstance(arg, int) and not isinstance(arg, bool) and arg == 1:
                signature[p.name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[p.name] = mangle_type(arg)
            if specialize and ((isinstance(arg, int) and not isinstance(arg, bool) and arg % 16 == 0)
                               or (isinstance(arg, torch.Tensor) and arg.data_ptr() % 16 == 0)):
                attrs[(i,)] = [["tt.divisibility", 16]]
        options = {name: kwargs[name] for name in ("num_warps", "num_stages") if name in kwargs}  # as launched
        compiled.append(triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                       target=GPUTarget("cuda", 90, 32), options=options))
    assert compiled
    if metadata is not None:
        metadata.extend(c.metadata for c in compiled)
    return [c.asm["ptx"] for c in compiled]


def compile_all_for_sm90():
    """Compile every kernel as its launcher calls it. Run in a fresh process without TRITON_INTERPRET (the
    interpreter patches triton.language for the rest of its process)."""
    with contextlib.ExitStack() as patches:
        s = torch.tensor([0, 1])
        _compile_recorded(patches, pos, "_step_plan_kernel", lambda: pos.step_plan_triton(s, s, s, 3, True, 5))
        c = torch.zeros(2, 2, 2, 8, 3, dtype=torch.bfloat16)  # [2, B, H_kv, C, D]
        n = torch.zeros(2, 3, 4, 3, dtype=torch.bfloat16)  # [B, T, 2 H_kv, D]
        cols = torch.zeros(2, 3, dtype=torch.int64)
        _compile_recorded(patches, kva, "_kv_append_kernel", lambda: kva.kv_append_triton(c, n, cols))
        caches = [(torch.zeros(2, 2, 2, 8, 3, dtype=torch.bfloat16), torch.zeros(2, 2, 2, 8, 3, dtype=torch.bfloat16)),
                  (torch.zeros(1, 2, 3, 8, 24), torch.zeros(1, 2, 3, 8, 24))]
        out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in caches]
        ptx = _compile_recorded(patches, rea, "_realign_kernel", lambda: (
            rea.realign_triton(caches, s, s, s), rea.realign_triton(caches, s, s, s, out=out)))
        assert "bar.sync" in ptx[0]  # in place: every load of a tile completes before its stores
        B, k, V = 2, 3, 100
        d = torch.zeros(B, k, dtype=torch.int64)
        ta = torch.zeros(B, k + 1, dtype=torch.int64)
        tp, dp = torch.zeros(B, k + 1, V, dtype=torch.bfloat16), torch.zeros(B, k, V, dtype=torch.bfloat16)
        g, u, z = torch.zeros(B, dtype=torch.bool), torch.zeros(B, k, dtype=torch.float64), torch.zeros(B, V)
        ptx = _compile_recorded(patches, rej, "_rejection_kernel", lambda: (
            rej.rejection_sample_triton(d, ta, tp, dp, g, u, z),
            rej.rejection_sample_triton(d, ta, None, None, g, None, None),
            rej.rejection_sample_triton(d, None, tp.float(), dp.double(), g, u, z.double())))
        assert "div.rn.f64" in ptx[0]  # the race divides in IEEE float64
        _compile_recorded(patches, nse, "_uniform_kernel", lambda: nse.uniform_noise_triton(s, s, 3, 2500, nse.RESIDUAL))
    print("compiled all kernels for sm_90")


@pytest.mark.skipif(not dispatch.triton_compiles_for_nvidia(), reason="triton's nvidia backend is not installed")
def test_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled all kernels" in proc.stdout, proc.stdout + proc.stderr[-4000:]


if __name__ == "__main__":
    compile_all_for_sm90()
