"""`Scheduler(...)` requires `block_size` from vLLM 0.11.1 (and takes `hash_block_size` from 0.20).

We compute both the way EngineCore does (`resolve_kv_cache_block_sizes` where it exists) at speculators' call site.
"""
from __future__ import annotations

from .. import engine
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="Scheduler", feature="scheduler_requires_block_size", rewrite=engine.scheduling.scheduler_kwargs,
    name="scheduler_block_size",
    broke="Scheduler requires block_size (TypeError)",
    affects=">=0.11.1",
    delete_when="speculators passes block_size (speculators >= 0.4)",
)
