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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_thread_count_and_the_instruction_set_do_not_change_the_bits(models, family):
    model = models[family]
    ids = token_ids(60, 3).view(3, 20)
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


def test_a_fresh_thread_gets_the_same_bits(models):
    """The engine thread of a server never ran a torch op: its forward is the main thread's."""
    model = models["llama"]
    ids = token_ids(24, 4)[None]
    here = model(ids, model.new_cache(1, 24))
    there = {}
    worker = threading.Thread(target=lambda: there.update(out=model(ids, model.new_cache(1, 24))))
    worker.start()
    worker.join()
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
