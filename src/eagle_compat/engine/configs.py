"""The `VllmConfig` of an extraction engine: a prefill-only capture's scheduler and cache settings, the same in
every release.
"""
from __future__ import annotations

from .keywords import build, cache_config_kwargs, scheduler_config_kwargs, text_only

VLLM_BLOCK_SIZE = 16
MAX_NUM_SEQS = 32
MIN_MAX_BATCHED_TOKENS = 8192


def build_vllm_config(model_path: str, *, worker_extension_cls: str, max_model_len: int,
                      gpu_memory_utilization: float, tensor_parallel_size: int = 1, dtype: str = "auto",
                      trust_remote_code: bool = False, max_num_seqs: int = MAX_NUM_SEQS,
                      max_num_batched_tokens: int | None = None, kv_cache_memory_bytes: int | None = None,
                      tokenizer: str | None = None, seed: int | None = None, load_format: str = "auto",
                      show_load_progress: bool = True, in_process: bool = False):
    from vllm.config import (CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    model_config = build(ModelConfig, **text_only(dict(
        model=model_path, tokenizer=tokenizer or model_path, trust_remote_code=trust_remote_code, dtype=dtype,
        max_model_len=max_model_len, enforce_eager=True, **({"seed": seed} if seed is not None else {}))))
    cache_kw = dict(block_size=VLLM_BLOCK_SIZE, gpu_memory_utilization=gpu_memory_utilization)
    if kv_cache_memory_bytes is not None:
        cache_kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    cache_config = CacheConfig(**cache_config_kwargs(cache_kw))
    scheduler_config = SchedulerConfig(**scheduler_config_kwargs(
        dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
             max_num_batched_tokens=(max(MIN_MAX_BATCHED_TOKENS, max_model_len) if max_num_batched_tokens is None
                                     else max_num_batched_tokens)),
        is_encoder_decoder=bool(getattr(model_config, "is_encoder_decoder", False))))
    parallel_config = build(ParallelConfig, tensor_parallel_size=tensor_parallel_size,
                            worker_extension_cls=worker_extension_cls,
                            **({"distributed_executor_backend": "uni"} if in_process else {}))
    return VllmConfig(model_config=model_config, cache_config=cache_config, parallel_config=parallel_config,
                      scheduler_config=scheduler_config, device_config=DeviceConfig(),
                      load_config=build(LoadConfig, load_format=load_format, use_tqdm_on_load=show_load_progress))
