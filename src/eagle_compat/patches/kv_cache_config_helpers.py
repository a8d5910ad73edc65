"""`get_kv_cache_config_from_groups` changed shape and grew preconditions.

* 0.12: the `kv_cache_specs` parameter is gone (TypeError);
* 0.29: the KV-cache layout must be resolved and published to the workers first (ValueError);
* 0.32: the config carries `hash_block_size` and `cache_hit_alignment_tokens`, which EngineCore fills in.
At speculators' call site we call the helper the way this release wants and finish the config as EngineCore does.
"""
from __future__ import annotations

from ._adapters import BuiltExecutors
from ._base import GENERATOR_MODULE, PatchUnit


def _needed() -> bool:
    from .. import detect
    return (not detect.feature("kv_helper_takes_kv_cache_specs") or detect.feature("kv_layout_must_be_resolved")
            or detect.feature("kv_cache_hit_alignment") or detect.feature("register_all_kvcache_specs"))


def _apply(patcher, module) -> None:
    from .. import engine

    # speculators calls the helper with the config only; its workers (0.29+: they take the KV layout) are those of
    # the executor it built with that config
    executors = BuiltExecutors()
    patcher.hook_executor(module, "MultiprocExecutor", executors.hooks())

    def helper(wrapped, instance, args, kwargs):
        config = kwargs.get("vllm_config")
        engine.kv_cache.register_kv_cache_specs(config)
        return engine.kv_cache.kv_cache_config_from_groups(wrapped, executor=executors.for_config(config), **kwargs)

    patcher.wrap(module, "get_kv_cache_config_from_groups", helper)


UNIT = PatchUnit(
    name="kv_cache_config_helpers",
    broke="get_kv_cache_config_from_groups lost kv_cache_specs (0.12) and needs a resolved KV layout (0.29)",
    affects=">=0.12",
    delete_when="the vLLM floor is 0.29 and speculators calls the helpers the 0.29 way",
    target=GENERATOR_MODULE,
    sides=("driver",),
    needed=_needed,
    apply=_apply,
)
