"""The start-up measurement (specdec/startup.py): the thread count, batch-invariant cost and auto k's cost tables
timed with one warm-up per model and way it runs, cached in one file keyed by host, models, dtype and threads,
and summed up in one line. The models are stubs that sleep a set time per step and count their forwards."""
from __future__ import annotations

import json
import re
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from specdec import autok, bi_mode, openmp, startup, timing
from specdec.startup import StartupMeasurement

STEP_S = {1: 0.004, 2: 0.002}  # a stub step's seconds by thread count: two threads win


class StubCache:
    def __init__(self, rows: int):
        self.length, self.host_length = None, [0] * rows

    def set_prefill(self, lengths, width):
        self.host_length = list(lengths)

    def set_rows(self, length, host_length):
        self.host_length = list(host_length)


class StubModel:
    """What the measurements call of a model. Each step forward (not a prefill) sleeps STEP_S at torch's thread
    count and is counted in `forwards` by how it ran: (batch-invariant, threads, timed or untimed)."""

    vocab_size = 50
    device = torch.device("cpu")
    cfg = None

    def __init__(self, dtype=torch.float32):
        self.dtype, self.batch_invariant = dtype, False
        self.forwards: Counter = Counter()
        self.timing = False  # set while PrefilledCache.time times a forward (the `timed_forwards` fixture)

    def new_cache(self, rows, capacity, layout):
        return StubCache(rows)

    def forward(self, x, cache, num_new=None, logits="all"):
        if num_new is None:
            time.sleep(STEP_S[min(torch.get_num_threads(), 2)])
            self.forwards[self.batch_invariant, torch.get_num_threads(), "timed" if self.timing else "untimed"] += 1

    def untimed(self) -> dict:
        """{(batch-invariant, threads): untimed forwards} (the warm-ups: the stub captures no CUDA graphs)."""
        return {(mode, n): count for (mode, n, kind), count in self.forwards.items() if kind == "untimed"}


@pytest.fixture(autouse=True)
def timed_forwards(monkeypatch):
    """Marks the forwards PrefilledCache.time times; torch's thread count is restored after the test."""
    real_time = timing.PrefilledCache.time

    def time_marked(self, x, logits="all"):
        self.model.timing = True
        try:
            return real_time(self, x, logits)
        finally:
            self.model.timing = False

    monkeypatch.setattr(timing.PrefilledCache, "time", time_marked)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def checkpoint(tmp_path, name: str) -> str:
    """A directory that `model_identity` identifies (its config file)."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"name": name}))
    return str(path)


def fake_llm(target, draft, measurement, k_max: int = 3):
    """What `autok.prepare_chooser` reads of an LLM."""
    options = SimpleNamespace(speculation=SimpleNamespace(k_max=k_max, max_speculative_tokens=k_max),
                              load=SimpleNamespace(cost_cache=measurement.cache_path))
    return SimpleNamespace(options=options, target=target, draft=draft, device=torch.device("cpu"), vocab_size=50,
                           max_context=256, startup=measurement)


def requests(n: int = 2):
    return [SimpleNamespace(prompt_ids=[5] * 12, params=SimpleNamespace(max_tokens=8)) for _ in range(n)]


def measure_all(measurement, target, draft, specs, monkeypatch, batch_size: int = 2):
    """The three measurements as a run makes them: `--threads auto` (from 2 threads), batch_invariant="auto" on
    a device that counts as CUDA, then auto k's costs at `batch_size` rows. Returns the chooser."""
    monkeypatch.setattr(bi_mode, "is_cuda", lambda device: True)
    torch.set_num_threads(2)
    openmp.apply_threads("auto", target, measurement, specs[0])
    bi_mode.choose("auto", target, draft, "cuda", True, batch_size, 3, 8, False, specs[0], measurement=measurement)
    llm = fake_llm(target, draft, measurement)
    chooser = autok.make_chooser(llm)
    autok.prepare_chooser(llm, chooser, requests(batch_size), *specs, batch_size)
    return chooser


def test_one_warm_up_per_model_and_way_it_runs(tmp_path, monkeypatch):
    """The three measurements share the warm-up: each model warms up once per way it runs (thread count,
    batch-invariant or not), however many shapes, rounds and measurements time it. Before the start-up
    measurement, every timing warmed up again: 6 for the thread count, 8 for the batch-invariant cost, one per
    auto k shape. Injected faults this catches: a warm-up per timing, none at all, one shared across thread
    counts or modes (a first forward in a new way timed as a step)."""
    target, draft = StubModel(), StubModel()
    measurement = StartupMeasurement("")
    measure_all(measurement, target, draft, (None, None), monkeypatch)
    assert torch.get_num_threads() == 2  # two threads won: every later forward ran at 2
    assert target.untimed() == {(False, 1): 1, (False, 2): 1, (True, 2): 1}
    assert draft.untimed() == {(False, 2): 1}
    assert sum(target.forwards.values()) > 40  # (many timed forwards: the counts above are not for want of them)


def test_one_cache_file_keyed_by_host_models_dtype_and_threads(tmp_path, monkeypatch):
    specs = checkpoint(tmp_path, "target"), checkpoint(tmp_path, "draft")
    path = str(tmp_path / "costs.json")
    first = StartupMeasurement(path)
    measure_all(first, StubModel(), StubModel(), specs, monkeypatch)
    data = json.loads(open(path).read())
    assert sorted(key.split("/")[0] for key in data) == ["auto-k", "batch-invariant", "threads"]
    target_id, draft_id = (startup.model_identity(None, spec) for spec in specs)
    for key in data:
        host = "cuda" if key.startswith("batch-invariant/") else startup.cpu_name()  # (no GPU here: its name)
        assert f"/{host}/" in key and f"/{target_id}/" in key and "/torch.float32/" in key and "/threads=2/" in key
    assert f"/{target_id}/{draft_id}/" in next(key for key in data if key.startswith("auto-k/"))
    assert [r.cached for r in first.records] == [False, False, False]

    again = StartupMeasurement(path)  # the same host, models, dtype and threads: all three read back
    target, draft = StubModel(), StubModel()
    chooser = measure_all(again, target, draft, specs, monkeypatch)
    assert [r.cached for r in again.records] == [True, True, True]
    assert [r.key for r in again.records] == [r.key for r in first.records]
    assert chooser.costs.as_dict() == data[again.records[2].key]
    assert target.untimed() == {(False, 2): 1} and draft.untimed() == {(False, 2): 1}  # the spot checks' warm-ups
    assert not any(mode for mode, _, _ in target.forwards)  # the batch-invariant cost read back untimed


@pytest.mark.parametrize("change", ["threads", "dtype", "host", "model"])
def test_another_thread_count_dtype_host_or_model_misses_the_cache(tmp_path, monkeypatch, change):
    """Auto k's costs and the batch-invariant cost, cached at 2 threads in float32 for these checkpoints on this
    host, are measured again (a new entry) when one of them differs, and read back when none does."""
    specs = checkpoint(tmp_path, "target"), checkpoint(tmp_path, "draft")
    path = str(tmp_path / "costs.json")
    monkeypatch.setattr(bi_mode, "is_cuda", lambda device: True)
    monkeypatch.setattr(startup, "host_name", lambda device: "Some CPU")

    def measure(dtype=torch.float32):
        target, draft = StubModel(dtype), StubModel(dtype)
        measurement = StartupMeasurement(path)
        bi_mode.choose("auto", target, draft, "cuda", True, 2, 3, 8, False, specs[0], measurement=measurement)
        llm = fake_llm(target, draft, measurement)
        autok.prepare_chooser(llm, autok.make_chooser(llm), requests(), *specs, 2)
        return [r.cached for r in measurement.records]

    torch.set_num_threads(2)
    assert measure() == [False, False]
    assert measure() == [True, True]
    if change == "threads":
        torch.set_num_threads(1)
    elif change == "host":
        monkeypatch.setattr(startup, "host_name", lambda device: "Another CPU")
    elif change == "model":  # the checkpoint changed (its config's size)
        with open(f"{specs[0]}/config.json", "a") as f:
            f.write(" ")
    assert measure(torch.bfloat16 if change == "dtype" else torch.float32) == [False, False]
    assert len(json.loads(open(path).read())) == 4  # new entries beside the first ones


def test_the_summary_gives_one_figure_and_a_line_per_finding(tmp_path, monkeypatch):
    """Issue 58: the summary gave two start-up figures ("+ 2.64 s of start-up measurement, not counted" and
    "start-up measurement: ... 5.11 s") and two auto-k tables under one name. Now: one figure, every measurement's
    seconds (the cached ones' reads and spot checks too), then one line per finding, each cost table named by
    its batch size and context bucket; "(cached)" where read back."""
    specs = checkpoint(tmp_path, "target"), checkpoint(tmp_path, "draft")
    path = str(tmp_path / "costs.json")
    assert StartupMeasurement(path).summary_lines() == []  # nothing measured: no line
    started = time.perf_counter()
    measured = StartupMeasurement(path)
    measure_all(measured, StubModel(), StubModel(), specs, monkeypatch)
    elapsed = time.perf_counter() - started
    lines = measured.summary_lines()
    m = re.fullmatch(r"start-up measurement: ([\d.]+) s \(not counted in tokens/s or latencies\)\n"
                     r"  threads 2 \(1: ([\d.]+) ms, 2: ([\d.]+) ms\)\n"
                     r"  batch-invariant cost ([\d.]+)x \(B=2, T=1/4\)\n"
                     r"  auto-k costs at B=2, context <= 16: target 1-8 tokens, draft 1-32 tokens", "\n".join(lines))
    assert m, lines
    seconds, one, two, cost = map(float, m.groups())
    assert one > two >= 1e3 * STEP_S[2] and 0.5 < cost < 2.0  # the stub's steps: 4 ms at 1 thread, 2 ms at 2
    assert 0 < seconds <= elapsed + 0.005 and seconds == pytest.approx(measured.seconds, abs=0.005)  # (rounded)
    cached = StartupMeasurement(path)
    measure_all(cached, StubModel(), StubModel(), specs, monkeypatch)
    lines = cached.summary_lines()
    assert [line.endswith(" (cached)") for line in lines] == [False, True, True, True], lines
    assert lines[0].startswith("start-up measurement: ") and not any(re.search(r"\d s\b", line) for line in lines[1:])
    measure_all(measured, StubModel(), StubModel(), specs, monkeypatch)  # the same measurements, read back later
    assert "\n".join(measured.summary_lines()).count("auto-k costs at B=2") == 1  # each finding said once
    llm = fake_llm(StubModel(), StubModel(), measured)
    autok.prepare_chooser(llm, autok.make_chooser(llm), [SimpleNamespace(prompt_ids=[5] * 40, params=SimpleNamespace(
        max_tokens=8))] * 2, *specs, 2)  # another context bucket: another table, its own line
    tables = [line for line in measured.summary_lines() if "auto-k costs" in line]
    assert [t.split(":")[0] for t in tables] == ["  auto-k costs at B=2, context <= 16",
                                                 "  auto-k costs at B=2, context <= 64"], tables


def test_measure_reads_checks_runs_and_stores(tmp_path):
    """`measure`: the cached value where `check` accepts it; else `run()`, stored (not for key None, nor without
    a cache file); an entry `decode` refuses is measured again."""
    path = str(tmp_path / "costs.json")
    runs = []

    def run():
        runs.append(1)
        return {"n": len(runs)}

    def measure(measurement, key, check=None):
        return measurement.measure(key, run, decode=lambda entry: {"n": int(entry["n"])},
                                   describe=lambda value: f"n={value['n']}", check=check)

    measurement = StartupMeasurement(path)
    assert measure(measurement, "k") == ({"n": 1}, False)
    assert measure(measurement, "k") == ({"n": 1}, True) and len(runs) == 1
    assert measure(measurement, "k", check=lambda value: False) == ({"n": 2}, False)  # a failed spot check
    assert json.loads(open(path).read()) == {"k": {"n": 2}}
    assert measure(measurement, None) == ({"n": 3}, False)  # a model object: measured, not stored
    startup.write_entry(path, "k", {"m": 1})
    assert measure(measurement, "k") == ({"n": 4}, False)  # an entry of another shape
    assert [r.result for r in measurement.records] == ["n=1", "n=1", "n=2", "n=3", "n=4"]
    assert measure(StartupMeasurement(""), "k") == ({"n": 5}, False)
    assert json.loads(open(path).read()) == {"k": {"n": 4}}  # "" keeps no cache


def test_a_compiled_forward_warms_up_per_size_1_specialisation():
    eager = SimpleNamespace()
    compiled = SimpleNamespace(compiled_forward=lambda *a: None)
    assert startup.warm_up_key(eager, 1, 1, "all") == startup.warm_up_key(eager, 8, 4, "last")
    keys = {startup.warm_up_key(compiled, rows, t, "all") for rows, t in ((1, 1), (1, 4), (8, 1), (8, 4), (16, 2))}
    assert len(keys) == 4  # torch.compile's graphs: rows 1 or more, new tokens 1 or more
