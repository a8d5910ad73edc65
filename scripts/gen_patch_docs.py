"""Writes docs/patches.md from the patch registry (never edit that page by hand)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from eagle_compat.patches import REGISTRY  # noqa: E402
from eagle_compat.workarounds import WORKAROUNDS  # noqa: E402


def render() -> str:
    lines = ["# Patch units", "",
             "Generated from `src/eagle_compat/patches/` by `scripts/gen_patch_docs.py`; do not edit by hand.",
             "`install()` applies a unit only where its feature probe says the installed vLLM needs it",
             "(`eagle-compat doctor` shows which). *Silent* units fix breaks that give wrong hidden states with no error.",
             "`eagle-compat doctor --release X.Y.Z` lists, from these tables alone, the units and workarounds whose",
             "releases hold X.Y.Z, with their conditions.",
             "",
             "A name several units need (`SchedulerConfig`, `Scheduler`, `CacheConfig`, the `MultiprocExecutor` speculators",
             "builds) gets one wrapper, its adapter (`patches/_adapters.py`); units contribute to it (a keyword rewrite, a",
             "hook on each object a constructor builds; an executor's spawning context, set-up, method hooks, ready check)",
             "and the adapter fixes how they combine, whatever the registry order: keyword rewrites must not disagree,",
             "built-object hooks and executor hooks run in phases, in unit-name order.",
             "The detection column names the feature probe (`eagle_compat.detect.FEATURE_PROBES`, what `doctor` lists)",
             "that alone decides a unit's need; the others decide in their own `needed` (docstring of the unit's module).",
             "", "| unit | what broke | vLLM releases | detected by | where | silent | delete when |",
             "|---|---|---|---|---|---|---|"]
    for u in REGISTRY:
        where = f"`{u.target}`" if u.target else "process environment"
        releases = (f"`{u.affects}`" if u.affects else "all") + (f"; where {u.condition}" if u.condition else "")
        detected = f"probe `{u.feature}`" if u.feature else "the unit's `needed`"
        lines.append(f"| `{u.name}` | {u.broke} | {releases} | {detected} | {where} ({', '.join(u.sides)}) | "
                     f"{'yes' if u.silent else ''} | {u.delete_when} |")
    lines += ["", "## Workarounds in eagle_compat's own engine code and capture", "",
              "Not patch units (they change no speculators name): they act in the generator, the engine adapters or",
              "the worker-side capture, which the shim also runs. `eagle-compat doctor` shows which apply here",
              "(`src/eagle_compat/workarounds.py`).", "",
              "| workaround | what broke | vLLM releases | where | silent | delete when |", "|---|---|---|---|---|---|"]
    for w in WORKAROUNDS:
        releases = (f"`{w.affects}`" if w.affects else "all") + (f"; where {w.condition}" if w.condition else "")
        lines.append(f"| `{w.name}` | {w.broke} | {releases} | {w.where} | {'yes' if w.silent else ''} | "
                     f"{w.delete_when} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "patches.md")
    with open(path, "w") as f:
        f.write(render())
    print(f"wrote {os.path.normpath(path)}")
