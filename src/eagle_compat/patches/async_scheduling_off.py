"""Async scheduling became automatic in vLLM 0.14 (on for GPU with the mp executor).

Workers would run in async-output mode against speculators' hand-driven synchronous scheduler. We pass
`async_scheduling=False` at speculators' SchedulerConfig call site.
"""
from __future__ import annotations

from ..engine import keywords
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="SchedulerConfig", feature="async_scheduling_not_off_by_default",
    rewrite=keywords.without_async_scheduling,
    name="async_scheduling_off",
    broke="async scheduling is automatic (GPU: on) and would pair async workers with a synchronous scheduler",
    affects=">=0.14",
    delete_when="speculators' call site passes async_scheduling=False",
)
