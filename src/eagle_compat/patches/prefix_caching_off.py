"""Prefix caching on by default (vLLM 0.12+) crashes speculators' scheduler, or would skip tokens.

speculators builds Requests without a block hasher, so any prompt of one block or more fails inside
`scheduler.schedule()` (AssertionError 0.12-0.25, IndexError 0.26+). With a hasher, cached prefix tokens would
not run through the layers and their states would be missing. We pass `enable_prefix_caching=False` wherever the
default is not False (0.11's None meant off, and passing False there changes nothing).
"""
from __future__ import annotations

from ..engine import keywords
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="CacheConfig", feature="prefix_caching_not_off_by_default", rewrite=keywords.without_prefix_caching,
    name="prefix_caching_off",
    broke="prefix caching is on by default: the scheduler fails on prompts >= one block (no block hasher)",
    affects=">=0.11",  # broke in 0.12; on 0.11 (default None = off) passing False changes nothing
    delete_when="speculators' call site passes enable_prefix_caching=False (speculators >= 0.4)",
)
