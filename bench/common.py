"""What every benchmark shares: interleaved repeated timing, medians with spread, the machine's metadata, the
command line that reproduces a run, the benchmark pairs and argparse's help format.

One forward on a prefilled cache (prefill, time, rewind) is the runtime's own `specdec.timing` (auto k
calibrates with it).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR_NAMES = ("default", "synthetic", "tiny")


# ------------------------------------------------------------------------------------------------ timing
def interleave(calls: dict, repeats: int, warmup: int = 1) -> dict[str, list]:
    """Each call `warmup` times untimed, then `repeats` rounds of all of them, the order rotating every round
    so that drift in machine load hits all alike; {name: [what the call returned, per round]}."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    results = {name: [] for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            results[name].append(calls[name]())
    return results


def stopwatch(fn):
    """A call that runs fn() and returns its wall seconds."""
    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return timed


def k_text(k, histogram: dict | None = None) -> str:
    """A run's k: fixed, or auto with the mean chosen k and the share of k = 0 steps (from its k histogram)."""
    hist = {int(n): count for n, count in (histogram or {}).items()}
    if k != "auto" or not hist:
        return "–" if k is None else str(k)
    steps = sum(hist.values())
    return f"auto (mean {sum(n * c for n, c in hist.items()) / steps:.1f}, {hist.get(0, 0) / steps:.0%} k=0)"


def spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_spread(values, spec: str = "{:.1f}", none: str = "–") -> str:
    """'median (min–max)' of a list of values or of a `spread` dict."""
    if values is None:
        return none
    s = values if isinstance(values, dict) else spread(values)
    return f"{spec.format(s['median'])} ({spec.format(s['min'])}–{spec.format(s['max'])})"


# ------------------------------------------------------------------------------------- machine, command
def git_revision() -> str:
    """HEAD of the repository, with '+dirty' when tracked files are modified ('' outside git)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return rev + ("+dirty" if rev and dirty else "")


def machine() -> dict:
    """Where and when a run ran: CPU, torch threads, versions, git revision, date, load average now."""
    import torch

    return {"git": git_revision(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "loadavg": list(os.getloadavg())}


def machine_line(m: dict | None = None) -> str:
    m = m or machine()
    return (f"torch {m['torch']}, Python {m['python']}, {m['cpu']}, {m['cpu_count']} CPUs, {m['threads']} torch "
            f"thread(s), git {m['git'] or '?'}, {m['date']}, load average {m['loadavg'][0]:.1f} at start")


def command_line(module: str, argv=None) -> str:
    """The command that reproduces this run, e.g. 'python -m bench.forward --quick'."""
    return " ".join(["python", "-m", module] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' only where there is a plain default (None/False ones are explained in the text)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


# ------------------------------------------------------------------------------------------------ pairs
def pair_dirs(name: str, folder: str | None = None) -> tuple[str, str]:
    """(target, draft) checkpoint directories of a benchmark pair: 'default' (the embedded pair), 'synthetic'
    (bench/pairs.py's 113M/19M pair) or 'tiny' (its toy version); the last two are built once into `folder`
    (default bench/results/pair, -tiny for the tiny one) and reused while their recipe matches."""
    if name == "default":
        from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET

        return DEFAULT_TARGET, DEFAULT_DRAFT
    if name not in PAIR_NAMES:
        raise ValueError(f"unknown pair {name!r}; choose from {', '.join(PAIR_NAMES)}")
    from bench.pairs import DEFAULT_PAIR_DIR, SyntheticPairSpec, build_synthetic_pair

    spec = SyntheticPairSpec() if name == "synthetic" else SyntheticPairSpec.quick()
    return build_synthetic_pair(folder or DEFAULT_PAIR_DIR + ("-tiny" if name == "tiny" else ""), spec)


def random_prompts(n: int, vocab: int, shortest: int = 8, longest: int = 64, seed: int = 0) -> list[list[int]]:
    """n prompts of random token ids (3..vocab-1, above the usual special ids) of random lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


def evenly_spaced(items: list, n: int) -> list:
    """n items spread over the list (cycling when it has fewer than n)."""
    if n <= len(items):
        return [items[(i * len(items)) // n] for i in range(n)]
    return [items[i % len(items)] for i in range(n)]
