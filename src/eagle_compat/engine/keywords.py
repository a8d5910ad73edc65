"""The keyword arguments of vLLM's config classes and `Request`, made right for the installed release.

Each function takes the keywords a caller (speculators 0.3.0's generator, or ours) built and returns them as this
release wants them; the patch units apply them at speculators' call sites (`patches/_base.keyword_rewrite_unit`).
Every branch is feature-detected (`detect.py`); the comments name releases only to say when a branch can go.
"""
from __future__ import annotations

import inspect
from typing import Any

from .. import detect


def build(cls: Any, **kwargs: Any) -> Any:
    """Construct a vLLM config class with only the keyword arguments this release knows.

    From 0.16 config classes reject unknown kwargs; before that they were silently dropped. Either way we drop
    them here explicitly, so adding a kwarg for a newer release never breaks an older one.
    """
    params = detect.parameters(cls)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return cls(**kwargs)
    return cls(**{k: v for k, v in kwargs.items() if k in params})


def with_encoder_decoder_field(kw: dict[str, Any], is_encoder_decoder: bool = False) -> dict[str, Any]:
    """`is_encoder_decoder` is a required SchedulerConfig InitVar from 0.12 (speculators never passes it)."""
    from vllm.config import SchedulerConfig

    if detect.has_parameter(SchedulerConfig, "is_encoder_decoder"):
        kw = {**kw, "is_encoder_decoder": kw.get("is_encoder_decoder", is_encoder_decoder)}
    return kw


def without_chunked_prefill(kw: dict[str, Any]) -> dict[str, Any]:
    """Chunked prefill is on by default from 0.11.1: it splits a batch across steps while the caller aborts
    every request after one step (truncated states, misaligned offsets, no error)."""
    from vllm.config import SchedulerConfig

    return {**kw, "enable_chunked_prefill": False} if detect.has_parameter(
        SchedulerConfig, "enable_chunked_prefill") else kw


def without_async_scheduling(kw: dict[str, Any]) -> dict[str, Any]:
    """Async scheduling is automatic from 0.14 (on for GPU): async workers against a hand-driven sync scheduler."""
    from vllm.config import SchedulerConfig

    return {**kw, "async_scheduling": False} if detect.has_parameter(SchedulerConfig, "async_scheduling") else kw


def without_prefix_caching(kw: dict[str, Any]) -> dict[str, Any]:
    """Prefix caching is on by default from 0.12: without a block hasher the scheduler crashes, and with one
    cached prefix tokens would never run through the layers (their states never captured)."""
    from vllm.config import CacheConfig

    return {**kw, "enable_prefix_caching": False} if detect.has_parameter(
        CacheConfig, "enable_prefix_caching") else kw


def without_extensible_kv_cache(kw: dict[str, Any]) -> dict[str, Any]:
    """0.34 on CUDA reserves the KV cache as virtual memory and backs its blocks only when EngineCore calls
    extend_kv_cache after warm-up. Engines built here (ours, speculators') size the cache up front and never make
    that call: every block past the first few would be unbacked."""
    return {**kw, "enable_extensible_kv_cache": False} if detect.feature("extensible_kv_cache_by_default") else kw


def platform_block_size(kw: dict[str, Any]) -> dict[str, Any]:
    """CPU attention rejects speculators' 16 once it is final ("No common block size for 16 (CPU_ATTN:
    [MultipleOf(32)])", seen on 0.32). The block size does not change the states, so let the platform pick it."""
    if detect.feature("explicit_block_size_is_final"):  # 0.18+: the platform no longer adjusts it
        kw = {k: v for k, v in kw.items() if k != "block_size"}
    return kw


def text_only(kw: dict[str, Any]) -> dict[str, Any]:
    """Extraction feeds token ids only: a multimodal wrapper (Kimi-K2.5 …) runs its language model alone, without
    building and profiling vision towers (memory, start-up time; profiling also needs the image processor).
    `language_model_only` where the release has it, else zero media items per prompt."""
    from vllm.config import ModelConfig

    if detect.has_parameter(ModelConfig, "language_model_only"):
        return {"language_model_only": True, **kw}
    if detect.has_parameter(ModelConfig, "limit_mm_per_prompt"):
        return {"limit_mm_per_prompt": {m: 0 for m in ("image", "video", "audio", "vision_chunk")}, **kw}
    return kw


def known_kwargs(cls: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """Config classes reject unknown kwargs from 0.16 (silently dropped before)."""
    return {k: v for k, v in kw.items() if detect.has_parameter(cls, k)}


def scheduler_config_kwargs(kwargs: dict[str, Any], *, is_encoder_decoder: bool = False) -> dict[str, Any]:
    from vllm.config import SchedulerConfig

    kw = without_async_scheduling(without_chunked_prefill(with_encoder_decoder_field(kwargs, is_encoder_decoder)))
    return known_kwargs(SchedulerConfig, kw)


def cache_config_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import CacheConfig

    return known_kwargs(CacheConfig, platform_block_size(without_extensible_kv_cache(without_prefix_caching(kwargs))))


def request_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`Request(eos_token_id=)` is gone from 0.17: the id moves into the sampling params."""
    kw = dict(kwargs)
    if "eos_token_id" in kw and detect.feature("request_lacks_eos_token_id"):
        eos = kw.pop("eos_token_id")
        sp = kw.get("sampling_params")
        if eos is not None and sp is not None:
            update = getattr(sp, "update_from_generation_config", None)
            if update is not None and detect.has_parameter(update, "eos_token_id"):
                update({}, eos_token_id=eos)
            elif update is not None and detect.has_parameter(update, "model_eos_token_id"):
                update({}, model_eos_token_id=eos)
    return kw
