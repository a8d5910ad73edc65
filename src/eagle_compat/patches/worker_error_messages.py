"""A worker exception reaches speculators' caller as `RuntimeError("Worker failed with error ''")` when its str is
empty (a bare assert, many KeyErrors), with the real traceback only in the worker's log.

Worker side: speculators' extension methods raise a failure that carries type, message and traceback. Driver side:
the executor built at speculators' call site turns it back into `eagle_compat.WorkerError`; a failure inside vLLM's
own worker code (profiling, KV initialisation, the forward) is recovered from what the workers logged, kept in a
`WorkerErrorLog` for the executor's life.
"""
from __future__ import annotations

import contextlib
import weakref

from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, WORKER_MODULE, PatchUnit

_RPC_METHODS = ("collective_rpc", "execute_model", "sample_tokens", "initialize_from_config")


def _apply(patcher, module) -> None:
    from .. import remote_errors

    if module.__name__ == WORKER_MODULE:
        ext = module.HiddenStatesWorkerExtension
        for name in ("_reset_capture", "_get_captured_states"):
            patcher.set(ext, name, remote_errors.reported(name)(vars(ext)[name]))
        return

    logs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # executor -> its workers' error log

    @contextlib.contextmanager
    def spawning_with_log(args, kwargs):
        log = remote_errors.WorkerErrorLog()
        try:
            with log.spawning():
                yield log
        except BaseException:
            log.close()
            raise

    def built(executor, log):
        logs[executor] = log
        weakref.finalize(executor, log.close)

    def translated(method):
        def hook(executor, call, args, kwargs):
            return remote_errors.translate(call, method, log=logs.get(executor), executor=executor)(*args, **kwargs)
        return hook

    methods = [m for m in _RPC_METHODS if hasattr(module.MultiprocExecutor, m)]  # sample_tokens: 0.11.1+
    patcher.hook_executor(module, "MultiprocExecutor", ExecutorHooks(
        spawning=spawning_with_log, built=built, methods={method: translated(method) for method in methods}))


def _make(target: str, sides: tuple[str, ...]) -> PatchUnit:
    return PatchUnit(
        name=f"worker_error_messages[{'generator' if target == GENERATOR_MODULE else 'worker'}]",
        broke="worker failures reach the caller as an empty message",
        affects="",
        delete_when="vLLM forwards worker exception types and tracebacks",
        target=target,
        sides=sides,
        apply=_apply,
    )


UNITS = (_make(WORKER_MODULE, ("driver", "worker")), _make(GENERATOR_MODULE, ("driver",)))
