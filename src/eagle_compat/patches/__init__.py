"""The registry of patch units that install() walks, in application order (uninstall() reverts in reverse).

Each module holds one unit (one break, one contract); see `_base.PatchUnit`. Units that need the same speculators
name contribute to its one adapter (`_adapters`), whose composition does not depend on this order.
"""
from __future__ import annotations

from . import (async_scheduling_off, chunked_prefill_off, cpu_int4_w4a16, cpu_kv_budget, cpu_mla_disable,
               cpu_tp_thread_binding, extensible_kv_cache_off, finished_requests_delivered, gpu_sampler_no_jit,
               kv_cache_config_helpers, kv_cache_room_checked, kv_planning_helpers_moved, kv_cache_groups_as_vllm,
               platform_block_size,
               prefix_caching_off, quiet_shutdown, request_eos_token_id, scheduler_block_size,
               scheduler_config_encoder_decoder, speculators_config_init,
               speculators_trainer_target_norm, startup_port_race, step_deadline, text_only_model,
               transformers5_pydantic_torch, transformers_attn_mask_utils, two_phase_step, unique_reply_shape,
               unscheduled_requests_refused, warm_up_separate, worker_capture, worker_error_messages, worker_handshake)
from ._base import GENERATOR_MODULE, WORKER_MODULE, Patcher, PatchUnit

REGISTRY: tuple[PatchUnit, ...] = (
    transformers5_pydantic_torch.UNIT,
    transformers_attn_mask_utils.UNIT,
    speculators_config_init.UNIT,
    speculators_trainer_target_norm.UNIT,
    cpu_mla_disable.UNIT,
    cpu_int4_w4a16.UNIT,
    gpu_sampler_no_jit.UNIT,
    scheduler_config_encoder_decoder.UNIT,
    chunked_prefill_off.UNIT,
    async_scheduling_off.UNIT,
    prefix_caching_off.UNIT,
    extensible_kv_cache_off.UNIT,
    platform_block_size.UNIT,
    text_only_model.UNIT,
    kv_planning_helpers_moved.UNIT,
    kv_cache_groups_as_vllm.UNIT,
    kv_cache_config_helpers.UNIT,
    scheduler_block_size.UNIT,
    kv_cache_room_checked.UNIT,
    request_eos_token_id.UNIT,
    two_phase_step.UNIT,
    finished_requests_delivered.UNIT,
    unique_reply_shape.UNIT,
    unscheduled_requests_refused.UNIT,
    warm_up_separate.UNIT,
    cpu_kv_budget.UNIT,
    cpu_tp_thread_binding.UNIT,
    worker_capture.UNIT,
    *worker_error_messages.UNITS,
    startup_port_race.UNIT,
    quiet_shutdown.UNIT,
    step_deadline.UNIT,
    worker_handshake.UNIT,
)

__all__ = ["REGISTRY", "PatchUnit", "Patcher", "GENERATOR_MODULE", "WORKER_MODULE"]
