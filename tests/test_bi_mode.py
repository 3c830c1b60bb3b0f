"""`batch_invariant="auto"` (specdec/bi_mode.py, the default of `LLM` and `--batch-invariant`): what it picks on
the CPU (today's behaviour: float models off, quantized ones on, nothing measured) and on CUDA (a start-up
measurement of a target forward with the mode on and off decides, against 1.15x; cached), with the measured
times injected, since this machine has no GPU."""
from __future__ import annotations

import json

import pytest
import torch

from specdec import LLM, SamplingParams, bi_mode, timing
from specdec.models import load_model
from specdec.startup import StartupMeasurement


def fake_measure(ratios, calls=None):
    """A `measure` giving {T: (ratio * 1e-3, 1e-3)} for the lengths asked, recording each call."""
    def measure(model, rows, lengths, measurement):
        if calls is not None:
            calls.append((rows, tuple(lengths)))
        return {T: (ratios.get(T, 1.0) * 1e-3, 1e-3) for T in lengths}
    return measure


def never(*args, **kwargs):
    raise AssertionError("measured where nothing should be measured")


def test_the_rule_and_the_settings():
    assert bi_mode.pays(1.15, 1.0) and not bi_mode.pays(1.151, 1.0) and bi_mode.AUTO_MAX_COST == 1.15
    assert bi_mode.worst_cost({1: (1.1, 1.0), 6: (2.4, 2.0)}) == pytest.approx(1.2)
    for bad in ("yes", 1, 0, None, "on", "always"):  # the option's rule (specdec/options.py), before anything loads
        with pytest.raises(ValueError, match=r"batch_invariant \(--batch-invariant\) must be True, False or 'auto'"):
            LLM("/nonexistent", method="ar", batch_invariant=bad)


def test_auto_on_cuda_decides_by_the_measured_cost(llama_pair, tmp_path):
    """choose() on a "cuda" device with injected times: on at <= 1.15x (the worst of T = 1 and k + 1), off
    above; ar, compile, a target already in the mode and model objects without it are off unmeasured."""
    target = load_model(llama_pair[0])
    draft = load_model(llama_pair[1])
    kw = dict(device=torch.device("cuda"), speculative=True, batch_size=8, k=5, k_max=8, compile=False,
              measurement=StartupMeasurement(""))
    calls = []
    cheap = bi_mode.choose("auto", target, draft, measure=fake_measure({1: 1.05, 6: 1.15}, calls), **kw)
    assert cheap.on and cheap.cost == pytest.approx(1.15) and calls == [(8, (1, 6))]
    assert "B=8" in cheap.reason and "measured" in cheap.reason
    dear = bi_mode.choose("auto", target, draft, measure=fake_measure({1: 1.02, 6: 1.3}), **kw)
    assert not dear.on and dear.cost == pytest.approx(1.3)
    calls.clear()
    bi_mode.choose("auto", target, draft, measure=fake_measure({}, calls), **{**kw, "k": "auto"})
    assert calls == [(8, (1, 9))]  # auto k: the longest verify, k_max + 1
    for change, why in ((dict(speculative=False), "ar"), (dict(compile=True), "compile"),
                        (dict(device=torch.device("cpu")), "cpu")):
        choice = bi_mode.choose("auto", target, draft, measure=never, **{**kw, **change})
        assert not choice.on and why in choice.reason
    target.batch_invariant = True  # e.g. a quantized target: already on, left as it is
    assert "already" in bi_mode.choose("auto", target, draft, measure=never, **kw).reason
    target.batch_invariant = False
    assert not bi_mode.choose("auto", object(), None, measure=never, **kw).on
    assert bi_mode.choose(True, target, draft, measure=never, **kw).on
    assert not bi_mode.choose(False, target, draft, measure=never, **kw).on


def test_auto_caches_the_measurement_per_checkpoint_and_batch(llama_pair, tmp_path):
    target = load_model(llama_pair[0])
    path = str(tmp_path / "costs.json")
    with open(path, "w") as f:
        json.dump({"v2/other": {"target": {"1": 1.0}, "draft": {}}}, f)  # auto k's entries are kept
    kw = dict(device=torch.device("cuda"), speculative=True, k=3, k_max=8, compile=False, target_spec=llama_pair[0],
              measurement=StartupMeasurement(path))
    calls = []
    first = bi_mode.choose("auto", target, None, batch_size=4, measure=fake_measure({4: 1.1}, calls), **kw)
    again = bi_mode.choose("auto", target, None, batch_size=4, measure=never, **kw)
    assert first.on and again.on and again.cost == first.cost and "cached" in again.reason and len(calls) == 1
    bi_mode.choose("auto", target, None, batch_size=2, measure=fake_measure({}, calls), **kw)
    assert len(calls) == 2  # another batch size is measured again
    data = json.load(open(path))
    assert "v2/other" in data and sum(key.startswith("batch-invariant/") for key in data) == 2
    calls.clear()
    bi_mode.choose("auto", target, None, batch_size=4, measure=fake_measure({}, calls),
                   **{**kw, "target_spec": target})  # a model object: not cached, measured
    assert calls


def test_auto_on_the_cpu_keeps_todays_behaviour(llama_pair, monkeypatch):
    """The default ("auto") on the CPU: float models stay off, a quantized target stays on (and its float
    draft off), nothing is measured."""
    monkeypatch.setattr(bi_mode, "measure_cost", never)
    llm = LLM(*llama_pair, method="eqspec", num_speculative_tokens=2, batch_size=2, check_invariants=False)
    assert not llm.batch_invariant_choice.on and "cpu" in llm.batch_invariant_choice.reason
    assert llm.target.batch_invariant is False and llm.draft.batch_invariant is False
    quant = LLM(*llama_pair, method="eqspec", num_speculative_tokens=2, batch_size=2, quantize="int8",
                check_invariants=False)
    assert quant.target.batch_invariant is True and quant.draft.batch_invariant is False


def test_auto_on_cuda_switches_an_llm_s_models(llama_pair, monkeypatch, tmp_path, capsys):
    """LLM(...) with the default "auto" where the device counts as CUDA (patched: the models stay on the CPU)
    and the measurement is injected: cheap -> both models in the mode, a line on stderr; dear -> off."""
    monkeypatch.setattr(bi_mode, "is_cuda", lambda device: True)
    calls = []
    monkeypatch.setattr(bi_mode, "measure_cost", fake_measure({1: 1.0, 3: 1.1}, calls))
    cache = str(tmp_path / "costs.json")
    llm = LLM(*llama_pair, method="ragged", num_speculative_tokens=2, batch_size=3, cost_cache=cache,
              check_invariants=False)
    assert llm.batch_invariant_choice.on and llm.target.batch_invariant and llm.draft.batch_invariant
    assert calls == [(3, (1, 3))] and "batch_invariant='auto'" in capsys.readouterr().err
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    monkeypatch.setattr(bi_mode, "measure_cost", fake_measure({3: 1.5}))
    dear = LLM(*llama_pair, method="ragged", num_speculative_tokens=2, batch_size=5, cost_cache=cache,
               check_invariants=False)
    assert not dear.batch_invariant_choice.on and dear.target.batch_invariant is False
    ar = LLM(llama_pair[0], method="ar", batch_size=3, cost_cache=cache)
    assert not ar.batch_invariant_choice.on and "ar" in ar.batch_invariant_choice.reason


def test_the_real_measurement_restores_the_mode(llama_pair, monkeypatch):
    """measure_cost times each (T, mode) pair, keeps the fastest round of each, and pairs them (on, off). Injected
    faults this catches: the pair swapped (off, on), the slowest round kept instead of the fastest, a mode left
    switched on afterwards, the forwards timed in the wrong mode or at another row count or T."""
    target = load_model(llama_pair[0])
    times = bi_mode.measure_cost(target, 2, [1, 3], StartupMeasurement(""), context=8, repeats=1,
                                 rounds=1)  # the real forwards run
    assert set(times) == {1, 3} and all(on > 0 and off > 0 for on, off in times.values())
    assert target.batch_invariant is False
    seen = []

    def fake_time_forward(model, rows, new_tokens, context, repeats, logits="all", **kw):
        seen.append((rows, new_tokens, model.batch_invariant))
        base = {1: 0.010, 3: 0.030}[new_tokens] * (2.0 if model.batch_invariant else 1.0)
        return base * (1 + len(seen) % 3), 0.0  # rounds differ: the fastest one must count

    monkeypatch.setattr(timing, "time_forward", fake_time_forward)
    times = bi_mode.measure_cost(target, 2, [1, 3], StartupMeasurement(""), context=8, repeats=1, rounds=3)
    assert times == {1: (0.020, 0.010), 3: (0.060, 0.030)}  # (with the mode, without), the fastest of 3 rounds
    assert {(rows, t) for rows, t, _ in seen} == {(2, 1), (2, 3)} and len(seen) == 12
    assert target.batch_invariant is False
