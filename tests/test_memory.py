"""Memory is bounded by the work, not by a flag (issue: reliability, second pass): caches and auto k's
calibration are sized by the rows that can run, and caches that cannot fit are refused in one line."""
import pytest

import specdec.autok as autok
import specdec.memory as memory
from specdec import LLM, SamplingParams
from specdec.memory import MemoryBudgetError, cache_bytes
from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET


def test_huge_batch_size_allocates_for_the_prompts_only(monkeypatch):
    """--batch-size 100000 with one prompt used to calibrate (and allocate) 100000 rows."""
    calibrated = []
    original = autok.calibrate

    def recording(target, draft, batch_size, *args, **kwargs):
        calibrated.append(batch_size)
        return original(target, draft, batch_size, *args, **kwargs)

    monkeypatch.setattr(autok, "calibrate", recording)
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method="ragged", batch_size=100_000, cost_cache="")
    engine = llm.engine()
    engine.add_request("def f(x):", SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert calibrated == [1]
    assert engine.scheduler.batch.target_cache.batch_size == 1


@pytest.mark.parametrize("method", ["ragged", "eqspec", "exspec"])
def test_caches_that_cannot_fit_are_refused_in_one_line(monkeypatch, method):
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, method=method, num_speculative_tokens=2, batch_size=64, window_size=64)
    per_row = cache_bytes(llm.target, 1, 1000) + cache_bytes(llm.draft, 1, 1000)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 * per_row)  # room for ~9 rows
    with pytest.raises(MemoryBudgetError) as err:
        llm.generate(["x"] * 64, SamplingParams(max_tokens=200))
    message = str(err.value)
    assert "\n" not in message and "--batch-size" in message and "GiB" in message and "batch size 64" in message
    llm.generate(["x"] * 4, SamplingParams(max_tokens=8))  # what fits still runs
