"""specdec/timing.py: every forward on a PrefilledCache sees exactly its prefix (the rewind restores it), which
is what auto k's calibration and the benchmarks time."""
import torch

from specdec.models import load_model
from specdec.models.cache import LEFT_PADDED, RAGGED
from specdec.prompts import DEFAULT_TARGET
from specdec.timing import PrefilledCache, random_tokens, time_forward


def test_forwards_on_a_prefilled_cache_see_the_prefix_every_time():
    model = load_model(DEFAULT_TARGET, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompt, x = random_tokens(2, 12, model.vocab_size, g, "cpu"), random_tokens(2, 3, model.vocab_size, g, "cpu")
    cache = model.new_cache(2, 16, RAGGED)  # the reference: prompt and x in one prefill
    cache.set_prefill([15, 15], 15)
    whole = model.forward(torch.cat([prompt, x], 1), cache, num_new=[15, 15])  # [2, 15, V]
    for layout in (RAGGED, LEFT_PADDED):
        prefilled = PrefilledCache(model, prompt, 16, layout)
        first = prefilled.forward(x)  # [2, 3, V]
        assert prefilled.time(x) > 0 and prefilled.time(x[:, :1], "last") > 0
        assert torch.equal(prefilled.forward(x), first)  # not a longer prefix after three forwards
        torch.testing.assert_close(first, whole[:, 12:], rtol=1e-4, atol=1e-4)


def test_time_forward_reports_a_median_and_the_warm_up():
    model = load_model(DEFAULT_TARGET, dtype="float32")
    median, warm_up = time_forward(model, rows=2, new_tokens=2, context=8, repeats=3)
    assert median > 0 and warm_up > 0
