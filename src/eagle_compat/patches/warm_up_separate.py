"""From vLLM 0.27 `initialize_from_config` no longer warms the model up; EngineCore calls
`compile_or_warm_up_model()` right after it. Without it the warm-up is silently skipped (first real step pays
for it, and on GPU kernels are not pre-tuned). At speculators' call site we call it after initialization.
"""
from __future__ import annotations

from ._base import executor_method_unit


def initialize_from_config(executor, call, args, kwargs):
    from .. import engine

    out = call(*args, **kwargs)
    engine.rpc.warm_up_if_separate(executor)
    return out


UNIT = executor_method_unit(
    method="initialize_from_config", hook=initialize_from_config, feature="warm_up_separate",
    name="warm_up_separate",
    broke="initialize_from_config no longer warms the model up (skipped silently)",
    affects=">=0.27",
    delete_when="speculators calls compile_or_warm_up_model",
    silent=True,
)
