"""The README's examples that show an output, run as the README writes them (issue 58): the command is read from
the README itself (its ```bash blocks, continuation lines joined), run in a subprocess from the repository root,
and what it prints is checked against what the README says it prints. On the real models: SmolLM2-135M-Instruct
(fetched once, tests/real_model.py) and the Qwen2.5-Coder pair where cached (skipped, naming the fetch command,
where not: CI). The cost cache goes to a temporary XDG_CACHE_HOME, so the start-up measurement runs every time."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from real_model import real_gguf

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SMOLLM2 = ".cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf"  # where the README's fetch puts it
QWEN_TARGET = ".cache/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = ".cache/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def readme_commands() -> list[tuple[str, str]]:
    """Every command line of the README's ```bash blocks: (the command, its trailing `# ...` comment or "")."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():  # continuation lines joined
            command, _, comment = line.partition("#")
            if command.strip():
                commands.append((command.strip(), comment.strip()))
    return commands


def readme_command(*words: str) -> tuple[list[str], str]:
    """The one README command holding every one of `words`: (its argv after `python`, its comment)."""
    found = [(c, note) for c, note in readme_commands() if all(w in c for w in words)]
    assert len(found) == 1, f"README.md: {len(found)} commands hold {words}, expected 1"
    command, note = found[0]
    argv = shlex.split(command)
    assert argv[0] == "python", command
    return argv[1:], note


def readme_quote(pattern: str) -> str:
    """The README's `backticked` text that matches `pattern` (a regex over the quote)."""
    quotes = [q for q in re.findall(r"`([^`\n]+)`", README) if re.fullmatch(pattern, q)]
    assert quotes, f"README.md: no `...` quote matching {pattern!r}"
    return quotes[0]


def run(argv: list[str], tmp_path: Path, swap: dict[str, str]) -> str:
    """`python *argv` from the repository root, paths in `swap` replaced (the cache where the tests keep it);
    its stdout, after checking it exited 0."""
    argv = [swap.get(a, a) for a in argv]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))  # a cold cost cache: the measurement runs
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{shlex.join(argv)}\n{result.stderr[-3000:]}"
    return result.stdout


def startup_figure() -> re.Pattern:
    """The README's start-up figure, `start-up measurement: S s (...)`, S any number."""
    quote = readme_quote(r"start-up measurement: S s .*")
    return re.compile(re.escape(quote).replace(r"S\ s", r"[\d.]+\ s"))  # (re.escape escapes spaces)


def test_the_smollm2_command_prints_what_the_readme_says(tmp_path):
    """`python -m specdec.run --target SmolLM2.gguf --chat --prompt "What is the capital of France?" --compare-ar`:
    the answer the README's comment gives, its AR check line, and the start-up figure."""
    argv, note = readme_command("specdec.run", SMOLLM2, "--compare-ar")
    out = run(argv, tmp_path, {SMOLLM2: real_gguf()})
    answer = note.removeprefix("...").strip()
    assert answer and answer in out, f"the README says the run prints {answer!r}; it printed:\n{out}"
    check = readme_quote(r"Check against AR decoding: .*")
    assert check in out, f"the README says the run prints {check!r}; it printed:\n{out}"
    figures = startup_figure().findall(out)
    assert len(figures) == 1, f"one start-up figure, as the README says; the run printed:\n{out}"


def test_the_qwen_pair_command_prints_an_exact_answer(tmp_path):
    """The README's Qwen2.5-Coder pair command, where the pair is cached: a quicksort in Python, equal to the
    target's own AR answer (the check line), the start-up figure once."""
    from bench.fetch_qwen import FETCH_COMMAND, cached_pair

    pair = cached_pair()
    if pair is None:
        pytest.skip(f"the Qwen pair is not cached: run `{FETCH_COMMAND}` (1.6 GB, once)")
    argv, _ = readme_command("specdec.run", QWEN_TARGET, QWEN_DRAFT)
    out = run(argv, tmp_path, {QWEN_TARGET: str(pair[0]), QWEN_DRAFT: str(pair[1])})
    assert "def quicksort" in out, out
    assert "Check against AR decoding: 1/1 exact-match (100.0%)" in out, out
    assert len(startup_figure().findall(out)) == 1, out
