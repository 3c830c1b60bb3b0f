"""The two attention shortcuts of the ordinary (not batch-invariant) forward (models/numerics.py `sdpa`):
a prefill whose rows all start at column 0 unpadded takes SDPA's causal path instead of the additive mask, with
the same bits; and a small CPU attention call runs on one thread (bitwise the one-thread result), the caller's
thread count restored after it."""
import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_checkpoint
from specdec.models import load_model, numerics
from specdec.models.cache import LEFT_PADDED, RAGGED


@pytest.fixture(scope="module", params=["llama", "qwen3", "glm4"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(f"prefill-{request.param}"))


def causal_calls(monkeypatch) -> list:
    """Records, per `numerics.sdpa` call, whether it took the causal path (attn_bias None)."""
    calls, real = [], numerics.sdpa
    monkeypatch.setattr(numerics, "sdpa", lambda q, k, v, bias, gqa: calls.append(bias is None) or real(q, k, v, bias, gqa))
    return calls


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", [RAGGED, LEFT_PADDED])
def test_causal_prefill_has_the_masked_prefills_bits(checkpoint, dtype, layout, monkeypatch):
    model = load_model(checkpoint, dtype=dtype)
    calls = causal_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    for T in (1, 7, 70):
        ids = torch.randint(3, model.vocab_size, (2, T), generator=g)  # [2, T]
        cache = model.new_cache(2, T + 4, layout)
        plan = cache.plan(T)
        assert torch.equal(plan.mask, torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T))  # what causal means
        with torch.no_grad():
            masked = model.forward_tensors(ids, cache.k.clone(), cache.v.clone(), plan.positions, plan.columns,
                                           plan.mask, None, plan.first_column, False, cache.backend)  # [2, T, V]
        calls.clear()
        causal = model.forward(ids, cache)  # [2, T, V]
        assert calls and all(calls), "a prefill from column 0 without padding takes the causal path"
        assert torch.equal(causal, masked), f"T={T}: causal and masked prefill differ"
        calls.clear()
        model.forward(ids[:, :1], cache)  # a step after the prefill keeps the mask
        assert calls and not any(calls)


def test_a_padded_prefill_keeps_the_mask(checkpoint, monkeypatch):
    model = load_model(checkpoint, dtype="float32")
    calls = causal_calls(monkeypatch)
    cache = model.new_cache(2, 12, RAGGED)
    model.forward(torch.randint(3, model.vocab_size, (2, 6)), cache, num_new=[6, 4])
    assert calls and not any(calls)


def test_small_attention_runs_on_one_thread_with_its_bits(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 6, 1, 32, generator=g)  # [B, H, T, D]
        k, v = torch.randn(2, 1, 2, 40, 32, generator=g)  # [B, H_kv, C, D] each
        bias = torch.zeros(1, 1, 1, 33)  # [B, 1, T, W]
        seen = []
        real = torch.set_num_threads
        monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(n) or real(n))
        out = numerics.sdpa(q, k, v, bias, True)  # [1, 6, 1, 32]
        assert seen == [1, 2] and torch.get_num_threads() == 2, "one thread inside, the caller's count after"
        real(1)
        alone = F.scaled_dot_product_attention(q, k[:, :, :33], v[:, :, :33], attn_mask=bias, enable_gqa=True)
        real(2)
        assert torch.equal(out, alone)
        seen.clear()
        monkeypatch.setattr(numerics, "SERIAL_ATTENTION_WORK", 0)
        numerics.sdpa(q, k, v, bias, True)
        assert seen == [], "a call above the bound keeps the caller's threads"
    finally:
        torch.set_num_threads(before)
