"""CPU threads of the command-line programs (specdec/openmp.py): a bounded spin before torch loads OpenMP,
unless the environment chose a policy; `--threads auto` keeps more threads only where they measure faster."""
import os
import re
import subprocess
import sys

import pytest
import torch

from specdec import openmp, timing
from specdec.startup import StartupMeasurement
from specdec.flags import Parser, add_threads_argument

PROBE = ("import sys, os, importlib; importlib.import_module(sys.argv[1]); "
         "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")


def probe(module: str, **env_values):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_values)
    out = subprocess.run([sys.executable, "-c", PROBE, module], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("module", ["specdec.run", "specdec.serve.__main__", "specdec.train.__main__"])
def test_a_program_spins_briefly_and_keeps_the_environments_choice(module):
    assert probe(module)[:2] == ["None", openmp.SPIN_COUNT]
    assert probe(module, OMP_WAIT_POLICY="PASSIVE")[:2] == ["PASSIVE", "None"]
    assert probe(module, GOMP_SPINCOUNT="5")[:2] == ["None", "5"]


def test_the_setting_module_loads_no_torch():
    assert probe("specdec.openmp") == ["None", "None", "False"]  # importing it alone changes nothing


def parse(*argv):
    p = Parser(prog="prog")
    add_threads_argument(p)
    return p.parse_args(list(argv))


def test_threads_flag_values(capsys):
    assert parse().threads == "auto" and parse("--threads", "AUTO").threads == "auto"
    assert parse("--threads", "3").threads == "3"
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as e:
            parse("--threads", bad)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--threads" in err[0] and "'auto' or an integer >= 1" in err[0]


def test_thread_counts():
    assert openmp.thread_counts(1) == [1]
    assert openmp.thread_counts(2) == [1, 2]
    assert openmp.thread_counts(8) == [1, 4, 8]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("step_ms,chosen", [
    ({1: 10.0, 2: 7.0}, 2),     # a second thread that helps is kept
    ({1: 10.0, 2: 13.0}, 1),    # one that slows the step is not (a core busy elsewhere)
    ({1: 10.0, 2: 9.9}, 1),     # nor one within the noise margin
    ({1: 10.0, 2: 9.0, 4: 9.5}, 2),
])
def test_time_threads_and_the_fastest_count(monkeypatch, restore_threads, step_ms, chosen):
    seen = []

    def fake_time_forward(model, rows, new_tokens, context, repeats, logits="all", **kw):
        n = torch.get_num_threads()
        seen.append((n, rows, new_tokens))
        return step_ms[n] / 1e3, 0.0

    monkeypatch.setattr(timing, "time_forward", fake_time_forward)
    medians = openmp.time_threads(object(), sorted(step_ms), StartupMeasurement(""))
    assert medians == pytest.approx({n: ms / 1e3 for n, ms in step_ms.items()})
    assert openmp.fastest_count(medians) == chosen
    assert {(r, t) for _, r, t in seen} == {(1, 1)}  # batch-1 decode steps
    assert [n for n, _, _ in seen] == sorted(step_ms) * openmp.THREADS_ROUNDS  # interleaved rounds


def test_apply_threads_on_a_model(restore_threads, llama_pair):
    from specdec.models import load_model

    model = load_model(llama_pair[0])
    assert openmp.apply_threads("1", model) == "torch threads 1" and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    line = openmp.apply_threads("auto", model)  # really timed: either count may win on a shared machine, but
    # the line must report the count the rule picks from the medians it prints, and leave torch at that count
    # (injected faults this catches: the slower count kept, the MARGIN rule reversed, torch left at another count,
    # a count missing from the line)
    m = re.fullmatch(r"torch threads (\d+) \(--threads auto: a decode step at 1: ([\d.]+) ms, 2: ([\d.]+) ms\)", line)
    assert m, line
    best, one, two = int(m[1]), float(m[2]), float(m[3])
    assert best == torch.get_num_threads()
    assert best == (2 if two < (1 - openmp.MARGIN) * one else 1), line


def test_apply_threads_caches_its_times_and_checks_the_cached_winner(monkeypatch, restore_threads, llama_pair,
                                                                     tmp_path):
    """`--threads auto` with the start-up measurement: the times are cached per checkpoint; a later run times the
    cached winner once and keeps the cached choice while that step is within the spot check's factor, and
    measures again when it is not (a core got busy: two threads now slower than one). Injected faults this
    catches: the cache not read, the spot check skipped (the stale 2 kept), torch left at another count."""
    from specdec.models import load_model

    model = load_model(llama_pair[0])
    step_ms, seen = {1: 10.0, 2: 7.0}, []

    def fake_time_forward(model, rows, new_tokens, context, repeats, logits="all", **kw):
        seen.append(torch.get_num_threads())
        return step_ms[torch.get_num_threads()] / 1e3, 0.0

    monkeypatch.setattr(timing, "time_forward", fake_time_forward)
    path = str(tmp_path / "costs.json")

    def apply():
        torch.set_num_threads(2)
        seen.clear()
        measurement = StartupMeasurement(path)
        return openmp.apply_threads("auto", model, measurement, llama_pair[0]), measurement

    line, measurement = apply()
    assert line.startswith("torch threads 2 (--threads auto: ") and len(seen) == 2 * openmp.THREADS_ROUNDS
    assert measurement.records[0].result == "threads 2 (1: 10.0 ms, 2: 7.0 ms)" and not measurement.records[0].cached
    line, measurement = apply()
    assert line.startswith("torch threads 2 (--threads auto, cached: ") and seen == [2]  # one spot check at 2
    assert torch.get_num_threads() == 2 and measurement.records[0].cached
    step_ms[2] = 20.0  # one core busy elsewhere
    line, _ = apply()
    assert line.startswith("torch threads 1 (--threads auto: ") and torch.get_num_threads() == 1
    assert seen == [2] + [1, 2] * openmp.THREADS_ROUNDS  # the failed spot check, then the measurement
    line, _ = apply()  # the new times replaced the stale ones
    assert line.startswith("torch threads 1 (--threads auto, cached: ") and seen == [1]
