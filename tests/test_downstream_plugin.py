"""A downstream repo's CI (docs/adr/0036-downstream-ci.md). A scratch repository (a pyproject depending on eagle-compat,
one test file) gets our fixtures through the `pytest11` entry point alone: its check passes on this vLLM, and fails
naming the layer, sequence, token and error when the capture is deliberately broken in the workers."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from helpers import in_newest_pass_only

SCRATCH_TEST = '''
def test_speculators_under_install_matches_hf(eagle_compat_check):
    result = eagle_compat_check("llama")
    assert result.precision == "bf16" and result.ok


def test_generator_with_a_broken_capture_is_caught(eagle_compat_check):
    def drop_the_residual(worker):  # in each vLLM worker: keep `hidden` and lose `residual` (a classic bug)
        from eagle_compat.capture import resolver
        original = resolver.stream_value
        resolver.stream_value = lambda output, kind, name: original((output[0], None), kind, name)

    eagle_compat_check("llama", check="generator",
                       prepare=lambda gen: gen.executor.collective_rpc(drop_the_residual))
'''


@pytest.mark.engine
@in_newest_pass_only("the plugin runs the same check the matrix and the parity suites run on every release")
def test_a_scratch_downstream_repo_passes_and_catches_a_broken_capture(tmp_path):
    repo = tmp_path / "downstream"
    (repo / "tests").mkdir(parents=True)
    (repo / "pyproject.toml").write_text(textwrap.dedent('''
        [project]
        name = "downstream-drafter"
        version = "0.0.1"
        dependencies = ["eagle-compat"]
        '''))
    (repo / "tests" / "test_extraction.py").write_text(SCRATCH_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=repo,
                          capture_output=True, text=True, timeout=900, env=env)
    out = proc.stdout
    assert proc.returncode == 1 and "1 failed, 1 passed" in out, (out + proc.stderr)[-4000:]
    assert "test_generator_with_a_broken_capture_is_caught" in out.split("short test summary")[-1]
    assert "generator on llama differs from HF transformers" in out and "layer 0: max abs error" in out, out[-4000:]
    assert re.search(r"sequence \d+, token \d+ is [\d.e+]+x its own bound \(tolerance 0\.0001 absolute, x the token's "
                     r"max \|value\| above 1, or 4 x HF's own fp32 error against float64 there \([\d.e+-]+\) where "
                     r"larger; fp32\)", out), out[-4000:]


def test_plugin_is_registered_and_inert():
    import importlib.metadata as md
    eps = [e for e in md.entry_points(group="pytest11") if e.name == "eagle_compat"]
    assert eps and eps[0].value == "eagle_compat.pytest_plugin"
    code = ("import sys, eagle_compat.pytest_plugin; "
            "print(sorted(m for m in ('vllm', 'torch', 'transformers', 'speculators') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr  # importing the plugin imports nothing heavy


def test_check_command_exit_status_and_json(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "check", "--family", "lama"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--family: unknown ['lama']; allowed: llama" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "eagle_compat.cli", "check", "--checks", "gen"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--checks: unknown ['gen']; allowed: shim, generator" in bad.stderr


@pytest.mark.parametrize("workflow", [".github/workflows/nightly.yml", "docs/ci/downstream-nightly.yml"])
def test_workflow_files_name_only_commands_and_options_that_exist(workflow):
    """Every `eagle-compat SUB --opt` and `python compat_matrix/run.py --opt` in the workflows exists here."""
    import argparse
    import shlex

    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    doc = yaml.safe_load(open(os.path.join(root, workflow)))
    lines = [line for job in doc["jobs"].values() for step in job["steps"] if "run" in step
             for line in step["run"].splitlines() if line.strip()]
    assert lines
    from eagle_compat import cli

    def options_of(parser: argparse.ArgumentParser) -> set[str]:
        return {o for a in parser._actions for o in a.option_strings}

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    sys.path.insert(0, os.path.join(root, "compat_matrix"))
    try:
        import run as matrix_run
    finally:
        sys.path.pop(0)
    checked = 0
    for line in lines:
        words = shlex.split(line.split(">")[0])
        if words[:1] == ["eagle-compat"]:
            assert words[1] in sub, line
            assert {w.split("=")[0] for w in words[2:] if w.startswith("--")} <= options_of(sub[words[1]]), line
            checked += 1
        elif words[:2] == ["python", "compat_matrix/run.py"]:
            assert os.path.exists(os.path.join(root, words[1]))
            assert {w for w in words[2:] if w.startswith("--")} <= options_of(matrix_run.parser()), line
            checked += 1
    assert checked, lines
