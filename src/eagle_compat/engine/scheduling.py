"""The scheduler an extraction engine drives by hand, and the requests it schedules.
"""
from __future__ import annotations

from typing import Any, Callable

from .. import detect
from ..errors import InvalidInput
from . import keywords, kv_cache


def scheduler_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Add `block_size` (required from 0.11.1) and `hash_block_size` (0.20+) where vLLM's Scheduler takes them."""
    kw = dict(kwargs)
    if detect.feature("scheduler_requires_block_size") and "block_size" not in kw:
        sched_bs, hash_bs = kv_cache.scheduler_block_sizes(kw["kv_cache_config"], kw["vllm_config"])
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


def make_request(request_id: str, token_ids: list[int], eos_token_id: int | None, arrival_time: float = 0.0):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    return Request(**keywords.request_kwargs(dict(request_id=request_id, prompt_token_ids=list(token_ids),
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
