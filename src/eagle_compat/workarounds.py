"""Engine-side workarounds that are not patch units: they act inside eagle_compat's own generator, its worker-side
capture or its engine adapters, on both the generator and (through `worker_capture`) the speculators shim. Each
states the same contract as a patch unit (what broke, which releases, where, when it can be deleted) and a probe
that says whether it applies on this installation; `eagle-compat doctor` and docs/patches.md list them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Workaround:
    name: str
    broke: str
    affects: str  # PEP 440 specifier over vLLM releases ("" = all), like a patch unit's
    where: str  # the code that acts
    delete_when: str
    silent: bool  # the break gave wrong hidden states with no error
    applies: Callable[[], bool | str]  # True / False on this installation, or a string naming the condition
    condition: str = ""  # what else decides it, in words (device, dtype, family, machine)


def _cpu() -> bool:
    from . import detect
    return not detect.feature("cuda_available")


def _custom_ops_default_to_kernels() -> bool:
    from vllm.model_executor.custom_op import CustomOp

    from . import detect
    return _cpu() and "forward_cuda" in detect.function_source(CustomOp.forward_cpu)


def _cpu_moe_builds_ops_in_forward() -> bool:
    from . import detect
    source = detect.module_source("vllm.model_executor.layers.fused_moe.cpu_fused_moe") or ""
    return _cpu() and "_CPU_MOE_ACT_FN" in source


def _cpu_with_mla_backend() -> bool | str:
    from . import detect
    return "float32 generator runs" if _cpu() and detect.feature("cpu_mla_backend") else False


def _ipex_moe() -> bool:
    import importlib.util
    return _cpu() and importlib.util.find_spec("intel_extension_for_pytorch") is not None


def _cpu_sdpa_cached_masks() -> bool | str:
    from . import detect
    source = detect.module_source("vllm.v1.attention.backends.cpu_attn") or ""
    cached = "class TorchSDPABackendImpl" in source and "get_attn_bias" in source
    return "models with mixed sliding windows" if _cpu() and cached else False


def _workers_meet_at_released_port() -> bool:
    from . import detect
    return bool(detect.feature("workers_meet_at_released_port"))


def _v2_runner_possible() -> bool | str:
    import importlib.util
    from . import detect
    if importlib.util.find_spec("vllm.v1.worker.gpu.model_runner") is None:
        return False
    return True if detect.feature("cuda_available") else "a GPU run (vLLM's CPU worker uses the V1 runner)"


def _amx_cpu() -> bool:
    from . import cpu
    return _cpu() and cpu.this_cpu().amx


def _numa_short_for_tp() -> bool | str:
    from . import engine
    return f"tensor_parallel_size > {engine.process_env.cpu_numa_nodes()} (NUMA nodes)" if _cpu() else False


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "cpu_custom_ops_native", "CPU CustomOps default to their CUDA path, i.e. vLLM's C++ CPU kernels, which "
        "mishandle strided views (Qwen3, Qwen3-MoE, DeepSeek-V3 0.7-1.6 relative off from layer 0)",
        "<0.14", "capture/resolver.py `use_native_custom_ops`", "the vLLM floor is 0.14", True,
        _custom_ops_default_to_kernels, condition="CPU"),
    Workaround(
        "cpu_native_rotary", "vLLM's CPU rotary kernel leaves most heads of DeepSeek-style strided q/k views "
        "unrotated (plain RoPE; real DeepSeek/Kimi checkpoints use YaRN and are not affected)",
        "", "capture/resolver.py `use_native_rotary` (families with "
        "`cpu_native_rotary`)", "vLLM's CPU rotary kernel handles strided views", True,
        lambda: "families with cpu_native_rotary" if _cpu() else False,
        condition="CPU, families marked cpu_native_rotary (seen on 0.16.0 and 0.32.0)"),
    Workaround(
        "keep_vllm_config_current", "CPU float32 MoE builds a CustomOp inside the forward, which needs a current vLLM "
        "config that vLLM's workers set only while loading (\"Current vLLM config is not set\")",
        ">=0.20,<0.25", "capture/worker.py `keep_vllm_config_current`", "the vLLM floor is 0.25", False,
        _cpu_moe_builds_ops_in_forward, condition="CPU, float32 MoE models"),
    Workaround(
        "mla_off_fp32", "vLLM's CPU MLA kernels take bf16/fp16 weights only", ">=0.29",
        "engine/process_env.py `default_worker_env` (VLLM_MLA_DISABLE=1 for float32 runs)",
        "vLLM's CPU MLA kernels take float32", False, _cpu_with_mla_backend,
        condition="CPU, float32 generator runs of MLA models"),
    Workaround(
        "ipex_moe_routing_bias_refused", "IPEX's fused MoE ignores DeepSeek-style routing bias "
        "(e_score_correction_bias): MoE output 26-50% off", "==0.11.0",
        "capture/resolver.py `check_known_wrong_kernels` (refuses with UnsupportedModel)", "the vLLM floor is 0.11.1",
        True, _ipex_moe, condition="x86 CPU with IPEX, DeepSeek-style routing bias"),
    Workaround(
        "cpu_sdpa_mixed_windows_refused", "CPU TorchSDPA attention caches one set of masks per step for every "
        "layer: models mixing windowed and global layers (Gemma 2/3, gpt-oss) attend with the first layer's window",
        "<0.12", "capture/resolver.py `check_known_wrong_kernels` (refuses with UnsupportedModel)",
        "the vLLM floor is 0.12", True, _cpu_sdpa_cached_masks,
        condition="CPU, TorchSDPA attention, layers of different sliding windows (seen on 0.11.0)"),
    Workaround(
        "v2_runner_batch_order", "vLLM's V2 model runner lays a batch out sorted by length, not in the scheduler's "
        "order: rows would belong to other requests", ">=0.12",
        "capture/worker.py `runner_batch_order` + `_reorder`", "never: the capture must follow the runner's order",
        True, _v2_runner_possible, condition="GPU with the V2 model runner (vLLM's default for Llama from 0.23, for every dense "
                  "model from 0.25.1: config/vllm.py `_is_default_v2_model_runner_model`)"),
    Workaround(
        "finished_ids_to_next_output", "the output after a batch's last step schedules nothing and was not sent, and "
        "with it the batch's finished request ids: the workers kept every request (V1 runner: its tokens for the "
        "engine's life; V2 runner: 'No free indices' after max_num_seqs requests)", "",
        "engine/scheduling.py `schedule` (the stable generator; the shim has unit finished_requests_delivered)",
        "never while eagle_compat drives vLLM's Scheduler itself", False, lambda: True),
    Workaround(
        "cpu_amx_permission", "vLLM's CPU kernels run AMX instructions without asking Linux for AMX state: a short "
        "first prompt in bf16 killed the worker with SIGILL", "",
        "capture/resolver.py `request_amx_permission`", "vLLM's CPU worker requests AMX itself", False, _amx_cpu,
        condition="CPU with AMX (seen on 0.32.0)"),
    Workaround(
        "cpu_tp_thread_binding_generator", "CPU workers outnumbering NUMA nodes are refused (\"Not enough allowed "
        "NUMA nodes\")", "",
        "engine/process_env.py `cpu_thread_binding` (generator; the shim has unit cpu_tp_thread_binding)",
        "vLLM splits one NUMA node among several workers itself", False, _numa_short_for_tp,
        condition="CPU, tensor_parallel_size above the NUMA nodes (seen on 0.32.0)"),
    Workaround(
        "dead_worker_named", "a worker that dies mid-batch reaches the caller as `cancelled` (or a hang)", "",
        "remote_errors.py `dead_workers` (WorkerError WorkerDied)", "vLLM reports dead workers itself",
        False, lambda: True),
    Workaround(
        "startup_port_race_generator", "an engine start fails with EADDRINUSE when another process on the host (an "
        "engine starting at the same time) takes the torch.distributed port vLLM chose before its worker binds it "
        "(seen on 0.16.0)", "<0.28",
        "remote_errors.py `retrying_lost_port_race` (around the generator's executor start; the shim has unit "
        "startup_port_race)", "the vLLM floor is 0.28 (its workers meet at a file store)", False,
        _workers_meet_at_released_port),
)


def status() -> dict[str, bool | str]:
    """For `doctor`: whether each workaround applies here (or the condition, or why the probe could not tell)."""
    out: dict[str, bool | str] = {}
    for w in WORKAROUNDS:
        try:
            out[w.name] = w.applies()
        except Exception as exc:  # noqa: BLE001 - a probe that cannot decide says so, it does not guess
            out[w.name] = f"unknown ({type(exc).__name__}: {exc})"
    return out


def for_release(release: str) -> list[tuple[str, str, str]]:
    """What eagle_compat changes on a vLLM release, from the declared contracts alone (no probe, no vLLM needed):
    (kind, name, condition) for every patch unit and workaround whose `affects` contains it. On the installed
    release the probes decide; `affects` is tested against them there and against every recorded matrix cell."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from .patches import REGISTRY
    version = Version(release)
    rows = [("patch unit", u.name, u.condition) for u in REGISTRY
            if SpecifierSet(u.affects).contains(version, prereleases=True)]
    rows += [("workaround", w.name, w.condition) for w in WORKAROUNDS
             if SpecifierSet(w.affects).contains(version, prereleases=True)]
    return rows
