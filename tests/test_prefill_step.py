"""The attention shortcuts of the ordinary (not batch-invariant) forward (models/numerics.py `sdpa`):
a prefill whose rows all start at column 0 unpadded takes SDPA's causal path instead of the additive mask, and
a one-token step of rows that all see every column takes no mask at all, both with the masked forward's bits;
and a small CPU attention call runs on one thread (bitwise the one-thread result), the caller's thread count
restored after it."""
import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_checkpoint
from specdec.models import load_model, numerics
from specdec.models.cache import LEFT_PADDED, RAGGED


@pytest.fixture(scope="module", params=["llama", "qwen3", "glm4"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(f"prefill-{request.param}"))


def attention_calls(monkeypatch) -> list:
    """Records, per `numerics.sdpa` call, which path it took: "causal", "none" (no mask) or "mask"."""
    calls, real = [], numerics.sdpa

    def spy(q, k, v, bias, gqa, causal=False):
        calls.append("mask" if bias is not None else "causal" if causal else "none")
        return real(q, k, v, bias, gqa, causal)

    monkeypatch.setattr(numerics, "sdpa", spy)
    return calls


def masked_forward(model, ids, cache):
    """The forward of ids [B, T] after `cache` with the additive mask (on a copy of the cache): logits [B, T, V]."""
    plan = cache.plan(ids.shape[1])
    kv = cache.kv[:, :, :, :, :plan.width].clone()  # [L, 2, B, H_kv, W, D]
    with torch.no_grad():
        return model.forward_tensors(ids, kv, plan.positions, plan.columns, plan.mask, None, False, cache.backend)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", [RAGGED, LEFT_PADDED])
def test_causal_prefill_has_the_masked_prefills_bits(checkpoint, dtype, layout, monkeypatch):
    model = load_model(checkpoint, dtype=dtype)
    calls = attention_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    for T in (1, 7, 70):
        ids = torch.randint(3, model.vocab_size, (2, T), generator=g)  # [2, T]
        cache = model.new_cache(2, T + 4, layout)
        plan = cache.plan(T)
        assert torch.equal(plan.mask, torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T))  # what causal means
        masked = masked_forward(model, ids, cache)  # [2, T, V]
        calls.clear()
        causal = model.forward(ids, cache)  # [2, T, V]
        assert calls == ["causal"] * model.cfg.num_layers, "a prefill from column 0 without padding is causal"
        assert torch.equal(causal, masked), f"T={T}: causal and masked prefill differ"
        step = ids[:, :1]
        masked = masked_forward(model, step, cache)  # [2, 1, V]
        calls.clear()
        unmasked = model.forward(step, cache)  # both rows end at one column: every column visible, no mask
        assert calls == ["none"] * model.cfg.num_layers
        assert torch.equal(unmasked, masked), f"T={T}: a step without the mask and with it differ"
        calls.clear()
        model.forward(torch.randint(3, model.vocab_size, (2, 2), generator=g), cache)  # a two-token step: a mask
        assert calls and set(calls) == {"mask"}


def test_a_padded_prefill_and_rows_of_other_lengths_keep_the_mask(checkpoint, monkeypatch):
    model = load_model(checkpoint, dtype="float32")
    calls = attention_calls(monkeypatch)
    cache = model.new_cache(2, 12, RAGGED)
    model.forward(torch.randint(3, model.vocab_size, (2, 6)), cache, num_new=[6, 4])
    assert calls and set(calls) == {"mask"}
    calls.clear()
    model.forward(torch.randint(3, model.vocab_size, (2, 1)), cache)  # rows of lengths 6 and 4: a mask
    assert calls and set(calls) == {"mask"}


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
        k, v = k[:, :, :33], v[:, :, :33]  # [B, H_kv, W, D]: the columns attention reads
        out = numerics.sdpa(q, k, v, bias, True)  # [1, 6, 1, 32]
        assert seen == [1, 2] and torch.get_num_threads() == 2, "one thread inside, the caller's count after"
        real(1)
        alone = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        real(2)
        assert torch.equal(out, alone)
        seen.clear()
        monkeypatch.setattr(numerics, "SERIAL_ATTENTION_WORK", 0)
        numerics.sdpa(q, k, v, bias, True)
        assert seen == [], "a call above the bound keeps the caller's threads"
    finally:
        torch.set_num_threads(before)
