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
     {"errors", "_version", "rounding", "cpu", "startup", "leftovers", "capture", "capture.families",
      "capture.handover", "model_source"}),
    ("facts about the installation, the worker's error channel and handshake",
     {"detect", "environment", "remote_errors", "capture.handshake"}),
    ("vLLM's internals behind adapters, and the capture that runs in vLLM's workers",
     {"engine", "capture.resolver", "capture.worker"}),
    ("patch units and their registry", {"patches", "patches.*"}),
    ("install() and the processes it reaches", {"installer", "workarounds", "plugin", "launcher"}),
    ("the stable generator, and the models tests and preflight build", {"generator", "tiny_models",
                                                                         "quantized_models", "preflight"}),
    ("jobs over the generator", {"check", "extract", "extract.*"}),
    ("entry points", {"cli", "pytest_plugin", "", "__main__"}),  # "": the package's __init__ (the public API)
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
