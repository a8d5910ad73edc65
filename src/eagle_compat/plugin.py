"""The `vllm.general_plugins` entry point. vLLM calls it in the driver and in every worker process it spawns,
before the worker extension class is resolved. If install() ran in the parent (it sets EAGLE_COMPAT_INSTALLED,
which the spawned worker inherits), the worker-side patches are applied here too. Otherwise it does nothing, so
vLLM's own engines are never changed by merely having eagle_compat installed.
"""
from __future__ import annotations

import os


def register() -> None:
    from .remote_errors import record_worker_errors
    from .installer import INSTALLED_ENV, install, is_installed

    record_worker_errors()  # only if a driver of ours asked (environment variable)

    if os.environ.get(INSTALLED_ENV) == "1" and not is_installed():
        install(side="worker")
