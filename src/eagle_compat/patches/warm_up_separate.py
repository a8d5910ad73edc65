"""From vLLM 0.27 `initialize_from_config` no longer warms the model up; EngineCore calls
`compile_or_warm_up_model()` right after it. Without it the warm-up is silently skipped (first real step pays
for it, and on GPU kernels are not pre-tuned). At speculators' call site we call it after initialization.
"""
from __future__ import annotations

from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, PatchUnit


def _needed() -> bool:
    from .. import detect
    return detect.feature("warm_up_separate")


def _apply(patcher, module) -> None:
    from .. import engine

    def initialize_from_config(executor, call, args, kwargs):
        out = call(*args, **kwargs)
        engine.warm_up_if_separate(executor)
        return out

    patcher.hook_executor(module, "MultiprocExecutor",
                          ExecutorHooks(methods={"initialize_from_config": initialize_from_config}))


UNIT = PatchUnit(
    name="warm_up_separate",
    broke="initialize_from_config no longer warms the model up (skipped silently)",
    affects=">=0.27",
    delete_when="speculators calls compile_or_warm_up_model",
    target=GENERATOR_MODULE,
    sides=("driver",),
    silent=True,
    needed=_needed,
    apply=_apply,
)
