"""Issue 26: a bounded hypothesis fuzz of `python -m specdec.run` over its flags and prompt-file contents.

The CLI runs in-process (`specdec.run.main([...])`) on the embedded default pair with tiny `--max-tokens`,
`-k 1/2`, `--no-compare-ar --no-progress`: an example costs well under a second, and the 46 examples (fixed
by `derandomize`) take 15-40 s on one busy CPU core. Half the examples are careful (every flag and prompt
valid: they must succeed), half hostile (bad values anywhere). The invariant, for every example:

- exit 0, and `--output` holds valid JSONL with one line per prompt, in prompt order, each with its prompt
  (and `--metrics`, when given, valid JSON); or
- exit 1 or 2 with one error line on stderr and no traceback (argparse's own refusals too: the one `error:`
  line naming the flag, without argparse's usage block); and, either way,
- no input file changed: the prompt file, the checkpoint files, a read-only file offered as --output.

The flags that reproduce a failing example are printed by hypothesis (`note`); shrinking is off to keep the
run bounded.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

from specdec.prompts import DEFAULT_DRAFT, DEFAULT_TARGET, read_prompts
from specdec.run import main

pytestmark = pytest.mark.slow  # not in the fast lane (pytest.ini)

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)  # any Unicode a file can hold
WORDS = st.lists(st.sampled_from(["def", "return", "x", "(", ")", ":", "import", "os", "\\n", "#", " "]),
                 max_size=12).map(" ".join)


@st.composite
def jsonl_line(draw, careful: bool) -> str:
    kinds = ["prompt", "turns", "blank"] + ([] if careful else ["garbage", "not an object", "surrogate", "deep"])
    kind = draw(st.sampled_from(kinds))
    text = draw(st.one_of(WORDS, TEXT))
    return {"prompt": json.dumps({"prompt": text}, ensure_ascii=draw(st.booleans())),
            "turns": json.dumps({"turns": [text, "second"]}),
            "blank": "",
            "garbage": text + "{",
            "not an object": json.dumps([text]),
            "surrogate": '{"prompt": "a\\ud800b"}',
            "deep": "[" * 3000 + "]" * 3000}[kind]


@st.composite
def prompt_file(draw, careful: bool) -> tuple[str, str]:
    """(suffix, content) of a prompt file; `careful`: every line a usable prompt (any Unicode text)."""
    suffix = draw(st.sampled_from([".txt", ".jsonl"]))
    if suffix == ".txt":
        lines = draw(st.lists(st.one_of(WORDS, TEXT, st.just("# a comment"), st.just("")),
                              min_size=1 if careful else 0, max_size=4))
        if careful:
            lines.append("def f(x):")
    else:
        lines = draw(st.lists(jsonl_line(careful), min_size=1, max_size=3))
        if careful:
            lines.append(json.dumps({"prompt": "import os"}))
    content = "\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n"]))
    if draw(st.booleans()):
        content = "\ufeff" + content
    return suffix, content


def pick(draw, flag: str, good: list, bad: list, careful: bool) -> list[str]:
    """No flag, a good value, or (not careful) sometimes a bad one."""
    values = good if careful else good + bad
    value = draw(st.one_of(st.none(), st.sampled_from(values)))
    return [] if value is None else [flag, str(value)]


@st.composite
def flags(draw, careful: bool) -> list[str]:
    """Flag values; `careful`: all valid (the run must succeed), else some out of range or of a wrong type."""
    chosen = [
        ["--method", draw(st.sampled_from(["ar", "eqspec", "exspec", "ragged"]))],
        ["-k", draw(st.sampled_from(["1", "2"]))],
        ["--max-tokens", draw(st.sampled_from(["1", "2", "3"] + ([] if careful else ["0"])))],
        pick(draw, "--batch-size", [1, 2, 3], [0, "x"], careful),
        pick(draw, "--window-size", [8, 12], [0, 1, 2], careful),  # exspec: >= the batch size (default 8)
        pick(draw, "--temperature", [0, 0.7, 1e-38], [-1, "nan"], careful),
        pick(draw, "--top-k", [0, 3], [-1], careful),
        pick(draw, "--top-p", [1, 0.5], [0, 1.5], careful),
        pick(draw, "--seed", [0, 7, -1], [(1 << 64) - 1, 1 << 64], careful),
        pick(draw, "--num-prompts", [1, 2], [0], careful),
        pick(draw, "--dtype", ["float32", "bfloat16", "float64"], ["int8"], careful),
        pick(draw, "--samples", [0, 1], [], careful),
        draw(st.sampled_from([[], ["--check-weights"], ["--no-packed-weights"]] + ([] if careful else [["--chat"]]))),
    ]
    return [part for group in chosen for part in group]


@st.composite
def case(draw) -> dict:
    """One CLI run: half of them careful (must exit 0), half hostile anywhere."""
    careful = draw(st.sampled_from([False, True]))
    kinds = ["new", "existing", "/dev/null"] + ([] if careful else ["read-only", "directory", "missing directory"])
    return {"careful": careful, "file": draw(st.one_of(st.none(), prompt_file(careful))),
            "inline": draw(st.lists(WORDS, max_size=2)), "flags": draw(flags(careful)),
            "output_kind": draw(st.sampled_from(kinds)), "metrics": draw(st.booleans())}


def fingerprint(paths) -> dict:
    """Size, modification time and bytes (small files) of every file: what "unchanged" means here."""
    prints = {}
    for path in paths:
        info = os.stat(path)
        small = info.st_size < (1 << 20)
        prints[path] = (info.st_size, info.st_mtime_ns, open(path, "rb").read() if small else None)
    return prints


CHECKPOINT_FILES = [os.path.join(d, n) for d in (DEFAULT_TARGET, DEFAULT_DRAFT) for n in sorted(os.listdir(d))]


def expected_prompts(argv: list[str], prompt_path: str | None) -> list[str] | None:
    """The prompts the run must write, in order (None when the prompt file itself is refused)."""
    inline = [argv[i + 1] for i, a in enumerate(argv) if a == "--prompt"]
    try:
        from_file = read_prompts(prompt_path) if prompt_path else []
    except (OSError, ValueError):
        return None
    prompts = inline + from_file
    if "--num-prompts" in argv:
        count = argv[argv.index("--num-prompts") + 1]
        prompts = prompts[: int(count)] if count.isdigit() and int(count) > 0 else prompts
    return prompts


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """main() in-process; argparse's refusals arrive as SystemExit. Any other exception is a traceback."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def check_invariant(argv, code, err, output, metrics, prompt_path) -> None:
    """Exit 0 with valid JSONL (and metrics JSON) for every prompt, or exit 1/2 with one error line."""
    assert "Traceback" not in err, err
    if code == 0:
        prompts = expected_prompts(argv, prompt_path)
        assert prompts, "exit 0 without prompts"
        if output != "/dev/null":
            data = open(output, encoding="utf-8").read()
            assert data.endswith("\n")
            records = [json.loads(line) for line in data.splitlines()]
            assert [r["index"] for r in records] == list(range(len(prompts)))
            assert [r["prompt"] for r in records] == prompts
        if metrics:
            json.load(open(metrics, encoding="utf-8"))
    else:
        assert code in (1, 2), (code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0], err  # argparse's refusals too (issue 44: no usage block)


@FUZZ
@given(run=case())
def test_cli_fuzz(capsys, run):
    file, inline, more, output_kind = run["file"], run["inline"], run["flags"], run["output_kind"]
    with tempfile.TemporaryDirectory(prefix="specdec-fuzz-") as root:
        argv = [part for text in inline for part in ("--prompt", text)]
        prompt_path = None
        if file is not None or not inline:  # always some prompt source: the default file is large
            suffix, content = file or (".txt", "def f(x):\n")
            prompt_path = os.path.join(root, "prompts" + suffix)
            with open(prompt_path, "w", encoding="utf-8", newline="") as f:
                f.write(content)
            argv += ["--prompts", prompt_path]
        output = {"new": os.path.join(root, "out.jsonl"), "existing": os.path.join(root, "old.jsonl"),
                  "read-only": os.path.join(root, "locked.jsonl"), "/dev/null": "/dev/null", "directory": root,
                  "missing directory": os.path.join(root, "nope", "out.jsonl")}[output_kind]
        if output_kind in ("existing", "read-only"):
            with open(output, "w") as f:
                f.write("old\n")
        if output_kind == "read-only":
            os.chmod(output, 0o444)
        metrics = os.path.join(root, "metrics.json") if run["metrics"] else None
        argv += [*more, "--output", output, *(["--metrics", metrics] if metrics else []), "--no-compare-ar",
                 "--no-progress"]
        note(f"argv: {argv}")
        note(f"prompt file: {file!r}")
        guarded = CHECKPOINT_FILES + ([prompt_path] if prompt_path else []) + \
            ([output] if output_kind == "read-only" else [])
        before = fingerprint(guarded)
        code, _, err = run_cli(argv, capsys)
        note(f"exit {code}; stderr: {err!r}")
        event(f"{'careful' if run['careful'] else 'hostile'}: exit {code}")
        assert code == 0 or not run["careful"], f"a careful run failed: {err}"
        assert code != 0 or output_kind not in ("read-only", "directory", "missing directory"), \
            f"--output {output_kind} was accepted"
        check_invariant(argv, code, err, output, metrics, prompt_path)
        assert fingerprint(guarded) == before, "an input file changed"


# Output paths that collide with an input or with each other: refused by `specdec.output.check_paths`.
@settings(FUZZ, max_examples=6)
@given(file=prompt_file(careful=True), more=flags(careful=True),
       collision=st.sampled_from(["output is prompts", "metrics is prompts", "metrics is output"]))
def test_cli_fuzz_outputs_never_overwrite_inputs(capsys, file, more, collision):
    with tempfile.TemporaryDirectory(prefix="specdec-fuzz-") as root:
        suffix, content = file
        prompt_path = os.path.join(root, "prompts" + suffix)
        with open(prompt_path, "w", encoding="utf-8", newline="") as f:
            f.write(content + "\n" + ('{"prompt": "def f():"}' if suffix == ".jsonl" else "def f():") + "\n")
        output, metrics = {"output is prompts": (prompt_path, None),
                           "metrics is prompts": (os.path.join(root, "o.jsonl"), prompt_path),
                           "metrics is output": (os.path.join(root, "x.json"), os.path.join(root, "x.json"))}[collision]
        argv = ["--prompts", prompt_path, *more, "--output", output, *(["--metrics", metrics] if metrics else []),
                "--no-compare-ar", "--no-progress"]
        note(f"argv: {argv}")
        guarded = CHECKPOINT_FILES + [prompt_path]
        before = fingerprint(guarded)
        code, _, err = run_cli(argv, capsys)
        note(f"exit {code}; stderr: {err!r}")
        assert fingerprint(guarded) == before, "an input file changed"
        if collision == "metrics is output":
            assert code != 0, "--output and --metrics on one file was accepted"
        assert code in (1, 2) and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
