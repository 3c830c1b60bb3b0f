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


def test_time_forward_reports_the_median_of_the_timed_forwards_and_not_the_warm_up(monkeypatch):
    """Injected faults this catches: time_forward returning the mean (or the first, or the last) of its timed
    forwards instead of their median, or timing the warm-up forward among them, or running it with
    warm_up=False (the start-up measurement's later timings of a model), or leaving the prefill and the warm-up
    out of the seconds before the timed forwards. The forwards' times are injected; the forwards really run."""
    import specdec.timing as timing

    model = load_model(DEFAULT_TARGET, dtype="float32")
    fake = iter([0.5, 0.1, 0.4, 7.0, 0.3])  # 4 timed forwards: median 0.45, mean 2.0; then 1 more
    real_step, real_time = timing.PrefilledCache.step, timing.PrefilledCache.time
    forwards, timed = [], []

    def step(self, x, logits="all"):
        forwards.append(x.shape)
        return real_step(self, x, logits)

    def time(self, x, logits="all"):
        real_time(self, x, logits)  # the forward runs (and rewinds) as it would
        timed.append(x.shape)
        return next(fake)

    monkeypatch.setattr(timing.PrefilledCache, "step", step)
    monkeypatch.setattr(timing.PrefilledCache, "time", time)
    median, before = time_forward(model, rows=2, new_tokens=2, context=8, repeats=4)
    assert median == 0.45  # the median of 0.5, 0.1, 0.4, 7.0: neither the mean (2.0) nor the first or last
    assert forwards == [(2, 2)] * 5 and timed == [(2, 2)] * 4  # one untimed warm-up, then `repeats` timed
    assert before > 0  # measured around the prefill and the warm-up forward
    forwards.clear()
    assert time_forward(model, rows=2, new_tokens=2, context=8, repeats=1, warm_up=False)[0] == 0.3
    assert forwards == [(2, 2)]  # no warm-up forward: the timed one alone
