"""Prefix caching on by default (vLLM 0.12+) crashes speculators' scheduler, or would skip tokens.

speculators builds Requests without a block hasher, so any prompt of one block or more fails inside
`scheduler.schedule()` (AssertionError 0.12-0.25, IndexError 0.26+). With a hasher, cached prefix tokens would
not run through the layers and their states would be missing. We pass `enable_prefix_caching=False`.
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, PatchUnit


def _needed() -> bool:
    from .. import detect
    return detect.feature("prefix_caching_on_by_default")


def _apply(patcher, module) -> None:
    from .. import engine

    patcher.rewrite_kwargs(module, "CacheConfig", engine.without_prefix_caching)


UNIT = PatchUnit(
    name="prefix_caching_off",
    broke="prefix caching is on by default: the scheduler fails on prompts >= one block (no block hasher)",
    affects=">=0.12",
    delete_when="speculators' call site passes enable_prefix_caching=False (speculators >= 0.4)",
    target=GENERATOR_MODULE,
    sides=("driver",),
    needed=_needed,
    apply=_apply,
)
