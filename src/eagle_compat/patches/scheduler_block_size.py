"""`Scheduler(...)` requires `block_size` from vLLM 0.11.1 (and takes `hash_block_size` from 0.20).

We compute both the way EngineCore does (`resolve_kv_cache_block_sizes` where it exists) at speculators' call site.
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, PatchUnit


def _needed() -> bool:
    from .. import detect
    return detect.feature("scheduler_requires_block_size")


def _apply(patcher, module) -> None:
    from .. import engine

    scheduler_cls = vars(module)["Scheduler"]

    patcher.rewrite_kwargs(module, "Scheduler", lambda kw: engine.scheduler_kwargs(kw, scheduler_cls))


UNIT = PatchUnit(
    name="scheduler_block_size",
    broke="Scheduler requires block_size (TypeError)",
    affects=">=0.11.1",
    delete_when="speculators passes block_size (speculators >= 0.4)",
    target=GENERATOR_MODULE,
    sides=("driver",),
    needed=_needed,
    apply=_apply,
)
