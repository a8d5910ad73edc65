"""Carry a worker exception's type, message and traceback to the driver intact.

vLLM's executor reports a worker failure as `RuntimeError("Worker failed with error '<str(exc)>' …")`: an exception
with an empty str (a bare `assert`, many `KeyError`s) reaches the user as an empty message. Worker-side code
of eagle_compat raises `RemoteFailure`, whose str is a tagged JSON payload; the driver turns it back into a
`WorkerError`.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import os
import re
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

from .errors import WorkerError

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


def translate(fn: Callable, method: str = "", log: "WorkerErrorLog | None" = None, executor: Any = None) -> Callable:
    """Driver side: re-raise a worker failure as WorkerError (type, message, worker traceback). With `log`, a
    failure inside vLLM's own worker code (no payload of ours) is recovered from what the worker logged. A worker of
    the call's executor (`executor`, else the one `fn` is bound to or gets first) that has died is named instead."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WorkerError:
            raise
        except Exception as exc:
            died = dead_workers(executor or _executor_of(fn, args))
            if died:  # the root cause; vLLM says only "cancelled" or that the engine shut down
                raise WorkerError("WorkerDied", "; ".join(died) + ". Nothing of the interrupted batch was "
                                  "returned; start a new engine (extract: rerun with --resume)", "",
                                  method or getattr(fn, "__name__", "")) from exc
            err = decode(exc) or (log.latest(method) if log is not None and reply_from_worker(exc) else None)
            if err is not None:
                raise err from exc
            text = str(exc)
            if isinstance(exc, RuntimeError) and ("''" in text or not text.strip()):
                raise WorkerError(type(exc).__name__, text or "(empty message)",
                                  "", method or getattr(fn, "__name__", "")) from exc
            raise
    return wrapper


def _executor_of(fn: Callable, args: tuple) -> Any:
    for candidate in (getattr(fn, "__self__", None), args[0] if args else None):
        if getattr(candidate, "workers", None) is not None:
            return candidate
    return None


def dead_workers(executor: Any) -> list[str]:
    """The executor's worker processes that have exited, described (rank, pid, signal or exit status). Only the
    executor of the failing call: an earlier engine's workers have exited normally."""
    import signal

    out = []
    if executor is not None:
        for rank, handle in enumerate(getattr(executor, "workers", None) or []):
            proc = getattr(handle, "proc", None)
            code = getattr(proc, "exitcode", None)
            if code is None:
                continue
            how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.Signals._value2member_map_
                   else f"exited with status {code}")
            out.append(f"vLLM worker {rank} (pid {proc.pid}) {how}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Failures inside vLLM's own worker code: at start-up vLLM only says "WorkerProc initialization failed due to an
# exception in a background process. See stack trace for root cause.", later "Worker failed with error '<str>'".
# The worker logs the exception; workers spawned under a WorkerErrorLog (told through the plugin, which vLLM loads
# before the model) also write it to a file the driver reads.

START_ERRORS_ENV = "EAGLE_COMPAT_WORKER_ERRORS_DIR"


class _FileHandler(logging.Handler):
    def __init__(self, directory: str):
        super().__init__(level=logging.ERROR)
        self.path = os.path.join(directory, f"worker-{os.getpid()}.jsonl")

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            _append(self.path, record.exc_info[1])


def _append(path: str, exc: BaseException) -> None:
    payload = {"type": type(exc).__name__, "message": str(exc), "method": "worker start-up", "time": time.time(),
               "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(payload) + "\n")
    except OSError:
        pass


def record_start_error(exc: BaseException) -> None:
    """In a process the driver is starting as a worker: leave `exc` where the driver reads start-up errors."""
    directory = os.environ.get(START_ERRORS_ENV)
    if directory and os.path.isdir(directory):
        _append(os.path.join(directory, f"worker-{os.getpid()}.jsonl"), exc)


def record_worker_errors() -> None:
    """Worker side (plugin): if the driver asked for it, copy logged exceptions to its directory."""
    directory = os.environ.get(START_ERRORS_ENV)
    if directory and os.path.isdir(directory):
        logger = logging.getLogger("vllm")
        if not any(isinstance(h, _FileHandler) for h in logger.handlers):
            logger.addHandler(_FileHandler(directory))


def reply_from_worker(exc: BaseException) -> bool:
    """Whether a driver-side exception is a worker's own failure reply (the reply stream stays in step)."""
    return isinstance(exc, RuntimeError) and "Worker failed with error" in str(exc)


class WorkerErrorLog:
    """A directory where workers spawned under `spawning()` copy every exception they log, for the workers'
    whole life (vLLM logs the traceback in the worker and sends the driver only str(exc))."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="eagle-compat-workers-")

    def records(self) -> list[dict]:
        """Every worker's records, in the order they were logged (each worker has its own file)."""
        records = []
        for path in sorted(glob.glob(os.path.join(self.directory, "*.jsonl"))):
            with open(path) as f:
                records += [json.loads(line) for line in f if line.strip()]
        return sorted(records, key=lambda r: r.get("time", 0.0))

    def latest(self, method: str = "") -> WorkerError | None:
        records = self.records()
        if not records:
            return None
        last = records[-1]
        return WorkerError(last["type"], last["message"], last["traceback"], method or last["method"])

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Around building an executor: its workers inherit the directory; an opaque start-up failure becomes a
        WorkerError carrying the first exception a worker logged."""
        previous = os.environ.get(START_ERRORS_ENV)
        os.environ[START_ERRORS_ENV] = self.directory
        try:
            yield
        except Exception as exc:
            records = self.records()
            if records:
                first = records[0]
                raise WorkerError(first["type"], first["message"], first["traceback"], first["method"]) from exc
            raise
        finally:
            if previous is None:
                os.environ.pop(START_ERRORS_ENV, None)
            else:
                os.environ[START_ERRORS_ENV] = previous

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


START_ATTEMPTS = 3  # a lost port race needs another engine starting in the same instant: twice in a row is rare


def lost_port_race(exc: BaseException) -> bool:
    """Whether an engine start failed because the torch.distributed port vLLM chose was taken before its worker
    bound it: `get_open_port()` binds port 0, reads the number and releases it, and the worker binds it only after
    it is spawned, so several engines starting on one host can be handed the same port (vllm#39015, vllm#43206)."""
    seen: BaseException | None = exc
    walked: set[int] = set()
    while seen is not None and id(seen) not in walked:
        walked.add(id(seen))
        text = seen.remote_message if isinstance(seen, WorkerError) else str(seen)
        if "EADDRINUSE" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def retrying_lost_port_race(start: Callable[[], Any], attempts: int | None = None) -> Any:
    """`start()` (one whole engine start: spawning the workers up to their being ready), once more after each start
    that lost the port race, at most `attempts` times in all. Nothing has reached the engine by then, and vLLM
    has ended a failed start's workers; any other failure is raised at once."""
    attempts = START_ATTEMPTS if attempts is None else attempts
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as exc:
            if attempt == attempts or not lost_port_race(exc):
                raise
            logging.getLogger("eagle_compat").warning(
                "engine start-up %d of %d lost the race for its torch.distributed port to another process on this "
                "host (EADDRINUSE); starting again on a new port", attempt, attempts)
    raise AssertionError("unreachable")
