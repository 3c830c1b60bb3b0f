"""No import cycles among the project's own modules.

The static import graph of models/ (installed as specdec.models), kernels/ (specdec.kernels), specdec/ (with
its subpackages) and bench/ is built with `ast`: every `import` and `from ... import` statement, module level
or inside a function, relative imports resolved. `from pkg import name` is an edge to the submodule
`pkg.name` when there is one, else to `pkg`; a name that specdec/__init__.py loads lazily (its `_EXPORTS`)
is an edge to the module that defines it. Any cycle fails the test and is printed.
"""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> the package it installs as (setup.py's package_dir)
ROOTS = {"models": "specdec.models", "kernels": "specdec.kernels", "specdec": "specdec", "bench": "bench"}


def project_modules() -> dict[str, str]:
    """{dotted module name: file} for every .py file under ROOTS (a package's __init__.py is the package)."""
    modules = {}
    for folder, package in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, folder)):
            dirnames[:] = sorted(d for d in dirnames if os.path.exists(os.path.join(dirpath, d, "__init__.py")))
            rel = os.path.relpath(dirpath, os.path.join(REPO, folder))
            prefix = package if rel == "." else ".".join([package, *rel.split(os.sep)])
            for name in sorted(filenames):
                if name.endswith(".py"):
                    dotted = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    modules[dotted] = os.path.join(dirpath, name)
    return modules


def lazy_exports(modules: dict[str, str]) -> dict[str, dict[str, str]]:
    """{package: {name: module}} for packages whose __init__ loads names on first use (`_EXPORTS`, PEP 562)."""
    out = {}
    for package, file in modules.items():
        if not file.endswith("__init__.py"):
            continue
        for node in ast.parse(open(file, encoding="utf-8").read()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                out[package] = {name: f"{package}.{mod}" for name, mod in ast.literal_eval(node.value).items()}
    return out


def imports_of(module: str, file: str, modules: dict[str, str], lazy: dict) -> set[str]:
    """The project modules that `module` imports anywhere in its file."""
    is_package = file.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(file, encoding="utf-8").read(), filename=file)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif alias.name in lazy.get(base, {}):
                    found.add(lazy[base][alias.name])
                else:
                    found.add(base)
    # `import a.b.c` names a.b.c; keep the deepest project module each name resolves to
    edges = set()
    for name in found:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            edges.add(name)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    lazy = lazy_exports(modules)
    return {m: imports_of(m, f, modules, lazy) for m, f in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, iterative)."""
    state = {}  # module -> "open" (on the current path) or "done"
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = "open"
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = "done"
                stack.pop()
            elif state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = "open"
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_graph_sees_the_project():
    graph = import_graph()
    for module in ("specdec.models.loader", "specdec.models.gguf", "specdec.kernels.rejection", "specdec.engine",
                   "specdec.serve.app", "specdec.schedulers.exspec", "specdec.proposers", "bench.common",
                   "specdec.train.loop"):
        assert module in graph
    # relative, absolute, aliased (models/ -> specdec.models) and function-local imports are all edges
    assert "specdec.models.transformer" in graph["specdec.models.loader"]
    assert "specdec.kernels.bi_matmul" in graph["specdec.models.numerics"]
    assert "specdec.models.gguf" in graph["specdec.models.loader"]
    assert "specdec.timing" in graph["bench.pairs"]


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_source_folder_kernels_does_not_shadow_the_installed_package():
    """From the repository root (`python -m ...` puts it first on sys.path) `import kernels` finds our
    kernels/ folder; transformers >= 5 imports the PyPI package `kernels`, so the folder hands over to it when
    it is installed, and otherwise stays the folder (as older transformers expect of a probe)."""
    import subprocess
    import sys

    def run(code):
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)

    others = [p for p in sys.path if p and os.path.abspath(p) != REPO]
    if any(os.path.exists(os.path.join(p, "kernels", "__init__.py")) for p in others):  # the PyPI package
        got = run("import kernels, specdec.kernels as ours, os; "
                  "print(os.path.dirname(kernels.__file__), os.path.dirname(ours.__file__))")
        assert got.returncode == 0, got.stderr
        theirs, ours = got.stdout.split()
        assert ours == os.path.join(REPO, "kernels") and theirs != ours
    hidden = run("import os, sys; sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') == os.getcwd() "
                 "or not os.path.exists(os.path.join(p, 'kernels', '__init__.py'))]; import kernels; "
                 "print(os.path.dirname(kernels.__file__))")
    assert hidden.returncode == 0 and hidden.stdout.strip() == os.path.join(REPO, "kernels"), hidden.stderr
