"""speculators passes `CacheConfig(block_size=16)`. From vLLM 0.18 an explicit block size counts as
user-specified and the platform no longer adjusts it: CPU attention (0.32) rejects it with "No common block
size for 16 (CPU_ATTN: [MultipleOf(32)])" while CPU MLA needs exactly 16. The block size does not change the
hidden states, so at speculators' call site we let the platform choose it.
"""
from __future__ import annotations

from ..engine import keywords
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="CacheConfig", feature="explicit_block_size_is_final", rewrite=keywords.platform_block_size,
    name="platform_block_size",
    broke="an explicit block_size=16 is no longer adjusted by the platform; CPU attention rejects it",
    affects=">=0.18",
    delete_when="speculators stops passing block_size",
)
