"""The start-up hook: reaches every Python process of a run before it imports anything of the user's.

Why: vLLM starts its workers with `spawn`, and a spawned child first re-imports its parent's `__main__` script
(multiprocessing's `_fixup_main_from_path`). A script shaped like speculators' imports speculators at its top, and
speculators 0.3.0 cannot be imported on transformers 5 unpatched, so the child dies before vLLM loads our worker
plugin. A `.pth` file in site-packages runs in every interpreter at start-up (coverage.py measures subprocesses
the same way); ours does nothing unless `EAGLE_COMPAT_INSTALLED=1`, which `install()` sets for the processes it
spawns and `uninstall()` clears. Then it applies only the import-time patch units (`PatchUnit.at_startup`);
`install()` and the worker plugin do the rest, as before.

The file is written once, by `eagle-compat run` / `python -m eagle_compat` (and `eagle-compat doctor --fix`), into
the site-packages of the running interpreter; it stays there, inert without the variable.
"""
from __future__ import annotations

import os
import sysconfig

from .installer import INSTALLED_ENV

PTH_NAME = "eagle_compat_startup.pth"
# One line: site executes .pth lines that start with `import`. It must not fail where eagle_compat was removed.
PTH_LINE = (f"import os, importlib.util; os.environ.get({INSTALLED_ENV!r}) == '1' and "
            "importlib.util.find_spec('eagle_compat') is not None and "
            "__import__('eagle_compat.startup').startup.process_startup()\n")


def process_startup() -> None:
    """Called by the .pth line in every new interpreter where the run's variable is set."""
    if os.environ.get(INSTALLED_ENV) != "1":
        return
    from .installer import activate_at_startup
    activate_at_startup()


def pth_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def pth_installed() -> bool:
    try:
        with open(pth_path()) as f:
            return f.read() == PTH_LINE
    except OSError:
        return False


def ensure_pth() -> str:
    """Write the start-up hook into this interpreter's site-packages (atomically; once). Returns its path."""
    path = pth_path()
    if pth_installed():
        return path
    from .errors import IncompatibleEnvironment
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(PTH_LINE)
        os.replace(tmp, path)
    except OSError as exc:
        raise IncompatibleEnvironment(
            f"cannot write the start-up hook {path} ({exc.strerror}): processes spawned by the run would import "
            f"speculators unpatched. Make {os.path.dirname(path)} writable once, or create {path} holding this "
            f"line:\n{PTH_LINE}") from exc
    return path
