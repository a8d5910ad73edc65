"""Before any capture, the driver asks every worker which capture it runs.

Why: the worker side of the speculators shim exists only where vLLM loaded eagle_compat's plugin in the worker. A
`VLLM_PLUGINS` allow-list without `eagle_compat`, or a worker started some other way, runs speculators' own
capture unpatched, and whether that fails loudly is luck of the release (0.16.0: an AttributeError deep in
speculators; 0.32.0: a pydantic error at worker start). So every worker must answer the handshake with our
version and capture contract, or the run is refused with the cause and the fix before a single step runs.
"""
from __future__ import annotations

import os
from typing import Any

from .. import settings
from .._version import __version__
from ..errors import IncompatibleEnvironment

# Bump when the driver/worker hand-over of captured states changes shape.
CAPTURE_CONTRACT = "eagle_compat.capture/1"
HANDSHAKE_METHOD = "eagle_compat_handshake"


def worker_report(kind: str) -> dict:
    """What a worker answers: runs inside the worker process."""
    return {"pid": os.getpid(), "version": __version__, "contract": CAPTURE_CONTRACT, "capture": kind}


def plugin_fix() -> str:
    allowed = settings.raw("VLLM_PLUGINS")
    where = (f"VLLM_PLUGINS={allowed!r} does not list it: add it (VLLM_PLUGINS={allowed + ',' if allowed else ''}"
             "eagle_compat) or unset VLLM_PLUGINS" if allowed is not None and "eagle_compat" not in allowed.split(",")
             else "install eagle_compat as a package in the workers' environment (pip install eagle-compat, or "
                  "pip install -e . in a checkout), so vLLM finds its `vllm.general_plugins` entry point, and start "
                  "the workers through vLLM")
    return f"vLLM must load the `eagle_compat` plugin in every worker: {where}."


def require_plugin_allowed() -> None:
    """Refuse, before any engine starts, an allow-list that would keep our plugin out of the workers."""
    allowed = settings.raw("VLLM_PLUGINS")
    if allowed is not None and "eagle_compat" not in allowed.split(","):
        raise IncompatibleEnvironment(
            "vLLM's workers would run speculators' capture unpatched (wrong or failing): " + plugin_fix())


def check_reports(replies: Any, expected_capture: str) -> list[dict]:
    """Every worker must answer with our version and contract, running `expected_capture`."""
    replies = replies if isinstance(replies, list) else [replies]
    bad = []
    for rank, reply in enumerate(replies):
        if (not isinstance(reply, dict) or reply.get("contract") != CAPTURE_CONTRACT
                or reply.get("version") != __version__ or reply.get("capture") != expected_capture):
            bad.append(f"worker {rank}: {reply!r}")
    if bad:
        raise IncompatibleEnvironment(
            f"a vLLM worker does not run eagle_compat {__version__}'s capture ({CAPTURE_CONTRACT}, "
            f"{expected_capture}): " + "; ".join(bad) + ". " + plugin_fix())
    return replies


def require_patched_workers(collective_rpc: Any, expected_capture: str) -> list[dict]:
    """Ask every worker (through the executor's `collective_rpc`); a worker without the method is unpatched."""
    try:
        replies = collective_rpc(HANDSHAKE_METHOD)
    except Exception as exc:  # noqa: BLE001 - an unpatched worker has no such method: that is the finding
        raise IncompatibleEnvironment(
            f"a vLLM worker did not answer eagle_compat's handshake ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): it runs speculators' capture unpatched. "
            + plugin_fix()) from exc
    return check_reports(replies, expected_capture)
