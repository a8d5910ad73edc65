"""Async scheduling became automatic in vLLM 0.14 (on for GPU with the mp executor).

Workers would run in async-output mode against speculators' hand-driven synchronous scheduler. We pass
`async_scheduling=False` at speculators' SchedulerConfig call site.
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, PatchUnit


def _needed() -> bool:
    from .. import detect
    return detect.feature("async_scheduling_not_off_by_default")


def _apply(patcher, module) -> None:
    from .. import engine

    patcher.rewrite_kwargs(module, "SchedulerConfig", engine.without_async_scheduling)


UNIT = PatchUnit(
    name="async_scheduling_off",
    broke="async scheduling is automatic (GPU: on) and would pair async workers with a synchronous scheduler",
    affects=">=0.14",
    delete_when="speculators' call site passes async_scheduling=False",
    target=GENERATOR_MODULE,
    sides=("driver",),
    needed=_needed,
    apply=_apply,
)
