"""The house has one direction (issue 23): no import circle among eagle_compat's modules, counting the imports made
inside functions (a circle hidden by a local import is still a circle). Read from the source with `ast`, so it sees
every import, whichever code path runs."""
from __future__ import annotations

import ast
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
