"""From vLLM 0.34 the KV cache on CUDA is reserved as virtual memory and backed only after warm-up.

`CacheConfig.enable_extensible_kv_cache` (None = on wherever CUDA or ROCm supports it) makes the workers commit the
first block or two at allocation; EngineCore then measures free memory after warm-up and calls
`extend_kv_cache(num_blocks)` (vllm/v1/engine/core.py, `_initialize_kv_caches`). speculators' engine predates that
call and never makes it, so every block past the first few would be unbacked device memory. We pass
`enable_extensible_kv_cache=False`: the cache is allocated whole, at the size speculators asked for. Read from
vLLM 0.34.0's source; not run (0.34.0 cannot be carried to the offline GPU machine:
compat_matrix/results/gpu/carry-probe.md).
"""
from __future__ import annotations

from ..engine import keywords
from ._base import keyword_rewrite_unit

UNIT = keyword_rewrite_unit(
    constructor="CacheConfig", feature="extensible_kv_cache_by_default", rewrite=keywords.without_extensible_kv_cache,
    name="extensible_kv_cache_off",
    broke="the KV cache is backed only when EngineCore extends it after warm-up, which speculators never does",
    affects=">=0.34",
    delete_when="speculators' engine extends the KV cache after warm-up or passes enable_extensible_kv_cache=False",
)
