"""Prefix caching on by default (vLLM 0.12+) crashes speculators' scheduler, or would skip tokens.

speculators builds Requests without a block hasher, so any prompt of one block or more fails inside
`scheduler.schedule()` (AssertionError 0.12-0.25, IndexError 0.26+). With a hasher, cached prefix tokens would
not run through the layers and their states would be missing. We pass `enable_prefix_caching=False`.
"""
from __future__ import annotations

from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="CacheConfig", feature="prefix_caching_not_off_by_default", rewrite="without_prefix_caching",
    name="prefix_caching_off",
    broke="prefix caching is on by default: the scheduler fails on prompts >= one block (no block hasher)",
    affects=">=0.12",
    delete_when="speculators' call site passes enable_prefix_caching=False (speculators >= 0.4)",
)
