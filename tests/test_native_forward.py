"""The native CPU forward (kernels/cpu/forward.cpp through kernels/forward_cpu.py and models/native.py): one C++ call a
step for models whose weights are quantized blocks on the CPU.

- It computes what the torch forward computes (the reference): on one-layer models of every family the logits and
  the cached K/V agree to float32 rounding except where an activation's int8 code flips (rare), so a wrong position,
  key range, head mapping, rotation, norm or bias shows as a large median difference.
- Exact by construction: a token's logits are the same bits alone, in a batch of rows of other lengths, at any T
  (a verify chunk), in either cache layout, with a prefix of the cache reused, at any thread count and on every
  instruction set; every method's greedy output equals AR's, and seeded sampling equals AR's seeded sampling.
- It is chosen at load where the model qualifies, and says why where not; a decode step dispatches at most a few
  ops from Python."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from block_models import block_model
from specdec.kernels import qmm_cpu

pytestmark = pytest.mark.skipif(not qmm_cpu.available(), reason="the CPU quantized kernel is not built")

FAMILIES = ("llama", "qwen2", "qwen3", "glm4")
HOST_ISAS = qmm_cpu.ISAS[: qmm_cpu.ISAS.index(qmm_cpu.host_isa()) + 1] if qmm_cpu.available() else ()
VOCAB = 300


@pytest.fixture(scope="module")
def models():
    """family -> a two-layer model (one built per family, shared)."""
    return {family: block_model(family, seed=i) for i, family in enumerate(FAMILIES)}


def token_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), f"{what}: max |diff| {(a - b).abs().max().item()}"


# ------------------------------------------------------------------------------------------ chosen at load
@pytest.mark.parametrize("family", FAMILIES)
def test_a_quantized_model_of_every_family_runs_natively(models, family):
    model = models[family]
    assert model.native is not None and model.native_reason is None
    assert model._run_step == model._native_step


def test_a_model_that_does_not_qualify_says_why(models):
    model = copy.deepcopy(models["llama"])
    model.native_forward = False
    assert model.native is None and "turned off" in model.native_reason
    model.native_forward = True
    assert model.native is not None
    from checkpoints import build_hf_model  # a float model: the torch forward
    from specdec.models.transformer import Transformer
    from specdec.models.config import ModelConfig

    hf = build_hf_model("llama", seed=0)
    ours = Transformer(ModelConfig.from_dict(hf.config.to_dict()))
    assert ours.native is None and "quantized blocks" in ours.native_reason


# ------------------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize("family", FAMILIES)
def test_one_layer_agrees_with_the_torch_forward_to_rounding(family):
    """Prefill of 150 tokens (keys in three chunks) and two decode steps: the cached K/V and the logits equal the
    torch forward's up to float32 rounding, except where an int8 activation code flips (a few logits at most)."""
    model = block_model(family, seed=7, layers=1)
    ids = token_ids(152, 1)[None]  # [1, 152]
    outs, caches = [], []
    for native in (True, False):
        model.native_forward = native
        cache = model.new_cache(1, 160)
        logits = [model(ids[:, :150], cache)] + [model(ids[:, t:t + 1], cache) for t in (150, 151)]
        outs.append(torch.cat(logits, dim=1))  # [1, 152, V]
        caches.append(cache.kv[:, :, :, :, :152].clone())
    model.native_forward = True
    (a, b), (ka, kb) = outs, caches
    scale = b.abs().max()
    per_token = (a - b).abs().amax(-1).flatten()  # [152] each position's largest logit difference
    # rounding everywhere; a flipped code moves one position's logits (a few of 152 here)
    assert per_token.median() <= 1e-6 * scale and (per_token > 1e-4 * scale).float().mean() <= 0.1, per_token
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.97
    kv_diff = (ka - kb).abs()
    assert (kv_diff > 1e-5 * kb.abs().max()).float().mean() <= 0.01


@pytest.mark.parametrize("family", FAMILIES)
def test_the_last_layers_output_is_the_torch_forwards(models, family):
    model = models[family]
    ids = token_ids(20, 2).view(2, 10)
    got = {}
    for native in (True, False):
        model.native_forward = native
        for hidden in ("all", "last"):
            got[native, hidden] = model(ids, model.new_cache(2, 16), logits="last", hidden=hidden)
    model.native_forward = True
    for hidden, shape in (("all", (2, 10, 256)), ("last", (2, 1, 256))):
        (la, ha), (lb, hb) = got[True, hidden], got[False, hidden]
        assert la.shape == lb.shape == (2, 1, VOCAB) and ha.shape == hb.shape == shape
        assert (ha - hb).abs().median() <= 1e-4 * hb.abs().max()


# ------------------------------------------------------------------------------------------ exact by construction
def alone(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] of every position of `ids` [n], decoded alone one token at a time after a 1-token prefill."""
    cache = model.new_cache(1, len(ids) + 1)
    return torch.cat([model(ids[None, t:t + 1], cache)[0] for t in range(len(ids))])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["ragged", "left"])
def test_a_tokens_logits_are_the_same_bits_alone_in_a_batch_and_at_any_t(models, family, layout):
    """Three rows of 70, 23 and 41 tokens: prefilled together (padded), then chunks of 9 and 5 tokens and single
    tokens; every real token's logits equal those of its row decoded alone one token at a time."""
    model = models[family]
    rows = [token_ids(n, 10 + i) for i, n in enumerate((70, 23, 41))]
    want = [alone(model, r) for r in rows]
    prefix = [40, 9, 20]  # the prefill, then T = 9, T = 5, then T = 1 steps
    B, P = 3, max(prefix)
    cache = model.new_cache(B, 100, layout)
    ids = torch.zeros(B, P, dtype=torch.int64)
    for i, (r, n) in enumerate(zip(rows, prefix)):
        if layout == "left":
            ids[i, P - n:] = r[:n]
        else:
            ids[i, :n] = r[:n]
    if layout == "left":
        cache.set_prefill(prefix, P)
    logits = model(ids, cache, num_new=prefix)  # [B, P, V]
    for i, n in enumerate(prefix):
        got = logits[i, P - n:] if layout == "left" else logits[i, :n]
        assert_same_bits(got, want[i][:n], f"row {i} prefill")
    done = list(prefix)
    for T in (9, 5, 1, 1, 1):
        if layout == "left":
            cache.right_align([True] * B)  # every row ends at one column again (eqspec's realignment)
        # [B, T] (a row past its end starts over: not compared)
        step = torch.stack([r[torch.arange(n, n + T) % len(r)] for r, n in zip(rows, done)])
        logits = model(step, cache)
        for i, n in enumerate(done):
            real = min(T, len(rows[i]) - n)
            if real > 0:
                assert_same_bits(logits[i, :real], want[i][n:n + real], f"row {i} at {n}, T = {T}")
        done = [n + T for n in done]


def assert_the_same_bits_on_every_isa_and_thread_count(model, seed: int) -> None:
    """A 3-row prefill of 20 tokens gives the same logits' bits on every instruction set of this host and at 1, 2
    and 3 threads."""
    ids = token_ids(60, seed).view(3, 20)
    native = model.native
    outs = []
    for isa in HOST_ISAS:
        for threads in (1, 2, 3):
            native.isa = isa
            cache = model.new_cache(3, 24)
            out = native.forward(ids, cache.host_start, cache.host_length, [20] * 3, False, cache.kv,
                                 model.rope_table(24), "all", None, threads=threads)[0]
            outs.append((isa, threads, out))
    native.isa = None
    for isa, threads, out in outs[1:]:
        assert_same_bits(out, outs[0][2], f"{isa}, {threads} threads")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_thread_count_and_the_instruction_set_do_not_change_the_bits(models, family):
    assert_the_same_bits_on_every_isa_and_thread_count(models[family], seed=3)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_fresh_thread_runs_on_the_count_it_was_given_and_gets_the_same_bits(models, threads):
    """The engine thread of a server never ran a torch op: its forward runs on the thread count the process was
    given (`--threads`), and gives the main thread's bits."""
    model = models["llama"]
    ids = token_ids(24, 4)[None]
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        here = model(ids, model.new_cache(1, 24))
        there = {}

        def work():
            there["out"] = model(ids, model.new_cache(1, 24))
            there["threads"] = model.native.last_threads()

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(was)
    assert there["threads"] == threads
    assert_same_bits(there["out"], here)


# ------------------------------------------------------------------------------------------ the model object
def test_a_deep_copy_computes_with_its_own_weights(models):
    model = models["llama"]
    twin = copy.deepcopy(model)
    assert twin.native is not None and twin.native is not model.native
    ids = token_ids(12, 5)[None]
    before = twin(ids, twin.new_cache(1, 12))
    for name, buf in model.named_buffers():  # the original's weights zeroed: the copy does not read them
        if name.endswith(("_codes", "_da")):
            twin_buf = dict(twin.named_buffers())[name]
            assert twin_buf.data_ptr() != buf.data_ptr()
    original = {n: b.clone() for n, b in model.named_buffers()}
    try:
        for b in model.buffers():
            b.zero_()
        assert_same_bits(twin(ids, twin.new_cache(1, 12)), before)
    finally:
        for n, b in model.named_buffers():
            b.copy_(original[n])


def test_bad_steps_are_one_line(models):
    model = models["llama"]
    with pytest.raises(ValueError, match="token id outside"):
        model(torch.tensor([[VOCAB]]), model.new_cache(1, 4))
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(1, 5, dtype=torch.int64), model.new_cache(1, 4))
    with pytest.raises(ValueError, match="takes no features"):
        model(torch.zeros(1, 2, dtype=torch.int64), model.new_cache(1, 4), features=torch.zeros(1, 2, 256))


def test_a_decode_step_dispatches_at_most_three_ops_a_layer(models):
    from bench.op_count import step_ops

    for family in ("llama", "qwen3"):
        model = models[family]
        ops = step_ops(model)
        assert sum(ops.values()) <= 3 * model.cfg.num_layers, ops


# ------------------------------------------------------------------------------------------ every method
def native_pair(family="qwen2"):
    """A native target and two drafts: its own copy (every draft accepted: full accepts and bonus tokens) and a
    one-layer model of other weights (most drafts rejected)."""
    target = block_model(family, seed=21)
    return target, copy.deepcopy(target), block_model(family, seed=22, layers=1)


def workload(n=6, seed=3, temperature=0.0):
    from specdec import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    prompts[1] = prompts[0] + prompts[0][:5]  # a shared prefix (the prefix cache's hit)
    params = [SamplingParams(max_tokens=14, temperature=temperature, top_p=0.9 if temperature else 1.0,
                             seed=40 + i if temperature else None, ignore_eos=True) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_method_equals_ar_on_native_models(temperature):
    """Greedy and seeded: ar, eqspec, exspec and ragged, fixed and auto k, drafts all accepted or mostly
    rejected, with and without the prefix cache and chunked prefill: the tokens of AR one request at a time."""
    from specdec import LLM

    target, twin, stranger = native_pair()
    assert all(m.native is not None for m in (target, twin, stranger))
    prompts, params = workload(temperature=temperature)
    common = dict(cost_cache="", check_invariants=True, max_speculative_tokens=4)
    want = [o.token_ids for o in LLM(target, method="ar", batch_size=1, **common).generate(
        prompt_token_ids=prompts, sampling_params=params)]
    cases = [("ar", None, None, 4, {}), ("eqspec", twin, 3, 4, {"lookup": None}), ("eqspec", stranger, 2, 3, {}),
             ("exspec", twin, 4, 2, {"window_size": 4}), ("ragged", stranger, "auto", 4, {}),
             ("ragged", twin, 3, 3, {"prefix_cache_gb": 0.01, "prefill_chunk": 7}),
             ("eqspec", twin, 2, 2, {"prefix_cache_gb": 0.01})]
    for method, draft, k, batch, extra in cases:
        llm = LLM(target, draft, method=method, num_speculative_tokens=k, batch_size=batch, **common, **extra)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == want, f"{method} k={k} B={batch} {extra}"
        if draft is twin and temperature == 0.0 and "lookup" in extra:  # the twin's own drafts are all taken
            assert outs.metrics.accepted_drafts == outs.metrics.proposed_drafts > 0


# ------------------------------------------------------------------------------------------ non-finite
@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("where", ["norm", "block scale", "activation"])  # NaN, NaN, inf
def test_a_nan_anywhere_is_refused_with_the_non_finite_line(isa, where):
    """A NaN in a norm weight, in one block's float16 scale, or in one activation: the logits of every token it
    reaches are NaN (never a number: int8 quantization would otherwise turn it into one), on every instruction
    set, and the engine refuses the step with its one line (issue 57)."""
    from specdec import LLM, SamplingParams
    from specdec.batch import NonFiniteLogitsError

    model = block_model("llama", seed=31)
    model.native.isa = isa
    with torch.no_grad():
        if where == "norm":
            model.layers[1].post_attention_layernorm.weight[7] = float("nan")
        elif where == "block scale":
            da = model.layers[0].mlp.down_proj.parts[0][1].da  # [T, K/SB, 16] float16: one row's scale
            da[2, 0, 5] = float("nan")
        if where == "activation":  # an infinity in the activations: a norm weight that overflows them
            model.layers[0].input_layernorm.weight[3] = 3e38
    out = model(token_ids(6, 8)[None], model.new_cache(1, 8))
    assert out.isnan().all(), f"{where}: {out.isnan().float().mean():.2f} of the logits NaN"
    llm = LLM(model, method="ar", cost_cache="")
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_makes_its_rows_outputs_nan_on_every_isa(bad):
    """The matmul's activation quantization: a block of 32 holding a NaN or an infinity gets scale NaN (fmax would
    skip a NaN, and converting one to int8 is undefined), so its row's every output is NaN, on every instruction
    set and in the reference; the other rows keep their values."""
    from specdec.models.ggml_blocks import decompose, pack
    from test_ggml_blocks import random_raw
    import numpy as np

    p = pack(decompose(random_raw(np.random.default_rng(0), "Q4_K", 40, 256), "Q4_K"), "Q4_K")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    x[1, 70] = bad
    ref = qmm_cpu.qmm_reference(x, p)
    assert ref[1].isnan().all() and ref[[0, 2]].isfinite().all()
    clean = qmm_cpu.qmm(x[[0, 2]], p)
    for isa in HOST_ISAS:
        y = qmm_cpu.qmm(x, p, isa=isa)
        assert y[1].isnan().all(), isa
        assert_same_bits(y[[0, 2]], clean, isa)


# ------------------------------------------------------------------------------------------ Q2_K, Q3_K, IQ4 types
@pytest.fixture(scope="module")
def low_bits_model():
    """A two-layer model whose projections, head and embedding are Q2_K, Q3_K, IQ4_NL and IQ4_XS blocks."""
    from block_models import LOW_BITS

    return block_model("qwen2", seed=31, qtypes=LOW_BITS)


def test_the_low_bit_types_run_natively_with_the_same_bits_on_every_isa_and_thread_count(low_bits_model):
    from block_models import LOW_BITS

    model = low_bits_model
    assert model.native is not None and model.native_reason is None
    qkv = model.layers[0].self_attn.qkv_proj
    assert [p.qtype for _, p in qkv.parts] == [LOW_BITS["q"], LOW_BITS["k"], LOW_BITS["v"]]
    assert_the_same_bits_on_every_isa_and_thread_count(model, seed=33)
    # a token's logits: the same bits alone and in a batch at T > 1
    rows = [token_ids(n, 40 + i) for i, n in enumerate((17, 9))]
    cache = model.new_cache(2, 20)
    ids = torch.zeros(2, 17, dtype=torch.int64)
    ids[0], ids[1, :9] = rows[0], rows[1]
    logits = model(ids, cache, num_new=[17, 9])
    for i, r in enumerate(rows):
        assert_same_bits(logits[i, :len(r)], alone(model, r), f"row {i}")


def test_the_low_bit_types_agree_with_the_torch_forward_to_rounding():
    from block_models import LOW_BITS

    model = block_model("qwen2", seed=32, qtypes=LOW_BITS, layers=1)
    ids = token_ids(90, 6)[None]  # [1, 90]
    outs = []
    for native in (True, False):
        model.native_forward = native
        cache = model.new_cache(1, 96)
        outs.append(torch.cat([model(ids[:, :88], cache)] + [model(ids[:, t:t + 1], cache) for t in (88, 89)], 1))
    model.native_forward = True
    a, b = outs  # [1, 90, V]
    scale = b.abs().max()
    per_token = (a - b).abs().amax(-1).flatten()  # [90]
    assert per_token.median() <= 1e-6 * scale and (per_token > 1e-4 * scale).float().mean() <= 0.1, per_token
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.97


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_the_native_embedding_lookup_is_the_dequantized_rows_bit_for_bit(qtype):
    """forward.cpp's dequantize_row: with every layer's weights zero (their float16 scales zeroed in place), the
    last layer's output is the embedding, so the native hidden states are the table's rows exactly
    (models/ggml_blocks.py's dequantize_rows, which the torch forward looks up)."""
    from block_models import LOW_BITS

    model = block_model("llama", seed=34, qtypes=dict(LOW_BITS, embed=qtype), layers=1)
    for name, buf in model.layers.named_buffers():
        if name.endswith(("_da", "_db")):
            buf.zero_()  # in place: the native model's pointers stay bound
    ids = token_ids(40, 7).view(2, 20)
    _, hidden = model(ids, model.new_cache(2, 20), logits="last", hidden="all")  # [2, 20, E]
    want = model.embed_tokens.rows(ids)  # [2, 20, E]
    assert model.embed_tokens.table.parts[0][1].qtype == qtype
    assert torch.equal(hidden, want) and (want != 0).float().mean() > 0.5


def test_a_block_linear_copied_cast_or_moved_computes_with_its_own_buffers():
    """qmm_cpu.Weight holds the buffers' addresses: a deep copy reads its own buffers (it used to read the
    original's), and a dtype cast (.float(), .half()) leaves the float16 scales as they are (held as int16 bits)
    instead of handing the kernel float32 ones."""
    from block_models import block_linear
    import numpy as np

    layer = block_linear(np.random.default_rng(0), ["Q4_K", "Q6_K"], [32, 16], 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    twin = copy.deepcopy(layer)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(twin.buffers(), layer.buffers()))
    with torch.no_grad():
        for b in layer.buffers():
            b.zero_()
    assert_same_bits(twin(x), y)  # the original zeroed: the copy does not read it
    cast = copy.deepcopy(twin).float()
    assert cast.parts[0][1].da.dtype == torch.float16
    assert_same_bits(cast(x), y)
    half = copy.deepcopy(twin).half()
    xh = x.half()
    assert torch.equal(half(xh), twin(xh.float()).half())  # float16 activations: the same products, rounded
    assert half.parts[1][1].da.dtype == torch.float16
