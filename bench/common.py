"""What every benchmark shares: interleaved timing, spreads, markdown tables, the machine and the command line
of a run, argparse types, prompts, JSONL files, figures and process memory."""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time

from specdec.flags import HelpFormatter  # noqa: F401  (the benchmarks' --help, as the programs')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def log(tag: str, message: str) -> None:
    """A progress line on stderr: '[tag] message'."""
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)


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


def md_table(header: list[str], rows, right=()) -> str:
    """A markdown table: the header's cells, then one line per row (str() of every cell); the columns whose
    indexes are in `right` are right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "".join("---:|" if i in right else "---|"
                                                             for i in range(len(header)))]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


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


def cpu_model() -> str:
    """The CPU by name and the vector extensions the native kernels use ('Intel(R) Xeon(R) Processor (AVX-512
    VNNI, AMX listed)'), from /proc/cpuinfo; the platform's name elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), ()))
    isa = "AVX-512 VNNI" if {"avx512f", "avx512_vnni"} <= flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa}{', AMX listed' if 'amx_int8' in flags else ''})"


def machine() -> dict:
    """Where and when a run ran: CPU, torch threads, versions, git revision, date, load average now."""
    import torch

    return {"git": git_revision(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "loadavg": list(os.getloadavg())}


def machine_line(m: dict | None = None) -> str:
    """`machine()` in one line."""
    m = m or machine()
    return (f"torch {m['torch']}, Python {m['python']}, {m['cpu']}, {m['cpu_count']} CPUs, {m['threads']} torch "
            f"thread(s), git {m['git'] or '?'}, {m['date']}, load average {m['loadavg'][0]:.1f} at start")


def command_line(module: str, argv=None) -> str:
    """The command that reproduces this run, e.g. 'python -m bench.forward --quick'."""
    return " ".join(["python", "-m", module] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])


def comma_list(choices=None):
    """An argparse type: comma-separated items ('a, b' -> ['a', 'b']), at least one, each one of `choices`
    where given; a bad value is one line naming the flag."""
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: " + (f"unknown {', '.join(bad)}; choose from "
                                             f"{', '.join(choices)}" if bad else "give at least one"))
        return items
    return parse


def comma_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, sorted, each once ('8,1,8' -> [1, 8])."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or not all(x.isdigit() and int(x) >= 1 for x in items):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers >= 1")
    return sorted({int(x) for x in items})


def quick_help(quick: dict, about: str) -> str:
    """--quick's help: `about`, then the flags it sets."""
    return f"{about}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items()) + \
        " (explicit flags still win)"


def parse_with_quick(parser: argparse.ArgumentParser, quick: dict, argv=None, check=None) -> argparse.Namespace:
    """Parses argv; with --quick the `quick` values become the defaults (flags given explicitly still win). `check`
    (the parsed args): a ValueError it raises is the parser's one-line error."""
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**quick)
    args = parser.parse_args(argv)
    if check is not None:
        try:
            check(args)
        except ValueError as err:
            parser.error(str(err))
    return args


# ---------------------------------------------------------------------------------------------- prompts
def random_prompts(n: int, vocab: int, shortest: int = 8, longest: int = 64, seed: int = 0) -> list[list[int]]:
    """n prompts of random token ids (3..vocab-1, above the usual special ids) of random lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


def evenly_spaced(items: list, n: int) -> list:
    """n items spread over the list (cycling when it has fewer than n)."""
    if n <= len(items):
        return [items[(i * len(items)) // n] for i in range(n)]
    return [items[i % len(items)] for i in range(n)]


def checkpoint_tokenizer(path: str):
    """The tokenizer of a checkpoint (a directory with tokenizer.model/tokenizer.json, or a .gguf file), or None
    for a pair that has none (bench/pairs.py's random pairs)."""
    from specdec.models import is_gguf, load_tokenizer

    if is_gguf(path) or any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.model", "tokenizer.json")):
        return load_tokenizer(path)
    return None


def prompt_ids(texts: list[str], tokenizer, vocab: int) -> tuple[list[list[int]], str]:
    """Token ids of text prompts: the tokenizer's, or UTF-8 bytes (id = byte + 3) without one; and which."""
    if tokenizer is not None:
        return [tokenizer.encode(t) for t in texts], "target tokenizer"
    return [[(b + 3) % vocab for b in t.encode("utf-8")] for t in texts], "UTF-8 bytes + 3 (no tokenizer)"


def lengths_text(ids: list[list[int]]) -> str:
    """'min / median / max' of the prompts' token lengths."""
    lengths = sorted(len(x) for x in ids)
    return f"{lengths[0]} / {int(statistics.median(lengths))} / {lengths[-1]}"


# ------------------------------------------------------------------------------------------------ files
def shown(path: str) -> str:
    """A path as reports show it: relative to the repository when inside it."""
    return os.path.relpath(path, REPO) if os.path.abspath(path).startswith(REPO + os.sep) else path


def file_sha256(path: str, n: int = 12) -> str:
    """The first n hex digits of a file's sha256 (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:n]


def write_jsonl(path: str, records) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pyplot():
    """matplotlib.pyplot, drawing to files only (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 90) -> str:
    """Writes a matplotlib figure to path and closes it; returns the path."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory now (VmRSS of /proc/PID/status), in MiB; NaN where there is none."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")
