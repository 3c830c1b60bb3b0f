"""The docs say what the code does: every command-line flag they name exists in some CLI's --help, every
`LLM(...)` argument of docs/api.md's table exists (and every argument is in the table), and every
`EngineOptions` field they name exists. Cheap checks, run in the fast lane."""
import argparse
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from specdec import LLM
from specdec.options import EngineOptions

ROOT = Path(__file__).resolve().parents[1]
# the user-facing docs whose flags must exist (benchmarks.md names each bench script's own flags with its command)
DOCS = ["README.md", "docs/api.md", "docs/design.md", "docs/distributed.md", "docs/serve.md", "docs/exspec.md",
        "docs/default_pair.md", "docs/kernels.md", "docs/feature_draft.md"]
# parser builders of our command lines: module, function
CLIS = [("specdec.run", "build_parser"), ("specdec.serve.__main__", "build_parser"), ("specdec.convert", "build_parser"),
        ("bench.default_pair.__main__", "build_parser"), ("bench.default_pair.feature_draft", "build_parser")]
# flags of other programs the docs show in their commands
OTHER_TOOLS = {
    "--head", "--address",  # ray start (docs/distributed.md)
    "--continuous-batching",  # transformers serve, the peer of bench/serve.py
    "--benchmark-only", "--benchmark-json",  # pytest-benchmark (docs/kernels.md)
    "--no-deps",  # pip download
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]+(?:-[a-z0-9]+)*(?![\w-])")


def our_flags() -> set[str]:
    flags = set()
    for module, name in CLIS:
        try:
            build = getattr(importlib.import_module(module), name)
        except ImportError as err:
            if "fastapi" in str(err) or "uvicorn" in str(err):
                continue  # the serve extra is not installed here
            raise
        parser = build()
        for action in parser._actions:
            for option in action.option_strings:
                flags.add(option)
                if isinstance(action, argparse.BooleanOptionalAction) and option.startswith("--"):
                    flags.add("--no-" + option[2:])
    return flags


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
    table = text[text.index("`LLM(...)` arguments:"):]
    table = table[: table.index("\n\n", table.index("| argument"))]
    names = set()
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        names |= set(re.findall(r"`(\w+)`", first))
    return names


def test_llm_arguments_table_matches_the_signature():
    documented = api_table_arguments()
    parameters = set(inspect.signature(LLM).parameters)
    assert documented <= parameters, f"documented but not LLM arguments: {documented - parameters}"
    undocumented = parameters - documented - {"tokenizer"}  # tokenizer: a model object's, documented below the table
    assert not undocumented, f"LLM arguments missing from docs/api.md's table: {undocumented}"


@pytest.mark.parametrize("doc", DOCS)
def test_engine_options_named_in_docs_exist(doc):
    path = ROOT / doc
    if not path.exists():
        pytest.skip(f"{doc} does not exist")
    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    named = set(re.findall(r"EngineOptions\.(\w+)", path.read_text(encoding="utf-8")))
    assert named <= fields, f"{doc} names EngineOptions fields that do not exist: {named - fields}"
