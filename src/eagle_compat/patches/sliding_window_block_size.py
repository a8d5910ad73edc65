"""vLLM 0.25-0.26 give sliding-window layers their own KV block size (the attention backend's smallest kernel
block), but their `unify_hybrid_kv_cache_specs`, which speculators calls to get one KV-cache type for every layer,
keeps that size when it turns them into full-attention specs. A model that mixes sliding-window and full layers of
different block sizes (gpt-oss and Gemma-2 on CPU) then fails with "failed to convert the KV cache specs to one
unified type". 0.27 promotes them with the full layers' block size; at speculators' call site we do the same first.
"""
from __future__ import annotations

from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from .. import engine

    def unify(wrapped, instance, args, kwargs):
        return engine.unify_kv_cache_specs(*args, unify=wrapped, **kwargs)

    patcher.wrap(module, "unify_hybrid_kv_cache_specs", unify)


UNIT = PatchUnit(
    name="sliding_window_block_size",
    broke="unify_hybrid_kv_cache_specs cannot unify sliding-window layers whose block size differs from the full "
          "layers' (ValueError: failed to convert the KV cache specs to one unified type)",
    affects=">=0.25,<0.27",
    delete_when="the vLLM floor is 0.27",
    target=GENERATOR_MODULE,
    sides=("driver",),
    feature="sliding_window_block_size_not_unified",
    apply=_apply,
)
