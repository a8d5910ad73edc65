"""Carry a worker exception's type, message and traceback to the driver intact.

vLLM's executor reports a worker failure as `RuntimeError("Worker failed with error '<str(exc)>' …")`: an exception
with an empty str (a bare `assert`, many `KeyError`s) reaches the user as an empty message. Worker-side code
of eagle_compat raises `RemoteFailure`, whose str is a tagged JSON payload; the driver turns it back into a
`WorkerError`.
"""
from __future__ import annotations

import functools
import json
import re
import traceback
from typing import Any, Callable

from ..errors import WorkerError

_OPEN, _CLOSE = "<<eagle_compat:", ":eagle_compat>>"
_PAYLOAD = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.S)


class RemoteFailure(RuntimeError):
    pass


def encode(exc: BaseException, method: str = "") -> RemoteFailure:
    payload = {"type": type(exc).__name__, "message": str(exc), "method": method,
               "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
    return RemoteFailure(f"{payload['type']}: {payload['message']} {_OPEN}{json.dumps(payload)}{_CLOSE}")


def reported(method: str) -> Callable:
    """Decorator for worker-side methods: any exception leaves as a RemoteFailure carrying the details."""
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except RemoteFailure:
                raise
            except BaseException as exc:  # noqa: BLE001 - re-raised with its details
                raise encode(exc, method) from exc
        return wrapper
    return deco


def decode(exc: BaseException) -> WorkerError | None:
    """The WorkerError carried by an exception raised in the driver, or None."""
    seen = exc
    while seen is not None:
        match = _PAYLOAD.search(str(seen))
        if match:
            try:
                payload = json.loads(match.group(1))
            except ValueError:
                break
            return WorkerError(payload.get("type", "Exception"), payload.get("message", ""),
                               payload.get("traceback", ""), payload.get("method", ""))
        seen = seen.__cause__ or seen.__context__
    return None


def translate(fn: Callable, method: str = "") -> Callable:
    """Driver side: re-raise a worker failure as WorkerError (type, message, worker traceback)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WorkerError:
            raise
        except Exception as exc:
            err = decode(exc)
            if err is not None:
                raise err from exc
            text = str(exc)
            if isinstance(exc, RuntimeError) and ("''" in text or not text.strip()):
                raise WorkerError(type(exc).__name__, text or "(empty message)",
                                  "", method or getattr(fn, "__name__", "")) from exc
            raise
    return wrapper
