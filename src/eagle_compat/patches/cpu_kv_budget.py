"""speculators sizes the KV cache with `torch.cuda.mem_get_info()`, which fails on a CPU-only machine.

Only speculators' module sees a `torch` whose `cuda.mem_get_info()` answers, on CPU, with what the CPU workers
reserved for the KV cache (`executor.determine_available_memory()`), scaled so that speculators' own formula
(`free * gpu_memory_utilization * CACHE_MEMORY_FRACTION`) yields exactly that budget. The real `torch` is untouched.
"""
from __future__ import annotations

import types

from ._adapters import BuiltExecutors
from ._base import GENERATOR_MODULE, PatchUnit


class _CudaOnCpu:
    def __init__(self, real_cuda, generator_module, executors: BuiltExecutors):
        self._real = real_cuda
        self._module = generator_module
        self._executors = executors

    def mem_get_info(self, *args, **kwargs):
        from .. import engine
        from ..errors import IncompatibleEnvironment

        executor = self._executors.last()  # speculators asks right after building it
        if executor is None:
            raise IncompatibleEnvironment("no CUDA device, and no vLLM executor to ask for the CPU KV-cache budget")
        budget = engine.kv_cache.kv_budget(executor, 1.0)
        gmu = float(executor.vllm_config.cache_config.gpu_memory_utilization) or 1.0
        fraction = float(getattr(self._module, "CACHE_MEMORY_FRACTION", 0.2)) or 1.0
        free = int(budget / (gmu * fraction)) + 1
        return free, free

    def empty_cache(self):
        return None

    def __getattr__(self, name):
        return getattr(self._real, name)


class _TorchForGenerator(types.ModuleType):
    def __init__(self, real_torch, generator_module, executors: BuiltExecutors):
        super().__init__("torch")
        self.__dict__["_real"] = real_torch
        self.__dict__["cuda"] = _CudaOnCpu(real_torch.cuda, generator_module, executors)

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)


def _apply(patcher, module) -> None:
    import torch

    executors = BuiltExecutors()  # the executor speculators builds is the one to ask
    patcher.set(module, "torch", _TorchForGenerator(torch, module, executors))
    patcher.hook_executor(module, "MultiprocExecutor", executors.hooks())


UNIT = PatchUnit(
    name="cpu_kv_budget",
    broke="torch.cuda.mem_get_info() fails on a CPU-only machine",
    affects=">=0.11",
    condition="a machine without CUDA",
    delete_when="speculators asks the executor for the KV budget",
    target=GENERATOR_MODULE,
    sides=("driver",),
    feature="cpu_only",
    apply=_apply,
)
