"""The launcher (docs/adr/0007-per-run-start-up-hook.md): a speculators-shaped script, unmodified, through
`eagle-compat run` and `python -m eagle_compat`, on a real CPU vLLM whose workers are spawned, equal to HF; the start-up
hook acts only in processes of a run (the variable set) and only with the import-time patch units."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eagle_compat import startup, tiny_models
from eagle_compat.installer import INSTALLED_ENV

from helpers import assert_matches_hf, in_newest_pass_only, prompts

SCRIPT = os.path.join(os.path.dirname(__file__), "data", "speculators_shaped_script.py")
EAGLE_COMPAT = os.path.join(os.path.dirname(sys.executable), "eagle-compat")

# What a fresh interpreter reports about itself: whether our start-up hook ran, what it patched, what it left in
# the environment for its own children.
PROBE = """
import json, os, sys
import transformers.configuration_utils as cu
from eagle_compat import installer
print(json.dumps({"eagle_compat_imported": "eagle_compat.installer" in sys.modules and installer.is_started_up(),
                  "started_up": installer.is_started_up(), "installed": installer.is_installed(),
                  "torch_in_configuration_utils": "torch" in vars(cu),
                  "units": {u.name: u.state for u in installer.status() if u.state != "not installed"},
                  "variable": os.environ.get(installer.INSTALLED_ENV), "pythonpath": os.environ.get("PYTHONPATH"),
                  "chained": os.environ.get("CHAINED_SITECUSTOMIZE_RAN")}))
"""
RUN_VALUE = "run:12345"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in (INSTALLED_ENV, "PYTHONPATH")}
    env.update(extra)
    return env


def _probe(env, *argv):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def hook_dir(tmp_path):
    return startup.write_hook(str(tmp_path))


def test_startup_hook_does_nothing_without_the_variable(hook_dir):
    seen = _probe(_env(PYTHONPATH=hook_dir), startup.SPAWNED_CHILD_FLAG)
    assert seen["started_up"] is False and seen["units"] == {}


def test_startup_hook_applies_only_import_time_units_in_a_spawned_child_of_a_run(hook_dir):
    from eagle_compat.patches import REGISTRY
    seen = _probe(_env(PYTHONPATH=hook_dir, **{INSTALLED_ENV: RUN_VALUE}), startup.SPAWNED_CHILD_FLAG)
    assert seen["started_up"] is True and seen["installed"] is False
    assert set(seen["units"]) == {u.name for u in REGISTRY if u.at_startup}
    assert seen["variable"] == RUN_VALUE  # a child of the run passes it on (vLLM's workers need it)
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5:  # the break the hook is for
        assert seen["torch_in_configuration_utils"] is True
        assert seen["units"]["transformers5_pydantic_torch"] == "applied"


def test_other_processes_started_from_a_run_are_left_alone_and_so_are_their_children(hook_dir, tmp_path):
    """pip, an eval script or a vLLM server started from the run is not patched, and the run's variable and directory
    are gone from its environment (its own children never see them)."""
    other = str(tmp_path / "user-path")
    env = _env(PYTHONPATH=os.pathsep.join([hook_dir, other]), **{INSTALLED_ENV: RUN_VALUE})
    seen = _probe(env)  # no --multiprocessing-fork: not a spawned child of the run
    assert seen["started_up"] is False and seen["units"] == {}
    assert seen["variable"] is None and seen["pythonpath"] == other  # the user's own entries stay


def test_variables_set_for_the_runs_workers_are_kept_from_other_processes(hook_dir):
    """What install() sets for vLLM's workers (process_env.apply_env: VLLM_MLA_DISABLE, VLLM_CPU_INT4_W4A8, ...) reaches
    the run's spawned children, not a vLLM server or script started from the run; the user's own variables stay."""
    listed = {startup.SET_ENV_LIST: "VLLM_MLA_DISABLE,VLLM_CPU_INT4_W4A8", "VLLM_MLA_DISABLE": "1",
              "VLLM_CPU_INT4_W4A8": "0", "USERS_OWN": "kept"}
    code = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
            f"{sorted(listed)!r}}}))")
    env = _env(PYTHONPATH=hook_dir, **{INSTALLED_ENV: RUN_VALUE}, **listed)
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    child = subprocess.run([sys.executable, "-c", code, startup.SPAWNED_CHILD_FLAG], env=env, capture_output=True,
                           text=True, timeout=120)
    assert other.returncode == 0 and child.returncode == 0, other.stderr[-2000:] + child.stderr[-2000:]
    assert json.loads(other.stdout) == {**{k: None for k in listed}, "USERS_OWN": "kept"}
    assert json.loads(child.stdout) == listed


def test_a_sitecustomize_the_hook_shadows_still_runs(hook_dir, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['CHAINED_SITECUSTOMIZE_RAN'] = '1'\n")
    seen = _probe(_env(PYTHONPATH=os.pathsep.join([hook_dir, str(theirs)]), **{INSTALLED_ENV: RUN_VALUE}),
                  startup.SPAWNED_CHILD_FLAG)
    assert seen["chained"] == "1" and seen["started_up"] is True


def test_startup_hook_is_inert_where_eagle_compat_is_missing(hook_dir):
    base = getattr(sys, "_base_executable", sys.executable)  # this venv's base interpreter: no eagle_compat there
    env = _env(PYTHONPATH=hook_dir, **{INSTALLED_ENV: RUN_VALUE})
    found = subprocess.run([base, "-c", "import importlib.util; print(importlib.util.find_spec('eagle_compat'))"],
                           env=_env(), capture_output=True, text=True, timeout=60)
    if found.stdout.strip() != "None":
        pytest.skip(f"the base interpreter {base} has eagle_compat too")
    out = subprocess.run([base, "-c", "print('ok')", startup.SPAWNED_CHILD_FLAG], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok" and "Error" not in out.stderr, out.stderr


def test_install_leaves_nothing_in_site_packages_and_uninstall_removes_the_run_hook():
    code = """
import json, os, sys, sysconfig
import eagle_compat
from eagle_compat import startup
before = sorted(os.listdir(sysconfig.get_paths()["purelib"]))
eagle_compat.install()
during = {"dir": startup.run_dir(), "exists": os.path.isdir(startup.run_dir()),
          "first_on_path": os.environ["PYTHONPATH"].split(os.pathsep)[0], "variable": os.environ.get("%s")}
eagle_compat.uninstall()
after = sorted(os.listdir(sysconfig.get_paths()["purelib"]))
print(json.dumps({"during": during, "same_site_packages": before == after, "gone": not os.path.exists(during["dir"]),
                  "pythonpath": os.environ.get("PYTHONPATH"), "variable": os.environ.get("%s")}))
""" % (INSTALLED_ENV, INSTALLED_ENV)
    # an empty entry (the current directory) is the user's too
    out = subprocess.run([sys.executable, "-c", code], env=_env(PYTHONPATH=os.pathsep + "/kept"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["during"]["exists"] and seen["during"]["first_on_path"] == seen["during"]["dir"]
    assert seen["during"]["variable"].startswith("run:")
    assert seen["same_site_packages"] and seen["gone"]
    assert seen["pythonpath"] == os.pathsep + "/kept" and seen["variable"] is None


def test_uninstall_leaves_another_runs_variable_as_it_found_it(monkeypatch):
    """A process of one run (its variable inherited) that installs and uninstalls keeps that run's variable."""
    import eagle_compat
    eagle_compat.uninstall()  # an install an earlier test of this worker left (its own variable goes with it)
    monkeypatch.setenv(INSTALLED_ENV, RUN_VALUE)
    eagle_compat.install()
    eagle_compat.uninstall()
    assert os.environ.get(INSTALLED_ENV) == RUN_VALUE


def test_bad_command_lines_are_refused_before_anything_runs(tmp_path):
    for argv, message in ((["run"], "usage"), (["run", "-m"], "-m needs a module"),
                          (["run", str(tmp_path / "missing.py")], "does not exist"),
                          (["run", "--verbose", "x.py"], "unknown option")):
        out = subprocess.run([EAGLE_COMPAT, *argv], capture_output=True, text=True, timeout=60, env=_env())
        assert out.returncode == 2 and message in out.stderr, (argv, out.stderr)


@in_newest_pass_only("the launcher's exit status and exceptions do not depend on the vLLM release")
def test_exit_status_and_exceptions_pass_through(tmp_path):
    script = tmp_path / "status.py"
    script.write_text("import sys, os\nprint(os.environ.get('EAGLE_COMPAT_INSTALLED'))\n"
                      "if sys.argv[1] == 'raise':\n    raise KeyError('boom')\nsys.exit(int(sys.argv[1]))\n")
    ok = subprocess.run([sys.executable, "-m", "eagle_compat", str(script), "0"], capture_output=True, text=True,
                        timeout=120, env=_env())
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1].startswith("run:"), ok.stderr  # the run's
    assert subprocess.run([EAGLE_COMPAT, "run", str(script), "7"], capture_output=True, timeout=120,
                          env=_env()).returncode == 7
    boom = subprocess.run([EAGLE_COMPAT, "run", str(script), "raise"], capture_output=True, text=True, timeout=120,
                          env=_env())
    assert boom.returncode == 1 and "KeyError: 'boom'" in boom.stderr


@pytest.mark.engine
@pytest.mark.parametrize("form", [
    # the two launchers are one code path (launcher.run); each release runs one, the newest pass both
    pytest.param("eagle-compat run", marks=in_newest_pass_only("the same launcher as `python -m eagle_compat`")),
    "python -m eagle_compat"])
def test_speculators_shaped_script_runs_unmodified_and_matches_hf(form, tmp_path):
    path, reference_path, num_layers = tiny_models.build_family("llama")
    layer_ids = [0, num_layers // 2, num_layers - 1]
    batch = prompts(3, 20, 60, seed=5)
    (tmp_path / "prompts.json").write_text(json.dumps(batch))
    out = tmp_path / "states.pt"
    launcher = [EAGLE_COMPAT, "run"] if form == "eagle-compat run" else [sys.executable, "-m", "eagle_compat"]
    proc = subprocess.run([*launcher, SCRIPT, "--target-model-path", path, "--prompts", str(tmp_path / "prompts.json"),
                           "--layer-ids", *map(str, layer_ids), "--output", str(out), "--exit-status", "3"],
                          capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-4000:]  # the script's own status
    for noise in ("Traceback", "Exception during executor shutdown", "Exception ignored"):  # a clean end
        assert noise not in proc.stderr + proc.stdout, (noise, proc.stderr[-3000:])
    states = torch.load(out)
    assert_matches_hf([{"hidden_states": s} for s in states], reference_path, batch, layer_ids, precision="bf16")


@pytest.mark.engine
@in_newest_pass_only("the shaped script covers the other release")
def test_speculators_own_offline_script_and_its_trainer_reader_run_unmodified(tmp_path):
    """speculators 0.3.0's scripts/data_generation_offline.py (vendored byte for byte) through `eagle-compat run`,
    then its trainer's reader through `python -m eagle_compat`: samples equal to HF."""
    import importlib.resources as res
    path, reference_path, num_layers = tiny_models.build_family("llama")
    layer_ids = [0, num_layers // 2, num_layers - 1]
    data = str(res.files("eagle_compat") / "data" / "demo_conversations.jsonl")
    script = os.path.join(os.path.dirname(__file__), "data", "speculators_v0_3_0", "data_generation_offline.py")
    out = tmp_path / "out"
    proc = subprocess.run([EAGLE_COMPAT, "run", script, "--target-model-path", path, "--train-data-path", data,
                           "--output-dir", str(out), "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.3",
                           "--seq-length", "512", "--num-preprocessing-workers", "1", "--layer-ids",
                           *map(str, layer_ids), "--token-freq-path", str(tmp_path / "token_freq.pt"),
                           "--hf-cache-dir", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=900, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    files = sorted(p.name for p in out.glob("data_*.pt"))
    assert len(files) == 24 and (out / "data_config.json").exists()
    for name in ("data_0.pt", "data_23.pt"):
        sample = torch.load(out / name)
        assert_matches_hf([sample], reference_path, [sample["input_ids"].tolist()], layer_ids, precision="bf16")
        assert 0 < int(torch.as_tensor(sample["loss_mask"]).sum()) < sample["input_ids"].numel()
    reader = os.path.join(os.path.dirname(__file__), "data", "read_with_speculators_dataset.py")
    read = subprocess.run([sys.executable, "-m", "eagle_compat", reader, str(out), str(tmp_path / "read.pt")],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert read.returncode == 0, read.stderr[-3000:]
    assert torch.load(tmp_path / "read.pt")["count"] == 24
