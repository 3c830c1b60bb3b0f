"""Batch-invariant numerics (models/numerics.py, kernels/bi_matmul.py, kernels/bi_attention.py): with
`batch_invariant` on, a token's logits are the same bits whatever else shares its forward -- batch size,
new tokens per row, layout, padding, row -- and greedy speculative decoding equals AR bit for bit in
bfloat16 and float32. Each claim is also shown false with the mode off, so these tests can fail.

The Triton kernels run under the interpreter here (TRITON_INTERPRET=1, set by conftest.py) and are compared
with their torch references; `test_kernels_compile_for_sm90` compiles them for an H100/H200 without a GPU.
"""
import contextlib
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from checkpoints import FAMILIES, make_checkpoint, make_pair
from specdec.models.cache import LEFT_PADDED, RAGGED
from specdec import LLM, SamplingParams
from specdec.kernels import bi_attention as ba
from specdec.kernels import bi_matmul as bm
from specdec.kernels import dispatch
from specdec.kernels.positions import step_plan_reference
from specdec.models import load_model, load_tokenizer
from specdec.models import numerics
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET, read_prompts

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
DTYPE_IDS = ("float32", "bfloat16", "float64")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GPU = torch.cuda.is_available() and not INTERPRET  # TRITON_INTERPRET=0 on a CUDA machine: the compiled kernels
KERNEL_DEVICE = "cuda" if GPU else "cpu"
needs_triton = pytest.mark.skipif(not (dispatch.triton_available() and (INTERPRET or GPU)),
                                  reason="needs triton with TRITON_INTERPRET=1, or a CUDA device")


def rows_alone_vs_batched(fn, X, sizes=(1, 2, 3, 4, 5, 8, 17, 48), shifts=(0, 1, 3), alone=24):
    """(M, shift) cases where a row of fn(X[s:s+M]) differs from fn of that row alone."""
    ref = torch.cat([fn(X[i:i + 1].clone()) for i in range(alone)])
    bad = []
    for M in sizes:
        for s in shifts:
            n = min(M, alone - s)
            if not torch.equal(fn(X[s:s + M].clone())[:n], ref[s:s + n]):
                bad.append((M, s))
    return bad


# ------------------------------------------------------------------------------------------------ linear
def test_a_cpu_whose_threads_change_rows_multiplies_on_one_thread(monkeypatch):
    """The guard the H200 machine's host CPU needed (float32 via oneDNN changed rows at two threads): where
    `threads_keep_rows` finds rows differ at the caller's thread count, the path runs on one thread and the
    caller's count is restored; where they agree, or on one thread, it runs as called."""
    seen = []
    real, probe = bm._cpu_linear, bm.threads_keep_rows
    monkeypatch.setattr(bm, "_cpu_linear", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(bm, "threads_keep_rows", lambda dtype, n: False)
        bm.bi_matmul_reference(x, w)
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(bm, "threads_keep_rows", lambda dtype, n: True)
        bm.bi_matmul_reference(x, w)
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(threads)
    assert probe.__wrapped__(torch.float32, 1)  # the probe itself (uncached): one thread agrees here


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_rows_do_not_depend_on_the_call(dtype):
    g = torch.Generator().manual_seed(0)
    for N, K in ((131, 64), (640, 384)):
        W = torch.randn(N, K, generator=g).to(dtype)
        b = torch.randn(N, generator=g).to(dtype)
        X = torch.randn(60, K, generator=g).to(dtype)
        assert rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="torch"), X) == []
        threads = torch.get_num_threads()
        try:  # the libraries split work by thread count: check two threads too (the CLI's default here)
            torch.set_num_threads(2)
            assert rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="torch"), X, sizes=(1, 3, 48)) == []
        finally:
            torch.set_num_threads(threads)
        packed = bm.pack_weight(W)  # what the model keeps; the same bits as packing on the fly
        assert torch.equal(bm.bi_linear(X, W, b, packed=packed, backend="torch"),
                           bm.bi_linear(X, W, b, backend="torch"))
        # a misaligned view of the input (float64 MKL results depend on alignment) and a 3-d input
        flat = torch.randn(8 * K + 16, generator=g).to(dtype)
        view = flat[3: 3 + 8 * K].view(2, 4, K)
        assert torch.equal(bm.bi_linear(view, W, b, backend="torch"), bm.bi_linear(view.clone(), W, b, backend="torch"))
        if dtype != torch.bfloat16:  # the ordinary path does depend on M: the mode is needed
            assert rows_alone_vs_batched(lambda x: F.linear(x, W, b), X), f"{dtype}: F.linear already invariant"
        y = bm.bi_linear(X, W, b, backend="torch").double()
        assert torch.allclose(y, F.linear(X.double(), W.double(), b.double()), rtol=2e-2, atol=2e-2 * y.abs().max())


def test_cpu_paths_are_the_measured_ones():
    assert bm.cpu_path(torch.bfloat16) == "native" and bm.cpu_path(torch.float64) == "padded"
    assert bm.cpu_path(torch.float32) == ("onednn" if bm.onednn_available() else "padded")
    assert [bm.padded_rows(m) for m in (1, 3, 4, 5, 48)] == [4, 4, 4, 8, 48]


def test_bi_linear_validation():
    W = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="features"):
        bm.bi_linear(torch.zeros(2, 5), W)
    with pytest.raises(ValueError, match="dtype"):
        bm.bi_linear(torch.zeros(2, 3, dtype=torch.float64), W)
    with pytest.raises(ValueError, match="bias"):
        bm.bi_linear(torch.zeros(2, 3), W, torch.zeros(5))


# --------------------------------------------------------------------------------------------- elementwise
def test_silu_every_bfloat16_input_and_float32_tails():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    pair = torch.stack([every, every], 1)  # a strided column runs torch's scalar loop
    assert torch.equal(F.silu(pair[:, 0].contiguous()), F.silu(pair[:, 0]))  # bf16 F.silu: kept as is
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 4
    pair = torch.stack([x, x], 1)
    assert not torch.equal(F.silu(pair[:, 0].contiguous()), F.silu(pair[:, 0]))  # float32: tails round differently
    assert torch.equal(numerics.silu(pair[:, 0].contiguous(), True), numerics.silu(pair[:, 0], True))
    assert torch.allclose(numerics.silu(x, True), F.silu(x), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------- attention
def _attention_case(dtype, B, T, rows, lengths, starts, left_padded, capacity=140, H=6, Hkv=2, D=24, seed=0,
                    backend="torch", chunk=None):
    """Attention output of row `rows[0]`'s queries for a batch whose row i has `lengths[i]` cached tokens at
    column `starts[i]`; every row's logical token t has the same K/V/q whatever the layout."""
    g = torch.Generator().manual_seed(seed)
    k_tok, v_tok = (torch.randn(8, Hkv, 100, D, generator=g).to(dtype) for _ in range(2))  # token t of sequence r
    q_tok = torch.randn(8, H, 100, D, generator=g).to(dtype)
    k_cache = torch.randn(B, Hkv, capacity, D, generator=g).to(dtype)  # junk everywhere else
    v_cache = torch.randn(B, Hkv, capacity, D, generator=g).to(dtype)
    q = torch.empty(B, H, T, D, dtype=dtype)
    for i, (n, s) in enumerate(zip(lengths, starts)):
        k_cache[i, :, s: s + n + T] = k_tok[rows[i], :, : n + T]
        v_cache[i, :, s: s + n + T] = v_tok[rows[i], :, : n + T]
        q[i] = q_tok[rows[i], :, n: n + T]
    start, length = torch.tensor(starts), torch.tensor(lengths)
    width = max(s + n + T for s, n in zip(starts, lengths))
    _, _, mask = step_plan_reference(start, length, torch.full((B,), T), T, left_padded, width)
    if backend == "triton":
        q, k_cache, v_cache, mask = (t.to(KERNEL_DEVICE) for t in (q, k_cache, v_cache, mask))
    if chunk is None:
        out = ba.bi_attention(q, k_cache, v_cache, mask, backend=backend)
    elif backend == "triton":
        out = ba.bi_attention_triton(q, k_cache, v_cache, mask, ba.first_keys(mask), chunk=chunk)
    else:
        out = ba.bi_attention_reference(q, k_cache, v_cache, mask, ba.first_keys(mask), chunk=chunk)
    bias = torch.where(mask, torch.zeros((), dtype=dtype), float("-inf"))[:, None]
    sdpa = F.scaled_dot_product_attention(q, k_cache[:, :, :width], v_cache[:, :, :width], attn_mask=bias,
                                          enable_gqa=True)
    return out.cpu(), sdpa.cpu()


# (B, T, the row's length before the step, starts, left padded): query n + j of row 0 is the same token in all
SCENARIOS = (
    (1, 1, [40], [0], False),
    (1, 1, [40], [9], True),
    (3, 1, [40, 3, 70], [0, 0, 0], False),
    (8, 1, [40, 5, 60, 1, 33, 70, 12, 8], [30, 0, 0, 0, 0, 0, 0, 0], True),
)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_query_does_not_depend_on_the_call(dtype):
    """Query 40 of a row (the 41st token) alone at T = 1, after 9 or 30 padding columns, in batches of
    3 and 8, as the first, third or sixth query of a T = 6 step: the same bits with bi_attention."""
    outs, sdpas = [], []
    for B, T, lengths, starts, left in SCENARIOS:
        out, sdpa = _attention_case(dtype, B, T, list(range(B)), lengths, starts, left)
        outs.append(out[0, :, 0])
        sdpas.append(sdpa[0, :, 0])
    for first in (40 - 2, 40 - 5):  # T = 6 steps where query 40 sits at index 2 and 5
        out, sdpa = _attention_case(dtype, 3, 6, [0, 1, 2], [first, 7, 50], [5, 0, 0], True)
        outs.append(out[0, :, 40 - first])
        sdpas.append(sdpa[0, :, 40 - first])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert not all(torch.equal(s, sdpas[0]) for s in sdpas[1:]), f"{dtype}: SDPA already invariant here"
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for o, s in zip(outs, sdpas):
        assert torch.allclose(o.double(), s.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_one_kv_head_and_reused_buffers(dtype):
    """One KV head at batch 1 with one chunk multiplies a batch of one matrix (padded to two: MKL takes another
    path for one); a model's reusable buffers give the same bits as fresh ones, whatever ran before."""
    kw = dict(H=2, Hkv=1, D=16, capacity=80)
    alone, _ = _attention_case(dtype, 1, 1, [0], [20], [0], False, **kw)
    batched, _ = _attention_case(dtype, 3, 6, [0, 1, 2], [15, 40, 2], [3, 0, 0], True, **kw)
    assert torch.equal(alone[0, :, 0], batched[0, :, 5])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 24, generator=g).to(dtype) for h, n in ((6, 3), (2, 90), (2, 90)))
    _, _, mask = step_plan_reference(torch.tensor([0, 4]), torch.tensor([70, 30]), torch.tensor([3, 3]), 3, True, 73)
    workspace = ba.Workspace()
    for shape in ((1, 6, 1, 24), (2, 6, 3, 24)):  # a smaller call first: the buffers are reused and grown
        small = torch.randn(shape, generator=g).to(dtype)
        ba.bi_attention(small, k[: shape[0]], v[: shape[0]], mask[: shape[0], : shape[2]],
                        plan=ba.chunk_plan(mask[: shape[0], : shape[2]], ba.first_keys(mask[: shape[0], : shape[2]]),
                                           3, 2, 90, workspace=workspace), backend="torch")
    plan = ba.chunk_plan(mask, ba.first_keys(mask), 3, 2, 90, workspace=workspace)
    assert torch.equal(ba.bi_attention(q, k, v, mask, plan=plan, backend="torch"),
                       ba.bi_attention(q, k, v, mask, backend="torch"))
    # one KV head: 1 matrix (padded to 2), then 2 real ones in the same buffer shapes, then 1 again
    q1, k1, v1 = (torch.randn(2, h, n, 24, generator=g).to(dtype) for h, n in ((2, 1), (1, 40), (1, 40)))
    _, _, mask1 = step_plan_reference(torch.tensor([0, 0]), torch.tensor([30, 20]), torch.tensor([1, 1]), 1, False, 31)
    for b in (1, 2, 1):
        args = (q1[:b], k1[:b], v1[:b], mask1[:b])
        plan = ba.chunk_plan(mask1[:b], ba.first_keys(mask1[:b]), 2, 1, 40, workspace=workspace)
        assert torch.equal(ba.bi_attention(*args, plan=plan, backend="torch"), ba.bi_attention(*args, backend="torch"))


def test_attention_padding_queries_and_validation():
    """A left-padding query of a prefill sees no key of its row: zeros, never NaN."""
    q = torch.randn(2, 2, 4, 8)
    cache = torch.randn(2, 1, 10, 8)
    start, length = torch.tensor([2, 0]), torch.tensor([0, 0])
    _, _, mask = step_plan_reference(start, length, torch.tensor([2, 4]), 4, True, 4)
    out = ba.bi_attention(q, cache, cache.clone(), mask, backend="torch")
    assert torch.isfinite(out).all() and (out[0, :, :2] == 0).all()
    with pytest.raises(ValueError, match="multiple"):
        ba.bi_attention(torch.zeros(2, 3, 4, 8), cache.expand(2, 2, 10, 8), cache.expand(2, 2, 10, 8), mask)
    with pytest.raises(ValueError, match="mask"):
        ba.bi_attention(q, cache, cache, mask.float())


# ------------------------------------------------------------------------------------------- the model
def _schedule_logits(model, seqs, prompt_lens, T, layout):
    """Prefill each row's prompt (padded on the layout's side), then feed the rest T tokens per step;
    returns [B, 1 + rest, V]: the prefill's last logits and every fed token's."""
    B, width, rest = len(seqs), max(prompt_lens), len(seqs[0]) - prompt_lens[0]
    cache = model.new_cache(B, width + rest + 1, layout)
    ids = torch.zeros(B, width, dtype=torch.int64)
    for i, (s, n) in enumerate(zip(seqs, prompt_lens)):
        if layout == LEFT_PADDED:
            ids[i, width - n:] = torch.tensor(s[:n])
        else:
            ids[i, :n] = torch.tensor(s[:n])
    cache.set_prefill(prompt_lens, width)
    out = [model.forward(ids.to(model.device), cache, num_new=prompt_lens, logits="last")]
    for j in range(0, rest, T):
        step = torch.tensor([s[n + j: n + j + T] for s, n in zip(seqs, prompt_lens)])
        out.append(model.forward(step.to(model.device), cache))
    return torch.cat(out, dim=1).cpu()


# (rows B, our row, new tokens per step T, layout); partners have other prompt lengths, so padding differs
MODEL_SCHEDULES = ((1, 0, 1, RAGGED), (1, 0, 6, RAGGED), (3, 1, 6, LEFT_PADDED), (3, 2, 1, RAGGED),
                   (8, 5, 6, RAGGED), (8, 0, 1, LEFT_PADDED), (8, 7, 6, LEFT_PADDED))


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bi")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


# on a CUDA machine with TRITON_INTERPRET=0 the model test also runs on the GPU (Triton kernels, torch's CUDA
# RMSNorm): the check this CPU-only project could not make
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and not INTERPRET else [])
# The controls (with the mode off, some schedule differs) are facts about this project's CPU (AMD EPYC, AVX2,
# measured): they show the tests can fail. On the GPU machine (seen 2026-12-04, H200 with its host CPU) cuBLAS
# and the host's libraries gave these tiny models the same bits with the mode off too, so the control cannot be
# shown there; the assertions on the mode hold everywhere.
CONTROLS_HOLD = not torch.cuda.is_available()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_model_logits_are_bitwise_batch_invariant(family_checkpoints, family, dtype, device):
    """The same 26 tokens: alone with T = 1 (AR), alone with T = 6, in batches of 3 and 8 at rows 0/1/2/5/7,
    left-padded (different padding) and ragged, T = 1 and 6. Logits of all 7 positions equal bit for bit with
    the mode on; with it off at least one schedule differs."""
    rng = random.Random(0)
    ours = [rng.randrange(3, 131) for _ in range(26)]
    partners = [[rng.randrange(3, 131) for _ in range(6 + n)] for n in (5, 40, 12, 33, 8, 27, 17)]
    model = load_model(family_checkpoints[family], dtype=dtype, device=device)
    logits = {}
    for mode in (True, False):
        model.batch_invariant = mode
        runs = []
        for B, row, T, layout in MODEL_SCHEDULES:
            seqs = partners[:row] + [ours] + partners[row:B - 1]
            lens = [len(s) - 6 for s in seqs]
            runs.append(_schedule_logits(model, seqs, lens, T, layout)[row])
        logits[mode] = runs
    on, off = logits[True], logits[False]
    for (B, row, T, layout), got in zip(MODEL_SCHEDULES[1:], on[1:]):
        assert torch.equal(got, on[0]), f"{family} {dtype}: B={B} row={row} T={T} {layout} differs from AR"
    if CONTROLS_HOLD:
        assert any(not torch.equal(got, off[0]) for got in off[1:]), f"{family} {dtype}: ordinary mode invariant"
    assert torch.allclose(on[0].float(), off[0].float(), atol=0.1 if dtype == "bfloat16" else 1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unfused_model_is_batch_invariant_too(family_checkpoints, dtype):
    """`load_model(fuse=False)` keeps separate q/k/v projections; they go through `numerics.linear` as the
    fused one does, so the model is batch-invariant (and packed) in attention too, not only in its MLP."""
    rng = random.Random(1)
    ours = [rng.randrange(3, 131) for _ in range(26)]
    partners = [[rng.randrange(3, 131) for _ in range(6 + n)] for n in (5, 40, 12, 33, 8, 27, 17)]
    model = load_model(family_checkpoints["llama"], dtype=dtype, fuse=False)
    assert hasattr(model.layers[0].self_attn, "q_proj") and not hasattr(model.layers[0].self_attn, "qkv_proj")
    model.batch_invariant = True
    runs = []
    for B, row, T, layout in MODEL_SCHEDULES:
        seqs = partners[:row] + [ours] + partners[row:B - 1]
        runs.append(_schedule_logits(model, seqs, [len(s) - 6 for s in seqs], T, layout)[row])
    for (B, row, T, layout), got in zip(MODEL_SCHEDULES[1:], runs[1:]):
        assert torch.equal(got, runs[0]), f"fuse=False {dtype}: B={B} row={row} T={T} {layout} differs from AR"


def test_cli_flag_reaches_the_engine(monkeypatch):
    import specdec
    from specdec import run as cli

    class Built(Exception):
        pass

    seen = {}

    def fake_llm(*args, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(specdec, "LLM", fake_llm)
    for argv, expected in ((["--batch-invariant"], True), ([], "auto"), (["--batch-invariant", "off"], False),
                           (["--batch-invariant=auto"], "auto")):
        with pytest.raises(Built):
            cli.run(cli.build_parser().parse_args(argv + ["--no-progress"]))
        assert seen["batch_invariant"] == expected and type(seen["batch_invariant"]) is type(expected)


def test_mode_is_a_model_attribute_and_skips_the_compiled_forward(family_checkpoints):
    model = load_model(family_checkpoints["llama"])
    assert model.batch_invariant is False
    model.batch_invariant = True
    assert all(layer.self_attn.batch_invariant and layer.mlp.batch_invariant for layer in model.layers)
    model.compiled_forward = lambda *a: pytest.fail("the batch-invariant forward must not run the compiled one")
    cache = model.new_cache(1, 8)
    cache.set_prefill([3], 3)
    model.forward(torch.tensor([[5, 6, 7]]), cache, num_new=[3])
    model.forward(torch.tensor([[8]]), cache)
    with pytest.raises(ValueError, match="batch_invariant"):
        numerics.set_batch_invariant(object(), True)
    fresh = load_model(family_checkpoints["llama"])
    LLM(fresh, method="ar", batch_invariant=True)  # model objects are switched in place
    assert fresh.batch_invariant
    LLM(fresh, method="ar")  # the default leaves them as they are (an AR comparison engine sharing the target)
    assert fresh.batch_invariant


# ------------------------------------------------------------------------------------------ end to end
def test_greedy_speculative_equals_ar_in_bfloat16(tmp_path):
    """bfloat16, tiny Llama pair, 16 prompts, 32 tokens, k = 5, batch 8: with the mode off some requests of
    some method leave AR's path (near ties flip); with it on eqspec, ragged and exspec equal AR at batch 1."""
    target, draft = make_pair("llama", tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(1, 60))] for _ in range(16)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    mismatches = {}
    for mode in (False, True):
        common = dict(dtype="bfloat16", batch_invariant=mode, check_invariants=False)
        ar = LLM(target, method="ar", batch_size=1, **common).generate(prompt_token_ids=prompts, sampling_params=params)
        for method in (("ragged",) if not mode else ("eqspec", "ragged", "exspec")):
            outs = LLM(target, draft, method=method, num_speculative_tokens=5, batch_size=8, **common).generate(
                prompt_token_ids=prompts, sampling_params=params)
            mismatches[mode, method] = [o.index for o, r in zip(outs, ar) if o.token_ids != r.token_ids]
    assert mismatches[False, "ragged"], "bfloat16 without the mode already equals AR here: the test shows nothing"
    for method in ("eqspec", "ragged", "exspec"):
        assert mismatches[True, method] == [], f"{method}: requests {mismatches[True, method]} differ from AR"


SPEC_BENCH_SLICE = os.path.join(os.path.dirname(__file__), "data", "spec_bench_64.jsonl")


@pytest.mark.slow
def test_specbench_slice_equals_ar_in_bfloat16():
    """The CI slice of the SpecBench check: the default pair in bfloat16 with the mode on, SpecBench's first
    64 prompts (cut to 64 tokens), 16 new tokens, k = 5: eqspec, ragged and exspec at batch 8 emit exactly
    AR's tokens at batch 1 (all 480 prompts x 32 tokens: `bench/batch_invariant.py equivalence`). With the
    mode off the same slice differs from AR on requests 6 and 20 (measured: docs/benchmarks/batch-invariant.md)."""
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [tokenizer.encode(p)[:64] for p in read_prompts(SPEC_BENCH_SLICE)]
    assert len(prompts) == 64
    params = SamplingParams(max_tokens=16, temperature=0.0)
    common = dict(dtype="bfloat16", batch_invariant=True, check_invariants=False)
    ar = LLM(DEFAULT_TARGET, method="ar", batch_size=1, **common).generate(prompt_token_ids=prompts,
                                                                         sampling_params=params)
    for method in ("eqspec", "ragged", "exspec"):
        outs = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method=method, num_speculative_tokens=5, batch_size=8,
                   **common).generate(prompt_token_ids=prompts, sampling_params=params)
        mismatched = [o.index for o, r in zip(outs, ar) if o.token_ids != r.token_ids]
        assert mismatched == [], f"{method}: SpecBench prompts {mismatched} differ from AR at batch 1"


def test_seeded_sampling_does_not_depend_on_the_batch(checkpoint_pairs):
    """With the mode on, target and draft are both invariant, so a seeded sampled request (coupled sampler,
    noise keyed by (seed, position)) gives the same tokens at batch 1 and batch 8, in bfloat16 (not so
    without: near-tied logits flip with the batch; 32 requests x 32 tokens make a flip near-certain)."""
    target, draft = checkpoint_pairs("qwen3")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(1, 40))] for _ in range(32)]
    params = [SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True) for i in range(32)]
    same = {}
    for mode in (False, True):
        llm = LLM(target, draft, method="ragged", num_speculative_tokens=3, batch_size=8, dtype="bfloat16",
                  batch_invariant=mode, check_invariants=False)
        together = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        alone = llm.generate(prompt_token_ids=prompts, sampling_params=params, batch_size=1)
        same[mode] = [a.token_ids == b.token_ids for a, b in zip(together, alone)]
    assert all(same[True])
    if CONTROLS_HOLD:
        assert not all(same[False]), "bfloat16 sampling without the mode is already batch-invariant here"


# ----------------------------------------------------------------------------------- Triton (interpreter)
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bi_matmul_triton_matches_reference_and_rows_keep_their_bits(dtype):
    g = torch.Generator().manual_seed(1)
    W, b, X = (t.to(KERNEL_DEVICE, dtype) for t in (torch.randn(70, 40, generator=g), torch.randn(70, generator=g),
                                                    torch.randn(140, 40, generator=g)))
    y = bm.bi_linear(X, W, b, backend="triton")
    ref = F.linear(X.double(), W.double(), b.double())
    rtol, atol = (1e-2, 0.1) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    assert torch.allclose(y.double(), ref, rtol=rtol, atol=atol)
    assert torch.allclose(bm.bi_linear(X, W, backend="triton").double(), ref - b.double(), rtol=1e-2, atol=0.1)
    # rows keep their bits when M, the other rows and the tile index change (tests/test_bi_kernels.py checks
    # rows at every place in their tile, alone and in batches of 3, 8 and 48)
    BLOCK_M = bm.matmul_config(70, 40, dtype, KERNEL_DEVICE).block_m
    for M, shift in ((1, 0), (3, BLOCK_M), (40, 0), (5, 2 * BLOCK_M)):
        other = X.clone()
        other[shift + M:] = torch.randn(len(X) - shift - M, 40, generator=g).to(KERNEL_DEVICE, dtype)
        got = bm.bi_linear(other[: shift + M], W, b, backend="triton")[shift:]
        assert torch.equal(got, y[shift: shift + M])
    if GPU:  # on the GPU every row keeps its bits at any place in its tile too
        assert rows_alone_vs_batched(lambda x: bm.bi_linear(x, W, b, backend="triton"), X) == []


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bi_attention_triton_is_invariant_and_matches_reference(dtype):
    """Per-query programs: bit-exact invariance under the interpreter too (chunk 16 to cross chunks)."""
    small = dict(capacity=60, H=2, Hkv=1, D=8, chunk=16)
    outs = []
    for B, T, lengths, starts, left in ((1, 1, [20], [0], False), (2, 1, [20, 3], [7, 0], True),
                                        (2, 3, [18, 30], [0, 0], False)):
        out, sdpa = _attention_case(dtype, B, T, list(range(B)), lengths, starts, left, backend="triton", **small)
        ref, _ = _attention_case(dtype, B, T, list(range(B)), lengths, starts, left, backend="torch", **small)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        assert torch.allclose(out.double(), ref.double(), atol=tol, rtol=tol)
        assert torch.allclose(out.double(), sdpa.double(), atol=tol, rtol=tol)
        outs.append(out[0, :, 20 - lengths[0]])  # query 20 of row 0
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_kernels_compile_for_sm90():
    """The interpreter forgives what the compiler rejects: compile both kernels for sm_90 (no GPU needed)."""
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("triton's nvidia backend is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def _compile_all_for_sm90():
    from unittest import mock

    from test_kernels import _compile_recorded

    x, w, b = torch.zeros(5, 40), torch.zeros(24, 40), torch.zeros(24)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        with contextlib.ExitStack() as patches:
            xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
            ptx = _compile_recorded(patches, bm, "_bi_matmul_kernel", lambda: (
                bm.bi_matmul_triton(xd, wd, bd), bm.bi_matmul_triton(xd, wd)))
            assert "mma" in ptx[0] or dtype == torch.float32  # tensor cores for bf16/fp64; fp32 stays IEEE (FMA)
        q, kc = torch.zeros(2, 6, 3, 24, dtype=dtype), torch.zeros(2, 2, 40, 24, dtype=dtype)
        mask, first = torch.zeros(2, 3, 33, dtype=torch.bool), torch.zeros(2, dtype=torch.int64)
        for name, other in (("_bi_attention_split_kernel", "_bi_attention_combine_kernel"),
                            ("_bi_attention_combine_kernel", "_bi_attention_split_kernel")):
            with contextlib.ExitStack() as patches:  # the other kernel of the launcher is not run (no GPU)
                patches.enter_context(mock.patch.object(ba, other, type("Null", (), {
                    "__getitem__": lambda self, grid: lambda *a, **kw: None})()))
                _compile_recorded(patches, ba, name, lambda: ba.bi_attention_triton(q, kc, kc.clone(), mask, first,
                                                                                     chunk=16, split=16))
    print("compiled bi_matmul and bi_attention for sm_90")


if __name__ == "__main__":
    _compile_all_for_sm90()
