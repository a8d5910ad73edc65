"""The start-up hook: reaches the processes a run spawns before they import anything of the user's, and no others.

Why: vLLM starts its workers with `spawn`, and a spawned child first re-imports its parent's `__main__` script
(multiprocessing's `_fixup_main_from_path`). A script shaped like speculators' imports speculators at its top, and
speculators 0.3.0 cannot be imported on transformers 5 unpatched, so the child dies before vLLM loads our worker
plugin.

How, leaving nothing behind (as `opentelemetry-instrument` does): `install()` makes a directory of its own holding a
`sitecustomize.py` and puts it first on `PYTHONPATH` for the processes it starts; `uninstall()` (or the process's
exit) removes both. Python imports `sitecustomize` at start-up, before `__main__`. Ours first runs any other
`sitecustomize` it shadows, then:
* in a multiprocessing child of the run (`--multiprocessing-fork` on its command line: vLLM's workers, the script's
  re-import) it applies only the import-time patch units (`PatchUnit.at_startup`); `install()` and the worker plugin
  do the rest, as before;
* in any other process started from the run (pip, an evaluation script, a vLLM server of the user's) it removes the
  run's variable and directory from that process's environment, so neither it nor its children are touched.
Nothing is written into site-packages.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

INSTALLED_ENV = "EAGLE_COMPAT_INSTALLED"  # "run:<pid of the driver>": a run's processes; unset elsewhere
SET_ENV_LIST = "EAGLE_COMPAT_SET_ENV"  # the variables eagle_compat set for vLLM's workers (process_env.apply_env)
SPAWNED_CHILD_FLAG = "--multiprocessing-fork"  # multiprocessing's spawn puts it on the child's command line

SITECUSTOMIZE = '''"""eagle_compat's start-up hook for one run (eagle_compat/startup.py); removed when the run ends."""
import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))


def _chain():
    """Run the sitecustomize this one shadows, if any."""
    import importlib.machinery
    import importlib.util
    path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _scope():
    if not _os.environ.get({env!r}):
        return
    if {flag!r} in _sys.argv:
        try:
            from eagle_compat.installer import activate_at_startup
        except ImportError:  # eagle_compat is not importable by this interpreter: nothing to do
            return
        activate_at_startup()
        return
    _os.environ.pop({env!r}, None)  # not a process of the run: it and its children stay untouched
    for name in _os.environ.pop({set_env!r}, "").split(","):  # nor do they get what we set for the run's workers
        if name:
            _os.environ.pop(name, None)
    kept = [p for p in _os.environ.get("PYTHONPATH", "").split(_os.pathsep) if not p or _os.path.abspath(p) != _HERE]
    if any(kept):
        _os.environ["PYTHONPATH"] = _os.pathsep.join(kept)
    else:
        _os.environ.pop("PYTHONPATH", None)


try:
    _chain()
finally:
    _scope()
'''.format(env=INSTALLED_ENV, flag=SPAWNED_CHILD_FLAG, set_env=SET_ENV_LIST)

_run_dir: str | None = None
_saved_pythonpath: tuple[bool, str] | None = None  # (was set, value) before the run's directory went first
_run_value: str | None = None  # the INSTALLED_ENV value begin_run() set (a process of another run keeps that run's)


def run_active() -> bool:
    """Whether this process belongs to a run (install() in it or in its multiprocessing parent)."""
    return bool(os.environ.get(INSTALLED_ENV))


def write_hook(directory: str) -> str:
    """Write the start-up hook (a sitecustomize.py) into `directory`; returns the directory."""
    with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    return directory


def begin_run() -> str:
    """Make the run's start-up directory and put it first on PYTHONPATH, with the run's variable (idempotent).
    Returns the directory."""
    global _run_dir, _saved_pythonpath, _run_value
    if _run_dir is None or not os.path.isdir(_run_dir):
        _run_dir = write_hook(tempfile.mkdtemp(prefix="eagle-compat-startup-"))
        atexit.register(end_run)
    if _saved_pythonpath is None:
        _saved_pythonpath = ("PYTHONPATH" in os.environ, os.environ.get("PYTHONPATH", ""))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_run_dir, _saved_pythonpath[1]) if p)
    if INSTALLED_ENV not in os.environ:
        _run_value = os.environ[INSTALLED_ENV] = f"run:{os.getpid()}"
    return _run_dir


def end_run() -> None:
    """Undo begin_run(): the variable, PYTHONPATH as it was, the directory."""
    global _run_dir, _saved_pythonpath, _run_value
    if _run_value is not None and os.environ.get(INSTALLED_ENV) == _run_value:
        os.environ.pop(INSTALLED_ENV, None)
    _run_value = None
    if _saved_pythonpath is not None:
        was_set, value = _saved_pythonpath
        # only the run's directory comes out: empty entries (the current directory) are the user's
        current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p != _run_dir]
        if was_set or any(current):
            os.environ["PYTHONPATH"] = os.pathsep.join(current)
        else:
            os.environ.pop("PYTHONPATH", None)
        _saved_pythonpath = None
    if _run_dir is not None:
        shutil.rmtree(_run_dir, ignore_errors=True)
        _run_dir = None


def run_dir() -> str | None:
    return _run_dir


def describe() -> dict:
    return {"run_dir": _run_dir, "active_in_this_process": run_active(),
            "spawned_child": SPAWNED_CHILD_FLAG in sys.argv}
