"""eagle_compat: run speculators 0.3.0's EAGLE-3 hidden-state extraction on newer vLLM releases, correctly.

    import eagle_compat
    eagle_compat.install()      # patch exactly what breaks, in the driver and in vLLM's workers
    ...                         # unmodified speculators 0.3.0 code
    eagle_compat.uninstall()    # restore everything

or use `eagle_compat.VllmHiddenStatesGenerator`, the stable generator with speculators 0.3.0's API.
"""
from __future__ import annotations

from .errors import (CaptureInvariantError, EagleCompatError, IncompatibleEnvironment, InvalidInput, UnsupportedModel,  # noqa: F401
                     WorkerError)
from ._version import __version__  # noqa: F401
from .installer import install, is_installed, status, uninstall  # noqa: F401


def __getattr__(name: str):
    # the generator imports vLLM lazily; `import eagle_compat` stays cheap
    if name == "VllmHiddenStatesGenerator":
        from .generator import VllmHiddenStatesGenerator
        return VllmHiddenStatesGenerator
    raise AttributeError(name)


__all__ = ["install", "uninstall", "is_installed", "status", "VllmHiddenStatesGenerator", "CaptureInvariantError", "EagleCompatError",
           "IncompatibleEnvironment", "InvalidInput", "UnsupportedModel", "WorkerError", "__version__"]
