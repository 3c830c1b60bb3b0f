"""Packed linear weights (CPU float32, steps of up to PACKED_MAX_ROWS token rows through oneDNN, with the
residual add and the MLP's SiLU and product fused in): the same logits as the ordinary forward up to float32
rounding, the packed path really taken (and only where it pays), the LLM's default, and greedy speculative
output equal to AR with it on (float64 ignores packing: exact)."""
import pytest
import torch

from checkpoints import make_checkpoint, make_pair
from specdec import LLM, SamplingParams
from specdec.models import load_model, numerics
from specdec.models.cache import RAGGED
from specdec.models.numerics import packing_pays

pytestmark = pytest.mark.skipif(numerics.pack_weight(torch.zeros(8, 8)) is None,
                                reason="torch without oneDNN's packed linear on this CPU")


@pytest.fixture(scope="module", params=["llama", "qwen3", "glm4"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(f"packed-{request.param}"))


def logits_of_steps(model, steps):
    """Logits of a 5-token prefill of 3 rows, then one forward per T in `steps`."""
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(3, 5 + sum(steps) + 1, RAGGED)
    cache.set_prefill([5, 5, 5], 5)
    outs = [model.forward(torch.randint(3, model.vocab_size, (3, 5), generator=g), cache, num_new=[5] * 3)]
    for T in steps:
        outs.append(model.forward(torch.randint(3, model.vocab_size, (3, T), generator=g), cache))
    return outs


def test_packed_forward_equals_the_ordinary_one_and_packs_small_steps(checkpoint, monkeypatch):
    model = load_model(checkpoint, dtype="float32")
    plain = logits_of_steps(model, [1, 4, 2])
    model.packed_linear = True
    calls = []
    real = numerics.packed_weight
    monkeypatch.setattr(numerics, "packed_weight", lambda layer, *part: calls.append(layer) or real(layer, *part))
    packed = logits_of_steps(model, [1, 4, 2])
    for a, b in zip(plain, packed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert calls, "the packed path was never taken"
    one_row = load_model(checkpoint, dtype="float32")
    one_row.packed_linear = True
    cache = one_row.new_cache(1, 4 + numerics.PACKED_MAX_ROWS, RAGGED)
    cache.set_prefill([1], 1)
    calls.clear()
    one_row.forward(torch.tensor([[5]]), cache, num_new=[1])  # M = 1: every layer packed
    assert calls
    calls.clear()
    long = torch.full((1, numerics.PACKED_MAX_ROWS + 1), 5)  # a prefill longer than the bound: MKL's GEMM
    one_row.forward(long, cache)
    assert not calls
    model.packed_linear = False
    assert all("bi_packed" not in m.__dict__ for m in model.modules())  # switching off frees the copies


def test_default_packs_small_float32_models_only(tmp_path):
    target, draft = make_pair("llama", tmp_path)
    assert LLM(target, draft, method="ragged", dtype="float32").target.packed_linear
    assert not LLM(target, draft, method="ragged", dtype="float64").target.packed_linear
    assert not LLM(target, draft, method="ragged", dtype="float32", packed_weights=False).draft.packed_linear
    model = load_model(target, dtype="float32")
    assert packing_pays(model) and not packing_pays(model, limit_bytes=1024)  # a big model keeps its memory


@pytest.mark.parametrize("method", ["eqspec", "ragged", "exspec"])
def test_greedy_equals_ar_with_packed_weights(tmp_path_factory, method):
    """float32 with packing on: every row at k = 3 against AR at batch 1 (which runs the GEMV path), on a
    pair with clear argmaxes; a near-tie could flip in float32 (docs/design.md, Exactness), none does here."""
    target, draft = make_pair("qwen3", tmp_path_factory.mktemp("packed-eq"))
    prompts = [[5, 9, 14], [7, 3, 21, 30, 11], [40, 41], [6] * 7]
    params = SamplingParams(max_tokens=12)
    ar = LLM(target, method="ar", batch_size=1, dtype="float32").generate(prompt_token_ids=prompts,
                                                                          sampling_params=params)
    spec = LLM(target, draft, method=method, num_speculative_tokens=3, batch_size=4, dtype="float32")
    assert spec.target.packed_linear
    out = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]


def test_packed_row_buckets_bound_the_shapes_and_keep_results():
    """Rows above PACKED_EXACT_ROWS run padded to a multiple of PACKED_ROW_STEP: few shapes (oneDNN caches a
    primitive per shape), the same values as the unpadded product up to float32 rounding."""
    from torch import nn

    from specdec.models import numerics

    shapes = {numerics.packed_rows(m) for m in range(1, numerics.PACKED_MAX_ROWS + 1)}
    assert len(shapes) <= 24 and all(s >= m for m, s in ((m, numerics.packed_rows(m)) for m in range(1, 65)))
    layer = nn.Linear(32, 48)
    if numerics.pack_weight(torch.zeros(8, 8)) is None:
        pytest.skip("no oneDNN packed path in this torch build")
    x = torch.randn(3, 7, 32)  # 21 rows: padded to 24
    torch.testing.assert_close(numerics.linear_kernel(layer, False, True)(x), layer(x), rtol=1e-5, atol=1e-5)
    model = nn.Sequential(layer)
    model.packed_linear = True
    assert numerics.warm_packed(model) == len(shapes)
