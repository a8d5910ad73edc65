"""speculators 0.3.0 never checks that its KV cache holds one prompt of max_model_len tokens.

vLLM's EngineCore refuses such a cache at start-up (`check_enough_kv_cache_memory`); speculators sizes its own
(`free GPU memory * gpu_memory_utilization * CACHE_MEMORY_FRACTION`) and builds the Scheduler on it unchecked. With
too small a cache a long prompt is never scheduled: `generate()` leaves the loop with it and every later prompt of
its batch unscheduled, slices empty hidden states for them, and leaves them queued to be captured into the next
call's rows. Silent, on every vLLM release. We refuse that cache where speculators builds its Scheduler, with the
check the stable generator makes (`engine.scheduling.require_room_for_max_model_len`).
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from .. import engine
    patcher.rewrite_kwargs(module, "Scheduler", engine.scheduling.require_room_for_max_model_len)


UNIT = PatchUnit(
    name="kv_cache_room_checked",
    broke="a KV cache smaller than one max_model_len prompt is accepted; longer prompts get empty hidden states",
    affects="",
    delete_when="speculators checks the KV cache against max_model_len (or builds its engine through EngineCore)",
    target=GENERATOR_MODULE,
    sides=("driver",),
    condition="speculators 0.3.0's own omission: every vLLM release",
    silent=True,
    apply=_apply,
)
