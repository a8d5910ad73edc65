"""Every committed benchmark and GPU script runs on the code it describes: each one's smoke mode (`--smoke`, or
`SMOKE=1` for a shell script) runs as a command in its own process, with tiny sizes and the stand-in engine of
`eagle_compat.testing` (the tests' own) or the tiny CPU model, in seconds; it must exit 0 and print what its real run
prints. A change that breaks a benchmark fails here instead of at its next real run (a benchmark's own stand-in
engine once drifted from the generator's signature, and nothing ran it).

What each smoke covers is said in its script (its docstring or header); the GPU scripts run their flow on CPU: cells
and phases with the stand-in engine, --preflight as a dry run, the bundle builder with a stand-in for pip."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

from helpers import in_newest_pass_only

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable

pytestmark = in_newest_pass_only("the scripts run in one environment: they test the scripts, not the release "
                                 "(CI time)")

# each script -> the test that runs it; a script added to benchmarks/ or scripts/gpu_*.sh without one fails
# test_every_script_has_a_smoke_run
SMOKED = {
    "benchmarks/completion_check.py": "test_completion_check",
    "benchmarks/input_memory.py": "test_input_memory",
    "benchmarks/input_spool.py": "test_input_spool",
    "benchmarks/line_check.py": "test_line_check",
    "benchmarks/machine_limits.py": "test_machine_limits",
    "benchmarks/million.py": "test_million",
    "benchmarks/model_checksum_cost.py": "test_model_checksum_cost",
    "benchmarks/parity_at_depth.py": "test_parity_at_depth",
    "benchmarks/ray_scaling.py": "test_ray_scaling",
    "benchmarks/resume_index.py": "test_resume_index",
    "benchmarks/seeded.py": "test_seeded",
    "benchmarks/throughput.py": "test_throughput",
    "benchmarks/training_proof.py": "test_training_proof",
    "scripts/gpu_bundle.sh": "test_gpu_bundle_sh",
    "scripts/gpu_parity.sh": "test_gpu_parity_sh",  # and scripts/gpu_preflight.py, which it calls (--dry-run)
    "scripts/gpu_throughput.sh": "test_gpu_throughput_sh",
    "scripts/gpu_training_proof.sh": "test_gpu_training_proof_sh",
    # run end to end with bundles made there (a full one and a delta)
    "scripts/gpu_bundle_setup.sh": "test_gpu_bundle.py",
    "scripts/gpu_setup.sh": "test_gpu_bundle.py",
}


def run(cmd: list[str], env: dict | None = None, timeout: int = 300) -> str:
    """The command's stdout; it must exit 0."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")
    return proc.stdout


def bench(name: str, *args: str) -> str:
    return run([PY, str(ROOT / "benchmarks" / name), *args])


def printed_json(out: str) -> dict:
    """The indented JSON document a script printed last (its result): from its last line `{`."""
    lines = out.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.JSONDecoder().raw_decode("\n".join(lines[start:]))[0]


def test_every_script_has_a_smoke_run():
    scripts = {str(p.relative_to(ROOT)) for p in (*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/gpu_*.sh"))}
    assert scripts == set(SMOKED), f"without a smoke run: {sorted(scripts - set(SMOKED))}"
    here = {name for name in globals() if name.startswith("test_")}
    for script, test in SMOKED.items():
        assert test in here or (ROOT / "tests" / test).exists(), f"{script}: no {test}"


def test_the_stand_in_takes_the_generators_arguments():
    """One stand-in engine (eagle_compat.testing), with the generator's signature: the runners' keywords reach it, and
    its states vary from token to token in the dtype asked for."""
    import inspect

    import torch

    from eagle_compat.generator import VllmHiddenStatesGenerator
    from eagle_compat.testing import StandInEngine
    real = inspect.signature(VllmHiddenStatesGenerator.__init__).parameters
    ours = inspect.signature(StandInEngine.__init__).parameters
    assert list(ours)[:4] == list(real)[:4] == ["self", "model_path", "layer_ids", "max_model_len"]
    assert all(ours[name].default == real[name].default for name in ("layer_ids", "max_model_len", "dtype"))
    defaults = {name: p.default for name, p in real.items() if p.default is not inspect.Parameter.empty}
    with StandInEngine(**{**defaults, "model_path": "no-model", "layer_ids": [0, 3], "dtype": "bfloat16"}) as engine:
        (result,) = engine.generate([[5, 6, 7]])
        assert engine.vllm_config.model_config.dtype == "torch.bfloat16"
    assert [h.shape for h in result["hidden_states"]] == [(3, 256), (3, 256)]
    assert all(h.dtype == torch.bfloat16 and not torch.equal(h[0], h[1]) for h in result["hidden_states"])


def test_gpu_scripts_parse():
    """The GPU scripts no smoke can run here (CUDA only) at least parse: each scripts/gpu_*.py compiles, each
    scripts/gpu_*.sh passes `bash -n`."""
    for path in sorted(glob.glob(str(ROOT / "scripts" / "gpu_*.py"))):
        compile(open(path).read(), path, "exec")
    for path in sorted(glob.glob(str(ROOT / "scripts" / "gpu_*.sh"))):
        run(["bash", "-n", path])


def test_completion_check():
    out = bench("completion_check.py", "--smoke")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["format"] for r in rows] == ["pt", "safetensors", "arrow"] and all("pool_2" in r for r in rows), out


def test_input_memory():
    out = bench("input_memory.py", "--smoke")
    assert "'samples': 400, 'tokens': 6400" in out, out


def test_input_spool():
    out = bench("input_spool.py", "--smoke")
    assert "'input': 'conversations', 'samples': 32" in out and "'spool_load_s'" in out, out


def test_line_check():
    out = bench("line_check.py", "--smoke")
    assert "conversations {'lines': 500" in out and "token_lines {'lines': 500" in out, out


def test_machine_limits():
    out = bench("machine_limits.py", "--smoke")
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["torch_save_fsync_gbps"]) == {"1", "8"} and result["bytes_per_measurement"] == 8 << 20, out


def test_million():
    """--conversations: the measurement a stand-in engine of the benchmark's own once broke at its first batch."""
    out = bench("million.py", "--smoke", "--conversations")
    row = json.loads(out.strip().splitlines()[-1])
    assert row["made_90_percent_done_files"] == 56 and row["new_set"]["first_batch_s"] > 0, out
    assert row["resume_with_spool"]["batches"] >= 1, out


def test_model_checksum_cost():
    out = bench("model_checksum_cost.py", "--smoke")
    assert "kimi_int4" in out and '"now / earlier cold"' in out, out


def test_parity_at_depth(tmp_path):
    out = bench("parity_at_depth.py", "--smoke", "--out", str(tmp_path / "result.json"))
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result["correct"]) == {"1", "2", "4", "5"} and "before_residual_add" in out, out


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (the [ray] extra)")
def test_ray_scaling():
    out = bench("ray_scaling.py", "--smoke")
    result = printed_json(out)
    assert result["ray"]["1"]["byte_identical_to_local"] and result["ray"]["1"]["files_compared"] == 8, out


def test_resume_index():
    out = bench("resume_index.py", "--smoke")
    result = printed_json(out)
    assert [r["mode"] for r in result["rows"]] == ["first run", "with index", "without index", "verify kept"], out
    assert result["rows"][0]["written"] == 64, out
    # what it measures: the index vouches for every kept file (a set copied per mode had other inodes and change
    # times, so the index vouched for none and the figures were of opening them all)
    by_mode = {r["mode"]: r for r in result["rows"]}
    assert by_mode["with index"]["files_opened"] == 0 < by_mode["without index"]["files_opened"], out


def test_seeded():
    import torch
    out = bench("seeded.py", "--smoke")
    torch.manual_seed(0)
    assert f"draws {random.Random(0).random()} {torch.rand(1).item()} ['--an-argument']" in out, out


def test_throughput():
    out = bench("throughput.py", "--smoke")
    for phase in ("disk", "delivered", "written"):
        assert f"{phase:>10}: " in out, out


def test_training_proof():
    out = bench("training_proof.py", "--smoke")
    assert "smoke: 24 training and 8 held-out prompts" in out and '"proof": true' in out, out


def test_gpu_throughput_sh(tmp_path):
    """SMOKE=1: the script's steps on CPU with the tiny Llama; the disk phase (no engine)."""
    run(["bash", "scripts/gpu_throughput.sh"],
        env={"SMOKE": "1", "OUT": str(tmp_path), "PY": PY, "RUNS": "llama8b-256x1024", "PHASES": "disk"})
    steps = (tmp_path / "steps.log").read_text()
    assert "end llama8b-256x1024 rc=0" in steps and "all done" in steps, steps
    assert json.loads((tmp_path / "llama8b-256x1024.json").read_text())["complete"]


def test_gpu_training_proof_sh(tmp_path):
    out = run(["bash", "scripts/gpu_training_proof.sh"],
              env={"SMOKE": "1", "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PY": PY})
    assert "training_proof: status 0" in out and (tmp_path / "work" / "prompts_heldout.jsonl").exists(), out


def test_gpu_parity_sh(tmp_path):
    """SMOKE=1: a cell on CPU with the stand-in engine (its verdict is the stand-in's), --preflight as a dry run."""
    out = run(["bash", "scripts/gpu_parity.sh"],
              env={"SMOKE": "1", "OUT": str(tmp_path), "PY": PY, "PREFLIGHT": "qwen3-8b"})
    cell = json.loads((tmp_path / "gpu_parity.jsonl").read_text())
    assert (cell["check"], cell["family"], cell["device"]) == ("generator", "llama", "cpu"), out
    assert cell["status"] in ("pass", "fail") and "traceback" not in cell, cell  # judged, not broken
    assert "qwen3-8b: ok=dry-run worker=default round 1" in out, out


FAKE_PIP = r"""#!/usr/bin/env bash
# stands in for pip, offline: `install --dry-run --report FILE vllm==V` writes a report; `download -d DIR PKG==V` a
# wheel (vLLM's with the files the builder removes)
report= dest=
for a in "$@"; do
  case $prev in --report) report=$a ;; -d) dest=$a ;; esac
  prev=$a
done
pkg=${!#}
[ -z "$dest" ] || mkdir -p "$dest"
if [ -n "$report" ]; then
  echo '{"install": [{"metadata": {"requires_dist": ["torch==2.13.0", "numpy"]}}]}' > "$report"
elif [ "${pkg%%==*}" = vllm ]; then
  python3 -c "import sys, zipfile
with zipfile.ZipFile(sys.argv[1], 'w') as z:
    z.writestr('vllm/__init__.py', '')
    z.writestr('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so', 'x')" "$dest/vllm-${pkg##*==}-cp38-abi3-manylinux_2_31_x86_64.whl"
else
  echo "$pkg" > "$dest/${pkg%%==*}-${pkg##*==}-py3-none-any.whl"
fi
"""


def test_gpu_bundle_sh(tmp_path):
    """The bundle builder end to end with a stand-in for pip (no network): parts, setup.sh, md5, the build record
    (SMOKE=1: in the bundle's folder, not the project's table)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text(FAKE_PIP)
    (bin_dir / "pip").chmod(0o755)
    table = ROOT / "compat_matrix" / "results" / "gpu" / "bundle-builds.md"
    before = table.read_bytes()
    out = run(["bash", "scripts/gpu_bundle.sh", "0.32.0", str(tmp_path / "bundle")],
              env={"SMOKE": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    bundle = tmp_path / "bundle"
    assert (bundle / "release.txt").read_text() == "0.32.0\n" and (bundle / "part00").exists(), out
    setup = (bundle / "setup.sh").read_text()
    assert setup.startswith('parts="part00"\n') and "SETUP_OK" in setup, setup
    assert "| 0.32.0 | 1 |" in (bundle / "bundle-builds.md").read_text()
    assert table.read_bytes() == before
