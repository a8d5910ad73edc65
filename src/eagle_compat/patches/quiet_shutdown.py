"""Every run of speculators' generator ends with noise: its `__del__` calls `executor.shutdown()` a second time
(after the caller's own call), which newer vLLM executors answer with an exception, logged as "Exception during
executor shutdown"; at interpreter exit its module's `log` is already None, so `__del__` itself raises
`AttributeError: 'NoneType' object has no attribute 'warning'`.

At speculators' call site, the executor it builds gets a `shutdown()` that runs once (later calls return), and
that does not raise while the interpreter is finalizing (the workers are being torn down with it anyway).
"""
from __future__ import annotations

import sys

from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    done: set[int] = set()  # ids of executors shut down (an attribute on vLLM's object would leak our state)

    def shutdown_once(executor, call, args, kwargs):
        if id(executor) in done:
            return None
        done.add(id(executor))
        try:
            return call(*args, **kwargs)
        except Exception:
            if sys.is_finalizing():
                return None
            raise

    patcher.hook_executor(module, "MultiprocExecutor", ExecutorHooks(methods={"shutdown": shutdown_once}))


UNIT = PatchUnit(
    name="quiet_shutdown",
    broke="runs end with 'Exception during executor shutdown' and an AttributeError from speculators' __del__",
    affects="",
    condition="a second MultiprocExecutor.shutdown() raises (seen on 0.32.0)",
    delete_when="speculators' __del__ no longer shuts the executor down a second time",
    target=GENERATOR_MODULE,
    sides=("driver",),
    apply=_apply,
)
