"""What the tests of `python -m specdec.run` and its --output writer share (tests/test_cli.py,
tests/test_reliability.py, tests/test_reliability2.py): stand-in outputs, a strict JSONL reader, the CLI as a
subprocess, and a bounded wait until a running CLI has kept its first finished request."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

# one OpenMP thread, no per-step invariant checks: these tests are about files, signals and error lines
QUIET_ENV = {"OMP_NUM_THREADS": "1"}


def fake_output(index: int) -> SimpleNamespace:
    """A stand-in for one RequestOutput, as the --output writer reads it (lines of a few hundred bytes)."""
    return SimpleNamespace(index=index, text=f"text {index} " * 20, token_ids=list(range(index, index + 30)),
                           prompt_token_ids=[1, index], finish_reason="length", accepted_counts=[1],
                           speculative_tokens=[3], latency_s=0.5, time_to_first_token_s=0.1)


def jsonl_indexes(path) -> list[int]:
    """Indexes of a JSONL file that must be valid: every line whole and parseable, ending in a newline."""
    data = open(path, encoding="utf-8").read()
    assert data == "" or data.endswith("\n"), "the file ends in a cut-off line"
    return [json.loads(line)["index"] for line in data.splitlines()]


def hidden(directory) -> list[str]:
    """The hidden files of a folder (where the writer keeps its temporaries and partial files)."""
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def quick_cli(*args, env=None, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    """`python -m specdec.run ARGS` to completion, with QUIET_ENV (plus `env`)."""
    env = dict(os.environ, **QUIET_ENV, **(env or {}))
    return subprocess.run([sys.executable, "-m", "specdec.run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kwargs)


def default_sigint() -> None:
    """Ctrl-C as a user's terminal delivers it: a shell that starts a job in the background (a CI runner may
    run the suite so) ignores SIGINT, the ignore is inherited, and Python then never raises
    KeyboardInterrupt; the signal tests restore the default first."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli(*args) -> subprocess.Popen:
    """`python -m specdec.run ARGS` started in the background, with QUIET_ENV and SIGINT at its default;
    stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "specdec.run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, **QUIET_ENV),
                            preexec_fn=default_sigint)


def wait_for_partial(proc: subprocess.Popen, out_dir, timeout: float = 120) -> str:
    """Polls (bounded by `timeout` seconds) until the CLI streams finished requests into its hidden
    `.partial` file in out_dir; returns that file's name. Kills the CLI and fails the test on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        partial = [n for n in os.listdir(out_dir) if n.endswith(".partial")]
        if partial and os.path.getsize(os.path.join(out_dir, partial[0])) > 0:
            return partial[0]
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    pytest.fail("no request finished in time")
