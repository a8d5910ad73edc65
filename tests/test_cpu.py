"""What depends on the CPU: the facts read off /proc/cpuinfo, which of vLLM's extension builds vLLM loads, the matrix's
kernel probe and its verdicts, the AMX workaround. Each choice is tested for both kinds of CPU our machines come with
(Intel with AVX-512/AMX, AMD EPYC with AVX2 only) by simulation; the probe also runs for real on the CPU at hand."""
from __future__ import annotations

import sys

import pytest

from eagle_compat import cpu

# the flags lines of the two kinds (cut to what matters plus neighbours, as /proc/cpuinfo spells them)
INTEL_SPR = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
INTEL_ICELAKE = """model name\t: Intel(R) Xeon(R) Gold 6338
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni
"""
AMD_EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma bmi2 avx512f
"""
# extension builds per wheel (vllm/_C*.abi3.so): <= 0.16 one, 0.17-0.2x two, 0.32 three
SHIPPED_016, SHIPPED_017, SHIPPED_032 = {"_C"}, {"_C", "_C_AVX2"}, {"_C", "_C_AVX2", "_C_AVX512"}


def test_cpuinfo_gives_the_model_and_the_kernel_flags_of_the_first_processor():
    spr = cpu.parse_cpuinfo(INTEL_SPR, "x86_64")
    assert spr.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert spr.avx512 and spr.avx512_bf16 and spr.amx
    assert spr.as_dict()["flags"] == {"avx2": True, "avx512f": True, "avx512bw": True, "avx512vl": True,
                                      "avx512dq": True, "avx512_bf16": True, "amx_tile": True, "amx_bf16": True}
    epyc = cpu.parse_cpuinfo(AMD_EPYC_AVX2, "x86_64")
    assert epyc.model == "AMD EPYC" and epyc.flags == {"avx2"}  # the first processor's flags only
    assert not (epyc.avx512 or epyc.avx512_bf16 or epyc.amx)
    assert "avx2" in epyc.describe() and "avx512f" not in epyc.describe()


@pytest.mark.parametrize("cpuinfo, shipped, expected", [
    (INTEL_SPR, SHIPPED_032, "_C"), (INTEL_ICELAKE, SHIPPED_032, "_C_AVX512"), (AMD_EPYC_AVX2, SHIPPED_032, "_C_AVX2"),
    (INTEL_SPR, SHIPPED_017, "_C"), (INTEL_ICELAKE, SHIPPED_017, "_C"), (AMD_EPYC_AVX2, SHIPPED_017, "_C_AVX2"),
    (INTEL_SPR, SHIPPED_016, "_C"), (AMD_EPYC_AVX2, SHIPPED_016, "_C"),
])
def test_the_extension_vllm_loads_follows_the_cpu_flags(cpuinfo, shipped, expected):
    # vllm/platforms/cpu.py `import_kernels` on 0.32.0 (three builds), 0.17.0 (two), 0.16.0 (one)
    assert cpu.vllm_extension_for(cpu.parse_cpuinfo(cpuinfo, "x86_64"), shipped) == expected


def test_a_probe_killed_by_sigill_is_a_measured_cause_naming_the_cpu():
    epyc = cpu.parse_cpuinfo(AMD_EPYC_AVX2, "x86_64")
    verdict = cpu.kernel_verdict(-4, cpu.LOADING_MARK + "\n", "Illegal instruction (core dumped)\n", cpu=epyc)
    assert verdict["decided"] and not verdict["loads"]
    assert "SIGILL" in verdict["cannot_load"] and "AMD EPYC" in verdict["cannot_load"], verdict


def test_a_signal_outside_vllms_loader_or_after_the_verdict_decides_nothing_against_it():
    # killed before the loader ran (an OOM kill while importing torch): no verdict
    assert cpu.kernel_verdict(-9, "", "Killed\n")["decided"] is False
    assert cpu.kernel_verdict(-4, "", "")["decided"] is False  # SIGILL before the loader: not vLLM's choice
    # a verdict printed, then a crash at exit: the verdict stands
    ok = cpu.PROBE_MARK + '{"decided": true, "loads": true, "loaded": ["_C_AVX2.abi3.so"]}'
    assert "cannot_load" not in cpu.kernel_verdict(-11, cpu.LOADING_MARK + "\n" + ok + "\n", "")


def test_a_probe_whose_loader_registered_no_op_carries_vllms_own_message():
    line = cpu.PROBE_MARK + ('{"decided": true, "loads": false, "loaded": [], "warnings": ["Failed to import from '
                             'vllm._C: ImportError(\\"CXXABI_1.3.15 not found\\")"], "why": "Failed to import from '
                             'vllm._C: CXXABI_1.3.15"}')
    verdict = cpu.kernel_verdict(0, "noise\n" + line + "\n", "")
    assert "CXXABI_1.3.15" in verdict["cannot_load"], verdict


def test_a_probe_without_a_verdict_decides_nothing():
    # e.g. vLLM itself fails to import: that is not "the extension does not load"; the cells run and say why
    verdict = cpu.kernel_verdict(1, "", "Traceback ...\nModuleNotFoundError: No module named 'vllm'\n")
    assert verdict["decided"] is False and "cannot_load" not in verdict
    assert "No module named 'vllm'" in verdict["why"]
    loads = cpu.kernel_verdict(0, cpu.PROBE_MARK + '{"decided": true, "loads": true, "loaded": ["_C_AVX2.abi3.so"]}',
                               "")
    assert "cannot_load" not in loads


def test_the_probe_loads_the_build_vllm_picks_for_this_cpu():
    """For real, on the CPU at hand: vLLM's own loader in a process of its own. The old probe (`import vllm._C`)
    died with SIGILL on an AVX2-only CPU, where vLLM itself loads `_C_AVX2`."""
    pytest.importorskip("vllm")
    verdict = cpu.run_kernel_probe(sys.executable)
    here = cpu.this_cpu()
    assert verdict.get("decided") and verdict.get("loads"), (verdict, here.describe())
    assert verdict["expected"] == cpu.vllm_extension_for(here, set(verdict["shipped"])), verdict
    assert f"{verdict['expected']}.abi3.so" in verdict["loaded"], (verdict, here.describe())
    assert verdict["cpu"] == here.as_dict()


def test_the_amx_workaround_applies_on_amx_cpus_only(monkeypatch):
    pytest.importorskip("vllm")
    from eagle_compat import workarounds
    monkeypatch.setattr(workarounds, "_cpu", lambda: True)
    for text, applies in ((INTEL_SPR, True), (INTEL_ICELAKE, False), (AMD_EPYC_AVX2, False)):
        monkeypatch.setattr(cpu, "_this_cpu", cpu.parse_cpuinfo(text, "x86_64"))
        assert workarounds._amx_cpu() is applies, text.splitlines()[0]


def test_amx_permission_is_granted_where_the_cpu_has_amx():
    """Linux grants AMX tile state only on a CPU with AMX; elsewhere the request answers False and nothing else
    changes (vLLM's kernels take other paths)."""
    pytest.importorskip("torch")
    from eagle_compat.capture import resolver
    if not cpu.this_cpu().amx:
        assert resolver.request_amx_permission() is False
        pytest.skip("this CPU has no amx_tile: the grant itself is not testable here (the refusal was)")
    assert resolver.request_amx_permission() is True
