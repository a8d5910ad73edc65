"""The house has one direction (docs/adr/0039-import-floors.md): no import circle among eagle_compat's modules, counting
the imports made inside functions (a circle hidden by a local import is still a circle). Read from the source with
`ast`, so it sees every import, whichever code path runs."""
from __future__ import annotations

import ast
import glob
import os

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PACKAGE = "eagle_compat"


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(os.path.join(SRC, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _edges(module: str, path: str, modules: dict[str, str]) -> set[str]:
    is_package = path.endswith("__init__.py")
    base = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:  # `from pkg import submodule` is an edge to the submodule, not the package
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != module}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _edges(m, p, modules) for m, p in modules.items()}


def test_no_module_imports_itself_back_through_others():
    circles = [group for group in _strongly_connected(import_graph()) if len(group) > 1]
    assert not circles, "import circles: " + "; ".join(" <-> ".join(g) for g in circles)


def test_the_graph_reader_sees_local_and_relative_imports(tmp_path):
    """The check can fail: a circle through a function-local relative import is found."""
    graph = import_graph()
    assert "eagle_compat.capture.worker" in graph["eagle_compat.patches.worker_capture"]  # a function-local import
    assert "eagle_compat.writer" not in graph["eagle_compat.extract.job"]  # `from . import writer` is extract's
    assert "eagle_compat.extract.writer" in graph["eagle_compat.extract.job"]
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [g for g in _strongly_connected(cyclic) if len(g) > 1] == [["a", "b", "c"]]


# The house's floors, lowest first: a module imports only from its own floor or below. `x.*` is every
# module under package x. A new module must be given a floor here.
FLOORS = [
    ("leaves: no import of the package's own, or only of each other",
     {"errors", "_version", "rounding", "cpu", "startup", "leftovers", "settings", "capture", "capture.families",
      "capture.handover", "model_source", "options"}),
    ("facts about the installation, the worker's error channel and handshake",
     {"detect", "host_checks", "environment", "remote_errors", "capture.handshake"}),
    ("vLLM's internals behind adapters, and the capture that runs in vLLM's workers",
     {"engine", "engine.*", "capture.resolver", "capture.worker"}),
    ("patch units and their registry", {"patches", "patches.*"}),
    ("install() and the processes it reaches", {"installer", "workarounds", "plugin", "launcher"}),
    ("the stable generator, what it reads of a model, and the models tests and preflight build",
     {"generator", "model_facts", "tiny_models", "quantized_models", "preflight"}),
    ("jobs over the generator", {"check", "extract", "extract.*", "online", "online_trainer"}),
    # "": the package's __init__ (the public API); testing: the stand-in engine and its `extract` command
    ("entry points", {"cli", "doctor", "pytest_plugin", "", "__main__", "testing"}),
]


def floor_of(module: str, floors=FLOORS) -> int | None:
    name = module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else "" if module == PACKAGE else module
    for k, (_, members) in enumerate(floors):
        if name in members or any(m.endswith(".*") and name.startswith(m[:-1]) for m in members):
            return k
    return None


def upward_imports(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    return [f"{m} (floor {floor_of(m, floors)}) imports {t} (floor {floor_of(t, floors)})"
            for m, targets in sorted(graph.items()) for t in sorted(targets)
            if floor_of(t, floors) > floor_of(m, floors)]


def test_every_module_has_a_floor_and_none_imports_from_a_floor_above():
    graph = import_graph()
    assert not [m for m in graph if floor_of(m) is None], "modules without a floor in FLOORS"
    assert not upward_imports(graph), "imports from a floor above:\n" + "\n".join(upward_imports(graph))


def test_the_floor_check_finds_an_upward_import():
    """The check can fail: an adapter importing the generator is found."""
    graph = {f"{PACKAGE}.engine": {f"{PACKAGE}.generator"}, f"{PACKAGE}.generator": {f"{PACKAGE}.engine"}}
    assert upward_imports(graph) == [f"{PACKAGE}.engine (floor 2) imports {PACKAGE}.generator (floor 5)"]
    assert floor_of(f"{PACKAGE}.patches.two_phase_step") == 3 and floor_of(PACKAGE) == 7


def test_no_private_wrapt_api():
    """wrapt's public hooks only (`register_post_import_hook`): its private tables change between releases."""
    for path in glob.glob(os.path.join(SRC, "**", "*.py"), recursive=True):
        text = open(path).read()
        assert "importer._" not in text and "wrapt._" not in text, path


# -- the environment table: one list in the source, the same in docs/environment.md ---------------------------------

ENV_NAME = r"""["']((?:EAGLE_COMPAT|VLLM|RAY|TORCH)_[A-Z0-9_]*[A-Z0-9])["']"""
NOT_VARIABLES = {"EAGLE_COMPAT_KERNEL_PROBE_LOADING"}  # a line the kernel probe prints, not a variable


def _doc_table(title: str) -> set[str]:
    import re
    doc = open(os.path.join(os.path.dirname(SRC), "docs", "environment.md")).read()
    section = doc.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return {name for row in section.splitlines() if row.startswith("| `")
            for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])}


def test_every_variable_in_the_source_is_in_the_environment_table_and_the_read_table_is_environment_read():
    import re

    from eagle_compat import environment
    in_source = set()
    for root, _, files in os.walk(os.path.join(SRC, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                in_source |= set(re.findall(ENV_NAME, open(os.path.join(root, name)).read()))
    documented = _doc_table("Read") | _doc_table("Set for vLLM")
    assert not in_source - NOT_VARIABLES - documented, "not in docs/environment.md"
    assert _doc_table("Read") == set(environment.READ)
    assert not {n for n in documented if n.startswith("EAGLE_COMPAT_")} - in_source, "documented, never read"


def test_the_read_table_is_generated_from_the_settings_module():
    from eagle_compat import settings
    doc = open(os.path.join(os.path.dirname(SRC), "docs", "environment.md")).read()
    assert settings.markdown_table() in doc, "run python -m eagle_compat.settings"


def _string_constants() -> dict[str, str]:
    """Module-level NAME = "STRING" assignments across the package (the *_ENV constants)."""
    found: dict[str, str] = {}
    for path in glob.glob(os.path.join(SRC, PACKAGE, "**", "*.py"), recursive=True):
        for node in ast.parse(open(path).read()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and
                    isinstance(node.value.value, str)):
                found.update((t.id, node.value.value) for t in node.targets if isinstance(t, ast.Name))
    return found


def _environ_reads(tree: ast.AST, constants: dict[str, str]) -> set[str]:
    """The variables a module reads from os.environ: .get(X), [X] loaded, X in os.environ, os.getenv(X)."""
    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv"):
            reads.add(name_of(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            reads.add(name_of(node.slice))
        elif (isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and
                any(is_environ(c) for c in node.comparators)):
            reads.add(name_of(node.left))
    return reads - {None}


def test_only_the_settings_module_reads_the_users_variables():
    from eagle_compat import settings
    constants, offenders = _string_constants(), []
    for path in glob.glob(os.path.join(SRC, PACKAGE, "**", "*.py"), recursive=True):
        if path.endswith(os.path.join(PACKAGE, "settings.py")):
            continue
        read = _environ_reads(ast.parse(open(path).read()), constants) & set(settings.BY_NAME)
        offenders += [f"{os.path.relpath(path, SRC)}: {name}" for name in sorted(read)]
    assert not offenders, offenders


def test_a_bad_value_is_refused_naming_the_variable_and_what_it_must_be(monkeypatch):
    import pytest

    from eagle_compat import settings
    from eagle_compat.errors import InvalidInput
    monkeypatch.setenv("EAGLE_COMPAT_WRITERS_WAIT_S", "soon")
    with pytest.raises(InvalidInput, match=r"EAGLE_COMPAT_WRITERS_WAIT_S='soon'; must be a number of seconds >= 0"):
        settings.value("EAGLE_COMPAT_WRITERS_WAIT_S")
    monkeypatch.setenv("EAGLE_COMPAT_WRITERS_WAIT_S", "7")
    assert settings.value("EAGLE_COMPAT_WRITERS_WAIT_S") == 7.0
    monkeypatch.setenv("EAGLE_COMPAT_DISABLE", " a, b ,,")
    assert settings.value("EAGLE_COMPAT_DISABLE") == ("a", "b")
    monkeypatch.delenv("EAGLE_COMPAT_TINY_MODELS", raising=False)
    assert settings.value("EAGLE_COMPAT_TINY_MODELS").endswith(os.path.join(".cache", "eagle-compat", "tiny-models"))


# -- functions a reader can hold in mind ----------------------------------------------------------------------------

MAX_FUNCTION_LINES = 80
# declarations, not logic: one add_argument per option of the command line
LONG_BY_NATURE = {("cli.py", "build_parser")}


def long_functions(root: str = os.path.join(SRC, PACKAGE), limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, root)
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) not in LONG_BY_NATURE:
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    return sorted(found)


def test_no_function_is_over_80_lines_but_the_parsers_declarations():
    assert not long_functions(), "split these:\n" + "\n".join(long_functions())


def test_the_length_check_finds_a_long_function(tmp_path):
    (tmp_path / "long.py").write_text("def f():\n" + "    x = 1\n" * 80)
    (tmp_path / "short.py").write_text("def g():\n" + "    x = 1\n" * 79)
    assert long_functions(str(tmp_path)) == ["long.py:1 f: 81 lines"]
