"""The KV cache of an extraction engine: its budget, its layout, its groups planned as vLLM's engine plans them, and
the config the workers and the scheduler take.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .. import detect
from ..errors import IncompatibleEnvironment, UnsupportedModel
from . import rpc

# What a promotion to full attention chooses itself: every other field a local-attention spec shares with the full
# spec it becomes describes the layer (shape, dtype) or its backend (KV stride order), and must come through
PROMOTION_CHOOSES = frozenset({"block_size", "page_size_padded"})

# where vLLM decides whether layers' KV specs can be planned (spec merge, unify, grouping)
KV_PLANNING_SOURCES = ("/v1/core/kv_cache_", "/v1/kv_cache_interface")


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
    specs = rpc.rpc_all(executor, "get_kv_cache_spec")
    publish_kv_cache_layout(vllm_config, executor, specs)
    spec = specs[0]
    groups = plan_kv_cache_groups(vllm_config, spec)
    return kv_cache_config_from_groups(kcu.get_kv_cache_config_from_groups, executor=executor,
                                       vllm_config=vllm_config, kv_cache_groups=groups,
                                       available_memory=available_memory, kv_cache_specs=spec)
